"""What a real GPU does that the first fake could not show (issue 33, items 1 to 6).

Each scenario runs real graphrt objects over tests/fake_cuda.py, which now executes nothing at
capture (garbage instead of values), keeps the default generator capturing after an invalidated
capture as torch 2.11 does, frees a stream's cuBLAS workspace on ``reset()`` as later releases do,
frees pools under non-owning views on ``empty_cache()``, and refuses a second capture in the
process; once per PyTorch behaviour it models, and, marked ``cuda``, on a GPU (the ``device``
fixture of tests/test_cuda_pool.py).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import pytest
import torch
from fake_cuda import TORCH_2_11, RecordingMode, install
from piecewise_helpers import double_rows
from test_cuda_pool import checks, device, older_objects_frozen, statuses  # noqa: F401 - fixtures

from graphrt import GraphRunner
from graphrt.backends.session import RecordingLock, gc_frozen
from graphrt.entry import GraphStatus
from graphrt.reference import make_extend_batch

READY = GraphStatus.READY


def draw(device_name: str) -> torch.Tensor:
    """An eager draw from the device's default generator."""
    return torch.rand(3, device=device_name)


# ---- item 1: a failed capture leaves eager random numbers working ---------------------------------

def test_a_failed_last_capture_leaves_eager_random_numbers_working(device, checks):
    model = checks.Misbehaving("item", at=1, device=device.name)
    runner = checks.runner_for(model, device.name, [1, 2])  # bs 1, the last key captured, fails
    runner.capture()
    assert statuses(runner) == {"decode/bs=2": READY, "decode/bs=1": GraphStatus.FAILED}
    assert draw(device.name).shape == (3,)  # torch <= 2.11 left the generator capturing: this raised
    device.settle()


class DrawingModel(torch.nn.Module):
    """``checks.Misbehaving`` whose step draws random numbers (a sampler's noise, scaled to nothing)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, positions, forward_batch):
        out = self.inner(input_ids, positions, forward_batch)
        return out + 0.0 * torch.rand_like(out)


def test_keys_that_draw_random_numbers_capture_after_a_failed_capture(device, checks):
    model = DrawingModel(checks.Misbehaving("item", at=4, device=device.name))
    runner = checks.runner_for(model, device.name, [1, 2, 4])
    runner.capture()
    assert statuses(runner) == {"decode/bs=4": GraphStatus.FAILED, "decode/bs=2": READY, "decode/bs=1": READY}
    device.settle()


def test_a_failed_capture_releases_its_graph_at_once(monkeypatch, checks):
    """With the collector off, the traceback cycle of the error would keep the failed graph alive."""
    with install(monkeypatch, TORCH_2_11) as fake:
        runner = checks.runner_for(checks.Misbehaving("item", at=2, device="cpu"), "cpu", [1, 2])
        gc.disable()
        try:
            runner.capture()
            failed = [graph for graph in fake.graphs if not graph.capture_ended and graph.referenced]
        finally:
            gc.enable()
        assert failed == []


# ---- item 3: splitting ops read real values during a piecewise capture ----------------------------

SEEN = []  # what the splitting op read, call by call


@torch.library.custom_op("graphrt_test::route_and_count", mutates_args=("counts",))
def route_and_count(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A splitting op like MoE routing: indexes with values of its input, writes a state tensor,
    draws random numbers. Between two pieces (no capture under way) it keeps what it read."""
    if not torch.cuda.is_current_stream_capturing():  # inside a full graph it is captured, not run
        SEEN.append(x.clone())
    expert = x.abs().sum(-1).long() % counts.shape[0]
    counts.index_add_(0, expert, torch.ones_like(expert, dtype=counts.dtype))
    return x * 2 + 0.0 * torch.rand_like(x)


class Routed(torch.nn.Module):
    def __init__(self, device_name: str) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(97, 8, generator=torch.Generator().manual_seed(0)).to(device_name))
        self.register_buffer("counts", torch.zeros(4, device=device_name))

    def forward(self, input_ids, positions, forward_batch):
        return route_and_count(self.embed[input_ids] + positions[:, None], self.counts) * 3


