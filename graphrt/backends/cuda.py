"""CUDA backend on ``torch.cuda.CUDAGraph``: side-stream warm-up, one shared memory pool kept capturable.

Every key captures into one private memory pool of PyTorch's caching allocator, largest key first,
so smaller graphs reuse the blocks the largest reserved. The allocator's rules for such a pool
(c10/cuda/CUDACachingAllocator.cpp, aten/src/ATen/cuda/CUDAGraph.cpp; docs/RELIABILITY.md cites them):

- ``capture_begin(pool=id)`` creates the pool ``id`` or takes a reference on it, asserting that a pool
  it finds is still referenced (``create_or_incref_pool``: ``use_count > 0``), and routes the capture's
  allocations to it (one routing per id: "already recording to mempool_id");
- a graph gives its reference back when it is freed, but the pool keeps its id until ``empty_cache``
  finds its blocks unused: an id whose graphs are all gone cannot be captured into again;
- a capture that fails can leave the routing on (``capture_end`` raises before ending it up to torch
  2.11; the pinned host allocator's routing by id cannot be ended from Python at all) and its
  reference taken.

So ``CudaPool`` captures into one id while a graph captured there is alive, takes a fresh id when
none is, and after a failed capture ends the routing and never uses that id again.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

from graphrt.backends.base import CapturedGraph, SplitPoint
from graphrt.backends.session import gc_frozen

logger = logging.getLogger(__name__)

# Which CUDA calls a capture forbids (cudaStreamCaptureMode). ``thread_local`` forbids this thread's
# unsafe calls, so a host sync in the step still fails its capture, and leaves other threads alone.
# PyTorch's default, ``global``, would also fail any other thread's unsafe call during the capture
# and invalidate the capture with it (another model's allocation, a communicator's watchdog querying
# events): graphrt captures while serving (``wrap()`` on real calls, ``retune()``), as torch.compile's
# CUDA-graph trees do, and they capture ``thread_local`` for that reason.
CAPTURE_ERROR_MODE = "thread_local"
PoolId = Tuple[int, int]


class CudaGraph:
    """One captured ``torch.cuda.CUDAGraph`` and the output tensors it writes on every replay."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: Any, pool_bytes: Optional[int]) -> None:
        self.graph = graph
        self.outputs = outputs
        self.pool_bytes = pool_bytes
        self.replay = graph.replay


def non_owning(value: Any) -> Any:
    """A tensor over the same memory that does not keep it: once the capture's own reference goes,
    an output's block returns to the pool and the next (smaller) key's capture may reuse it, so
    the pool's memory stays near one largest key (as vLLM and torch.compile's CUDA-graph trees
    keep outputs). The graph still writes there on every replay: an output is valid until the
    next replay of any key in the pool. Only CUDA memory: a pool keeps it reserved while graphs live."""
    if not isinstance(value, torch.Tensor) or not value.is_cuda:
        return value
    storage = value.untyped_storage()
    view = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
    with torch.no_grad(), torch.inference_mode(False):  # an output usable in every mode
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            view, value.storage_offset(), value.size(), value.stride())


def end_allocate_to_pool() -> Optional[Callable[[int, PoolId], None]]:
    """torch's binding that stops routing a device's allocations to a pool: ``_cuda_endAllocateToPool``
    from 2.8, ``_cuda_endAllocateCurrentStreamToPool`` before (same arguments); None without either
    (CPU builds hold placeholder classes under these names)."""
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        binding = getattr(torch._C, name, None)
        if callable(binding) and not isinstance(binding, type):
            return binding
    return None


