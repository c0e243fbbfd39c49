"""CUDA backend on ``torch.cuda.CUDAGraph``: side-stream warm-up, one shared memory pool."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from graphrt.backends.base import CapturedGraph, SplitPoint
from graphrt.backends.session import gc_frozen

logger = logging.getLogger(__name__)


class CudaGraph:
    """One captured ``torch.cuda.CUDAGraph`` and the output tensors it writes on every replay."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: Any, pool_bytes: Optional[int]) -> None:
        self.graph = graph
        self.outputs = outputs
        self.pool_bytes = pool_bytes
        self.replay = graph.replay


class CudaGraphBackend:
    """Captures on a side stream into one memory pool shared by every key (largest key first,
    so smaller graphs reuse the blocks the largest one reserved)."""

    name = "cuda"
    capture_executes = False  # kernels are recorded, not run: capture writes nothing

    def __init__(self, device: Optional[torch.device] = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda': torch.cuda.is_available() is False on this machine")
        self.device = torch.device(device if device is not None else "cuda")
        self.graph_device = self.device  # a CUDA graph launches kernels on this device only
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=self.device)

    @contextmanager
    def _session(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        with gc_frozen():
            yield
        torch.cuda.synchronize(self.device)

    def capture_session(self) -> AbstractContextManager:
        return self._session()

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    @contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def warmup_context(self) -> AbstractContextManager:
        return self._on_capture_stream()

    def capture(self, fn: Callable[[], Any], generators: Sequence[torch.Generator] = ()) -> CudaGraph:
        torch.cuda.synchronize(self.device)
        reserved_before = self._reserved()
        graph = self.new_graph(generators)
        with self._on_capture_stream():
            graph.capture_begin(pool=self.pool)
            try:
                outputs = fn()
            except BaseException:
                self.abandon(graph)
                raise
            graph.capture_end()
        torch.cuda.synchronize(self.device)
        return CudaGraph(graph, outputs, self._reserved() - reserved_before)

    def piece_sink(self, generators: Sequence[torch.Generator] = ()) -> "CudaPieces":
        return CudaPieces(self, generators)

    def new_graph(self, generators: Sequence[torch.Generator] = ()) -> "torch.cuda.CUDAGraph":
        """A CUDAGraph with the step's own CUDA generators registered (the default generator is the
        graph's already): each replay then advances them by what the captured step draws, as eager
        would. A torch without ``register_generator_state`` cannot: the key fails, naming the generator."""
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            if generator.device.type != "cuda":
                continue
            register = getattr(graph, "register_generator_state", None)
            if register is None:
                raise RuntimeError(f"the step draws from its own CUDA generator {generator!r} (seed "
                                   f"{generator.initial_seed()}); this torch cannot register it with a CUDA graph "
                                   "(CUDAGraph.register_generator_state): use the default generator")
            register(generator)
        return graph

    def abandon(self, graph: "torch.cuda.CUDAGraph") -> None:
        """End a capture whose callable raised, so the stream leaves capture mode."""
        for step in (graph.capture_end, lambda: torch.cuda.synchronize(self.device)):
            try:
                step()
            except RuntimeError as error:  # the capture was already invalidated; keep the first error
                logger.debug("cleanup after a failed capture raised: %s", error)


class CudaPiece:
    """One captured piece of a split step: replay() launches its graph."""

    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph
        self.outputs = None
        self.pool_bytes = None
        self.replay = graph.replay


class CudaPieces:
    """One CUDAGraph per piece, in the backend's shared pool, captured on its capture stream; the
    op between two pieces runs between one ``capture_end`` and the next ``capture_begin``."""

    def __init__(self, backend: CudaGraphBackend, generators: Sequence[torch.Generator] = ()) -> None:
        self.backend = backend
        self.generators = generators
        self.graphs: List["torch.cuda.CUDAGraph"] = []
        self.pool_bytes: Optional[int] = None

    def _begin(self) -> None:
        graph = self.backend.new_graph(self.generators)
        graph.capture_begin(pool=self.backend.pool)
        self.graphs.append(graph)

    @contextmanager
    def recording(self) -> Iterator[None]:
        backend = self.backend
        torch.cuda.synchronize(backend.device)
        reserved_before = backend._reserved()
        with backend.warmup_context():  # the capture stream
            self._begin()
            try:
                yield
            except BaseException:
                backend.abandon(self.graphs[-1])
                raise
            self.graphs[-1].capture_end()
        torch.cuda.synchronize(backend.device)
        self.pool_bytes = backend._reserved() - reserved_before

    def split(self, run: Callable[[], Any]) -> Any:
        self.graphs[-1].capture_end()
        result = run()
        self._begin()
        return result

    def pieces(self, splits: Sequence[SplitPoint], outputs: Sequence[Any]) -> List[CapturedGraph]:
        return [CudaPiece(graph) for graph in self.graphs]
