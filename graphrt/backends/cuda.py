"""CUDA backend on ``torch.cuda.CUDAGraph``: side-stream warm-up, one shared memory pool kept capturable.

Every key captures into one private memory pool of PyTorch's caching allocator, largest key first,
so smaller graphs reuse the blocks the largest reserved (``CudaPool``, graphrt/backends/cuda_pool.py,
has the allocator's rules). Around every capture, what a real GPU needs and no CPU run shows
(issues 33 and 40; docs/RELIABILITY.md has a row each):

- one recording at a time in the process (``recording()``: ``capture_begin`` to ``capture_end``, with the
  synchronize and cache emptying before it): up to torch 2.11 the default generator's capture flag is
  process-wide, so a second capture would break the first one's random numbers; a session's
  device-wide ``synchronize()`` would break a capture under way, and its ``empty_cache()`` would free
  nothing of the default pools while one is (from torch 2.8 silently, pytorch#158152; up to 2.7 an assertion). On such a torch
  graphrt's steps, and a session's warm-ups, compile runs and verification, share the lock, so they
  wait for another thread's recording only, never for its warm-ups or compile runs
  (graphrt/backends/session.py);
- the collector run and the cache emptied when a session begins and again before each capture, as
  ``torch.cuda.graph`` does: during a capture the allocator cannot free other pools' cached blocks, so
  the warm-ups' cached activations would stay reserved while the capture allocates them again;
- warm-ups that see ``torch.cuda.is_current_stream_capturing()`` True (``warmup_capture_path``), so a model
  with a capture-only path (transformers' explicit masks) warms up the kernels its capture runs;
- cuBLAS's cached workspaces cleared around each capture (``clear_cublas_workspaces``): each capture's
  first matmul allocates one in the pool (``cublas_workspace_bytes``: 32 MiB from Hopper on);
- after a capture that failed, one empty capture on the same stream with the same generators: up to
  torch 2.11 a failed ``capture_end`` raises before ``capture_epilogue``, and the default generator
  would refuse every eager draw ("Offset increment outside graph capture") until a capture succeeds.
  The failed graph is reset at once (a traceback cycle would keep it alive while gc is off), and up to
  torch 2.11, whose ``reset()`` gives back only an ended capture's pool reference, graphrt gives back
  the reference the failed ``capture_begin`` took (``cuda_pool.RELEASE_FAILED_CAPTURE_POOL``);
- piecewise: each piece replayed once right after its capture, so the splitting op after it reads
  real values (a capture computes nothing) (``CudaPieces``, graphrt/backends/cuda_pieces.py).
"""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence, Set

import torch
from torch.utils._pytree import tree_map

from graphrt.backends import cuda_pool
from graphrt.backends.cuda_pieces import CudaPieces
from graphrt.backends.cuda_pool import (
    CAPTURE_ERROR_MODE, CudaPool, clear_cublas_workspaces, empty_capture, private_binding,
)
from graphrt.backends.session import RECORDING_LOCK, recording, no_recording

logger = logging.getLogger(__name__)


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
    return non_owning_view(value)


def non_owning_view(value: torch.Tensor) -> torch.Tensor:
    """``value`` over a storage that points at its memory without owning it."""
    storage = value.untyped_storage()
    view = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
    with torch.no_grad(), torch.inference_mode(False):  # an output usable in every mode
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            view, value.storage_offset(), value.size(), value.stride())


_capture_path_threads: Set[int] = set()  # threads whose warm-ups see a capture under way
_capture_path_lock = threading.Lock()
_real_is_capturing: Optional[Callable[[], bool]] = None  # torch's, while the answer is patched


