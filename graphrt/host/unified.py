"""Unified mixed batches: prefill chunks and decode steps in one ForwardBatch.

Each ``UnifiedBatchItem`` is one sequence's work for this step: a prefill chunk
(possibly continuing at ``pos_offset > 0``) or a one-token decode. All ``q_tokens``
are concatenated into one token stream; only attention sees the per-item segments.
The batch is built through ``BatchBuilder``, so its mode follows the same rule:
IDLE when there are no items, DECODE when every item has exactly one token
(a one-token prompt computes exactly like a decode), MIXED when some one-token
item continues a cached sequence (``pos_offset > 0``) beside longer chunks, and
EXTEND otherwise (every item is a prefill chunk).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from graphrt.batch import ForwardBatch
from graphrt.host.input_batch import BatchBuilder, InputBuffers, KvSlots

logger = logging.getLogger(__name__)


class KvCacheHandle(Protocol):
    """A sequence's KV cache: its ReqToTokenPool row and the KV slots of absolute positions."""

    req_pool_index: int

    def slots_for(self, start: int, end: int) -> Sequence[int]:
        """KV-pool slots that positions ``start .. end - 1`` are written to (already allocated)."""
        ...


@dataclass
class UnifiedBatchItem:
    """One sequence's contribution to a unified forward: a prefill chunk or a decode step."""

    seq_id: str
    q_tokens: List[int]
    kv_cache: KvCacheHandle
    pos_offset: int
    is_final_chunk: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the bad field (empty chunk, negative offset)."""
        if not self.q_tokens:
            raise ValueError(f"q_tokens: item {self.seq_id!r} needs at least one token, got none")
        if type(self.pos_offset) is not int or self.pos_offset < 0:
            raise ValueError(f"pos_offset: item {self.seq_id!r} needs a non-negative int, got {self.pos_offset!r}")

    @property
    def end_pos(self) -> int:
        """One past the last absolute position of this chunk (= the sequence length after it)."""
        return self.pos_offset + len(self.q_tokens)


def build_forward_batch(
    items: Sequence[UnifiedBatchItem],
    device: Any = "cpu",
    buffers: Optional[InputBuffers] = None,
    **extra: Any,
) -> Tuple[ForwardBatch, torch.Tensor]:
    """One ForwardBatch for all items, and the token indices whose logits are sampled.

    Positions run ``pos_offset .. pos_offset + len - 1``, ``seq_lens`` is ``pos_offset +
    len(q_tokens)``, ``extend_prefix_lens`` is ``pos_offset`` and ``out_cache_loc`` comes from
    ``kv_cache.slots_for``. Logits indices cover only items with ``is_final_chunk`` (their last
    token), in item order. Pass ``buffers`` to reuse preallocated arenas (the result then lives
    until the next build on them, on their device); otherwise arenas sized to this batch are
    allocated on ``device``.
    ``extra`` sets further ForwardBatch fields.
    """
    seen = set()
    for item in items:
        item.validate()
        if item.seq_id in seen:
            raise ValueError(f"seq_id: duplicate item {item.seq_id!r} in one batch")
        seen.add(item.seq_id)
    total_tokens = sum(len(item.q_tokens) for item in items)
    if buffers is None:
        buffers = InputBuffers.allocate(max(1, len(items)), max(1, total_tokens), device=device)
    builder = BatchBuilder(buffers)
    for item in items:
        slots = item.kv_cache.slots_for(item.pos_offset, item.end_pos)
        kv = KvSlots(item.kv_cache.req_pool_index, out_cache_loc=slots)
        builder.add_request(item.seq_id, item.q_tokens, np.arange(item.pos_offset, item.end_pos), kv=kv)
    batch = builder.build()
    final = [i for i, item in enumerate(items) if item.is_final_chunk]
    if len(final) == len(items):
        logits_indices = batch.get_logits_indices()
    else:
        last_tokens = batch.query_start_loc_cpu[1:][final] - 1
        logits_indices = torch.from_numpy(last_tokens).to(buffers.device, non_blocking=True)
    logger.debug("unified batch: %d items, %d tokens, mode %s, %d logits rows",
                 len(items), total_tokens, batch.forward_mode.name, len(final))
    return batch.to_forward_batch(**extra), logits_indices