def rng_state(device_name: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_name == "cuda" else torch.get_rng_state()


def test_splitting_ops_read_real_values_during_a_piecewise_capture_and_leave_no_trace(device):
    model = Routed(device.name)
    runner = GraphRunner(model, max_batch_size=2, backend="cuda", device=device.name, progress=False,
                         splitting_ops=[route_and_count], piecewise_sizes=[8])
    counts, rng = model.counts.clone(), rng_state(device.name)
    SEEN.clear()
    runner.capture()
    assert statuses(runner)["piecewise/tokens=8"] is READY
    assert SEEN and all(bool(torch.isfinite(seen).all()) for seen in SEEN), "the op read a piece never computed"
    assert torch.equal(model.counts, counts), "the splitting op's writes at capture were not undone"
    assert torch.equal(rng_state(device.name), rng), "the capture moved the generator"
    batch = make_extend_batch([list(range(6))], [1], [0], torch.arange(1, 7, device=device.name), device.name)
    with torch.no_grad():
        for _ in range(2):  # the first call shows the output's token axis eagerly (axis_probe), the second replays
            got = runner(batch).clone()
            model.counts.copy_(counts)
            assert torch.equal(got, model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["piecewise_runs"] == 1
    device.settle()


# ---- item 4: retiring a pool never frees memory an output views ----------------------------------

def test_an_output_held_across_a_retune_stays_readable_and_its_pool_is_freed_after(device, checks):
    model = checks.Misbehaving(device=device.name)
    runner = checks.runner_for(model, device.name, [2, 4])
    runner.capture()
    held = runner(checks.decode_batch(4, device.name))  # a non-owning view of the first pool
    kept = held.clone()
    first_pool = checks.pools(runner)[0]
    runner.retune(1)  # drops every decode graph: the first pool is retired
    checks.replay_equal_eager(runner, model, device.name, [4], 2)
    assert torch.equal(held, kept)  # stale rows but readable: its memory was not cudaFree'd
    if device.fake is not None:
        assert first_pool in device.fake.allocator.graph_pools
    del held
    runner.retune(1)  # the next capture session frees what nothing views any more
    if device.fake is not None:
        assert first_pool not in device.fake.allocator.graph_pools
        assert device.fake.effects.illegal_accesses == []
    device.settle()


# ---- item 5: one capture at a time in the process -------------------------------------------------

def test_the_collector_stays_off_until_the_last_capture_session_ends():
    first, second = gc_frozen(), gc_frozen()
    was_enabled = gc.isenabled()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # another session still captures
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled() == was_enabled


def test_the_recording_lock_is_shared_by_steps_and_held_alone_by_a_recording():
    """Issue 48, item 3: steps of several threads share the lock; a recording waits for the shares
    then holds it alone; a waiting recording goes before new sharers; a thread that shares it and
    records sets its share aside (no deadlock) and has it back after."""
    lock, order = RecordingLock(), []
    lock.acquire_shared()
    other_shared = threading.Event()

    def share() -> None:
        lock.acquire_shared()
        other_shared.set()
        lock.release_shared()

    sharer = threading.Thread(target=share)
    sharer.start()
    assert other_shared.wait(timeout=5), "a second thread's share waited for the first"
    sharer.join()

    def record() -> None:
        with lock:
            order.append("recorded")

    recorder = threading.Thread(target=record)
    recorder.start()
    time.sleep(0.05)
    assert order == [], "the recording ran beside a share"
    late = threading.Thread(target=lambda: (lock.acquire_shared(), order.append("late share"), lock.release_shared()))
    late.start()
    time.sleep(0.05)
    with lock:  # this thread shares it and records: its share set aside while it waits
        order.append("own recording")
    lock.release_shared()
    recorder.join(timeout=5)
    late.join(timeout=5)
    assert order[-1] == "late share" and sorted(order[:2]) == ["own recording", "recorded"], order


class WaitingModel(torch.nn.Module):
    """``checks.Misbehaving`` whose first capture waits (up to ``timeout`` s) for another thread's
    capture to end, after telling it that it captures."""

    def __init__(self, inner: torch.nn.Module, capturing: threading.Event, other_done: threading.Event) -> None:
        super().__init__()
        self.inner, self.capturing, self.other_done = inner, capturing, other_done

    def forward(self, input_ids, positions, forward_batch):
        if torch.cuda.is_current_stream_capturing() and not self.capturing.is_set():
            self.capturing.set()
            self.other_done.wait(timeout=1.0)  # with the process-wide lock the other thread cannot end first
        return self.inner(input_ids, positions, forward_batch)


def test_captures_in_two_threads_take_turns(device, checks):
    capturing, done = threading.Event(), threading.Event()
    first = checks.runner_for(WaitingModel(checks.Misbehaving(device=device.name), capturing, done), device.name, [2])
    second = checks.runner_for(checks.Misbehaving(device=device.name), device.name, [2])
    errors = []

    def capture_second() -> None:
        try:
            capturing.wait(timeout=10)
            # dispatch modes are per thread: the fake's recording mode goes on in this one too
            with contextlib.nullcontext() if device.fake is None else RecordingMode(device.fake):
                second.capture()
        except Exception as error:  # noqa: BLE001 - the test reports it
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=capture_second)
    thread.start()
    first.capture()
    thread.join(timeout=30)
    assert errors == [] and statuses(first) == {"decode/bs=2": READY} and statuses(second) == {"decode/bs=2": READY}
    assert second.stats()["failed_keys"] == {}
    device.settle()


# ---- item 2: dropping one graph leaves the others' cuBLAS workspaces ------------------------------

def test_dropping_one_graph_leaves_the_other_graphs_replayable(device, checks):
    model = checks.Misbehaving(device=device.name)  # a matmul per step: cuBLAS
    runner = checks.runner_for(model, device.name, [2, 4])
    runner.capture()
    entry = runner.registry.entries[next(key for key in runner.registry.entries if key.num_tokens == 4)]

    def fail() -> None:
        raise RuntimeError("injected replay failure")

    entry.graph.replay = fail  # the next bs-4 replay raises: the key is disabled and its graph dropped
    checks.replay_equal_eager(runner, model, device.name, [4], 1)
    assert entry.status is GraphStatus.DISABLED
    gc.collect()
    assert checks.replay_equal_eager(runner, model, device.name, [2], 2) == 2
    assert statuses(runner)["decode/bs=2"] is READY
    if device.fake is not None:
        assert device.fake.effects.illegal_accesses == []
    device.settle()


# ---- item 6: the cache is emptied before capturing ------------------------------------------------

def test_a_capture_session_frees_unused_cached_pools_first(device, checks):
    model = checks.Misbehaving(device=device.name)
    runner = checks.runner_for(model, device.name, [2, 4])
    runner.capture()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    del runner
    gc.collect()  # its graphs and anchor are gone: its pool is freeable, still reserved
    if device.fake is not None:
        device.fake.allocator.capacity = reserved + reserved // 2  # room for one such pool, not two
    again = checks.runner_for(model, device.name, [2, 4])
    again.capture()
    assert statuses(again) == {"decode/bs=4": READY, "decode/bs=2": READY}, again.stats()["failed_keys"]
    assert torch.cuda.memory_reserved() <= reserved + (2 << 20)
    device.settle()


# ---- item 9: a capture's pool bytes are never negative --------------------------------------------

class Wide(torch.nn.Module):
    """``checks.Misbehaving`` with 0.8 MB of output per row: 4 rows take a 20 MiB segment, 1 row a 2 MiB one."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, positions, forward_batch):
        return self.inner(input_ids, positions, forward_batch).repeat(1, 2048)


def test_pool_bytes_stay_non_negative_when_a_retired_pool_is_freed_during_a_capture(device, checks):
    model = Wide(checks.Misbehaving(device=device.name))
    runner = checks.runner_for(model, device.name, [2, 4])
    runner.capture()
    checks.replay_equal_eager(runner, model, device.name, [1], 2)
    report = runner.retune(1)  # bs 1 only; its capture frees the first pool (no output views it) as it begins
    assert report.keys and all(key.pool_bytes >= 0 for key in report.keys), [key.pool_bytes for key in report.keys]
    device.settle()


# ---- item 7: piecewise keys hold their pool memory as the pool does ---------------------------------

class Split(torch.nn.Module):
    """Embeds tokens (a piece), doubles them in a splitting op, scales them (a piece)."""

    def __init__(self, device_name: str) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(97, 512, generator=torch.Generator().manual_seed(0)).to(device_name))

    def forward(self, input_ids, positions, forward_batch):
        return double_rows(self.embed[input_ids] + positions[:, None]) * 3


def piecewise_pool_allocated(fake, sizes) -> int:
    """Pool bytes that tensors still own after capturing a runner with piecewise keys of ``sizes``."""
    runner = GraphRunner(Split("cpu"), max_batch_size=1, capture_sizes=[1], backend="cuda", device="cpu",
                         progress=False, splitting_ops=[double_rows], piecewise_sizes=sizes)
    runner.capture()
    assert all(status is READY for status in statuses(runner).values())
    allocated = fake.allocator.allocated()
    del runner
    gc.collect()
    return allocated


def test_piecewise_keys_own_no_pool_memory_so_it_stays_near_the_largest_keys(monkeypatch):
    with install(monkeypatch, TORCH_2_11) as fake:
        largest_only = piecewise_pool_allocated(fake, [64])
        every_size = piecewise_pool_allocated(fake, [8, 16, 32, 64])
    assert every_size <= largest_only, (every_size, largest_only)


@pytest.mark.cuda
def test_piecewise_keys_replay_equal_to_eager_with_pool_held_outputs():
    model = Split("cuda")
    runner = GraphRunner(model, max_batch_size=1, capture_sizes=[1], backend="cuda", device="cuda", progress=False,
                         splitting_ops=[double_rows], piecewise_sizes=[8, 16])
    runner.capture()
    for tokens in (6, 12, 6, 12, 6):  # each size shows its token axis once (axis_probe), then replays
        batch = make_extend_batch([list(range(tokens))], [1], [0], torch.arange(1, tokens + 1, device="cuda"), "cuda")
        with torch.no_grad():
            torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["piecewise_runs"] >= 3
