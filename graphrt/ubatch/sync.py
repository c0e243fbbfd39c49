"""Micro-batch synchronization: states, execution contexts, the barrier.

A ``UBatchContext`` runs one micro-batch (on its CUDA stream in threaded CUDA
calls), exposes it to the model through ``current_ubatch()`` and signals its
readiness on CPU and GPU events; ``UBatchBarrier`` starts a threaded call's
workers together and turns every broken round into ``UBatchBarrierError``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable, Dict, List, Optional

import torch

from graphrt.batch import ForwardBatch
from graphrt.ubatch.plan import UBatchSlice

__all__ = [
    "UBatchBarrier",
    "UBatchBarrierError",
    "UBatchContext",
    "UBatchState",
    "UBatchTimeoutError",
    "UbatchMetadata",
    "current_ubatch",
    "make_ubatch_contexts",
]


class UBatchState(Enum):
    """Lifecycle of one micro-batch context."""

    IDLE = auto()
    RUNNING = auto()
    READY = auto()
    FAILED = auto()


class UBatchTimeoutError(TimeoutError):
    """A micro-batch wait (readiness, results, barrier) ran past its timeout."""


class UBatchBarrierError(UBatchTimeoutError):
    """A barrier round broke: a party timed out, or the round was aborted."""


@dataclass
class UBatchContext:
    """Execution context of one micro-batch: its slice, worker slot, readiness events and CUDA stream."""

    slice_info: UBatchSlice
    thread_id: int = 0  # worker slot that runs it (0 in sequential mode)
    cpu_wait_event: threading.Event = field(default_factory=threading.Event)
    gpu_wait_event: Optional[Any] = None  # torch.cuda.Event in threaded CUDA calls, else None
    stream: Optional[Any] = None  # torch.cuda.Stream it runs on, else None (the caller's stream)
    state: UBatchState = UBatchState.IDLE

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Call ``fn`` on this context's stream, visible through ``current_ubatch()``, then signal ready."""
        previous, _LOCAL.metadata = current_ubatch(), UbatchMetadata.from_call(self, args, kwargs)
        self.state = UBatchState.RUNNING
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                return fn(*args, **kwargs)
        except BaseException:
            self.state = UBatchState.FAILED
            raise
        finally:
            _LOCAL.metadata = previous
            self.signal_ready()

    def signal_ready(self) -> None:
        """Mark the outputs produced: record the GPU event on this stream, then wake CPU waiters."""
        if self.gpu_wait_event is not None:
            self.gpu_wait_event.record(self.stream)
        if self.state is not UBatchState.FAILED:
            self.state = UBatchState.READY
        self.cpu_wait_event.set()

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until signalled (UBatchTimeoutError after ``timeout`` s); on CUDA order the current stream after it."""
        if not self.cpu_wait_event.wait(timeout):
            raise UBatchTimeoutError(
                f"micro-batch tokens [{self.slice_info.token_slice.start}, {self.slice_info.token_slice.stop}) "
                f"on worker {self.thread_id} not ready after {timeout}s (state {self.state.name})")
        if self.gpu_wait_event is not None:
            device = self.stream.device if self.stream is not None else None
            torch.cuda.current_stream(device).wait_event(self.gpu_wait_event)

    def reset(self) -> None:
        """Back to IDLE with the CPU event cleared, ready to run again."""
        self.cpu_wait_event.clear()
        self.state = UBatchState.IDLE


@dataclass
class UbatchMetadata:
    """What one micro-batch runs with: its context, the model's main inputs, and the whole sliced call."""

    context: UBatchContext
    input_ids: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    inputs_embeds: Optional[torch.Tensor] = None
    intermediate_tensors: Optional[Any] = None
    num_tokens: int = 0
    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_call(cls, context: UBatchContext, args: tuple, kwargs: Dict[str, Any]) -> "UbatchMetadata":
        """Pick the named inputs from keyword arguments, else from a ForwardBatch argument."""
        batch = next((v for v in (*args, *kwargs.values()) if isinstance(v, ForwardBatch)), None)
        ids, pos = (kwargs.get(name, getattr(batch, name, None)) for name in ("input_ids", "positions"))
        return cls(context, ids, pos, kwargs.get("inputs_embeds"), kwargs.get("intermediate_tensors"),
                   context.slice_info.num_tokens, args, kwargs)


_LOCAL = threading.local()


def current_ubatch() -> Optional[UbatchMetadata]:
    """The micro-batch this thread runs inside a UBatchWrapper call, else None (for models and attention hooks)."""
    return getattr(_LOCAL, "metadata", None)


class UBatchBarrier:
    """Reusable barrier for micro-batch threads: a broken round raises in every party, the next round works."""

    def __init__(self, num_parties: int) -> None:
        if num_parties < 1:
            raise ValueError(f"num_parties: expected >= 1, got {num_parties}")
        self.num_parties = num_parties
        self._rounds = 0
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(num_parties, action=self._round_done)

    def _round_done(self) -> None:
        self._rounds += 1  # threading.Barrier runs the action in one party before releasing any

    @property
    def generation(self) -> int:
        """Number of completed rounds."""
        return self._rounds

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for every party; return this party's arrival index, or raise UBatchBarrierError if the round breaks."""
        with self._lock:
            if self._barrier.broken:  # every party of a broken round raises, so a fresh round is safe
                self._barrier.reset()
        start = time.monotonic()
        try:
            return self._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            timed_out = timeout is not None and time.monotonic() - start >= timeout
            cause = f"timed out after {timeout}s" if timed_out else "was broken by another party's timeout or abort"
            raise UBatchBarrierError(
                f"micro-batch barrier ({self.num_parties} parties, after {self._rounds} rounds) {cause}") from None

    def reset(self) -> None:
        """Break the current round (its waiters raise) and start a fresh one."""
        self._barrier.reset()

    def abort(self) -> None:
        """Break the current round so every waiter raises now (a call being abandoned)."""
        self._barrier.abort()


def make_ubatch_contexts(num_ubatches: int, num_tokens: int, num_reqs: int) -> List[UBatchContext]:
    """Contexts for an even split of tokens and of requests into at most ``num_ubatches`` pieces.

    Token and request ranges are split independently (exact when every request has the same
    number of tokens); use ``UBatchWrapper.compute_slices`` to cut at real request boundaries.
    """
    if num_ubatches < 1 or num_tokens < 0 or num_reqs < 0:
        raise ValueError(f"make_ubatch_contexts: bad arguments ({num_ubatches}, {num_tokens}, {num_reqs})")
    pieces = max(1, min(num_ubatches, num_reqs or 1, num_tokens or 1))
    tokens = [num_tokens * i // pieces for i in range(pieces + 1)]
    reqs = [num_reqs * i // pieces for i in range(pieces + 1)]
    return [UBatchContext(UBatchSlice.from_range(tokens[i], tokens[i + 1], reqs[i], reqs[i + 1]), thread_id=i)
            for i in range(pieces)]
