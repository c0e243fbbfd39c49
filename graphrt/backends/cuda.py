"""CUDA backend on ``torch.cuda.CUDAGraph``: side-stream warm-up, one shared memory pool."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

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

    def capture(self, fn: Callable[[], Any]) -> CudaGraph:
        torch.cuda.synchronize(self.device)
        reserved_before = self._reserved()
        graph = torch.cuda.CUDAGraph()
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

    def abandon(self, graph: "torch.cuda.CUDAGraph") -> None:
        """End a capture whose callable raised, so the stream leaves capture mode."""
        for step in (graph.capture_end, lambda: torch.cuda.synchronize(self.device)):
            try:
                step()
            except RuntimeError as error:  # the capture was already invalidated; keep the first error
                logger.debug("cleanup after a failed capture raised: %s", error)
