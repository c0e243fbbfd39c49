"""Shared capture-session context: collect garbage once, keep the collector off while capturing."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Run ``gc.collect()`` once, then disable the collector until the block ends.

    A collection inside a CUDA-graph capture can free tensors whose memory the graph
    is recording; collecting once up front also makes every capture start clean.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
