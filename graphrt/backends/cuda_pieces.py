"""The CUDA backend's captures in pieces (piecewise keys): one ``torch.cuda.CUDAGraph`` per piece, in the
backend's shared pool, each replayed right after its capture so the splitting op after it reads real values."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from graphrt.backends.base import CapturedGraph, SplitPoint
from graphrt.backends.session import recording


class CudaPiece:
    """One captured piece of a split step: replay() launches its graph."""

    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph
        self.outputs = None
        self.pool_bytes = None
        self.replay = graph.replay


class CudaPieces:
    """One CUDAGraph per piece, in the backend's shared pool, captured on its capture stream; the
    op between two pieces runs between one ``capture_end`` and the next ``capture_begin``. Only
    the piece whose capture is open (begun, not ended) is abandoned when the pass fails.

    A capture computes nothing: what a piece made holds whatever the pool memory held. So each
    piece replays once as soon as its capture ends, and the splitting op after it reads the values
    eager would give it (an op indexing with them, as MoE routing does, would otherwise hit a
    device-side assert). The replays' writes and draws, and the splitting ops', are undone with the
    warm-ups' (``graphrt.capture.capture_graph`` restores after the recording)."""

    def __init__(self, backend: "CudaGraphBackend", generators: Sequence[torch.Generator] = ()) -> None:  # noqa: F821
        self.backend = backend
        self.generators = generators
        self.graphs: List["torch.cuda.CUDAGraph"] = []  # pieces whose capture ended
        self.open: Optional["torch.cuda.CUDAGraph"] = None  # the piece being captured
        self.pool_bytes: Optional[int] = None

    def _begin(self) -> None:
        graph = self.backend.new_graph(self.generators)
        self.backend.begin_capture(graph, self.generators)  # abandons it if it raises
        self.open = graph

    def _end(self) -> None:
        graph, self.open = self.open, None
        self.backend.end_capture(graph, self.generators)  # abandons it if it raises
        self.graphs.append(graph)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The pieces and the splitting ops between them, as one recording (``session.recording``)."""
        backend = self.backend
        with recording():
            reserved_before = backend._prepare_capture()
            with backend.warmup_context():  # the capture stream
                self._begin()
                try:
                    yield
                except BaseException:
                    if self.open is not None:
                        backend.abandon(self.open, self.generators)
                        self.open = None
                    raise
                self._end()
            torch.cuda.synchronize(backend.device)
        self.pool_bytes = backend._grown(reserved_before)

    def split(self, run: Callable[[], Any]) -> Any:
        """End the piece, replay it (the op reads real values), run the op, begin the next piece."""
        self._end()
        self.graphs[-1].replay()
        result = run()
        self._begin()
        return result

    def pieces(self, splits: Sequence[SplitPoint], outputs: Sequence[Any]) -> List[CapturedGraph]:
        return [CudaPiece(graph) for graph in self.graphs]

    def weak(self, tensor: torch.Tensor) -> torch.Tensor:
        """A non-owning view: the block goes back to the pool, which stays reserved while the view lives."""
        return self.backend.weak(tensor)
