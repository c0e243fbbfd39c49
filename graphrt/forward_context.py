"""The batch of the step in progress, for code that runs inside a step without receiving it.

A splitting op (attention between graph pieces) is called with tensors only; it reads the
request-level metadata of the step (``extend_seq_lens_cpu``, ``seq_lens``, ...) from
``current_batch()``, as vLLM's forward context serves it. The runner sets it around every step:
the live batch for eager and piecewise steps, the batch being recorded during capture, and
inside a whole-graph replay the batch as it was at capture (its Python values frozen, as a
CUDA graph freezes them).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

from graphrt.batch import ForwardBatch

_CURRENT: ContextVar[Optional[ForwardBatch]] = ContextVar("graphrt_current_batch", default=None)


def current_batch() -> Optional[ForwardBatch]:
    """The ForwardBatch of the step in progress, or None outside any step."""
    return _CURRENT.get()


@contextmanager
def use_batch(batch: Optional[ForwardBatch]) -> Iterator[None]:
    """Make ``batch`` the current batch for the block (restores the previous one after)."""
    token = _CURRENT.set(batch)
    try:
        yield
    finally:
        _CURRENT.reset(token)
