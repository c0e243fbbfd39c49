"""Shared capture-session state: one capture session in the process at a time, the collector off while capturing.

PyTorch captures one CUDA graph at a time per process, and a capture session's device-wide calls
(``torch.cuda.synchronize()``, ``empty_cache()``) would break another thread's capture under way:
CUDA sessions hold ``CAPTURE_LOCK`` (re-entrant: a session may open inside another of the same
thread). The collector's state is process-wide too: it stays off until the last session ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

CAPTURE_LOCK = threading.RLock()
_gc_lock = threading.Lock()
_gc_sessions = 0  # sessions under way that turned the collector off or found it off by another session
_gc_was_enabled = False  # the collector's state before the first of them


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
