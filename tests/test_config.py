"""RunnerConfig: GraphRunner's options checked once, before anything is built; the public names."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import decode_batch

import graphrt
from graphrt import ForwardMode, GraphRunner, RunnerConfig, UBatchConfig


def double(input_ids, positions, forward_batch):
    return input_ids * 2


def test_keywords_and_a_config_build_the_same_runner():
    from_keywords = GraphRunner(double, max_batch_size=8, capture_sizes=[2, 8], backend="emulated", progress=False)
    config = RunnerConfig(max_batch_size=8, capture_sizes=[8, 2, 2], backend="emulated", progress=False)
    from_config = GraphRunner(double, config)
    assert from_config.config == from_keywords.config and from_config.config.capture_sizes == (2, 8)
    assert sorted(from_config.registry.entries) == sorted(from_keywords.registry.entries)
    overridden = GraphRunner(double, config, max_batch_size=16, capture_sizes=[16])
    assert overridden.config.max_batch_size == 16 and config.max_batch_size == 8, "the given config is not changed"
    for runner in (from_keywords, from_config):
        runner.capture()
        assert torch.equal(runner(decode_batch(3)), decode_batch(3).input_ids * 2)
        assert runner.stats()["graph_runs"] == 1


def test_defaults_are_filled_in_and_frozen():
    config = RunnerConfig(max_batch_size=16, modes=[ForwardMode.DECODE, ForwardMode.EXTEND], pad_values={"seq_lens": 2})
    assert config.capture_sizes == (1, 2, 4, 8, 16) and config.modes == (ForwardMode.DECODE, ForwardMode.EXTEND)
    assert config.extend_capture_sizes == ((64, 128, 256, 512), (1, 2, 4, 8, 16))
    assert dict(config.pad_values) == {"input_ids": 0, "positions": 0, "seq_lens": 2, "out_cache_loc": 0,
                                       "req_pool_indices": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 32
    with pytest.raises(TypeError):
        config.pad_values["seq_lens"] = 5
    assert RunnerConfig(histogram={3: 5}).histogram == {ForwardMode.DECODE: {3: 5}}, "parsed once, at construction"


@pytest.mark.parametrize("options, message", [
    ({"max_batch_size": 0}, "max_batch_size: expected an int >= 1"),
    ({"warmup_iters": -1}, "warmup_iters: expected an int >= 0"),
    ({"warmup_iters": 0, "backend": "cuda"}, "warmup_iters: expected an int >= 1 on the cuda backend"),
    ({"backend": "tpu"}, "backend: expected one of"),
    ({"capture_sizes": [1, 99], "max_batch_size": 8}, r"capture_sizes: expected ints in \[1, 8\]"),
    ({"capture_sizes": "tuned"}, "capture_sizes: expected None, 'auto' or a list of ints"),
    ({"max_graphs": 2}, "max_graphs: only used with capture_sizes='auto'"),
    ({"pad_values": {"seq_lens": 0}}, r"pad_values\['seq_lens'\]: expected an int \(seq_lens >= 1"),
    ({"pad_values": {"logits": 0}}, "pad_values: expected keys among"),
    ({"batch_context": {"kv": object()}}, "batch_context: expected keys among"),
    ({"modes": [ForwardMode.EXTEND], "extend_capture_sizes": ([0], [1])}, r"extend_capture_sizes\[0\]"),
    ({"histogram": {"DECODE": {"x": 1}}}, r"histogram\[DECODE\]"),
    ({"ubatch": UBatchConfig(threaded=True)}, "ubatch.threaded: expected False"),
])
def test_bad_options_raise_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**options)
    with pytest.raises(ValueError, match=message):
        GraphRunner(double, **options)


def test_wrong_types_raise_type_errors():
    with pytest.raises(TypeError, match="ubatch: expected a UBatchConfig"):
        RunnerConfig(ubatch={"num_ubatches": 2})
    with pytest.raises(TypeError, match="config: expected a RunnerConfig, got int"):
        GraphRunner(double, 8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_batch'"):
        GraphRunner(double, max_batch=8)


def test_public_names_are_what_a_user_imports():
    assert sorted(graphrt.__all__, key=str.lower) == [
        "CaptureReport", "check", "CheckReport", "current_batch", "EagerReason", "ForwardBatch", "ForwardMode", "GraphedCallable",
        "GraphKey", "GraphRunner", "RunnerConfig", "StaleOutputError", "UBatchConfig", "wrap",
    ]
    assert all(getattr(graphrt, name) is not None for name in graphrt.__all__)
