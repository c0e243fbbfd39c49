"""Which keys each query row of a step reads, planned once per step for every layer (graphrt.hf.paged_attention).

A query row is a request (a decode step: one token each) or a token (a prefill or mixed step: the
tokens of every request, packed). Each row has its request's table row and its position, and its new
KV slot goes into the request table (``req_to_token[row, position]``) when the plan is made, before any
layer reads the table: a decode graph records that write with the step. A layer
reads, per row, the KV slots of the keys it may see and which of them it sees: every position up to
its own through the request table (full attention, ``width`` columns: the decode runner's width, or
the step's longest request), the last ``window`` positions through the request table (a paged
window) or through its request row's ring of ``ring`` slots (a sliding layer's ring). All of it is a
handful of device ops over every row at once, made on the first layer that needs it and kept for
the others: the same ops whether the step carries one request or many, and no read of a device
value (the host values a prefill plan needs, its token count and longest request, are the batch's
host mirrors).

A step's plan lives until the next step: ``new_step()`` forgets it (the engine's model call begins
with it, so a capture's warm-ups and recording, an eager step and a verification each plan for
themselves); a piecewise replay, which never enters the model's Python, plans on its first
splitting op, for the live batch it carries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from graphrt.batch import ForwardBatch


@dataclass(frozen=True)
class KeyReads:
    """What each query row reads in a layer's KV buffers: ``slots`` [rows, keys] and which it sees
    (``visible`` [rows, keys] bool)."""

    slots: torch.Tensor
    visible: torch.Tensor


class StepPlan:
    """One step's query rows (their request table rows and positions, int64) and the key reads of each
    kind of layer, made on first use."""

    def __init__(self, batch: ForwardBatch, width: Optional[int]) -> None:
        table = batch.req_to_token_pool.req_to_token
        self.table = table
        self.context = table.shape[1]
        requests = batch.req_pool_indices.to(torch.int64)
        if batch.forward_mode.is_extend():
            tokens = batch.input_ids.shape[0]
            lengths = [prefix + count for prefix, count in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)]
            starts = batch.extend_start_loc  # each request's first token: the last start at or before a token is its own
            token_request = torch.searchsorted(starts, torch.arange(tokens, dtype=starts.dtype, device=starts.device),
                                               right=True) - 1
            self.rows = requests.index_select(0, token_request)
            self.positions = batch.positions[:tokens].to(torch.int64)
            self.width = min(max(lengths, default=1), self.context)
        else:
            self.rows = requests
            self.positions = batch.seq_lens.to(torch.int64) - 1
            lengths = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens  # eager steps only
            self.width = width if width is not None else max(1, int(lengths.max()))
        rows = self.rows.shape[0]  # the step's new tokens take their slots in the table before any layer reads it
        table.index_put_((self.rows, batch.positions[:rows].to(torch.int64)), batch.out_cache_loc[:rows].to(table.dtype))
        self._reads: Dict[Tuple[int, int], KeyReads] = {}

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def reads(self, window: int, ring: int) -> KeyReads:
        """The key reads of a layer with ``window`` (0: none) stored in a ring of ``ring`` slots per request
        row (0: in pool slots through the request table)."""
        reads = self._reads.get((window, ring))
        if reads is None:
            reads = self._reads[(window, ring)] = self._key_reads(window, ring)
        return reads

    def _key_reads(self, window: int, ring: int) -> KeyReads:
        device = self.rows.device
        if not window:  # every position up to the row's own, through the request table
            columns = torch.arange(self.width, device=device)
            slots = self.table[:, :self.width].index_select(0, self.rows)
            return KeyReads(slots, columns[None, :] <= self.positions[:, None])
        count = min(window, self.width)  # the last ``count`` positions, oldest first
        positions = self.positions[:, None] - (count - 1) + torch.arange(count, device=device)[None, :]
        if ring:
            slots = self.rows[:, None] * ring + positions.clamp(min=0) % ring
        else:  # a capture's padding rows may sit past the table: its last column there
            slots = self.table.view(-1)[self.rows[:, None] * self.context + positions.clamp(0, self.context - 1)]
        return KeyReads(slots, positions >= 0)


class _Current(threading.local):
    """This thread's step plan and the batch (and width) it was made for."""

    key: Any = None
    plan: Optional[StepPlan] = None


_CURRENT = _Current()


def new_step() -> None:
    """Forget the plan of the last step (a model call begins with it)."""
    _CURRENT.key = None
    _CURRENT.plan = None


def step_plan(batch: ForwardBatch, width: Optional[int] = None) -> StepPlan:
    """The plan of ``batch``'s step (made on first use; ``width``: a decode step's full-attention columns,
    None for as many as its longest request)."""
    key = (batch, width)
    if _CURRENT.plan is None or _CURRENT.key[0] is not batch or _CURRENT.key[1] != width:
        _CURRENT.plan = StepPlan(batch, width)
        _CURRENT.key = key
    return _CURRENT.plan


__all__ = ["KeyReads", "StepPlan", "new_step", "step_plan"]
