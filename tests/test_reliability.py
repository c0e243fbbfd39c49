"""Nothing silently wrong: property tests, injected faults, concurrency, stale outputs, long runs."""

from __future__ import annotations

import gc
import random
import threading
import tracemalloc

import pytest
import torch
from conftest import BACKENDS, decode_batch, failing_capture

from graphrt import GraphRunner
from graphrt.debug import StaleOutputError
from graphrt.entry import GraphStatus

MAX_BS = 16


class GemmModel(torch.nn.Module):
    """A pure function of its inputs (no KV state), so concurrent callers can be checked exactly."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(97, 33, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids, positions, forward_batch):
        return self.weight[input_ids] * (positions + forward_batch.seq_lens)[:, None].float()


# ---- injected faults ------------------------------------------------------------------------


def test_simulated_out_of_memory_during_capture_disables_only_that_key():
    model = GemmModel()
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend="emulated", progress=False)
    with failing_capture(runner, 8, torch.OutOfMemoryError("CUDA out of memory (simulated)")):
        report = runner.capture()
    assert list(report.failed) == [key for key in report.failed if key.num_reqs == 8] and len(report.failed) == 1
    assert "OutOfMemoryError" in next(iter(report.failed.values()))
    batch = decode_batch(7, seed=1)
    torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1}
    runner(decode_batch(3, seed=1))
    assert runner.stats()["graph_runs"] == 1


def test_keyboard_interrupt_during_capture_keeps_captured_keys_and_runner_usable():
    model = GemmModel()
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend="emulated", progress=False)
    with failing_capture(runner, 4, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        runner.capture()
    statuses = {key.num_reqs: entry.status for key, entry in runner.registry.entries.items()}
    assert statuses == {16: GraphStatus.READY, 8: GraphStatus.READY, 4: GraphStatus.PENDING,
                        2: GraphStatus.PENDING, 1: GraphStatus.PENDING}
    for batch_size in (3, 12):
        batch = decode_batch(batch_size, seed=batch_size)
        torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["eager_reasons"] == {"not_captured": 1} and runner.stats()["graph_runs"] == 1
    assert [key.num_reqs for key in runner.capture().ok] == [4, 2, 1], "capture() resumes the pending keys"
    assert gc.isenabled(), "the garbage collector must be back on after an interrupted capture"


# ---- concurrency ------------------------------------------------------------------------------


def test_threads_sharing_a_runner_get_correct_results():
    """Calls are serialized by the runner's lock; copy_outputs=True gives each thread owned outputs."""
    model = GemmModel()
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend="emulated", progress=False, copy_outputs=True)
    runner.capture()
    batches = [decode_batch(random.Random(i).randint(1, MAX_BS), seed=i) for i in range(24)]
    expected = [model(b.input_ids, b.positions, b) for b in batches]
    kept, errors = {}, []

    def worker(offset):
        try:
            for step in range(60):
                index = (offset * 7 + step) % len(batches)
                out = runner(batches[index])
                kept[(offset, step)] = (index, out)
                torch.testing.assert_close(out, expected[index], atol=1e-5, rtol=1e-5)
        except Exception as error:  # surfaced in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not errors, errors[0]
    for index, out in kept.values():  # copies handed to one thread were never overwritten by another
        torch.testing.assert_close(out, expected[index], atol=1e-5, rtol=1e-5)
    assert runner.stats()["graph_runs"] == 240


def test_copy_outputs_false_views_are_shared_between_threads_as_documented():
    runner = GraphRunner(GemmModel(), max_batch_size=MAX_BS, backend="emulated", progress=False)
    runner.capture()
    first = runner(decode_batch(5, seed=1))
    second = runner(decode_batch(5, seed=2))
    assert first.data_ptr() == second.data_ptr()


# ---- stale outputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_debug_mode_raises_on_reading_an_overwritten_output(how, monkeypatch):
    if how == "environment":
        monkeypatch.setenv("GRAPHRT_DEBUG", "1")
    runner = GraphRunner(GemmModel(), max_batch_size=MAX_BS, backend="emulated", progress=False,
                         debug=True if how == "argument" else None)
    runner.capture()
    first = runner(decode_batch(5, seed=1))
    float(first.sum())  # reading before the next replay is fine
    other_key = runner(decode_batch(2, seed=3))  # another key of the pool: its outputs share `first`'s memory
    with pytest.raises(StaleOutputError, match=r"decode/bs=8 \(replay #1 of its memory pool\).*last graph "
                                               r"decode/bs=2 \(replay #2\)"):
        first + 1
    with pytest.raises(StaleOutputError):
        first.tolist()
    assert other_key.shape == (2, 33) and float(other_key.sum()) == float(other_key.sum())
    latest = runner(decode_batch(6, seed=2))  # bs=8 again: `other_key` is stale now, `latest` current
    with pytest.raises(StaleOutputError, match="last graph decode/bs=8"):
        other_key + 1
    assert torch.isfinite(latest).all()


def test_debug_mode_is_off_by_default_and_outputs_are_plain_views():
    runner = GraphRunner(GemmModel(), max_batch_size=MAX_BS, backend="emulated", progress=False)
    runner.capture()
    out = runner(decode_batch(5, seed=1))
    runner(decode_batch(6, seed=2))
    assert type(out) is torch.Tensor
    out + 1  # stale but unchecked: the documented CUDA-graph contract


# ---- long runs ---------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def run_steps(steps: int, device: str = "cpu", backend: str = "emulated"):
    model = GemmModel().to(device)
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend=backend, device=device, progress=False)
    runner.capture()
    rng = random.Random(0)
    batches = [decode_batch(n, device=device, seed=n) for n in range(1, MAX_BS + 6)]
    for batch in batches:  # warm every size (view caches, counters) before measuring
        runner(batch)
    pointers = {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()}
    return runner, rng, batches, pointers


@pytest.mark.parametrize("steps", [pytest.param(2_000, id="short"), pytest.param(20_000, id="long", marks=pytest.mark.slow)])
def test_long_run_keeps_host_memory_and_static_tensors_constant(steps):
    runner, rng, batches, pointers = run_steps(steps)
    gc.collect()
    tracemalloc.start()
    baseline_traced = tracemalloc.get_traced_memory()[0]
    baseline_rss = rss_bytes()
    for _ in range(steps):
        runner(rng.choice(batches))
    gc.collect()
    growth_traced = tracemalloc.get_traced_memory()[0] - baseline_traced
    tracemalloc.stop()
    assert growth_traced < 64 * 1024, f"Python heap grew by {growth_traced} bytes over {steps} steps"
    assert rss_bytes() - baseline_rss < 8 * 2**20
    assert {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()} == pointers
    assert runner.stats()["graph_runs"] + runner.stats()["eager_runs"] == steps + len(batches)


@pytest.mark.cuda
def test_long_run_keeps_cuda_memory_constant():
    runner, rng, batches, pointers = run_steps(2_000, device="cuda", backend="cuda")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(2_000):
        runner(rng.choice(batches))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()} == pointers


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_graph_equals_eager_across_backends_after_many_mixed_steps(backend_device):
    backend, device = backend_device
    model = GemmModel().to(device)
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend=backend, device=device, progress=False)
    runner.capture()
    rng = random.Random(5)
    for step in range(200):
        batch = decode_batch(rng.randint(1, MAX_BS + 3), device=device, seed=step)
        torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch), atol=1e-5, rtol=1e-5)
