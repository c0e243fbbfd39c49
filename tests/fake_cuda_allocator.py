"""The caching allocator's private-pool bookkeeping, as tests/fake_cuda.py's fake torch.cuda uses it.

Each rule follows PyTorch's source (c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator``;
aten/src/ATen/core/CachingHostAllocator.h for the pinned host allocator's routing by pool id), and
``TorchBehaviour`` names where releases differ on a failed capture. tests/fake_cuda.py's module
docstring lists the rules and what is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import torch

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
    rng_epilogue_on_failure: bool = False  # a failed capture_end still ends the generators' capture (pytorch#176752)
    reset_frees_workspace: bool = False  # reset() frees the capture stream's cuBLAS workspace (pytorch#175276)
    # Each capture keeps its own generator state (pytorch#176752): no capture flag shared by the process (up to
    # 2.11 one flag per default generator: another thread's draw or replay raises while any capture is under
    # way), and no seed and offset tensors allocated when the first graph registers the default generator.
    rng_per_capture: bool = False
    # empty_cache() during a capture: up to 2.7 release_cached_blocks calls synchronize_and_free_events, whose
    # TORCH_INTERNAL_ASSERT(captures_underway.empty()) fails; from 2.8 (pytorch#158152) it skips the default
    # pools while any capture routes (no sync, nothing of them freed, no error) and still frees freeable graph pools.
    empty_cache_asserts_in_capture: bool = False


# 2.12 stands for "a release after 2.11": pytorch#176752 and pytorch#175276 landed after the 2.11 branch cut.
TORCH_2_7 = TorchBehaviour("2.7", False, False, "_cuda_endAllocateCurrentStreamToPool",
                           empty_cache_asserts_in_capture=True)
TORCH_2_11 = TorchBehaviour("2.11", False, False, "_cuda_endAllocateToPool")
TORCH_2_12 = TorchBehaviour("2.12", True, False, "_cuda_endAllocateToPool", True, True, True)
TORCH_RESET_RELEASES = TorchBehaviour("pr190348", True, True, "_cuda_endAllocateToPool", True, True, True)
BEHAVIOURS = (TORCH_2_7, TORCH_2_11, TORCH_2_12, TORCH_RESET_RELEASES)
END_BINDINGS = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")


class InternalAssert(RuntimeError):
    """A failed ``TORCH_INTERNAL_ASSERT`` (PyTorch raises it as a RuntimeError, or aborts in a destructor)."""


# The caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp): blocks round to 512 bytes; a
# block up to 1 MiB comes from a 2 MiB segment, one under 10 MiB from a 20 MiB segment, a larger one
# from a segment of its own rounded to 2 MiB.
MIN_BLOCK_SIZE, SMALL_SIZE, SMALL_BUFFER = 512, 1 << 20, 2 << 20
LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 << 20, 10 << 20, 2 << 20


def block_size(nbytes: int) -> int:
    """round_size: a block's bytes."""
    return max(MIN_BLOCK_SIZE, -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def segment_size(nbytes: int) -> int:
    """get_allocation_size: the bytes of the segment cudaMalloc'd for a block that fits no segment."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def storage_users(storage: torch.UntypedStorage) -> int:
    """How many owners the memory has (the StorageImpl's use count): the allocator's own is one."""
    return torch._C._storage_Use_Count(storage._cdata)


@dataclass
class Segment:
    """One cudaMalloc of a pool: its blocks' storages, kept as the allocator keeps memory reserved.
    A block is allocated while a tensor other than the allocator's own record owns its memory; a
    freed block's bytes are free for the next block of its pool (fragmentation is not modelled)."""

    size: int
    small: bool
    blocks: List[Tuple[torch.UntypedStorage, int]] = field(default_factory=list)  # allocated when last seen
    free_blocks: List[torch.UntypedStorage] = field(default_factory=list)  # freed: the memory stays reserved

    def allocated(self) -> int:
        live = [(storage, size) for storage, size in self.blocks if storage_users(storage) > 1]
        if len(live) < len(self.blocks):
            self.free_blocks.extend(storage for storage, _ in self.blocks if storage_users(storage) == 1)
            self.blocks = live
        return sum(size for _, size in live)

    def storages(self) -> List[torch.UntypedStorage]:
        return [storage for storage, _ in self.blocks] + self.free_blocks

    def fits(self, size: int, small: bool) -> bool:
        return small == self.small and self.size - self.allocated() >= size


@dataclass
class PrivatePool:
    """One graph pool: its references and the segments captures allocated in it."""

    id: PoolId
    use_count: int = 1
    segments: List[Segment] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return sum(segment.size for segment in self.segments)

    def in_use(self) -> bool:
        return any(segment.allocated() for segment in self.segments)

    def allocate(self, storage: torch.UntypedStorage) -> None:
        """A block for ``storage`` in a segment with room, or in a new one."""
        size = block_size(storage.nbytes())
        small = size <= SMALL_SIZE
        segment = next((segment for segment in self.segments if segment.fits(size, small)), None)
        if segment is None:
            segment = Segment(segment_size(size), small)
            self.segments.append(segment)
        segment.blocks.append((storage, size))


class FakeAllocator:
    """The caching allocator's private-pool bookkeeping (DeviceCachingAllocator), and the pinned host
    allocator's routing by pool id (CachingHostAllocator ``begin_allocate_to_pool``)."""

    def __init__(self, empty_cache_asserts_in_capture: bool = False) -> None:
        self.empty_cache_asserts_in_capture = empty_cache_asserts_in_capture  # TorchBehaviour's
        self.default_pool = PrivatePool((0, 0))  # the allocations outside graph pools the fake models
        self.graph_pools: Dict[PoolId, PrivatePool] = {}
        self.freeable: Dict[PoolId, PrivatePool] = {}
        self.captures_underway: List[Tuple[PoolId, "FakeStream"]] = []
        self.host_underway: List[PoolId] = []
        self.asserts: List[str] = []  # every INTERNAL ASSERT hit, raised or not
        self.capacity: Optional[int] = None  # device bytes the pools may reserve (None: unlimited)
        self.freed: Set[int] = set()  # data pointers of blocks whose segment was cudaFree'd
        self.graveyard: List[torch.UntypedStorage] = []  # their CPU memory, kept so a stale read is safe here

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
        """A tensor made while ``stream`` captures lives in the pool the capture routes to (get_pool).
        A capture cannot free other pools' cached segments (no cudaFree while capturing): past
        ``capacity`` it runs out of memory."""
        for pool_id, routed in self.captures_underway:
            if routed is stream:
                pool, reserved = self.graph_pools[pool_id], self.reserved()
                pool.allocate(tensor.untyped_storage())
                if self.capacity is not None and self.reserved() > self.capacity:
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory (fake): {self.reserved() - reserved} bytes more than the "
                        f"{self.capacity} a capture may reserve (cached segments of other pools cannot be freed)")
                return

    def allocate_outside_pools(self, tensor: torch.Tensor) -> None:
        """An allocation no capture routes (the default generator's seed and offset): the default pool."""
        self.default_pool.allocate(tensor.untyped_storage())

    def empty_cache(self) -> None:
        """release_cached_blocks: while no capture routes, the default pool's unused segments (after
        synchronize_and_free_events); while one does, up to 2.7 that sync's assertion fails, and from 2.8
        the default pool is left as it is, silently (pytorch#158152). Either way then each freeable pool whose
        blocks no tensor holds is freed, which drops its id (cudaFree of its segments: a tensor still viewing
        that memory then reads freed memory)."""
        if self.empty_cache_asserts_in_capture:
            self.internal_assert(not self.captures_underway, "captures_underway.size() == 0")
        if not self.captures_underway:
            self.default_pool.segments = [segment for segment in self.default_pool.segments if segment.allocated()]
        for pool_id, pool in list(self.freeable.items()):
            if not pool.in_use():
                del self.freeable[pool_id], self.graph_pools[pool_id]
                for segment in pool.segments:
                    for storage in segment.storages():
                        self.freed.add(storage.data_ptr())
                        self.graveyard.append(storage)

    def reserved(self) -> int:
        """Bytes the modelled segments hold (the graph pools', and the default pool's)."""
        return sum(pool.reserved for pool in (self.default_pool, *self.graph_pools.values()))

    def allocated(self) -> int:
        """Bytes of modelled blocks a tensor still owns."""
        return sum(segment.allocated() for pool in (self.default_pool, *self.graph_pools.values())
                   for segment in pool.segments)
