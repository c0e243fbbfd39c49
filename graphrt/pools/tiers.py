"""Tiered buffer pools, a predictive input-buffer manager, and the factory that picks one.

Tiers, fastest first for host staging: pinned host memory (async host-to-device copies),
pageable host memory, device memory, and managed memory. A tier is available only where
this machine can allocate it; the rest are reported with the reason. Buffers of a spec that
keeps being reused are promoted to the faster tier; under memory pressure (a tier over its
byte budget, or device pressure from ``graphrt.pools.memory``) released buffers are demoted or freed.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

import torch

from graphrt.pools.buffers import BufferPool, SimpleBufferPool
from graphrt.pools.memory import memory_pressure
from graphrt.staging import BufferSpec, InputBufferManager

logger = logging.getLogger(__name__)


class Tier(enum.Enum):
    """Where a pooled buffer lives."""

    PINNED_HOST = "pinned_host"
    HOST = "host"
    DEVICE = "device"
    MANAGED = "managed"


@dataclass
class TierStats:
    """Per-tier counters."""

    available: bool
    reason: str = ""
    allocations: int = 0
    reuses: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_in_use: int = 0
    bytes_free: int = 0


@dataclass
class _Pooled:
    spec: BufferSpec
    tier: Tier
    tensor: torch.Tensor
    in_use: bool = True


def tier_availability() -> Dict[Tier, str]:
    """Empty string for a tier this machine can allocate, else why not."""
    cuda = torch.cuda.is_available()
    no_cuda = "no CUDA device (torch.cuda.is_available() is False)"
    return {
        Tier.PINNED_HOST: "" if cuda else f"pinned memory needs a CUDA driver: {no_cuda}",
        Tier.HOST: "",
        Tier.DEVICE: "" if cuda else no_cuda,
        Tier.MANAGED: "torch exposes no managed-memory (cudaMallocManaged) allocator",
    }


def _default_allocate(spec: BufferSpec, tier: Tier) -> torch.Tensor:
    device = spec.device if tier is Tier.DEVICE else torch.device("cpu")
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device, pin_memory=tier is Tier.PINNED_HOST)


class HierarchicalBufferPool(BufferPool):
    """Tiered pool: promotes hot host specs to pinned memory, demotes or frees under pressure."""

    def __init__(
        self,
        promote_after: int = 4,
        tier_budgets: Optional[Dict[Tier, int]] = None,
        pressure_threshold: float = 0.9,
        availability: Optional[Dict[Tier, str]] = None,
        allocate: Callable[[BufferSpec, Tier], torch.Tensor] = _default_allocate,
        pressure: Callable[[Optional[torch.device]], float] = memory_pressure,
    ) -> None:
        reasons = availability if availability is not None else tier_availability()
        self.stats: Dict[Tier, TierStats] = {tier: TierStats(not reasons[tier], reasons[tier]) for tier in Tier}
        for tier, stats in self.stats.items():
            if not stats.available:
                logger.info("buffer tier %s unavailable: %s", tier.value, stats.reason)
        self.promote_after = promote_after
        self.tier_budgets = dict(tier_budgets or {})
        self.pressure_threshold = pressure_threshold
        self._allocate = allocate
        self._pressure = pressure
        self._buffers: Dict[int, _Pooled] = {}
        self._free: Dict[tuple, Deque[_Pooled]] = {}
        self._spec_uses: Counter = Counter()
        self._promoted: set = set()

    def tier_for(self, spec: BufferSpec) -> Tier:
        """Device specs live on the device; host specs on pinned memory once hot (or when asked)."""
        if spec.device.type != "cpu":
            return Tier.DEVICE
        if not self.stats[Tier.PINNED_HOST].available:
            return Tier.HOST
        if spec.pin_memory:
            return Tier.PINNED_HOST
        if self._spec_uses[spec] >= self.promote_after:
            if spec not in self._promoted:
                self._promoted.add(spec)
                self.stats[Tier.PINNED_HOST].promotions += 1
                logger.debug("promoted %s to pinned host memory after %d uses", spec, self.promote_after)
            return Tier.PINNED_HOST
        return Tier.HOST

    def allocate(self, spec: BufferSpec) -> torch.Tensor:
        self._spec_uses[spec] += 1
        tier = self.tier_for(spec)
        if not self.stats[tier].available:
            raise RuntimeError(f"spec.device: tier {tier.value} is unavailable here: {self.stats[tier].reason}")
        free = self._free.get((spec, tier))
        if free:
            pooled = free.pop()
            self.stats[tier].reuses += 1
            self.stats[tier].bytes_free -= spec.size_bytes()
        else:
            pooled = _Pooled(spec, tier, self._allocate(spec, tier))
            self._buffers[id(pooled.tensor)] = pooled
            self.stats[tier].allocations += 1
        pooled.in_use = True
        self.stats[tier].bytes_in_use += spec.size_bytes()
        return pooled.tensor

    def release(self, tensor: torch.Tensor) -> None:
        pooled = self._buffers.get(id(tensor))
        if pooled is None or not pooled.in_use:
            raise ValueError("tensor: not allocated by this pool (or already released)")
        pooled.in_use = False
        stats = self.stats[pooled.tier]
        stats.bytes_in_use -= pooled.spec.size_bytes()
        stats.bytes_free += pooled.spec.size_bytes()
        self._free.setdefault((pooled.spec, pooled.tier), deque()).appendleft(pooled)
        self.relieve_pressure()

    def relieve_pressure(self) -> None:
        """Demote free pinned buffers to pageable memory, free device buffers, while over budget."""
        for tier in (Tier.PINNED_HOST, Tier.DEVICE):
            budget = self.tier_budgets.get(tier)
            over_budget = budget is not None and self.stats[tier].bytes_in_use + self.stats[tier].bytes_free > budget
            pressured = tier is Tier.DEVICE and self.stats[tier].bytes_free and (
                self._pressure(None) > self.pressure_threshold)
            if over_budget or pressured:
                self._shed(tier, budget)

    def _shed(self, tier: Tier, budget: Optional[int]) -> None:
        for (spec, held_tier), free in list(self._free.items()):
            while held_tier is tier and free:
                stats = self.stats[tier]
                if budget is not None and stats.bytes_in_use + stats.bytes_free <= budget:
                    return
                pooled = free.pop()
                del self._buffers[id(pooled.tensor)]
                stats.bytes_free -= spec.size_bytes()
                stats.demotions += 1
                if tier is Tier.PINNED_HOST:  # keep the buffer's role on the slower host tier
                    host_spec = dataclasses.replace(spec, pin_memory=False)
                    demoted = _Pooled(host_spec, Tier.HOST, self._allocate(host_spec, Tier.HOST), in_use=False)
                    self._buffers[id(demoted.tensor)] = demoted
                    self._free.setdefault((host_spec, Tier.HOST), deque()).appendleft(demoted)
                    self.stats[Tier.HOST].bytes_free += spec.size_bytes()

    def clear(self) -> None:
        self._buffers.clear()
        self._free.clear()
        for stats in self.stats.values():
            stats.bytes_in_use = stats.bytes_free = 0

    def tier_stats(self) -> Dict[str, Dict[str, object]]:
        """Per-tier counters and availability, keyed by tier name."""
        return {tier.value: vars(stats).copy() for tier, stats in self.stats.items()}


class PredictiveBufferManager(InputBufferManager):
    """An InputBufferManager that learns which token counts come next and pre-warms their views.

    For host code that stages batches of many token counts through ``stage_inputs`` (a scheduler
    building prefills of arbitrary lengths): building a slot's view of a new row count costs a
    tensor allocation, which ``prewarm`` moves off the hot path. A GraphRunner does not need it:
    its views are built once per captured key."""

    def __init__(self, *args, history: int = 256, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.history: Deque[int] = deque(maxlen=history)

    def record_usage(self, num_tokens: int) -> None:
        """Remember one step's token count."""
        if type(num_tokens) is not int or not 0 <= num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens: expected an int in [0, {self.max_seq_len}], got {num_tokens!r}")
        self.history.append(num_tokens)

    def predict_next_sizes(self, n: int = 4) -> List[int]:
        """The ``n`` most likely next token counts: most frequent first, recent steps weigh double."""
        recent = list(self.history)[-max(1, len(self.history) // 4):] if self.history else []
        scores = Counter(self.history) + Counter(recent)
        return [size for size, _ in sorted(scores.items(), key=lambda item: (-item[1], -item[0]))[:n]]

    def prewarm(self, n: int = 4) -> List[int]:
        """Build every slot's views for the predicted sizes now, off the hot path; returns the sizes."""
        sizes = self.predict_next_sizes(n)
        for size in sizes:
            self.get_static_tensors(num_tokens=size, num_reqs=min(size, self.max_batch_size))
        return sizes


def create_input_buffer_manager(
    max_batch_size: int,
    max_seq_len: Optional[int] = None,
    use_hierarchical: bool = False,
    use_predictive: bool = False,
    device: Optional[torch.device] = None,
) -> InputBufferManager:
    """An input buffer manager with a simple or tiered pool, plain or predictive."""
    pool = HierarchicalBufferPool() if use_hierarchical else SimpleBufferPool()
    cls = PredictiveBufferManager if use_predictive else InputBufferManager
    return cls(pool, max_batch_size=max_batch_size, max_seq_len=max_seq_len, device=device)
