"""CPU backend with the CUDA-graph contract: capture records the step's aten ops, replay runs them.

Replay never enters the model's Python: branches and Python scalars are frozen at capture,
the tensors the step read (static inputs, parameters, caches) are read live, in-place writes
are applied to them, and outputs land in the same tensors every replay. A host sync in the
step fails the capture, as on CUDA. So a model that breaks under a CUDA graph breaks here.
"""

from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from graphrt.backends.base import CapturedGraph, SplitPoint
from graphrt.backends.op_graph import OpGraph, OpRecorder, RecordedOp, build_op_graph
from graphrt.backends.session import gc_frozen


class EmulatedGraph:
    """A recorded op graph plus the output tensors every replay writes. ``context``: the context
    variables the step was recorded with; replays run in them (a custom op node re-runs its Python
    at replay and must see the host values of the capture, as on CUDA)."""

    def __init__(self, op_graph: OpGraph, outputs: Any, context: Optional[contextvars.Context] = None,
                 pool_bytes: Optional[int] = None) -> None:
        self.outputs = outputs
        self.pool_bytes: Optional[int] = (sum(t.numel() * t.element_size() for t in op_graph.copy_targets)
                                          if pool_bytes is None else pool_bytes)
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


class OutputArena:
    """The emulated pool's output memory. Keys captured largest first into one CUDA pool reuse the
    blocks the earlier keys' outputs freed (graphrt keeps only non-owning views of them), so a
    replay of one key overwrites what another returned. Here every key's outputs are laid out from
    the start of one buffer per device, grown to the largest key: the same sharing, shown on CPU."""

    ALIGN = 64  # bytes: every dtype's alignment

    def __init__(self) -> None:
        self._buffers: Dict[torch.device, torch.Tensor] = {}

    def place(self, tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], int]:
        """Copies of ``tensors`` in the arena (contiguous, non-empty ones; others are kept as they
        are), laid out from its start, and the bytes the arena grew by."""
        offsets: Dict[torch.device, int] = {}
        spans = []
        for tensor in tensors:
            if not tensor.is_contiguous() or not tensor.numel():
                spans.append(None)
                continue
            start = offsets.get(tensor.device, 0)
            spans.append(start)
            size = tensor.numel() * tensor.element_size()
            offsets[tensor.device] = start + -(-size // self.ALIGN) * self.ALIGN
        grown = 0
        for device, needed in offsets.items():
            buffer = self._buffers.get(device)
            if buffer is None or buffer.numel() < needed:
                grown += needed - (0 if buffer is None else buffer.numel())
                with torch.inference_mode(False):
                    self._buffers[device] = torch.empty(needed, dtype=torch.uint8, device=device)
        placed = []
        with torch.no_grad(), torch.inference_mode(False):  # outputs usable in every mode, as eager's under no_grad
            for tensor, start in zip(tensors, spans):
                if start is None:
                    placed.append(tensor)
                    continue
                size = tensor.numel() * tensor.element_size()
                view = self._buffers[tensor.device][start:start + size].view(tensor.dtype).view(tensor.shape)
                placed.append(view.copy_(tensor))
        return placed, grown


class EmulatedBackend:
    """Graph backend for machines without CUDA: records at capture, replays the recording."""

    name = "emulated"
    capture_executes = True  # recording runs the ops, so capture's writes must be undone
    graph_device = None  # a recording replays its ops on whatever device their tensors live

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device
        self.arena = OutputArena()

    def capture_session(self) -> AbstractContextManager:
        return gc_frozen()

    def warmup_context(self, capture_path: bool = False) -> AbstractContextManager:
        return nullcontext()  # the recording itself takes the capture path (OpRecorder)

    def capture(self, fn: Callable[[], Any], generators: Sequence[torch.Generator] = ()) -> EmulatedGraph:
        """Record one call of ``fn``; a generator the step is handed is a constant of the recording,
        drawn from at every replay as eager draws from it. The outputs the graph writes live in
        the shared output arena."""
        with OpRecorder() as recorder:
            outputs = fn()
        op_graph = build_op_graph(recorder.ops, outputs)
        placed, grown = self.arena.place(op_graph.copy_targets)
        moved = {id(target): view for target, view in zip(op_graph.copy_targets, placed)}
        op_graph.copy_targets = placed
        outputs = tree_map(lambda leaf: moved.get(id(leaf), leaf), outputs)
        return EmulatedGraph(op_graph, outputs, recorder.context, grown)

    def piece_sink(self, generators: Sequence[torch.Generator] = ()) -> "EmulatedPieces":
        return EmulatedPieces()


class EmulatedPieces:
    """Records the pass once and cuts the recording at the split points into segments, each built
    into its own op graph. A segment's externals are whatever it did not produce (static inputs,
    parameters, tensors of earlier pieces, split-op outputs: all capture-time tensors); it publishes
    (copies out on replay) the tensors it produced that later pieces, split ops or the step's
    outputs read."""

    def __init__(self) -> None:
        self.recorder = OpRecorder()
        self.bounds: List[int] = [0]  # index of the first op of each piece
        self.pool_bytes: Optional[int] = None

    @contextmanager
    def recording(self) -> Iterator[None]:
        with self.recorder:
            yield

    def split(self, run: Callable[[], Any]) -> Any:
        self.bounds.append(len(self.recorder.ops))
        with self.recorder.host_reads_allowed():  # the op runs eagerly between pieces
            return run()

    @staticmethod
    def weak(tensor: torch.Tensor) -> torch.Tensor:
        """The tensor itself: an emulated piece reads and publishes through the capture's own tensors."""
        return tensor

    def pieces(self, splits: Sequence[SplitPoint], outputs: Sequence[Any]) -> List[CapturedGraph]:
        ops = self.recorder.ops
        segments = [ops[start:end] for start, end in zip(self.bounds, self.bounds[1:] + [len(ops)])]
        published = _published(segments, splits, outputs)
        pieces = [EmulatedGraph(build_op_graph(segment, targets), targets, self.recorder.context)
                  for segment, targets in zip(segments, published)]
        self.pool_bytes = sum(piece.pool_bytes or 0 for piece in pieces)
        return pieces


def _published(segments: List[List[RecordedOp]], splits: Sequence[SplitPoint], outputs: Sequence[Any]
               ) -> List[List[Any]]:
    """Per segment, the tensors it produced that something after it reads (in production order)."""
    read_later: Set[int] = {id(leaf) for leaf in outputs if isinstance(leaf, torch.Tensor)}
    result: List[List[Any]] = [[] for _ in segments]
    for index in reversed(range(len(segments))):
        if index < len(splits):
            read_later.update(_tensor_ids((splits[index].args, splits[index].kwargs)))
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
