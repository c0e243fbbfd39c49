"""The one small protocol every graph backend implements."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Protocol


class CapturedGraph(Protocol):
    """A captured forward: ``replay()`` re-runs it reading the static inputs and
    writing into ``outputs`` (the same tensors every replay)."""

    outputs: Any
    pool_bytes: Optional[int]

    def replay(self) -> None:
        """Run the captured work again on the current static inputs."""


class GraphBackend(Protocol):
    """Captures callables into replayable graphs; warm-up and undo live in graphrt.backends.capture."""

    name: str
    capture_executes: bool  # True when capture runs the step's ops (its writes must be undone)

    def capture_session(self) -> AbstractContextManager:
        """Context for capturing many keys: one gc.collect(), garbage collector off inside."""

    def warmup_context(self) -> AbstractContextManager:
        """Where warm-up runs execute (CUDA: the capture stream, so lazy state binds to it)."""

    def capture(self, fn: Callable[[], Any]) -> CapturedGraph:
        """Capture one call of ``fn`` (already warmed up)."""
