"""CPU backend with the exact CUDA-graph contract, so tests prove staging and dispatch for real.

Replay re-runs the captured callable, which reads the static input tensors as they are
*now*, and copies its results into the output tensors returned at capture time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, List, Optional

import torch
from torch.utils._pytree import tree_flatten

from .session import gc_frozen


class EmulatedGraph:
    """A "graph" that replays by calling the function and writing into the captured outputs."""

    def __init__(self, fn: Callable[[], Any], outputs: Any) -> None:
        self._fn = fn
        self.outputs = outputs
        self.flat_outputs: List[torch.Tensor] = tree_flatten(outputs)[0]
        self.pool_bytes: Optional[int] = sum(t.numel() * t.element_size() for t in self.flat_outputs)

    def replay(self) -> None:
        fresh = tree_flatten(self._fn())[0]
        for static, new in zip(self.flat_outputs, fresh):
            if static.shape != new.shape:
                raise RuntimeError(
                    f"replay produced an output of shape {list(new.shape)} where capture produced "
                    f"{list(static.shape)}: the model's output shape must depend only on the input shapes"
                )
        torch._foreach_copy_(self.flat_outputs, fresh)


class EmulatedBackend:
    """Graph backend for machines without CUDA: same static-buffer semantics, eager execution."""

    name = "emulated"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device

    def capture_session(self) -> AbstractContextManager:
        return gc_frozen()

    def capture(self, fn: Callable[[], Any], warmup_iters: int) -> EmulatedGraph:
        with torch.no_grad():
            for _ in range(warmup_iters):
                fn()
            outputs = fn()
        return EmulatedGraph(torch.no_grad()(fn), outputs)
