"""The CUDA backend's graph memory pool: kept capturable, and never freed under an output's view.

The caching allocator's rules for a graph pool (c10/cuda/CUDACachingAllocator.cpp,
aten/src/ATen/cuda/CUDAGraph.cpp; docs/RELIABILITY.md cites them):

- ``capture_begin(pool=id)`` creates the pool ``id`` or takes a reference on it, asserting that a pool
  it finds is still referenced (``create_or_incref_pool``: ``use_count > 0``), and routes the capture's
  allocations to it (one routing per id: "already recording to mempool_id");
- a graph gives its reference back when it is freed; at no reference the pool is freeable, and any
  ``empty_cache()`` (the caller's, or the allocator's own retry before an out-of-memory error)
  ``cudaFree``s it once no block of it is allocated. An output is a non-owning view of its block
  (``non_owning``), so such a free leaves it pointing at freed memory: reading it is an illegal
  address, which ends the CUDA context;
- a capture that fails can leave the routing on (``capture_end`` raises before ending it up to torch
  2.11; the pinned host allocator's routing by id cannot be ended from Python at all) and its
  reference taken.

So ``CudaPool`` captures into one id while a graph captured there is alive, takes a fresh id when
none is or after a capture in it failed, and holds every id it used with an *anchor* (an empty
graph captured into it, one reference) until no output view of that pool is left: a retired pool's
memory stays reserved while a caller may still read an output of it, and is freed after.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from graphrt.backends.session import torch_release

logger = logging.getLogger(__name__)

PoolId = Tuple[int, int]
# Which CUDA calls a capture forbids (cudaStreamCaptureMode). ``thread_local`` forbids this thread's
# unsafe calls, so a host sync in the step still fails its capture, and leaves other threads alone.
# PyTorch's default, ``global``, would also fail any other thread's unsafe call during the capture
# and invalidate the capture with it (another model's allocation, a communicator's watchdog querying
# events): graphrt captures while serving (``wrap()`` on real calls, ``retune()``), as torch.compile's
# CUDA-graph trees do, and they capture ``thread_local`` for that reason.
CAPTURE_ERROR_MODE = "thread_local"
# Up to torch 2.11 ``CUDAGraph::reset()`` gives back only an ended capture's pool reference, so graphrt gives
# back the one a failed capture took (``CudaGraphBackend.abandon``); pytorch#190348 releases it in reset()
# itself in a later release. tests/fake_cuda.py sets it as the torch release it models does.
RELEASE_FAILED_CAPTURE_POOL = torch_release() <= (2, 11)


def private_binding(*names: str) -> Optional[Callable[..., Any]]:
    """The first of torch's private ``torch._C`` bindings ``names`` this build has, or None (CPU
    builds hold placeholder classes under some of these names)."""
    for name in names:
        binding = getattr(torch._C, name, None)
        if callable(binding) and not isinstance(binding, type):
            return binding
    return None


def clear_cublas_workspaces() -> None:
    """Forget cuBLAS's cached workspaces (inductor's ``clear_cublas_manager`` does it around each capture).
    Each capture then allocates its own workspace in its pool, and no graph's workspace stays cached
    for the capture stream, where ``CUDAGraph.reset()`` frees it from pytorch#175276 on under the other
    graphs captured on that stream (pytorch#193402)."""
    clear = private_binding("_cuda_clearCublasWorkspaces")
    if clear is not None:
        clear()


def cublas_workspace_bytes(capability: Tuple[int, int]) -> int:
    """The bytes of the workspace cuBLAS allocates per (handle, stream) on a device of compute
    ``capability`` (aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``): the
    ``:SIZE:COUNT`` KiB pairs of ``CUBLAS_WORKSPACE_CONFIG``, else 32 MiB from Hopper (9.x) on and
    4096 KiB x 2 + 16 KiB x 8 before. cuBLASLt shares it (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by
    default). A capture's first matmul allocates it in the graph pool, as graphrt clears the cached
    workspaces before each capture (``clear_cublas_workspaces``)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def empty_capture(pool: Optional[PoolId], generators: Sequence[torch.Generator] = ()) -> "torch.cuda.CUDAGraph":
    """A graph of nothing captured on the current stream, into ``pool`` (None: a private pool of its
    own), with ``generators`` registered: it holds a reference on ``pool`` while it lives, and its
    successful ``capture_end`` ends the generators' capture (``capture_epilogue``)."""
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": that is the point
        graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        graph.capture_end()
    return graph


@dataclass
class RetiredPool:
    """A pool no capture uses any more: its anchor holds it until no output view of it is left."""

    id: PoolId
    anchor: Any
    views: List[StorageWeakRef] = field(default_factory=list)

    def viewed(self) -> bool:
        return any(not view.expired() for view in self.views)


class CudaPool:
    """The pool id captures begin in, kept capturable: the same id while a graph captured into it is
    alive (smaller keys reuse the largest key's blocks), a fresh one when none is or after a capture
    in it failed. Graphs are tracked by weak reference: a graph alive in Python holds its pool
    reference in the allocator, and a freed one has given it back. Every id is held by an anchor
    graph until no output view of it is left (``release_unviewed``)."""

    def __init__(self) -> None:
        self.id: PoolId = torch.cuda.graph_pool_handle()
        self._graphs: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()
        self._anchor: Any = None  # an empty graph captured into ``id``: keeps it from being freed
        self._views: List[StorageWeakRef] = []  # the outputs captured into ``id``
        self.retired: List[RetiredPool] = []
        self._used = False  # a capture began in ``id``
        self._abandoned = False  # a capture in ``id`` failed: the id is never used again
        self._untracked = False  # this torch's graphs take no weak reference: every capture in a fresh id

    def for_capture(self) -> PoolId:
        """The id the next ``capture_begin`` uses, anchored (call on the capture stream, outside a capture)."""
        if self._abandoned or (self._used and (self._untracked or not self._graphs)):
            self._renew()
        if self._anchor is None:
            self._anchor = empty_capture(self.id)
        self._used = True
        return self.id

    def viewed(self, outputs: Any) -> None:
        """``outputs`` (non-owning views of the current id's memory) keep the pool reserved while a
        caller holds one, after its graphs are gone."""
        self._views.extend(StorageWeakRef(leaf.untyped_storage()) for leaf in tree_leaves(outputs)
                           if isinstance(leaf, torch.Tensor))

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
        """A fresh id; the old one is retired, held by its anchor while an output views it."""
        logger.debug("graph pool %s retired (%s); captures continue in a fresh pool", self.id,
                     "a capture failed in it" if self._abandoned else "no graph captured into it is alive")
        if self._anchor is not None:
            self.retired.append(RetiredPool(self.id, self._anchor, self._views))
        self.id = torch.cuda.graph_pool_handle()
        self._graphs = weakref.WeakSet()
        self._anchor, self._views = None, []
        self._used = self._abandoned = False
        self.release_unviewed()

    def release_unviewed(self) -> None:
        """Drop the anchors of retired pools no output views any more, and free what no graph holds
        (``empty_cache``: a recapture would otherwise need that memory twice, as the allocator's own
        out-of-memory retry cannot free during a capture). Call outside a capture."""
        unviewed = [pool for pool in self.retired if not pool.viewed()]
        if not unviewed:
            return
        self.retired = [pool for pool in self.retired if pool.viewed()]
        clear_cublas_workspaces()  # a reset frees the stream's cached workspace (pytorch#175276): none left
        for pool in unviewed:
            pool.anchor.reset()
        try:
            torch.cuda.empty_cache()
        except RuntimeError as error:  # an assertion only up to torch 2.7 during a capture, and RECORDING_LOCK keeps those out
            logger.debug("empty_cache after releasing retired graph pools raised: %s", error)