@contextmanager
def warmup_capture_path() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` answers True on this thread for the block (other
    threads get the real answer; several threads' blocks may overlap: torch's function is back when the
    last ends)."""
    global _real_is_capturing
    thread = threading.get_ident()
    with _capture_path_lock:
        if not _capture_path_threads:
            real = _real_is_capturing = torch.cuda.is_current_stream_capturing

            def capturing() -> bool:
                return True if threading.get_ident() in _capture_path_threads else real()

            torch.cuda.is_current_stream_capturing = capturing
        _capture_path_threads.add(thread)
    try:
        yield
    finally:
        with _capture_path_lock:
            _capture_path_threads.discard(thread)
            if not _capture_path_threads:
                torch.cuda.is_current_stream_capturing = _real_is_capturing
                _real_is_capturing = None


def empty_cache_before_capture() -> None:
    """A young-generation collection (the warm-ups' cyclic garbage; a full one ran when the session
    began), then ``empty_cache()``: the blocks the warm-ups freed go back to the device instead of
    staying reserved while the capture allocates the same activations in its pool."""
    gc.collect(1)
    torch.cuda.empty_cache()


def capture_ended(graph: "torch.cuda.CUDAGraph") -> bool:
    """Whether ``graph``'s capture ended (``capture_ended_``, set even when instantiating it then failed):
    ``CUDAGraph.pool()`` refuses a graph whose capture did not."""
    try:
        graph.pool()
        return True
    except RuntimeError:
        return False


def stream_capturing() -> Optional[bool]:
    """Whether the current stream captures, its capture invalidated or not (None: torch cannot say)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return None


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
        """The collector runs, then the memory no graph or output holds is freed (a capture cannot free
        it), out of any other thread's recording; the session's eager work shares the recording lock
        (``no_recording``), each recording holds it alone."""
        gc.collect()
        with no_recording():
            with RECORDING_LOCK:
                torch.cuda.synchronize(self.device)
                self.pool.release_unviewed()
                torch.cuda.empty_cache()
            yield
            with RECORDING_LOCK:
                torch.cuda.synchronize(self.device)

    def capture_session(self) -> AbstractContextManager:
        return self._session()

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def _grown(self, reserved_before: int) -> int:
        """The pool memory a capture added (never negative: a retired pool may be freed meanwhile)."""
        return max(0, self._reserved() - reserved_before)

    @contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    @contextmanager
    def warmup_context(self, capture_path: bool = False) -> Iterator[None]:
        """The capture stream; with ``capture_path`` the step sees a capture under way (``warmup_capture_path``)."""
        with self._on_capture_stream(), warmup_capture_path() if capture_path else nullcontext():
            yield

    def _prepare_capture(self) -> int:
        """Before a capture: synchronize, free what the warm-ups left cached; the bytes reserved then."""
        torch.cuda.synchronize(self.device)
        empty_cache_before_capture()
        return self._reserved()

    def capture(self, fn: Callable[[], Any], generators: Sequence[torch.Generator] = ()) -> CudaGraph:
        with recording():
            reserved_before = self._prepare_capture()
            graph = self.new_graph(generators)
            with self._on_capture_stream():
                self.begin_capture(graph, generators)
                try:
                    outputs = fn()
                except BaseException:
                    self.abandon(graph, generators)
                    raise
                self.end_capture(graph, generators)
            outputs = tree_map(non_owning, outputs)
            self.pool.viewed(outputs)
            torch.cuda.synchronize(self.device)
        return CudaGraph(graph, outputs, self._grown(reserved_before))

    def piece_sink(self, generators: Sequence[torch.Generator] = ()) -> CudaPieces:
        return CudaPieces(self, generators)

    def weak(self, tensor: torch.Tensor) -> torch.Tensor:
        """A non-owning view of memory a capture allocated: the block goes back to the pool, which stays
        reserved while the view lives."""
        view = non_owning(tensor)
        self.pool.viewed(view)
        return view

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

    def begin_capture(self, graph: "torch.cuda.CUDAGraph", generators: Sequence[torch.Generator] = ()) -> None:
        """``capture_begin`` on the current (capture) stream, in the pool, cuBLAS's workspaces
        cleared first; if it raises, whatever it began is undone (``abandon``) before the error goes on."""
        pool = self.pool.for_capture()
        clear_cublas_workspaces()
        try:
            graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        except BaseException:
            self.abandon(graph, generators, began=False)
            raise

    def end_capture(self, graph: "torch.cuda.CUDAGraph", generators: Sequence[torch.Generator] = ()) -> None:
        """``capture_end``, cuBLAS's workspaces cleared after; the graph then holds the pool while it
        lives. If it raises (the capture was invalidated: a host sync, an illegal call), ``abandon``
        cleans up before the error goes on."""
        try:
            graph.capture_end()
        except BaseException:
            self.abandon(graph, generators)
            raise
        clear_cublas_workspaces()
        self.pool.captured(graph)

    def abandon(self, graph: "torch.cuda.CUDAGraph", generators: Sequence[torch.Generator] = (),
                began: bool = True) -> None:
        """Leave no trace of a capture that failed, so the next key captures and eager random numbers
        work: call on the capture stream once ``capture_begin`` (``began`` False), the step or
        ``capture_end`` raised; the first error is kept.

        1. A stream still capturing (even invalidated) leaves capture mode through ``capture_end``
           (``cudaStreamEndCapture`` ends any capture). If that succeeds, the failure was clean:
           routing ended, the generators' capture ended.
        2. Otherwise the allocator may still route to the pool (torch <= 2.11 raises before ending
           it): end it. "not currently recording" means torch ended it already (2.12+). The pool id
           is retired: the pinned host allocator's routing by id cannot be ended from Python. Then
           one empty capture with the same generators ends their capture, which torch <= 2.11 left
           on (pytorch#176752).
        3. The failed graph is reset now, not when a collection finds it (the error's traceback
           holds it in a cycle, and the collector is off while capturing).
        4. The pool reference its ``capture_begin`` took: torch <= 2.11's ``reset()`` gives back only
           an ended capture's, so graphrt gives it back there (``_release_pool``) and the retired
           pool is freed once its graphs and views are gone. torch releases it in ``reset()`` from
           pytorch#190348 on, where a second release would drop a pool live graphs use (or abort on
           ``uc >= 0``): on a release after 2.11 that may lack it, a reference kept only keeps the
           retired pool's memory reserved (docs/RELIABILITY.md). A ``capture_begin`` that raised took
           the reference if it routed the pool (``beginAllocateToPool`` takes it, then routes, then
           ``cudaStreamBeginCapture`` may fail): a routing ended in step 2 says so (issue 48)."""
        clean = self._end_capture_cleanly(graph)
        routed = False
        if not clean:
            routed = self._end_routing()
            self.pool.abandon()
            self._end_generator_capture(generators)
        clear_cublas_workspaces()
        # reset() gives back only an ended capture's reference; a capture_begin that routed the pool took one
        unreleased = (began or routed) and not capture_ended(graph)
        graph.reset()
        if unreleased:
            self._release_pool()
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:
            logger.debug("synchronize after a failed capture raised: %s", error)

    @staticmethod
    def _end_generator_capture(generators: Sequence[torch.Generator]) -> None:
        """One empty capture into a private pool of its own with ``generators`` registered: its
        ``capture_end`` runs the epilogue a failed one skipped. The graph is dropped at once."""
        try:
            empty_capture(None, [generator for generator in generators if generator.device.type == "cuda"]).reset()
        except RuntimeError as error:
            logger.warning("could not end the random generators' capture after a failed capture (%s): eager "
                           "random numbers on this device may fail until a capture succeeds", error)

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

    def _release_pool(self) -> None:
        """Give back the pool reference of a capture that began and did not end, where torch's
        ``reset()`` does not (``cuda_pool.RELEASE_FAILED_CAPTURE_POOL``)."""
        release = private_binding("_cuda_releasePool")
        if not cuda_pool.RELEASE_FAILED_CAPTURE_POOL or release is None:
            return
        try:
            release(torch.cuda.current_device(), self.pool.id)
        except RuntimeError as error:  # never in the way of the next key
            logger.warning("could not give back a failed capture's graph pool %s (%s): its memory stays reserved",
                           self.pool.id, error)

    def _end_routing(self) -> bool:
        """Stop the allocator routing this device's allocations to the pool, if it still does:
        torch's ``_cuda_endAllocateToPool`` from 2.8, ``_cuda_endAllocateCurrentStreamToPool`` before.
        True when it did (a routing was left on)."""
        end = private_binding("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
        if end is None:
            logger.warning("this torch has no binding to end a failed capture's pool routing: a later "
                           "torch.cuda.empty_cache() may fail")
            return False
        try:
            end(torch.cuda.current_device(), self.pool.id)  # the capture stream's device (capture_begin's)
            return True
        except RuntimeError as error:  # "not currently recording": capture_end ended it
            logger.debug("ending the pool routing after a failed capture: %s", error)
            return False
