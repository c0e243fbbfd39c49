"""Micro-batch synchronization: contexts, the barrier, and threaded calls that fail, time out and recover."""

from __future__ import annotations

import threading

import pytest
import torch
from ubatch_helpers import SIZES, batch_model, call_and_close, make_batch

from graphrt.batch import ForwardBatch
from graphrt.ubatch import (
    UBatchBarrier,
    UBatchBarrierError,
    UBatchConfig,
    UBatchContext,
    UBatchSlice,
    UBatchState,
    UBatchTimeoutError,
    UBatchWrapper,
    current_ubatch,
)

JOIN_S = 20.0


def test_context_signal_wait_and_reset():
    context = UBatchContext(UBatchSlice.from_range(0, 4, 0, 4))
    with pytest.raises(UBatchTimeoutError, match="not ready"):
        context.wait_ready(0.01)
    context.signal_ready()
    context.wait_ready(0.01)
    assert context.state is UBatchState.READY
    context.reset()
    assert context.state is UBatchState.IDLE and not context.cpu_wait_event.is_set()


def test_context_run_exposes_the_piece_then_signals_ready_or_failed():
    context = UBatchContext(UBatchSlice.from_range(0, 2, 0, 2))

    def fail():
        raise RuntimeError("piece failed")

    seen = context.run(lambda x: (current_ubatch().context is context, current_ubatch().args), (torch.ones(2),), {})
    assert seen[0] and len(seen[1]) == 1 and current_ubatch() is None
    assert context.state is UBatchState.READY and context.cpu_wait_event.is_set()
    context.reset()
    with pytest.raises(RuntimeError, match="piece failed"):
        context.run(fail, (), {})
    assert context.state is UBatchState.FAILED and context.cpu_wait_event.is_set() and current_ubatch() is None


def wait_in_threads(barrier, count, timeout):
    results = []
    threads = [threading.Thread(target=lambda: results.append(barrier.wait(timeout))) for _ in range(count)]
    for thread in threads:
        thread.start()
    return results, threads


def test_barrier_timeout_raises_and_the_barrier_works_again():
    barrier = UBatchBarrier(2)
    with pytest.raises(UBatchBarrierError, match="timed out") as info:
        barrier.wait(timeout=0.05)
    assert isinstance(info.value, TimeoutError) and barrier.generation == 0
    for round_ in (1, 2):
        results, threads = wait_in_threads(barrier, 2, timeout=JOIN_S)
        for thread in threads:
            thread.join(JOIN_S)
        assert sorted(results) == [0, 1] and barrier.generation == round_


def test_barrier_reset_releases_waiters():
    barrier = UBatchBarrier(3)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(UBatchBarrierError, barrier.wait, JOIN_S)))
    thread.start()
    while barrier._barrier.n_waiting == 0 and thread.is_alive():
        thread.join(0.01)
    barrier.reset()
    thread.join(JOIN_S)
    assert not thread.is_alive() and len(errors) == 1 and barrier.generation == 0


class GatedWrapper(UBatchWrapper):
    """Workers wait for a gate before reaching the barrier (a stalled thread pool)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _worker(self, barrier, items):
        self.gate.wait(JOIN_S)
        return super()._worker(barrier, items)


def test_barrier_timeout_in_a_threaded_call_raises_then_the_wrapper_recovers():
    wrapper = GatedWrapper(lambda x: x + 1, UBatchConfig(capture_sizes=SIZES, threaded=True, barrier_timeout_s=1.0))
    x = torch.arange(70)
    try:
        with pytest.raises(UBatchBarrierError):
            wrapper(x)
        wrapper.gate.set()
        assert torch.equal(wrapper(x), x + 1)
        assert wrapper.stats()["failures"] == 1
    finally:
        wrapper.gate.set()
        wrapper.close()


def test_stuck_micro_batch_times_out_then_the_wrapper_recovers():
    release = threading.Event()

    def model(x):
        if x.shape[0] == 2:
            release.wait(JOIN_S)
        return x + 1

    wrapper = UBatchWrapper(model, UBatchConfig(capture_sizes=SIZES, threaded=True, barrier_timeout_s=1.0))
    x = torch.arange(70)
    try:
        with pytest.raises(UBatchTimeoutError, match="not ready"):
            wrapper(x)
        release.set()
        assert torch.equal(wrapper(x), x + 1)
    finally:
        release.set()
        wrapper.close()


def test_worker_errors_propagate_and_the_wrapper_recovers():
    def model(x):
        if x.shape[0] == 4:
            raise RuntimeError("piece failed")
        return x + 1

    wrapper = UBatchWrapper(model, UBatchConfig(capture_sizes=SIZES, threaded=True, barrier_timeout_s=10))
    try:
        with pytest.raises(RuntimeError, match="piece failed"):
            wrapper(torch.arange(70))
        assert torch.equal(wrapper(torch.arange(66)), torch.arange(66) + 1)
        assert wrapper.stats()["failures"] == 1
    finally:
        wrapper.close()


def test_threaded_calls_from_several_threads_are_correct():
    names = set()

    def model(x):
        names.add(threading.current_thread().name)
        return x * 2 + 1

    wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=3, capture_sizes=SIZES, threaded=True,
                                                barrier_timeout_s=10))
    errors = []

    def caller(seed):
        for rows in range(65 + seed, 200, 23):
            x = torch.arange(rows) + seed
            if not torch.equal(wrapper(x), x * 2 + 1):
                errors.append((seed, rows))

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in threads) and errors == []
        assert names and all(name.startswith("graphrt-ubatch") for name in names)
        stats = wrapper.stats()
        assert stats["split_calls"] == stats["barrier_rounds"] > 0 and stats["failures"] == 0
    finally:
        wrapper.close()


@pytest.mark.cuda
def test_threaded_cuda_streams_match_the_whole_batch():
    batch = make_batch([1] * 150, seed=3)
    batch = ForwardBatch(**{k: (v.cuda() if isinstance(v, torch.Tensor) and k != "seq_lens_cpu" else v)
                            for k, v in vars(batch).items()})
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=SIZES, threaded=True, barrier_timeout_s=30))
    assert torch.equal(call_and_close(wrapper, batch), batch_model(batch))
