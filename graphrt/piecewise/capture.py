"""PiecewiseBackend: a graph backend whose capture records the step in pieces split at the splitting ops.

It wraps the runner's backend (cuda or emulated) and goes through the same capture sequence as
whole graphs (``backends/capture.py``: warm-up, capture, every write undone; the registry then
verifies the first replay against eager), so whatever that sequence does for a whole graph it
does for a piecewise one. Its ``capture`` runs the step under ``SplitWatcher`` and builds a
``PiecewiseGraph``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.batch import ForwardBatch
from graphrt.forward_context import current_batch, use_batch
from graphrt.piecewise.ops import SplittingOps
from graphrt.piecewise.sinks import piece_sink
from graphrt.piecewise.split import SplitCall, SplitWatcher

logger = logging.getLogger(__name__)


class PiecewiseGraph:
    """Pieces and the splitting-op calls between them; ``outputs`` are the step's static output leaves."""

    def __init__(self, pieces: List[CapturedGraph], calls: List[SplitCall], outputs: Any,
                 capture_batch: Optional[ForwardBatch]) -> None:
        self.pieces = pieces
        self.calls = calls
        self.outputs = outputs
        self.capture_batch = capture_batch  # the batch the step was recorded on (verify replays with it)
        self.pool_bytes: Optional[int] = None
        self.piece_count = len(pieces)

    def replay(self) -> None:
        """Piece, splitting op (eager, on its static inputs), piece, ..., piece. The splitting ops
        read the step's live request metadata from ``graphrt.current_batch()``, set by the caller;
        outside any step (the registry's first-replay check) they read the batch the step was
        recorded on."""
        if current_batch() is None:
            with use_batch(self.capture_batch):
                self._replay()
        else:
            self._replay()

    def _replay(self) -> None:
        pieces = self.pieces
        for index, call in enumerate(self.calls):
            pieces[index].replay()
            call.run()
        pieces[-1].replay()


class PiecewiseBackend:
    """``backend`` with a capture that splits the step at ``splitting`` ops (same protocol)."""

    def __init__(self, backend: GraphBackend, splitting: SplittingOps,
                 request_fields: Mapping[Tuple[torch.device, int], str]) -> None:
        self.backend = backend
        self.splitting = splitting
        self.request_fields = request_fields
        self.name = backend.name
        self.capture_executes = backend.capture_executes

    def capture_session(self) -> AbstractContextManager:
        return self.backend.capture_session()

    def warmup_context(self) -> AbstractContextManager:
        return self.backend.warmup_context()

    def capture(self, fn: Callable[[], Any]) -> PiecewiseGraph:
        """Run ``fn`` once under the watcher into the backend's piece sink; the pieces and calls make the graph."""
        sink = piece_sink(self.backend)
        watcher = SplitWatcher(self.splitting, self.request_fields, sink)
        reserved = _reserved(self.backend)
        with sink.recording():
            with watcher:
                outputs = fn()
        watcher.check_all_called()
        graph = PiecewiseGraph(sink.pieces(watcher.calls, outputs), watcher.calls, outputs, watcher.batch)
        graph.pool_bytes = _pool_bytes(self.backend, reserved, graph)
        logger.debug("captured %d pieces around %d splitting-op calls", graph.piece_count, len(watcher.calls))
        return graph


def _reserved(backend: GraphBackend) -> Optional[int]:
    return torch.cuda.memory_reserved(backend.device) if backend.name == "cuda" else None


def _pool_bytes(backend: GraphBackend, reserved: Optional[int], graph: PiecewiseGraph) -> int:
    """CUDA: growth of reserved memory; emulated: bytes of the tensors the pieces publish."""
    if reserved is not None:
        return _reserved(backend) - reserved
    return sum(piece.pool_bytes or 0 for piece in graph.pieces)
