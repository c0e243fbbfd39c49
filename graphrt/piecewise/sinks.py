"""Piece sinks, one per backend: where the pieces of a split capture go.

Emulated: one ``OpRecorder`` runs through the whole pass (the splitting ops never reach it),
and the recording is cut at the split points into segments, each built into its own op graph.
A segment's externals are whatever it did not produce (static inputs, parameters, tensors of
earlier pieces, split-op outputs: all capture-time tensors, the static memory); it publishes
(copies out on replay) the tensors it produced that later pieces, splitting ops or the step's
outputs read. CUDA: one ``torch.cuda.CUDAGraph`` per piece in the backend's shared pool, on its
capture stream; the splitting op runs eagerly between ``capture_end`` and the next ``capture_begin``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set

import torch
from torch.utils._pytree import tree_leaves

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.backends.emulated import EmulatedGraph
from graphrt.backends.op_graph import OpRecorder, RecordedOp, build_op_graph
from graphrt.piecewise.split import SplitCall


class EmulatedPieces:
    """Records the pass once and cuts the recording at the split points."""

    def __init__(self) -> None:
        self.recorder = OpRecorder()
        self.bounds: List[int] = [0]  # index of the first op of each piece

    @contextmanager
    def recording(self) -> Iterator[None]:
        with self.recorder:
            yield

    def split(self, run: Callable[[], Any]) -> Any:
        self.bounds.append(len(self.recorder.ops))
        with self.recorder.host_reads_allowed():  # the op runs eagerly between pieces
            return run()

    def pieces(self, calls: Sequence[SplitCall], outputs: Sequence[Any]) -> List[CapturedGraph]:
        ops = self.recorder.ops
        segments = [ops[start:end] for start, end in zip(self.bounds, self.bounds[1:] + [len(ops)])]
        published = _published(segments, calls, outputs)
        return [EmulatedGraph(build_op_graph(segment, targets), targets, self.recorder.context)
                for segment, targets in zip(segments, published)]


def _published(segments: List[List[RecordedOp]], calls: Sequence[SplitCall], outputs: Sequence[Any]) -> List[List[Any]]:
    """Per segment, the tensors it produced that something after it reads (in production order)."""
    read_later: Set[int] = {id(leaf) for leaf in outputs if isinstance(leaf, torch.Tensor)}
    result: List[List[Any]] = [[] for _ in segments]
    for index in reversed(range(len(segments))):
        if index < len(calls):
            read_later.update(_tensor_ids((calls[index].args, calls[index].kwargs)))
        produced: Dict[int, torch.Tensor] = {}
        for op in segments[index]:
            for leaf in tree_leaves(op.output):
                if isinstance(leaf, torch.Tensor):
                    produced.setdefault(id(leaf), leaf)
        result[index] = [tensor for key, tensor in produced.items() if key in read_later]
        for op in segments[index]:
            read_later.update(_tensor_ids((op.args, op.kwargs)))
    return result


def _tensor_ids(tree: Any) -> Iterator[int]:
    return (id(leaf) for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class CudaPiece:
    """One captured piece: replay() launches its graph."""

    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph
        self.outputs = None
        self.pool_bytes = None
        self.replay = graph.replay


class CudaPieces:
    """One CUDAGraph per piece, in the backend's shared pool, captured on its capture stream."""

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.graphs: List["torch.cuda.CUDAGraph"] = []

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.backend.pool)
        self.graphs.append(graph)

    @contextmanager
    def recording(self) -> Iterator[None]:
        torch.cuda.synchronize(self.backend.device)
        with self.backend.warmup_context():  # the capture stream
            self._begin()
            try:
                yield
            except BaseException:
                self.backend.abandon(self.graphs[-1])
                raise
            self.graphs[-1].capture_end()
        torch.cuda.synchronize(self.backend.device)

    def split(self, run: Callable[[], Any]) -> Any:
        self.graphs[-1].capture_end()
        result = run()
        self._begin()
        return result

    def pieces(self, calls: Sequence[SplitCall], outputs: Sequence[Any]) -> List[CapturedGraph]:
        return [CudaPiece(graph) for graph in self.graphs]


def piece_sink(backend: GraphBackend) -> Any:
    """The sink for ``backend``'s pieces."""
    return CudaPieces(backend) if backend.name == "cuda" else EmulatedPieces()
