"""Paged KV cache: ReqToTokenPool (request -> slot table) and KVPool (per-layer K/V slots).

Both reserve index 0 so that padding rows of a graph batch are harmless: padding
requests point at ``DUMMY_REQUEST`` whose every slot is ``SCRATCH_SLOT``, and
padding tokens write their K/V into ``SCRATCH_SLOT``, which no real request owns.
Allocation bookkeeping never reads device memory: free request rows are a host
list and free KV slots a device tensor that is only sliced and concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from graphrt.reference.config import ReferenceConfig

SCRATCH_SLOT = 0
DUMMY_REQUEST = 0

Device = Union[str, torch.device]


class ReqToTokenPool:
    """Table ``req_to_token[request, position]`` of KV slot indices; row 0 is the dummy request."""

    def __init__(
        self,
        num_requests: int,
        max_context_len: int,
        device: Device = "cpu",
        dtype: torch.dtype = torch.int64,
    ) -> None:
        if num_requests < 2:
            raise ValueError(f"num_requests: expected >= 2 (row {DUMMY_REQUEST} is reserved), got {num_requests}")
        self.num_requests = num_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.full(
            (num_requests, max_context_len), SCRATCH_SLOT, dtype=dtype, device=self.device
        )
        self._free_rows: List[int] = [row for row in range(num_requests) if row != DUMMY_REQUEST]

    @property
    def available(self) -> int:
        """Number of request rows that can still be allocated."""
        return len(self._free_rows)

    def alloc(self) -> int:
        """Reserve one request row (never the dummy row)."""
        if not self._free_rows:
            raise RuntimeError(f"ReqToTokenPool: all {self.num_requests - 1} request rows are in use")
        return self._free_rows.pop(0)

    def free(self, req: int) -> None:
        """Return a request row and point all its positions back at the scratch slot."""
        if req == DUMMY_REQUEST or not 0 <= req < self.num_requests or req in self._free_rows:
            raise ValueError(f"req: expected an allocated request row, got {req}")
        self.req_to_token[req].fill_(SCRATCH_SLOT)
        self._free_rows.append(req)


class KVPool:
    """Per-layer K and V buffers of shape [num_slots, num_kv_heads, head_dim]; slot 0 is scratch.

    ``v_head_dim`` (default ``head_dim``) sizes the V buffers apart from the K buffers, for attention
    whose values are narrower than its keys (DeepSeek's MLA run as per-head keys and values).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Device = "cpu",
        v_head_dim: Optional[int] = None,
    ) -> None:
        self._init_slots(num_slots, device)
        k_shape = (num_slots, num_kv_heads, head_dim)
        v_shape = (num_slots, num_kv_heads, head_dim if v_head_dim is None else v_head_dim)
        self.k_buffers = [torch.zeros(k_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(v_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def _init_slots(self, num_slots: int, device: Device) -> None:
        """The slot bookkeeping: ``num_slots`` slots, all free but the scratch slot (buffers are the caller's)."""
        if num_slots < 2:
            raise ValueError(f"num_slots: expected >= 2 (slot {SCRATCH_SLOT} is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._free_slots = torch.arange(1, num_slots, dtype=torch.int64, device=self.device)

    @property
    def available(self) -> int:
        """Number of slots that can still be allocated (a host-side shape, no device read)."""
        return self._free_slots.shape[0]

    def alloc(self, n: int) -> torch.Tensor:
        """Reserve ``n`` slots; returns their indices (int64, on the pool's device, never SCRATCH_SLOT)."""
        if n > self.available:
            raise RuntimeError(f"KVPool: asked for {n} slots, only {self.available} free")
        slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool (the caller guarantees they were allocated and are not SCRATCH_SLOT)."""
        self._free_slots = torch.cat((self._free_slots, slots.to(self._free_slots.device, torch.int64)))


@dataclass
class CachePools:
    """The two pools a model's KV cache is made of, plus host-side slot assignment helpers."""

    req_to_token: ReqToTokenPool
    kv: KVPool

    @classmethod
    def for_config(
        cls, config: ReferenceConfig, num_requests: int, num_slots: int, device: Device = "cpu"
    ) -> "CachePools":
        """Pools sized for ``config`` (context length, layers, KV heads, head_dim, dtype)."""
        return cls(
            req_to_token=ReqToTokenPool(num_requests, config.max_context_len, device),
            kv=KVPool(num_slots, config.num_layers, config.num_kv_heads, config.head_dim, config.dtype, device),
        )

    def assign(self, reqs: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Allocate ``counts[i]`` slots for positions ``starts[i]..`` of request ``reqs[i]``.

        Writes them into ``req_to_token`` with one indexed store and returns them flattened
        in request order, ready to be a batch's ``out_cache_loc``.
        """
        rows: List[int] = []
        cols: List[int] = []
        for req, start, count in zip(reqs, starts, counts):
            if req == DUMMY_REQUEST:
                raise ValueError(f"reqs: request row {DUMMY_REQUEST} is the reserved dummy request")
            if start + count > self.req_to_token.max_context_len:
                raise ValueError(
                    f"counts: request {req} would reach {start + count} tokens, "
                    f"max_context_len is {self.req_to_token.max_context_len}"
                )
            rows.extend([req] * count)
            cols.extend(range(start, start + count))
        slots = self.kv.alloc(len(rows))
        device = self.req_to_token.device
        table = self.req_to_token.req_to_token
        table[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = slots.to(table.dtype)
        return slots

    def release(self, req: int, seq_len: int) -> None:
        """Free request ``req`` and the KV slots of its first ``seq_len`` positions."""
        self.kv.free(self.req_to_token.req_to_token[req, :seq_len].clone())
        self.req_to_token.free(req)
