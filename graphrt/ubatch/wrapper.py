"""UBatchWrapper: run one call as micro-batches of captured sizes, in order or on worker threads.

Outputs that are views of static buffers (a graph replay) are overwritten by the
next replay of the same size, so in sequential mode a piece's outputs are copied
when a later piece of the same call pads to the same captured size. Threaded mode
needs a runnable that is safe to call from several threads at once (an eager
model, not one shared graph runner with one set of static buffers).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from graphrt.pools.memory import unreclaimable_pressure
from graphrt.ubatch.plan import CallInputs, UBatchSlice, _call_shape, _SizePlanner, _slice_tree
from graphrt.ubatch.sync import (
    UBatchBarrier,
    UBatchContext,
    UBatchTimeoutError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UBatchConfig:
    """How UBatchWrapper splits batches and runs the pieces."""

    num_ubatches: int = 2  # worker threads; pieces of a balanced split when no sizes are captured
    capture_sizes: Sequence[int] = ()  # token counts with captured graphs: pieces are planned onto them
    max_ubatch_size: Optional[int] = None  # largest piece in tokens (default: the largest capture size)
    threaded: bool = False
    barrier_timeout_s: float = 30.0  # bound on every wait of a threaded call (barrier, results)
    split_threshold: Optional[int] = None  # batches of at most this many tokens run whole (default: piece_limit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capture_sizes", tuple(sorted(set(int(size) for size in self.capture_sizes))))
        if self.num_ubatches < 1:
            raise ValueError(f"num_ubatches: expected >= 1, got {self.num_ubatches}")
        if self.capture_sizes and self.capture_sizes[0] < 1:
            raise ValueError(f"capture_sizes: expected positive sizes, got {list(self.capture_sizes)}")
        smallest = self.capture_sizes[0] if self.capture_sizes else 1
        if self.max_ubatch_size is not None and self.max_ubatch_size < smallest:
            raise ValueError(f"max_ubatch_size: expected >= {smallest}, got {self.max_ubatch_size}")
        if self.barrier_timeout_s <= 0:
            raise ValueError(f"barrier_timeout_s: expected > 0, got {self.barrier_timeout_s}")

    @property
    def piece_limit(self) -> Optional[int]:
        """Largest piece: the largest capture size within max_ubatch_size, else max_ubatch_size."""
        if not self.capture_sizes:
            return self.max_ubatch_size
        cap = self.max_ubatch_size or self.capture_sizes[-1]
        return self.capture_sizes[bisect.bisect_right(self.capture_sizes, cap) - 1]


class UBatchWrapper:
    """Runs a callable on micro-batches that hit captured graph sizes, and merges the outputs.

    The batch is the first ForwardBatch argument (split with ``split_forward_batch``), else
    the first tensor's dim 0 (every row its own request): tensors whose dim 0 is the token
    count are cut by token rows, those whose dim 0 is the request count by request rows,
    everything else is passed whole to every piece.
    """

    def __init__(self, runnable: Callable[..., Any], config: UBatchConfig) -> None:
        self.runnable = runnable
        self.config = config
        self._planner = _SizePlanner(config.capture_sizes, config.num_ubatches)
        self._call_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counters = dict(calls=0, split_calls=0, ubatches=0, padded_tokens=0, failures=0, barrier_rounds=0)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._barrier: Optional[UBatchBarrier] = None
        self._streams: Dict[torch.device, List[Any]] = {}

    def __getattr__(self, key: str) -> Any:
        """Delegate unknown attributes to the wrapped runnable."""
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(key)
        return getattr(runnable, key)

    def unwrap(self) -> Callable[..., Any]:
        """The wrapped runnable."""
        return self.runnable

    def compute_slices(self, num_tokens: int, num_reqs: int,
                       tokens_per_req: Optional[Sequence[int]] = None) -> List[UBatchSlice]:
        """Plan micro-batches: whole requests only, on captured sizes with least padding, then fewest pieces."""
        return self._planner.plan(num_tokens, num_reqs, tokens_per_req, self.config.piece_limit,
                                  self.config.split_threshold)

    def prepare_contexts(self, slices: Sequence[UBatchSlice],
                         device: Optional[torch.device] = None) -> List[UBatchContext]:
        """Fresh contexts, round-robin over worker slots; threaded CUDA calls get per-slot streams and events."""
        workers = min(len(slices), self.config.num_ubatches) if self.config.threaded else 1
        streams = self._worker_streams(workers, device)
        return [UBatchContext(info, thread_id=i % workers, stream=streams[i % workers],
                              gpu_wait_event=None if streams[i % workers] is None else torch.cuda.Event())
                for i, info in enumerate(slices)]

    def _worker_streams(self, workers: int, device: Optional[torch.device]) -> List[Any]:
        """Side streams for threaded CUDA calls, ordered after the caller's stream; Nones otherwise."""
        if not self.config.threaded or device is None or device.type != "cuda":
            return [None] * workers
        streams = self._streams.setdefault(device, [])
        streams.extend(torch.cuda.Stream(device) for _ in range(workers - len(streams)))
        caller = torch.cuda.current_stream(device)
        for stream in streams[:workers]:
            stream.wait_stream(caller)  # inputs were produced on the caller's stream
        return streams[:workers]

    def slice_inputs(self, inputs: CallInputs, slice_info: UBatchSlice) -> CallInputs:
        """The ``(args, kwargs)`` of one micro-batch."""
        shape = _call_shape(inputs)
        if shape is None:
            raise ValueError("inputs: expected a ForwardBatch or a tensor with a batch dim 0 to slice")
        return _slice_tree(inputs, [slice_info], shape)[0]

    def _run_ubatch(self, context: UBatchContext, sliced_inputs: CallInputs) -> Any:
        """Run one micro-batch on its stream, visible through ``current_ubatch()``, then signal it ready."""
        args, kwargs = sliced_inputs
        return context.run(self.runnable, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the call whole when it fits one piece, else as micro-batches with merged outputs."""
        inputs = (args, kwargs)
        shape = _call_shape(inputs)
        if shape is None:
            return self.runnable(*args, **kwargs)
        slices = self.compute_slices(shape.num_tokens, shape.num_reqs, shape.tokens_per_req)
        self._count(calls=1)
        if len(slices) == 1:
            return self.runnable(*args, **kwargs)
        # Threaded calls take turns: they share the worker pool, the barrier and the streams.
        with self._call_lock if self.config.threaded else contextlib.nullcontext():
            work = list(zip(self.prepare_contexts(slices, shape.device), _slice_tree(inputs, slices, shape)))
            outputs = self._run_threaded(work) if self.config.threaded else self._run_sequential(work)
        graph_sizes = [self._planner.graph_size(info.num_tokens) for info in slices]
        padding = sum(size - info.num_tokens for size, info in zip(graph_sizes, slices) if size)
        self._count(split_calls=1, ubatches=len(slices), padded_tokens=padding)
        return self._merge_outputs(outputs)

    def _run_sequential(self, work: List[Tuple[UBatchContext, CallInputs]]) -> List[Any]:
        """Pieces in order on the caller's thread. Every output but the last is copied: a graph's
        outputs are valid until the next replay of any graph in its memory pool."""
        outputs = []
        for i, (context, sliced) in enumerate(work):
            output = self._run_ubatch(context, sliced)
            outputs.append(tree_map_only(torch.Tensor, torch.Tensor.clone, output) if i + 1 < len(work) else output)
        return outputs

    def _run_threaded(self, work: List[Tuple[UBatchContext, CallInputs]]) -> List[Any]:
        """Pieces on worker threads started together by the barrier (call lock held); waits bounded by the timeout."""
        timeout = self.config.barrier_timeout_s
        workers = max(context.thread_id for context, _ in work) + 1
        if self._barrier is None or self._barrier.num_parties != workers + 1:
            self._barrier = UBatchBarrier(workers + 1)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.config.num_ubatches, "graphrt-ubatch")
        barrier = self._barrier
        futures = [self._pool.submit(self._worker, barrier, work[slot::workers]) for slot in range(workers)]
        try:
            self.barrier_sync(timeout)
            deadline = time.monotonic() + timeout
            outputs: List[Any] = [None] * len(work)
            for slot, future in enumerate(futures):
                outputs[slot::workers] = future.result(max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            timed_out = isinstance(exc, TimeoutError)
            self._abandon(barrier, futures, 0.0 if timed_out else timeout)
            if timed_out and not isinstance(exc, UBatchTimeoutError):
                raise UBatchTimeoutError(f"micro-batch results not ready {timeout}s after the barrier") from exc
            raise
        for (context, _), output in zip(work, outputs):
            context.wait_ready(0)  # set before its worker returned; on CUDA this orders the caller's stream
            if context.stream is not None:
                caller = torch.cuda.current_stream(context.stream.device)
                for tensor in tree_leaves(output):
                    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                        tensor.record_stream(caller)
        return outputs

    def _worker(self, barrier: UBatchBarrier, items: List[Tuple[UBatchContext, CallInputs]]) -> List[Any]:
        """One worker slot: wait for the others at this call's barrier, then run its pieces in order."""
        barrier.wait(self.config.barrier_timeout_s)
        return [self._run_ubatch(context, sliced) for context, sliced in items]

    def _abandon(self, barrier: UBatchBarrier, futures: List[concurrent.futures.Future], wait_s: float) -> None:
        """Release a failed call's workers; a pool with a worker still stuck is replaced so the next call runs."""
        self._count(failures=1)
        barrier.abort()
        for future in futures:
            future.cancel()
        _, stuck = concurrent.futures.wait(futures, timeout=wait_s)
        self._barrier = None  # stragglers only ever see the aborted barrier
        if stuck:
            logger.warning("ubatch: %d worker(s) still running after a failed call; starting a new pool", len(stuck))
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def barrier_sync(self, timeout: Optional[float] = None) -> int:
        """The caller's turn at the threaded call's barrier (timeout default: barrier_timeout_s)."""
        if self._barrier is None:
            raise RuntimeError("barrier_sync: no threaded micro-batch call is in progress")
        index = self._barrier.wait(self.config.barrier_timeout_s if timeout is None else timeout)
        self._count(barrier_rounds=1)
        return index

    def _merge_outputs(self, outputs: List[Any]) -> Any:
        """Concatenate micro-batch outputs along dim 0 in order, leaf by leaf (tuples, lists, dicts: any pytree)."""
        return tree_map(_cat_rows, outputs[0], *outputs[1:])

    def _count(self, **increments: int) -> None:
        with self._stats_lock:
            for name, value in increments.items():
                self._counters[name] += value

    def stats(self) -> Dict[str, int]:
        """Counters: calls, calls split, micro-batches run, padded tokens, failed threaded calls, barrier rounds."""
        with self._stats_lock:
            return dict(self._counters)

    def close(self) -> None:
        """Shut down the worker threads (a later threaded call starts new ones)."""
        with self._call_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _cat_rows(first: Any, *rest: Any) -> Any:
    """One output leaf of every micro-batch, concatenated along dim 0 (None stays None)."""
    if first is None:
        return None
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"micro-batch output: cannot merge {type(first).__name__} (expected tensors, "
                        "tuples, lists or dicts of tensors)")
    if first.dim() == 0:
        raise TypeError("micro-batch output: expected tensors with a batch dim 0, got a 0-d tensor")
    return torch.cat([first, *rest], dim=0)


