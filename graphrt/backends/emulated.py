"""CPU backend with the CUDA-graph contract: capture records the step's aten ops, replay runs them.

Replay never enters the model's Python: branches and Python scalars are frozen at capture,
the tensors the step read (static inputs, parameters, caches) are read live, in-place writes
are applied to them, and outputs land in the same tensors every replay. A host sync in the
step fails the capture, as on CUDA. So a model that breaks under a CUDA graph breaks here.
"""

from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch

from graphrt.backends.op_graph import OpGraph, OpRecorder, build_op_graph
from graphrt.backends.session import gc_frozen


class EmulatedGraph:
    """A recorded op graph plus the output tensors every replay writes. ``context``: the context
    variables the step was recorded with; replays run in them (a custom op node re-runs its Python
    at replay and must see the host values of the capture, as on CUDA)."""

    def __init__(self, op_graph: OpGraph, outputs: Any, context: Optional[contextvars.Context] = None) -> None:
        self.outputs = outputs
        self.pool_bytes: Optional[int] = sum(t.numel() * t.element_size() for t in op_graph.copy_targets)
        self._forward = op_graph.module.forward
        self._targets = op_graph.copy_targets
        self._context = context

    def replay(self) -> None:
        if self._context is None:
            self._replay()
        else:
            self._context.run(self._replay)

    def _replay(self) -> None:
        # The recorded ops ran below autograd and view tracking; replaying them there too is
        # faithful and skips two dispatch layers per op (about 12% of a small model's replay).
        with torch._C._AutoDispatchBelowADInplaceOrView():
            fresh = self._forward()
            if fresh:
                torch._foreach_copy_(self._targets, fresh)


class EmulatedBackend:
    """Graph backend for machines without CUDA: records at capture, replays the recording."""

    name = "emulated"
    capture_executes = True  # recording runs the ops, so capture's writes must be undone

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    def capture_session(self) -> AbstractContextManager:
        return gc_frozen()

    def warmup_context(self) -> AbstractContextManager:
        return nullcontext()

    def capture(self, fn: Callable[[], Any]) -> EmulatedGraph:
        with OpRecorder() as recorder:
            outputs = fn()
        return EmulatedGraph(build_op_graph(recorder.ops, outputs), outputs, recorder.context)
