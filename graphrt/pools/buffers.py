"""Buffer pools: tensors handed out by spec and taken back for reuse, evicted least recently used.

An InputBufferManager built with ``pool=`` allocates its slots from one (see graphrt.pools.tiers);
a GraphRunner's static slots come from one with ``RunnerConfig(slot_pool=...)`` (they are
allocated once, so the pool decides where they live: pinned host memory, the device).
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from graphrt.staging import BufferSpec

logger = logging.getLogger(__name__)


class BufferState(enum.Enum):
    """Lifecycle of a pooled buffer."""

    FREE = enum.auto()
    IN_USE = enum.auto()


@dataclass
class BufferEntry:
    """A pooled tensor with its state and last use, for LRU eviction."""

    spec: BufferSpec
    tensor: torch.Tensor
    state: BufferState = BufferState.FREE
    last_used: float = field(default_factory=time.monotonic)
    use_count: int = 0

    def mark_in_use(self) -> None:
        self.state = BufferState.IN_USE
        self.last_used = time.monotonic()
        self.use_count += 1

    def release(self) -> None:
        self.state = BufferState.FREE
        self.last_used = time.monotonic()


class BufferPool(ABC):
    """Hands out tensors by spec and takes them back for reuse."""

    @abstractmethod
    def allocate(self, spec: BufferSpec) -> torch.Tensor:
        """A tensor matching ``spec`` (reused when a released one exists)."""

    @abstractmethod
    def release(self, tensor: torch.Tensor) -> None:
        """Return ``tensor`` to the pool."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every buffer the pool holds."""


class SimpleBufferPool(BufferPool):
    """One-tier pool: reuses released buffers of the same spec, evicts the least recently used."""

    def __init__(self, max_buffers: int = 64) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers: expected a positive int, got {max_buffers!r}")
        self.max_buffers = max_buffers
        self._entries: "OrderedDict[int, BufferEntry]" = OrderedDict()

    def allocate(self, spec: BufferSpec) -> torch.Tensor:
        for entry in self._entries.values():
            if entry.state is BufferState.FREE and entry.spec == spec:
                entry.mark_in_use()
                self._entries.move_to_end(id(entry.tensor))
                return entry.tensor
        if len(self._entries) >= self.max_buffers:
            self._evict_oldest()
        entry = BufferEntry(spec, self._create_tensor(spec))
        entry.mark_in_use()
        self._entries[id(entry.tensor)] = entry
        return entry.tensor

    def _create_tensor(self, spec: BufferSpec) -> torch.Tensor:
        return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device, pin_memory=spec.pin_memory)

    def _evict_oldest(self) -> None:
        for key, entry in self._entries.items():
            if entry.state is BufferState.FREE:
                del self._entries[key]
                logger.debug("evicted buffer %s", entry.spec)
                return
        raise MemoryError(f"buffer pool full: all {self.max_buffers} buffers are in use")

    def release(self, tensor: torch.Tensor) -> None:
        entry = self._entries.get(id(tensor))
        if entry is None:
            raise ValueError("tensor: not allocated by this pool")
        entry.release()
        self._entries.move_to_end(id(tensor))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
