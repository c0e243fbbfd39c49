"""The capture sequence both backends share: warm up, capture, and leave no trace in the model.

Warm-up runs and (on backends whose capture executes the step, like the emulated one) the
recording run write the model's state: KV caches, counters, running statistics. All of it
runs under a StateJournal and is undone before the graph is handed out, so capturing a key
changes no tensor the model can reach. On CUDA the capture itself executes nothing, so it
runs after the undo.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.backends.state_journal import StateJournal


def capture_graph(backend: GraphBackend, fn: Callable[[], Any], warmup_iters: int) -> CapturedGraph:
    """``warmup_iters`` warm-up calls of ``fn``, then one capture; every in-place write undone."""
    journal = StateJournal()
    graph = None
    with torch.no_grad():
        try:
            with journal:
                with backend.warmup_context():
                    for _ in range(warmup_iters):
                        fn()
                if backend.capture_executes:
                    graph = backend.capture(fn)
        finally:
            journal.restore()
        if graph is None:
            graph = backend.capture(fn)
    return graph
