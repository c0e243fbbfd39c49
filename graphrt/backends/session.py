"""Shared capture state: one CUDA recording in the process at a time, the collector off while recording.

Concurrent captures on different streams are legal in CUDA (graphrt captures ``thread_local``), but
up to torch 2.11 each device's default CUDA generator has one capture flag for the whole process
(aten/src/ATen/cuda/CUDAGeneratorImpl.cpp: ``capture_prologue`` in ``capture_begin`` sets ``capturing_``,
``capture_epilogue`` in ``capture_end`` clears it, and ``increase()`` refuses any draw that disagrees
with the calling stream's capture status). While any thread records, another thread's eager draw from
the default generator, and the replay of a graph that drew random numbers (``replay_prologue`` calls
``increase()`` when the graph's whole-graph increment is above 0; one that drew nothing returns before
it, pytorch#143777), raise "Offset increment outside graph capture encountered unexpectedly"; a second
recording would reset the first one's offsets. pytorch#176752 (after 2.11) keeps one state per capture.

So ``RECORDING_LOCK`` is a readers-writer lock. A CUDA recording (``capture_begin`` to ``capture_end``,
with the synchronize and cache emptying just before it) holds it alone (``recording()``), and so do a
capture session's device-wide ``synchronize()``/``empty_cache()``: a device sync during another thread's
recording breaks it, and ``empty_cache`` then frees nothing of the default pools (an INTERNAL ASSERT up to
torch 2.7; from 2.8 it skips them silently while any capture routes, pytorch#158152), so the session would
capture on top of the memory it meant to free. On a torch whose generator flag is the process's, every
graphrt step (a replay or an eager run of the model) shares it (``step_lock``), and so does a capture
session's eager work (warm-ups, compile runs, verification: ``no_recording``): a step waits for
another thread's recording, never for its warm-ups or compile runs, and steps of several threads run
side by side. A thread that shares it and records sets its share aside while it waits and records. The
collector runs once when a session begins and is off while any recording is under way (a collection
inside a capture can free memory the graph records); its state is process-wide, so it stays off until
the last such block ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

import torch


class RecordingLock:
    """Shared by steps, held alone by a recording; re-entrant per thread in both ways (a step inside a
    recording of the same thread shares it; a thread that shares it and records sets its shares aside
    until the recording ends). A waiting recording goes before new sharers, so serving threads that
    step without pause do not starve it."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields; entered directly on a step's uncontended path
        self._condition = threading.Condition(self._mutex)
        self._shared: Dict[int, int] = {}  # thread ident -> its nested shares
        self._writer: Optional[int] = None  # the recording thread
        self._depth = 0  # its nested exclusive holds
        self._set_aside = 0  # its shares, back when its recording ends
        self._waiting = 0  # recordings waiting

    def acquire_shared(self) -> None:
        me = threading.get_ident()
        with self._mutex:
            shared = self._shared
            if (self._writer is None and not self._waiting) or self._writer == me or me in shared:
                shared[me] = shared.get(me, 0) + 1
                return
        with self._condition:
            while self._writer is not None or self._waiting:
                self._condition.wait()
            self._shared[me] = self._shared.get(me, 0) + 1

    def release_shared(self) -> None:
        me = threading.get_ident()
        with self._mutex:
            depth = self._shared[me] - 1
            if depth:
                self._shared[me] = depth
                return
            del self._shared[me]
            if self._waiting:
                self._condition.notify_all()

    def acquire(self) -> None:
        """Hold it alone (a recording), setting this thread's shares aside while it waits."""
        me = threading.get_ident()
        with self._condition:
            if self._writer == me:
                self._depth += 1
                return
            held = self._shared.pop(me, 0)
            if held:
                self._condition.notify_all()
            self._waiting += 1
            try:
                while self._writer is not None or self._shared:
                    self._condition.wait()
            finally:
                self._waiting -= 1
            self._writer, self._depth, self._set_aside = me, 1, held

    def release(self) -> None:
        with self._condition:
            self._depth -= 1
            if self._depth:
                return
            if self._set_aside:
                self._shared[self._writer] = self._shared.get(self._writer, 0) + self._set_aside
            self._writer, self._set_aside = None, 0
            self._condition.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


