"""The caching allocator's private-pool bookkeeping, as tests/fake_cuda.py's fake torch.cuda uses it.

Each rule follows PyTorch's source (c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator``;
aten/src/ATen/core/CachingHostAllocator.h for the pinned host allocator's routing by pool id), and
``TorchBehaviour`` names where releases differ on a failed capture. tests/fake_cuda.py's module
docstring lists the rules and what is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from fake_cuda import FakeStream

PoolId = Tuple[int, int]


@dataclass(frozen=True)
class TorchBehaviour:
    """Where PyTorch releases differ on a failed capture."""

    name: str
    end_pool_before_raising: bool  # capture_end ends the pool routings before raising (pytorch#180395)
    reset_releases_failed: bool  # reset() releases a failed capture's pool reference (pytorch#190348)
    end_binding: str  # the Python binding that ends a routing (renamed in 2.8)


TORCH_2_7 = TorchBehaviour("2.7", False, False, "_cuda_endAllocateCurrentStreamToPool")
TORCH_2_11 = TorchBehaviour("2.11", False, False, "_cuda_endAllocateToPool")
TORCH_2_12 = TorchBehaviour("2.12", True, False, "_cuda_endAllocateToPool")
TORCH_RESET_RELEASES = TorchBehaviour("pr190348", True, True, "_cuda_endAllocateToPool")
BEHAVIOURS = (TORCH_2_7, TORCH_2_11, TORCH_2_12, TORCH_RESET_RELEASES)
END_BINDINGS = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")


class InternalAssert(RuntimeError):
    """A failed ``TORCH_INTERNAL_ASSERT`` (PyTorch raises it as a RuntimeError, or aborts in a destructor)."""


@dataclass
class PrivatePool:
    """One graph pool: its references and the blocks captures allocated in it."""

    id: PoolId
    use_count: int = 1
    reserved: int = 0
    blocks: List[Tuple[Any, int]] = field(default_factory=list)  # (StorageWeakRef, bytes) a capture allocated here

    def in_use(self) -> bool:
        return any(not block.expired() for block, _ in self.blocks)


class FakeAllocator:
    """The caching allocator's private-pool bookkeeping (DeviceCachingAllocator), and the pinned host
    allocator's routing by pool id (CachingHostAllocator ``begin_allocate_to_pool``)."""

    def __init__(self) -> None:
        self.graph_pools: Dict[PoolId, PrivatePool] = {}
        self.freeable: Dict[PoolId, PrivatePool] = {}
        self.captures_underway: List[Tuple[PoolId, "FakeStream"]] = []
        self.host_underway: List[PoolId] = []
        self.asserts: List[str] = []  # every INTERNAL ASSERT hit, raised or not

    def internal_assert(self, ok: bool, message: str) -> None:
        """TORCH_INTERNAL_ASSERT: raise, and keep the message (a caller may swallow the error)."""
        if not ok:
            self.asserts.append(message)
            raise InternalAssert(f"{message} INTERNAL ASSERT FAILED (fake CUDACachingAllocator)")

    def create_or_incref_pool(self, pool_id: PoolId) -> None:
        """A new pool (use_count 1), or one more reference on a pool that must still be referenced."""
        pool = self.graph_pools.get(pool_id)
        if pool is None:
            self.graph_pools[pool_id] = PrivatePool(pool_id)
            return
        self.internal_assert(pool.use_count > 0, f"use_count > 0 (pool {pool_id})")
        pool.use_count += 1

    def route_to_pool(self, pool_id: PoolId, stream: "FakeStream") -> None:
        """The rest of beginAllocateToPool, after create_or_incref_pool: one routing per id."""
        if any(underway == pool_id for underway, _ in self.captures_underway):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.captures_underway.append((pool_id, stream))

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        """endAllocateToPool: stop the routing to ``pool_id`` (TORCH_CHECK that one exists)."""
        for index, (underway, _) in enumerate(self.captures_underway):
            if underway == pool_id:
                del self.captures_underway[index]
                return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def host_begin(self, pool_id: PoolId) -> None:
        """The pinned host allocator's begin_allocate_to_pool: one routing per id, no Python binding to end it."""
        if pool_id in self.host_underway:
            raise RuntimeError("beginAllocateToPool: already recording to pool_id")
        self.host_underway.append(pool_id)

    def host_end(self, pool_id: PoolId) -> None:
        """The pinned host allocator's end_allocate_to_pool (only capture_end calls it)."""
        self.internal_assert(pool_id in self.host_underway, "it != captures_underway_.end() (host allocator)")
        self.host_underway.remove(pool_id)

    def release_pool(self, pool_id: PoolId) -> None:
        """releasePool: one reference fewer; at 0 the pool is freeable, still registered under its id."""
        pool = self.graph_pools.get(pool_id)
        self.internal_assert(pool is not None, "it != graph_pools.end()")
        pool.use_count -= 1
        self.internal_assert(pool.use_count >= 0, f"uc >= 0 (pool {pool_id})")
        if pool.use_count == 0:
            self.internal_assert(pool_id not in self.freeable, "inserted (graph_pools_freeable)")
            self.freeable[pool_id] = pool

    def allocated_in_capture(self, stream: "FakeStream", tensor: torch.Tensor) -> None:
        """A tensor made while ``stream`` captures lives in the pool the capture routes to (get_pool)."""
        for pool_id, routed in self.captures_underway:
            if routed is stream:
                pool, storage = self.graph_pools[pool_id], tensor.untyped_storage()
                pool.blocks.append((StorageWeakRef(storage), storage.nbytes()))
                pool.reserved += storage.nbytes()
                return

    def empty_cache(self) -> None:
        """release_cached_blocks: synchronize_and_free_events asserts no capture routes, then frees
        each freeable pool whose blocks no tensor holds, which drops its id."""
        self.internal_assert(not self.captures_underway, "captures_underway.size() == 0")
        for pool_id, pool in list(self.freeable.items()):
            if not pool.in_use():
                del self.freeable[pool_id], self.graph_pools[pool_id]

    def reserved(self) -> int:
        """Bytes the graph pools hold (no block reuse inside a pool is modelled)."""
        return sum(pool.reserved for pool in self.graph_pools.values())

    def allocated(self) -> int:
        """Bytes of graph-pool tensors still alive."""
        return sum(size for pool in self.graph_pools.values() for block, size in pool.blocks if not block.expired())
