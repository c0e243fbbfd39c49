"""The one small protocol every graph backend implements: whole captures, and captures in pieces."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch


class StepRefusal(Exception):
    """A step runs code no graph of graphrt can hold, whatever the key (CUDA graphs of its own, TorchScript):
    the key that found it fails with this reason, and its front captures no other key of that step."""


class CollectiveError(RuntimeError):
    """A collective a replay ran failed on the host (gloo's wait inside an emulated graph): a peer died, or
    did not reach it within its group's timeout. Never the key's fault; in lockstep it is a lost peer."""


class CapturedGraph(Protocol):
    """A captured forward: ``replay()`` re-runs it reading the static inputs and
    writing into ``outputs`` (the same tensors every replay)."""

    outputs: Any
    pool_bytes: Optional[int]

    def replay(self) -> None:
        """Run the captured work again on the current static inputs."""


class SplitPoint(Protocol):
    """An op run eagerly between two pieces: the static arguments it was called with."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class PieceSink(Protocol):
    """Where one capture in pieces goes. ``recording()`` begins the first piece and ends the last;
    ``split(run)`` ends the current piece, calls ``run`` (the op between pieces, eagerly, outside
    any capture) and begins the next; ``pieces`` then hands out one graph per piece."""

    def recording(self) -> AbstractContextManager:
        """Context of the whole capture pass."""

    def split(self, run: Callable[[], Any]) -> Any:
        """End the piece, run the op, begin the next piece; returns the op's result."""

    def pieces(self, splits: Sequence[SplitPoint], outputs: Sequence[Any]) -> List[CapturedGraph]:
        """The captured pieces; ``outputs`` are the step's output leaves (what the last piece must publish)."""

    def weak(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (memory a piece allocated), held no more than the pieces' graphs hold it."""

    @property
    def pool_bytes(self) -> Optional[int]:
        """Memory the pieces hold (after ``recording()`` ended)."""


class GraphBackend(Protocol):
    """Captures callables into replayable graphs, whole or in pieces; the capture sequence
    (warm-up, capture, undo, verify) lives in graphrt.capture."""

    name: str
    capture_executes: bool  # True when capture runs the step's ops (its writes must be undone)
    graph_device: Optional[torch.device]  # where a graph's inputs and outputs must live (None: anywhere)

    def capture_session(self) -> AbstractContextManager:
        """Context for capturing many keys: one gc.collect(), garbage collector off inside."""

    def warmup_context(self, capture_path: bool = False) -> AbstractContextManager:
        """Where warm-up runs execute (CUDA: the capture stream, so lazy state binds to it); with
        ``capture_path`` (CUDA) the step sees ``torch.cuda.is_current_stream_capturing()`` True, as
        its capture will, so the kernels of a capture-only path are warmed up too."""

    def capture(self, fn: Callable[[], Any], generators: Sequence[torch.Generator] = ()) -> CapturedGraph:
        """Capture one call of ``fn`` (already warmed up). ``generators``: the generators other than
        the default ones the step draws from (CUDA registers them with the graph, so each replay
        advances them as eager does)."""

    def piece_sink(self, generators: Sequence[torch.Generator] = ()) -> PieceSink:
        """A fresh sink for one capture split into pieces (piecewise graphs); ``generators`` as for ``capture``."""