RECORDING_LOCK = RecordingLock()
_gc_lock = threading.Lock()
_gc_sessions = 0  # blocks under way that turned the collector off or found it off by another block
_gc_was_enabled = False  # the collector's state before the first of them


def torch_release() -> Tuple[int, int]:
    """This torch's (major, minor) release."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# One capture flag per default generator for the whole process (torch <= 2.11; see the module docstring).
# tests/fake_cuda.py sets it as the torch release it models does.
GENERATOR_FLAG_PROCESS_WIDE = torch_release() <= (2, 11)
# The error a replay or an eager draw raises while another capture of the process is under way (or, up to
# torch 2.11, after a capture that failed left the flag on): never the fault of the key that raised it.
ANOTHER_CAPTURE_ERRORS = ("Offset increment outside graph capture encountered unexpectedly",)


def step_lock(own_lock: Any) -> AbstractContextManager:
    """What a graphrt step (a replay or an eager run of the model) holds: its front's ``own_lock``, and a
    share of ``RECORDING_LOCK`` too where the default generator's capture flag is process-wide, so no step
    runs while another thread records. Elsewhere ``own_lock`` itself: a step costs no Python call more."""
    return _BothLocks(own_lock) if GENERATOR_FLAG_PROCESS_WIDE else own_lock


class _BothLocks:
    """A front's own lock, then a share of ``RECORDING_LOCK`` (released in the reverse order)."""

    __slots__ = ("own_lock",)

    def __init__(self, own_lock: Any) -> None:
        self.own_lock = own_lock

    def __enter__(self) -> None:
        self.own_lock.acquire()
        try:
            RECORDING_LOCK.acquire_shared()
        except BaseException:
            self.own_lock.release()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        RECORDING_LOCK.release_shared()
        self.own_lock.release()


def another_capture_error(error: BaseException) -> bool:
    """Whether ``error`` is the one another capture of the process causes, not the failing step's own."""
    return any(text in str(error) for text in ANOTHER_CAPTURE_ERRORS)


@contextmanager
def no_recording() -> Iterator[None]:
    """The block runs while no other thread records a CUDA graph, and none begins meanwhile (a share of
    ``RECORDING_LOCK``) where the generator's capture flag is the process's; elsewhere it holds nothing.
    A capture session's eager work (warm-ups, compile runs, verification) runs so, and a user's own draws
    from the default generator beside graphrt may (docs/MANUAL.md)."""
    if not GENERATOR_FLAG_PROCESS_WIDE:
        yield
        return
    RECORDING_LOCK.acquire_shared()
    try:
        yield
    finally:
        RECORDING_LOCK.release_shared()


@contextmanager
def recording() -> Iterator[None]:
    """One CUDA recording (and what must not overlap another thread's: the cache emptied before it):
    ``RECORDING_LOCK`` held alone (a recording may run inside a step of the same thread: its share is
    set aside), the collector off."""
    with RECORDING_LOCK, gc_paused():
        yield


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Run ``gc.collect()`` once, then disable the collector for the block (``gc_paused``).

    A collection inside a capture can free tensors whose memory the graph
    is recording; collecting once up front also makes every capture start clean.
    """
    gc.collect()
    with gc_paused():
        yield


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the collector until the last such block of the process ends (a block ending while
    another is under way leaves it off)."""
    global _gc_sessions, _gc_was_enabled
    with _gc_lock:
        if _gc_sessions == 0:
            _gc_was_enabled = gc.isenabled()
        _gc_sessions += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_sessions -= 1
            if _gc_sessions == 0 and _gc_was_enabled:
                gc.enable()
