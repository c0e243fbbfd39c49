"""PiecewiseGraph and its recorder: a step captured in pieces split at the splitting ops.

A piecewise key goes through the same capture sequence as a whole graph (``graphrt.capture``:
warm-up, recording, every write undone, the first replay verified against eager); only its
recording differs: ``record_in_pieces`` runs the step once under ``SplitWatcher`` into the
backend's piece sink (``GraphBackend.piece_sink``), and the pieces and the splitting-op calls
between them make the ``PiecewiseGraph``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

from graphrt.backends import CapturedGraph, GraphBackend
from graphrt.backends.state_journal import storage_key
from graphrt.batch import ForwardBatch
from graphrt.forward_context import current_batch, use_batch
from graphrt.piecewise.ops import SplittingOps
from graphrt.piecewise.split import SplitCall, SplitWatcher

logger = logging.getLogger(__name__)


class PiecewiseGraph:
    """Pieces and the splitting-op calls between them; ``outputs`` are the step's static output leaves."""

    def __init__(self, pieces: List[CapturedGraph], calls: List[SplitCall], outputs: Any,
                 capture_batch: Optional[ForwardBatch], pool_bytes: Optional[int]) -> None:
        self.pieces = pieces
        self.calls = calls
        self.outputs = outputs
        self.capture_batch = capture_batch  # the batch the step was recorded on (verify replays with it)
        self.pool_bytes = pool_bytes
        self.piece_count = len(pieces)

    def replay(self) -> None:
        """Piece, splitting op (eager, on its static inputs), piece, ..., piece. The splitting ops
        read the step's live request metadata from ``graphrt.current_batch()``, set by the caller;
        outside any step (the first-replay check at capture) they read the batch the step was
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


class PieceRecorder:
    """A piecewise key's recorder: ``fn`` run once under the watcher into ``backend``'s piece sink."""

    def __init__(self, splitting: SplittingOps, request_fields: Mapping[Tuple[torch.device, int], str]) -> None:
        self.splitting = splitting
        self.request_fields = request_fields  # storage of each request-shaped static slot -> its field name

    def __call__(self, backend: GraphBackend, fn: Callable[[], Any],
                 generators: Sequence[torch.Generator] = ()) -> PiecewiseGraph:
        sink = backend.piece_sink(generators)
        watcher = SplitWatcher(self.splitting, self.request_fields, sink)
        with sink.recording():
            with watcher:
                outputs = fn()
        watcher.check_all_called()
        pieces = sink.pieces(watcher.calls, outputs)

        def held_by_pool(leaf: Any) -> Any:
            """What the pieces allocated, held as the backend's pool holds it (CUDA: not at all, so a
            later key reuses the blocks and memory stays near the largest key's, as vLLM keeps weak
            references to piecewise outputs); split-op results stay owned (no pool holds them)."""
            if isinstance(leaf, torch.Tensor) and storage_key(leaf) in watcher.made:
                return sink.weak(leaf)
            return leaf

        for call in watcher.calls:
            call.args, call.kwargs = tree_map(held_by_pool, call.args), tree_map(held_by_pool, call.kwargs)
        outputs = [held_by_pool(leaf) for leaf in outputs]
        graph = PiecewiseGraph(pieces, watcher.calls, outputs, watcher.batch, sink.pool_bytes)
        logger.debug("captured %d pieces around %d splitting-op calls", graph.piece_count, len(watcher.calls))
        return graph
