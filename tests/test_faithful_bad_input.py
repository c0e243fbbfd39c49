"""Bad input poisons nothing, bad construction is refused up front by name, and logs say what happens.

A bad batch (a KV slot past the cache, a token id past the vocabulary) raises a clear error and
the key stays in use: a replay that raises is redone eagerly, and when eager raises too the input
is at fault, so that error reaches the caller and the key is kept; only a key whose replay fails
where eager succeeds is disabled. No value of the failed step stays where a later capture or a
padded step reads it. Where the runner knows a table's size (the KV pool and the request pool of
its ``batch_context``) validation checks indices against it before anything is staged: always on
host tensors, and with ``debug=True`` on CUDA (a device-side index error inside a CUDA graph
would kill the process's CUDA context).

A model or ``fn`` that is not callable, ``device="cuda"`` without CUDA, an option given both in a
``RunnerConfig`` and beside it, and a ``graphrt.check`` factory returning None are refused when
built, naming what is wrong. A padded capture recovered at the call's own size is INFO, not a
WARNING, and keys of a prefill layout are not named ``decode/...``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re

import pytest
import torch
from conftest import BACKENDS, CUDA_AVAILABLE, ToyPagedModel, decode_batch, pad_batch, static_checksums
from faithful_helpers import assert_identical

from graphrt import GraphRunner, RunnerConfig, wrap
from graphrt.check.__main__ import main as check_main
from graphrt.reference import ReferenceConfig, build_reference, graph_runner_kwargs, make_decode_batch, run_eager

KV_SLOTS = 256  # ToyPagedModel's KV cache; its vocabulary is 97 tokens

# ---------------------------------------------------------------- item 6: a bad batch poisons nothing


def toy_runner(model: ToyPagedModel) -> GraphRunner:
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated", progress=False)
    assert runner.capture().ok
    return runner


BAD_INDICES = {
    "token id past the vocabulary": dict(input_ids=torch.tensor([5, 1000, 7])),
    "KV slot past the cache": dict(out_cache_loc=torch.tensor([5, 300, 7])),
}


@pytest.mark.parametrize("bad", list(BAD_INDICES))
def test_an_index_past_a_table_raises_eagers_error_and_the_key_stays_in_use(bad):
    """The replay raises, the eager redo raises the same IndexError: the input is at fault, so the
    caller gets that error and ``decode/bs=4`` keeps replaying the next (valid) batch of its size."""
    model = ToyPagedModel()
    control = copy.deepcopy(model)
    runner = toy_runner(model)
    with pytest.raises(IndexError, match="out of (bounds|range)"):
        runner(decode_batch(3, seed=1, **BAD_INDICES[bad]))
    stats = runner.stats()
    assert "decode/bs=4" in stats["captured_keys"] and "decode/bs=4" not in stats["failed_keys"], stats["failed_keys"]
    good = decode_batch(3, seed=2)
    padded = pad_batch(good, 4)
    assert_identical(runner(good), control(padded.input_ids, padded.positions, padded)[:3])
    stats = runner.stats()
    assert stats["graph_runs"] == 1 and "disabled" not in stats["eager_reasons"], stats["eager_reasons"]


def test_a_replay_that_fails_where_eager_succeeds_disables_the_key():
    """A replay that raises (a fault injected into the key's graph) where eager succeeds: that key
    is disabled and the step returns eager's result (this holds today and must keep holding)."""
    model = ToyPagedModel()
    control = copy.deepcopy(model)
    runner = toy_runner(model)
    (entry,) = [entry for key, entry in runner.registry.entries.items() if str(key) == "decode/bs=4"]

    def broken_replay() -> None:
        raise RuntimeError("injected replay fault")

    entry.graph.replay = broken_replay
    batch = decode_batch(3, seed=1)
    assert_identical(runner(batch), control(batch.input_ids, batch.positions, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"replay_failed": 1} and "decode/bs=4" in stats["failed_keys"], stats


def test_a_cache_rebound_after_capture_is_never_replayed():
    """The model rebinds its KV cache to a larger tensor after capture: a replay would write the
    captured 256-slot cache (slot 300 failed the replay before the guards); the key's guard sees
    the rebinding and the step runs eagerly on the new cache, the key kept."""
    model = ToyPagedModel()
    runner = toy_runner(model)
    model.kv = torch.zeros(2 * KV_SLOTS, model.kv.shape[1])
    batch = decode_batch(3, seed=1, out_cache_loc=torch.tensor([5, 300, 7]))
    control = copy.deepcopy(model)
    assert_identical(runner(batch), control(batch.input_ids, batch.positions, batch))
    assert torch.equal(model.kv, control.kv)
    stats = runner.stats()
    assert stats["eager_reasons"] == {"rebound_state": 1} and not stats["failed_keys"], stats


def test_no_value_of_a_failed_step_reaches_a_later_capture_or_padded_step():
    """After a batch whose token id is past the vocabulary failed, ``retune()`` captures every key
    it picks (today the bad id left in a static slot fails that capture), and a padded step whose
    padding row is the row the bad id was staged into equals eager."""
    model = ToyPagedModel()
    control = copy.deepcopy(model)
    runner = toy_runner(model)
    with pytest.raises(IndexError):
        runner(decode_batch(3, seed=1, input_ids=torch.tensor([5, 1000, 7])))
    report = runner.retune(2)
    assert report.ok and not report.failed, report.failed
    small = decode_batch(1, seed=3)
    padded = pad_batch(small, min(size for size in runner.stats()["capture_sizes"] if size > 1))
    assert_identical(runner(small), control(padded.input_ids, padded.positions, padded)[:1])
    assert runner.stats()["graph_runs"] == 1


def reference_setup(backend: str, device: str, debug):
    """The reference model with its pools in ``batch_context``, captured, and a valid 3-request decode batch."""
    model, attn, pools = build_reference(ReferenceConfig.tiny(), num_requests=8, device=device)
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[2, 4], backend=backend, device=device,
                         progress=False, debug=debug, **graph_runner_kwargs(attn, pools))
    assert runner.capture().ok
    reqs = [pools.req_to_token.alloc() for _ in range(3)]
    out_loc = pools.assign(reqs, [0, 0, 0], [1, 1, 1])
    batch = make_decode_batch([5, 6, 7], reqs, [1, 1, 1], out_loc, device, pools, attn)
    return model, pools, runner, batch


def past_the_pool(pools, field: str, device: str) -> dict:
    """The batch field ``field`` with its middle entry one past the table it indexes."""
    size = {"out_cache_loc": pools.kv.num_slots, "req_pool_indices": pools.req_to_token.num_requests}[field]
    return {field: torch.tensor([1, size, 2], device=device)}


BACKENDS_WITH_DEBUG = [pytest.param((*param.values[0], None if param.id == "emulated" else True), id=param.id,
                                    marks=param.marks) for param in BACKENDS]


@pytest.mark.parametrize("field", ["out_cache_loc", "req_pool_indices"])
@pytest.mark.parametrize("backend_device_debug", BACKENDS_WITH_DEBUG)
def test_an_index_past_a_known_pool_is_refused_by_validation_naming_the_field(backend_device_debug, field,
                                                                            value_check_path):
    """With the KV pool and the request pool in ``batch_context``, an index past either is a
    ``ValueError`` naming the field and the pool's size, raised before anything is staged or run
    (on CPU host tensors always, on CUDA with ``debug=True``); the valid batch then replays."""
    backend, device, debug = backend_device_debug
    model, pools, runner, batch = reference_setup(backend, device, debug)
    before = static_checksums(runner)
    bad = dataclasses.replace(batch, **past_the_pool(pools, field, device))
    with pytest.raises(ValueError, match=rf"{field}: .*{int(getattr(bad, field)[1])}"):
        runner(bad)
    after = static_checksums(runner)
    assert all(torch.equal(before[name], after[name]) for name in before), "a refused batch was staged"
    assert runner.stats()["graph_runs"] == 0 and runner.stats()["eager_runs"] == 0
    expected = run_eager(model, batch).clone()
    torch.testing.assert_close(runner(batch), expected, atol=1e-5, rtol=1e-5)
    assert runner.stats()["graph_runs"] == 1


def test_wrap_call_with_an_index_past_the_table_raises_and_keeps_its_graph():
    """wrap() already does this right: the bad call raises the embedding's IndexError and later
    calls, padded ones included, replay with eager's result (this must keep holding)."""
    embedding = torch.nn.Embedding(10, 4)
    fast = wrap(embedding, max_batch_size=4, capture_sizes=[4], backend="emulated")
    with torch.no_grad():
        fast(torch.tensor([1, 2, 3, 4]))
        fast(torch.tensor([1, 2, 3, 4]))
        with pytest.raises(IndexError):
            fast(torch.tensor([1, 20, 3, 4]))
        for ids in (torch.tensor([1, 2, 3, 4]), torch.tensor([4, 2])):
            assert_identical(fast(ids), embedding(ids))
    assert fast.stats()["failed_keys"] == {} and fast.stats()["key_hits"] != {}


# ---------------------------------------------------------------- item 7: refused up front, named


@pytest.mark.parametrize("build,name", [
    (lambda: GraphRunner(None, max_batch_size=4, backend="emulated", progress=False), "model"),
    (lambda: GraphRunner(torch.zeros(3), max_batch_size=4, backend="emulated", progress=False), "model"),
    (lambda: wrap(None, max_batch_size=4, backend="emulated"), "fn"),
    (lambda: wrap("forward", max_batch_size=4, backend="emulated"), "fn"),
], ids=["runner of None", "runner of a tensor", "wrap of None", "wrap of a string"])
def test_a_model_or_fn_that_is_not_callable_is_refused_when_built(build, name):
    """A TypeError naming the argument when the runner or wrapper is built, not a failure at capture."""
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        build()


@pytest.mark.skipif(CUDA_AVAILABLE, reason="needs a machine without CUDA")
@pytest.mark.parametrize("backend", ["auto", "emulated"])
def test_device_cuda_without_cuda_is_refused_naming_device(backend):
    """An error that names the ``device`` option, not torch's "Torch not compiled with CUDA enabled"."""
    with pytest.raises((ValueError, RuntimeError), match=r"\bdevice\b"):
        GraphRunner(ToyPagedModel(), max_batch_size=4, backend=backend, device="cuda", progress=False)


@pytest.mark.parametrize("in_config,beside", [(16, 4), (4, 16)])
def test_max_batch_size_in_a_config_and_beside_it_is_refused_naming_both(in_config, beside):
    """``GraphRunner(model, RunnerConfig(max_batch_size=a), max_batch_size=b)``: the message is about
    the two values given, not about ``capture_sizes`` (derived from the config, never set)."""
    with pytest.raises((TypeError, ValueError)) as raised:
        GraphRunner(ToyPagedModel(), RunnerConfig(max_batch_size=in_config, progress=False), max_batch_size=beside)
    message = str(raised.value)
    assert "max_batch_size" in message and str(in_config) in message and str(beside) in message, message
    assert "capture_sizes" not in message, message


def test_check_command_with_a_factory_returning_none_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    """``python -m graphrt.check module:fn`` whose ``fn`` returns None is a usage error (exit 2) that
    says so, not a report on ``None`` as if it were the step."""
    (tmp_path / "faithful_none_factory.py").write_text("def make():\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = check_main(["faithful_none_factory:make"])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert "the factory returned None" in captured.err, captured.err


# ---------------------------------------------------------------- item 8: logs that say what happens


class RowsOfThree(torch.nn.Module):
    """A state sized to 3 rows (like a StaticCache made for the real batch): padded capture fails."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3, 4))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def graphrt_records(caplog, level: int):
    return [record for record in caplog.records if record.name.startswith("graphrt") and record.levelno >= level]


def test_a_padded_capture_recovered_at_the_call_size_is_info_not_a_warning(caplog):
    """Calls of 3 rows padded to 4: the 4-row capture fails, the 3-row key records and replays. No
    step runs eagerly for it, so nothing is logged as a WARNING; an INFO line says the call's size
    gets a graph of its own."""
    caplog.set_level(logging.INFO, logger="graphrt")
    fast = wrap(RowsOfThree(), max_batch_size=4, capture_sizes=[4], backend="emulated")
    for _ in range(3):
        fast(torch.ones(3, 4))
    assert fast.stats()["graph_runs"] == 2, fast.stats()
    warnings = graphrt_records(caplog, logging.WARNING)
    assert not warnings, [record.getMessage() for record in warnings]
    infos = [record.getMessage() for record in graphrt_records(caplog, logging.INFO)]
    assert any("own size" in message for message in infos), infos


def test_a_capture_whose_steps_will_run_eagerly_is_a_warning(caplog):
    """The other side (holds today): a step that fails capture at every size really runs eagerly,
    and that is a WARNING naming why."""
    caplog.set_level(logging.INFO, logger="graphrt")
    fast = wrap(lambda x: x * float(x.sum()), max_batch_size=4, capture_sizes=[4], backend="emulated")
    for _ in range(3):
        fast(torch.ones(3, 4))
    assert fast.stats()["graph_runs"] == 0
    warnings = [record.getMessage() for record in graphrt_records(caplog, logging.WARNING)]
    assert warnings and all("HostSyncError" in message for message in warnings), warnings


def test_keys_of_a_prefill_layout_are_not_named_decode(caplog):
    """Hugging Face ``generate()`` through ``graph_generate`` with ``max_new_tokens=1``: every forward
    call is a prefill (3 prompts, padded to 4, recorded at 3 after the padded capture fails). No
    key in ``stats()`` and no log line names it ``decode/...``; keys still say their size."""
    pytest.importorskip("transformers")
    from hf_helpers import tiny_causal_lm

    import graphrt.hf

    caplog.set_level(logging.INFO, logger="graphrt")
    model = tiny_causal_lm("llama")
    fast = graphrt.hf.graph_generate(model, max_batch_size=4)
    prompts = torch.randint(1, 128, (3, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model.generate(prompts, max_new_tokens=1, do_sample=False)
    stats = fast.stats()
    assert stats["graph_runs"] == 2, stats
    names = [*stats["key_hits"], *stats["captured_keys"], *stats["failed_keys"]]
    names += [key for layout in stats["layouts"].values() for key in layout["captured_keys"]]
    assert names and all(re.fullmatch(r"(layout\d+:)?([a-z]+/)?bs=\d+", name) for name in names), names
    assert not [name for name in names if "decode" in name], names
    logged = [record.getMessage() for record in graphrt_records(caplog, logging.INFO)]
    assert not [message for message in logged if "decode/" in message], logged
