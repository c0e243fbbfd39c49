"""Capture sizes chosen from traffic: exact DP, fallback, waste, histogram files, "auto" and retune()."""

from __future__ import annotations

import gc
import itertools
import json
import weakref

import pytest
import torch
from conftest import BACKENDS, ToyPagedModel, decode_batch, pad_batch

from graphrt import ForwardMode, GraphRunner
from graphrt.sizes import (
    choose_capture_sizes,
    default_capture_sizes,
    fallback_capture_sizes,
    padding_waste,
    uncovered_steps,
)
from graphrt.stats import load_histogram, save_histogram


def padded_tokens(histogram, sizes):
    """Reference: padded tokens of every step, by brute force."""
    return sum(count * (min(s for s in sizes if s >= size) - size) for size, count in histogram.items())


def test_choice_on_a_hand_example_and_with_enough_graphs():
    histogram = {1: 10, 2: 5, 3: 1, 7: 4, 8: 2, 30: 1}
    # [2, 8, 30] pads 1->2 (10), 3->8 (5), 7->8 (4): 19 tokens; any other 3 sizes pad more.
    assert choose_capture_sizes(histogram, 3) == [2, 8, 30]
    assert choose_capture_sizes(histogram, 6) == [1, 2, 3, 7, 8, 30]
    assert choose_capture_sizes(histogram, 60) == [1, 2, 3, 7, 8, 30]
    assert choose_capture_sizes(histogram, 1) == [30]


def test_sizes_above_max_batch_size_and_size_zero_are_ignored():
    assert choose_capture_sizes({0: 100, 3: 2, 5: 1, 99: 7}, 4, max_batch_size=8) == [3, 5]


def test_fallback_without_history_is_the_default_list_compressed_to_max_graphs():
    assert choose_capture_sizes({}, 11, max_batch_size=64) == default_capture_sizes(64)
    assert choose_capture_sizes({0: 5}, 20, max_batch_size=64) == default_capture_sizes(64)
    compressed = fallback_capture_sizes(64, 4)
    assert len(compressed) == 4 and compressed[-1] == 64 and set(compressed) <= set(default_capture_sizes(64))
    uniform = {size: 1 for size in range(1, 65)}
    for other in itertools.combinations(default_capture_sizes(64)[:-1], 3):
        assert padded_tokens(uniform, compressed) <= padded_tokens(uniform, list(other) + [64])
    assert fallback_capture_sizes(64, 1) == [64]
    with pytest.raises(ValueError, match="histogram: no observed size"):
        choose_capture_sizes({}, 4)


@pytest.mark.parametrize("call, field", [
    (lambda: choose_capture_sizes({1: 1}, 0), "max_graphs"),
    (lambda: choose_capture_sizes({-1: 1}, 2), "histogram"),
    (lambda: choose_capture_sizes({2: 1.5}, 2), "histogram"),
    (lambda: padding_waste({1: 1}, []), "sizes"),
])
def test_bad_arguments_name_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_padding_waste_is_padded_per_real_token_and_uncovered_steps_are_separate():
    histogram = {1: 2, 3: 1, 4: 1, 9: 5}
    # 1 -> 4 twice (6 padded), 3 -> 4 (1), 4 -> 4 (0): 7 padded over 2 + 3 + 4 = 9 real tokens.
    assert padding_waste(histogram, [4]) == pytest.approx(7 / 9)
    assert uncovered_steps(histogram, [4]) == 5
    assert padding_waste(histogram, [1, 3, 4, 9]) == 0.0 and uncovered_steps(histogram, [1, 3, 4, 9]) == 0
    assert padding_waste({9: 1}, [4]) == 0.0


def test_histogram_file_round_trip_and_merge(tmp_path):
    path = tmp_path / "traffic.json"
    save_histogram({ForwardMode.DECODE: {3: 4, 5: 1}, ForwardMode.EXTEND: {2: 7}}, path)
    assert json.loads(path.read_text())["histogram"] == {"DECODE": {"3": 4, "5": 1}, "EXTEND": {"2": 7}}
    assert load_histogram(path) == {ForwardMode.DECODE: {3: 4, 5: 1}, ForwardMode.EXTEND: {2: 7}}
    runner = GraphRunner(ToyPagedModel(), max_batch_size=8, backend="emulated", progress=False)
    runner(decode_batch(3, seed=1))
    runner.load_histogram(path)
    runner.load_histogram(path)
    assert runner.stats()["histogram"] == {"DECODE": {3: 9, 5: 2}, "EXTEND": {2: 14}}
    runner.save_histogram(path)
    assert load_histogram(path)[ForwardMode.DECODE] == {3: 9, 5: 2}
    path.write_text(json.dumps({"DECODE": {"3": 4}}))
    with pytest.raises(ValueError, match="histogram: .* not a graphrt histogram file"):
        runner.load_histogram(path)
    path.write_text(json.dumps({"version": 1, "histogram": {"DECODE": {"x": 4}}}))
    with pytest.raises(ValueError, match=r"histogram\[DECODE\]"):
        runner.load_histogram(path)