@dataclass
class _Throughput:
    """Timing history of one micro-batch size."""

    samples: int = 0
    tokens_per_s: float = 0.0


# Calls of DynamicUBatchWrapper between two memory probes.
PRESSURE_EVERY = 32


class DynamicUBatchWrapper(UBatchWrapper):
    """UBatchWrapper that splits into more, smaller pieces as memory pressure rises, sized by learned throughput.

    Pressure above ``memory_threshold`` asks for ``ceil(num_ubatches * g)`` pieces, where the
    growth ``g`` rises linearly from 1 at the threshold to ``max_growth`` at full memory.
    ``record_timing`` (called by whoever can time a piece, e.g. with CUDA events) builds the
    history that ``optimal_ubatch_size`` reads; the best size then caps every piece.

    Pressure is read once every ``pressure_every`` calls (an NVML query costs more than a step's host
    budget), by default without the caching allocator's cached blocks (``unreclaimable_pressure``).
    """

    def __init__(self, runnable: Callable[..., Any], config: UBatchConfig, memory_threshold: float = 0.8,
                 pressure_fn: Optional[Callable[[], float]] = None, max_growth: float = 4.0,
                 min_samples: int = 3, smoothing: float = 0.2, pressure_every: int = PRESSURE_EVERY) -> None:
        super().__init__(runnable, config)
        if not 0.0 <= memory_threshold < 1.0:
            raise ValueError(f"memory_threshold: expected a fraction in [0, 1), got {memory_threshold}")
        if type(pressure_every) is not int or pressure_every < 1:
            raise ValueError(f"pressure_every: expected an int >= 1 (calls between two memory probes), got "
                             f"{pressure_every!r}")
        if max_growth < 1.0 or min_samples < 1 or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"max_growth >= 1, min_samples >= 1, smoothing in (0, 1] expected, got "
                             f"{max_growth}, {min_samples}, {smoothing}")
        self.memory_threshold = memory_threshold
        self.max_growth = max_growth
        self.min_samples = min_samples
        self.smoothing = smoothing
        self._pressure_fn = pressure_fn or unreclaimable_pressure
        self._pressure_every = pressure_every
        self._calls_since_probe = pressure_every  # the first call probes
        self._pressure = 0.0
        self._history: Dict[int, _Throughput] = {}
        self._history_lock = threading.Lock()

    def compute_slices(self, num_tokens: int, num_reqs: int,
                       tokens_per_req: Optional[Sequence[int]] = None) -> List[UBatchSlice]:
        """The base plan with pieces capped by the learned best size and, under memory pressure, by 1/k of the batch."""
        limit, threshold = self.config.piece_limit, self.config.split_threshold
        learned = self.optimal_ubatch_size()
        if learned is not None:
            limit = learned if limit is None else min(limit, learned)
        usage = self._get_memory_usage()
        if usage > self.memory_threshold and num_tokens > 0:
            growth = 1.0 + (usage - self.memory_threshold) / (1.0 - self.memory_threshold) * (self.max_growth - 1.0)
            target = -(-num_tokens // int(np.ceil(self.config.num_ubatches * growth)))
            limit, threshold = self._fit(target if limit is None else min(limit, target)), 0
        return self._planner.plan(num_tokens, num_reqs, tokens_per_req, limit, threshold)

    def _fit(self, tokens: int) -> int:
        """The largest captured size within ``tokens`` (the smallest size if none), or ``tokens`` without sizes."""
        sizes = self.config.capture_sizes
        return sizes[max(0, bisect.bisect_right(sizes, tokens) - 1)] if sizes else max(1, tokens)

    def _get_memory_usage(self) -> float:
        """Memory pressure in [0, 1] from the injected probe (default: graphrt.pools.memory.unreclaimable_pressure),
        read again once every ``pressure_every`` calls."""
        if self._calls_since_probe >= self._pressure_every:
            self._pressure = min(1.0, max(0.0, float(self._pressure_fn())))
            self._calls_since_probe = 0
        self._calls_since_probe += 1
        return self._pressure

    def record_timing(self, num_tokens: int, elapsed: float) -> None:
        """Add one micro-batch timing (seconds) to the throughput history of its captured size."""
        if num_tokens < 1 or elapsed <= 0:
            raise ValueError(f"record_timing: expected num_tokens >= 1 and elapsed > 0, got {num_tokens}, {elapsed}")
        size = self._planner.graph_size(num_tokens) or num_tokens
        rate = num_tokens / elapsed
        with self._history_lock:
            entry = self._history.setdefault(size, _Throughput())
            entry.tokens_per_s = rate if not entry.samples else (
                (1.0 - self.smoothing) * entry.tokens_per_s + self.smoothing * rate)
            entry.samples += 1

    def optimal_ubatch_size(self) -> Optional[int]:
        """The size with the best smoothed tokens/s among those with min_samples timings, else None."""
        with self._history_lock:
            ready = [(entry.tokens_per_s, size) for size, entry in self._history.items()
                     if entry.samples >= self.min_samples]
        return max(ready)[1] if ready else None
