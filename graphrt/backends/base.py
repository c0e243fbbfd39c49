"""The one small protocol every graph backend implements."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, List, Optional, Protocol

import torch


class CapturedGraph(Protocol):
    """A captured forward: ``replay()`` re-runs it reading the static inputs and
    writing into ``outputs`` (the same tensors every replay)."""

    outputs: Any
    flat_outputs: List[torch.Tensor]
    pool_bytes: Optional[int]

    def replay(self) -> None:
        """Run the captured work again on the current static inputs."""


class GraphBackend(Protocol):
    """Captures callables into replayable graphs."""

    name: str

    def capture_session(self) -> AbstractContextManager:
        """Context for capturing many keys: one gc.collect(), garbage collector off inside."""

    def capture(self, fn: Callable[[], Any], warmup_iters: int) -> CapturedGraph:
        """Warm ``fn`` up ``warmup_iters`` times, then capture one call of it."""