def test_auto_capture_sizes_from_a_mapping_a_file_or_the_fallback(tmp_path):
    def auto(**options):
        return GraphRunner(ToyPagedModel(), max_batch_size=16, backend="emulated", progress=False,
                           capture_sizes="auto", **options)

    traffic = {1: 50, 3: 30, 6: 10, 12: 5, 40: 9}  # 40 > max_batch_size: runs eagerly, ignored
    assert auto(histogram=traffic, max_graphs=3).capture_sizes == [1, 3, 12]
    path = tmp_path / "traffic.json"
    save_histogram({ForwardMode.DECODE: traffic}, path)
    runner = auto(histogram=str(path), max_graphs=3)
    assert runner.capture_sizes == [1, 3, 12]
    assert runner.stats()["histogram"]["DECODE"] == traffic, "the given histogram seeds the runner's own"
    assert auto(histogram={"DECODE": traffic}).capture_sizes == [1, 3, 6, 12]  # default budget: 6 graphs
    assert auto().capture_sizes == default_capture_sizes(16)
    assert auto(max_graphs=2).capture_sizes == fallback_capture_sizes(16, 2)
    with pytest.raises(ValueError, match="max_graphs"):
        auto(max_graphs=0)
    with pytest.raises(ValueError, match="capture_sizes"):
        GraphRunner(ToyPagedModel(), max_batch_size=16, capture_sizes="tuned")
    with pytest.raises(ValueError, match="max_graphs: only used with capture_sizes='auto'"):
        GraphRunner(ToyPagedModel(), max_batch_size=16, capture_sizes=[1, 2], max_graphs=2)
    with pytest.raises(TypeError, match="histogram"):
        auto(histogram=42)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_retune_uses_traffic_sizes_matches_eager_and_releases_old_graphs(backend_device):
    backend, device = backend_device
    model = ToyPagedModel(device=device)
    runner = GraphRunner(model, max_batch_size=24, backend=backend, device=device, progress=False)
    pointers = {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()}
    runner.capture()
    for step, size in enumerate([3, 3, 3, 5, 5, 13, 3, 5, 13, 3]):
        runner(decode_batch(size, device, seed=step))
    old_graphs = [weakref.ref(entry.graph) for entry in runner.registry.entries.values()]
    assert len(old_graphs) == len(default_capture_sizes(24))

    report = runner.retune(max_graphs=3)
    assert runner.capture_sizes == [3, 5, 13] == sorted(key.num_reqs for key in report.ok)
    assert runner.stats()["captured_keys"] == ["decode/bs=13", "decode/bs=5", "decode/bs=3"]
    gc.collect()
    assert all(ref() is None for ref in old_graphs), "retune must release the old graphs"
    assert {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()} == pointers
    for step, size in enumerate([1, 3, 4, 5, 9, 13]):
        batch = decode_batch(size, device, seed=100 + step)
        out = runner(batch).clone()
        padded_size = min(s for s in runner.capture_sizes if s >= size)
        padded = pad_batch(batch, padded_size)
        assert torch.equal(out, model(padded.input_ids, padded.positions, padded)[:size])
    assert runner.stats()["key_hits"] == {"decode/bs=3": 2, "decode/bs=5": 2, "decode/bs=13": 2}
    eager_before = runner.stats()["eager_runs"]
    runner(decode_batch(14, device, seed=7))
    assert runner.stats()["eager_runs"] == eager_before + 1, "sizes above the largest tuned size run eagerly"


def test_retune_without_traffic_falls_back_and_keeps_extend_keys():
    runner = GraphRunner(ToyPagedModel(), max_batch_size=8, backend="emulated", progress=False)
    runner.capture()
    runner.retune(max_graphs=2)
    assert runner.capture_sizes == fallback_capture_sizes(8, 2)
    with pytest.raises(ValueError, match="retune"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, modes=(ForwardMode.EXTEND,), backend="emulated",
                    progress=False).retune(2)


@pytest.mark.cuda
def test_repeated_retunes_do_not_grow_cuda_memory():
    model = ToyPagedModel(device="cuda")
    runner = GraphRunner(model, max_batch_size=64, backend="cuda", device="cuda", progress=False)
    runner.capture()
    for step in range(40):
        runner(decode_batch(1 + (7 * step) % 64, "cuda", seed=step))
    runner.retune(max_graphs=6)
    torch.cuda.synchronize()
    gc.collect()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for max_graphs in (6, 3, 11, 6, 6):
        runner.retune(max_graphs=max_graphs)
        runner(decode_batch(5, "cuda", seed=1))
        torch.cuda.synchronize()
        gc.collect()
    runner.retune(max_graphs=6)
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_reserved() <= reserved, "retune leaked reserved memory"
    assert torch.cuda.memory_allocated() <= allocated, "retune leaked allocated memory"
