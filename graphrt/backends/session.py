"""Shared capture-session state: one capture session in the process at a time, the collector off while capturing.

Concurrent captures on different streams are legal in CUDA (graphrt captures ``thread_local``), but
up to torch 2.11 each device's default CUDA generator has one capture flag for the whole process
(aten/src/ATen/cuda/CUDAGeneratorImpl.cpp: ``capture_prologue`` sets ``capturing_``, and
``increase()`` refuses any draw that disagrees with the calling stream's capture status). While any
thread captures, another thread's eager draw, and every replay (``replay_prologue`` calls
``increase()`` for the default generator every graph registers), raises "Offset increment outside
graph capture encountered unexpectedly"; a second capture would reset the first one's offsets.
pytorch#176752 (after 2.11) keeps one state per capture. So CUDA capture sessions hold
``CAPTURE_LOCK`` (re-entrant: a session may open inside another of the same thread), and on such a
torch graphrt's replays and eager steps hold it too (``step_lock``). A session's device-wide
``synchronize()``/``empty_cache()`` would also break a capture of another thread under way. The
collector's state is process-wide too: it stays off until the last session ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator, Tuple

import torch

CAPTURE_LOCK = threading.RLock()
_gc_lock = threading.Lock()
_gc_sessions = 0  # sessions under way that turned the collector off or found it off by another session
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
    """What a graphrt step (a replay or an eager run of the model) holds: its front's ``own_lock``, and
    ``CAPTURE_LOCK`` too where the default generator's capture flag is process-wide, so no step runs
    while another thread captures. Elsewhere ``own_lock`` itself: a step costs no Python call more."""
    return _BothLocks(own_lock) if GENERATOR_FLAG_PROCESS_WIDE else own_lock


class _BothLocks:
    """A front's own lock, then ``CAPTURE_LOCK`` (released in the reverse order)."""

    __slots__ = ("own_lock",)

    def __init__(self, own_lock: Any) -> None:
        self.own_lock = own_lock

    def __enter__(self) -> None:
        self.own_lock.acquire()
        try:
            CAPTURE_LOCK.acquire()
        except BaseException:
            self.own_lock.release()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        CAPTURE_LOCK.release()
        self.own_lock.release()


def another_capture_error(error: BaseException) -> bool:
    """Whether ``error`` is the one another capture of the process causes, not the failing step's own."""
    return any(text in str(error) for text in ANOTHER_CAPTURE_ERRORS)


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Run ``gc.collect()`` once, then disable the collector until the last such block of the
    process ends (a session ending while another captures leaves it off).

    A collection inside a CUDA-graph capture can free tensors whose memory the graph
    is recording; collecting once up front also makes every capture start clean.
    """
    global _gc_sessions, _gc_was_enabled
    gc.collect()
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