def stream_capturing() -> Optional[bool]:
    """Whether the current stream captures, its capture invalidated or not (None: torch cannot say)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return None


class CudaPool:
    """The pool id captures begin in, kept capturable: the same id while a graph captured into it is
    alive (smaller keys reuse the largest key's blocks), a fresh one when none is or after a capture
    in it failed. Graphs are tracked by weak reference: a graph alive in Python holds its pool
    reference in the allocator, and a freed one has given it back."""

    def __init__(self) -> None:
        self.id: PoolId = torch.cuda.graph_pool_handle()
        self._graphs: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()
        self._used = False  # a capture began in ``id``
        self._abandoned = False  # a capture in ``id`` failed: the id is never used again
        self._untracked = False  # this torch's graphs take no weak reference: every capture in a fresh id

    def for_capture(self) -> PoolId:
        """The id the next ``capture_begin`` uses."""
        if self._abandoned or (self._used and (self._untracked or not self._graphs)):
            self._renew()
        self._used = True
        return self.id

    def captured(self, graph: "torch.cuda.CUDAGraph") -> None:
        """``graph``'s capture ended in the current id: it holds the pool while it lives."""
        try:
            self._graphs.add(graph)
        except TypeError:  # no weak reference: whether the pool is held cannot be known
            self._untracked = True

    def abandon(self) -> None:
        """A capture in the current id failed: the next capture takes a fresh id."""
        self._abandoned = True

    def _renew(self) -> None:
        """A fresh id. An old pool no graph holds any more is freed by ``empty_cache`` (the allocator's
        own out-of-memory retry skips it while a capture is under way, so a recapture would need its
        memory twice)."""
        held = bool(self._graphs) or self._untracked
        logger.debug("graph pool %s retired (%s); captures continue in a fresh pool", self.id,
                     "a capture failed in it" if self._abandoned else "no graph captured into it is alive")
        self.id = torch.cuda.graph_pool_handle()
        self._graphs = weakref.WeakSet()
        self._used = self._abandoned = False
        if not held:
            try:
                torch.cuda.empty_cache()
            except RuntimeError as error:  # another thread's capture is under way: the memory waits
                logger.debug("empty_cache after retiring a graph pool raised: %s", error)


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
        self.pool = CudaPool()
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
            self.begin_capture(graph)
            try:
                outputs = fn()
            except BaseException:
                self.abandon(graph)
                raise
            self.end_capture(graph)
        torch.cuda.synchronize(self.device)
        return CudaGraph(graph, tree_map(non_owning, outputs), self._reserved() - reserved_before)

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

    def begin_capture(self, graph: "torch.cuda.CUDAGraph") -> None:
        """``capture_begin`` on the current (capture) stream, in the pool; if it raises, whatever it
        began is undone (``abandon``) before the error goes on."""
        try:
            graph.capture_begin(pool=self.pool.for_capture(), capture_error_mode=CAPTURE_ERROR_MODE)
        except BaseException:
            self.abandon(graph)
            raise

    def end_capture(self, graph: "torch.cuda.CUDAGraph") -> None:
        """``capture_end``; the graph then holds the pool while it lives. If it raises (the capture
        was invalidated: a host sync, an illegal call), ``abandon`` cleans up before the error goes on."""
        try:
            graph.capture_end()
        except BaseException:
            self.abandon(graph)
            raise
        self.pool.captured(graph)

    def abandon(self, graph: "torch.cuda.CUDAGraph") -> None:
        """Leave no trace of a capture that failed, so the next key captures: call on the capture
        stream once ``capture_begin``, the step or ``capture_end`` raised; the first error is kept.

        1. A stream still capturing (even invalidated) leaves capture mode through ``capture_end``
           (``cudaStreamEndCapture`` ends any capture). If that succeeds, the failure was clean:
           routing ended, the discarded graph gives its pool reference back when freed.
        2. Otherwise the allocator may still route to the pool (torch <= 2.11 raises before ending
           it): end it. "not currently recording" means torch ended it already (2.12+).
        3. Otherwise the pool id is retired: the pinned host allocator's routing by id cannot be ended
           from Python. Its reference, if the failed graph kept one, is not given back here: torch
           releases it in the graph's ``reset()`` from pytorch#190348 on, and a second release would
           drop a pool live graphs use (or abort on ``uc >= 0``); a missing one only keeps the
           retired pool's memory reserved (docs/RELIABILITY.md)."""
        if not self._end_capture_cleanly(graph):
            self._end_routing()
            self.pool.abandon()
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:
            logger.debug("synchronize after a failed capture raised: %s", error)

    @staticmethod
    def _end_capture_cleanly(graph: "torch.cuda.CUDAGraph") -> bool:
        """End the stream's capture if it still captures; True when ``capture_end`` succeeded."""
        if stream_capturing() is False:
            return False
        try:
            graph.capture_end()
            return True
        except RuntimeError as error:  # invalidated (or never begun): keep the first error
            logger.debug("capture_end after a failed capture raised: %s", error)
            return False

    def _end_routing(self) -> None:
        """Stop the allocator routing this device's allocations to the pool, if it still does."""
        end = end_allocate_to_pool()
        if end is None:
            logger.warning("this torch has no binding to end a failed capture's pool routing: a later "
                           "torch.cuda.empty_cache() may fail")
            return
        try:
            end(torch.cuda.current_device(), self.pool.id)  # the capture stream's device (capture_begin's)
        except RuntimeError as error:  # "not currently recording": capture_end ended it
            logger.debug("ending the pool routing after a failed capture: %s", error)


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
    the piece whose capture is open (begun, not ended) is abandoned when the pass fails."""

    def __init__(self, backend: CudaGraphBackend, generators: Sequence[torch.Generator] = ()) -> None:
        self.backend = backend
        self.generators = generators
        self.graphs: List["torch.cuda.CUDAGraph"] = []  # pieces whose capture ended
        self.open: Optional["torch.cuda.CUDAGraph"] = None  # the piece being captured
        self.pool_bytes: Optional[int] = None

    def _begin(self) -> None:
        graph = self.backend.new_graph(self.generators)
        self.backend.begin_capture(graph)  # abandons it if it raises
        self.open = graph

    def _end(self) -> None:
        graph, self.open = self.open, None
        self.backend.end_capture(graph)  # abandons it if it raises
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
                if self.open is not None:
                    backend.abandon(self.open)
                    self.open = None
                raise
            self._end()
        torch.cuda.synchronize(backend.device)
        self.pool_bytes = backend._reserved() - reserved_before

    def split(self, run: Callable[[], Any]) -> Any:
        self._end()
        result = run()
        self._begin()
        return result

    def pieces(self, splits: Sequence[SplitPoint], outputs: Sequence[Any]) -> List[CapturedGraph]:
        return [CudaPiece(graph) for graph in self.graphs]
