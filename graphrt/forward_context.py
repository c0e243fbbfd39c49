"""The batch of the step in progress, for code that runs inside a step without receiving it.

A splitting op (attention between graph pieces) is called with tensors only; it reads the
request-level metadata of the step (``extend_seq_lens_cpu``, ``seq_lens``, ...) from
``current_batch()``, as vLLM's forward context serves it. The runner sets it around every step:
the live batch for eager and piecewise steps, the batch being recorded during capture, and
inside a whole-graph replay the batch as it was at capture (its Python values frozen, as a
CUDA graph freezes them).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Optional

from graphrt.batch import ForwardBatch

_CURRENT: ContextVar[Optional[ForwardBatch]] = ContextVar("graphrt_current_batch", default=None)


def current_batch() -> Optional[ForwardBatch]:
    """The ForwardBatch of the step in progress, or None outside any step."""
    return _CURRENT.get()


class use_batch:  # noqa: N801 - used like a function: ``with use_batch(batch):``
    """Make ``batch`` the current batch for the block (restores the previous one after). A class,
    not a generator: it runs on every step, and this costs half of what @contextmanager does."""

    __slots__ = ("_batch", "_token")

    def __init__(self, batch: Optional[ForwardBatch]) -> None:
        self._batch = batch

    def __enter__(self) -> None:
        self._token = _CURRENT.set(self._batch)

    def __exit__(self, *exc_info: Any) -> None:
        _CURRENT.reset(self._token)
