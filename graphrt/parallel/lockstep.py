"""Lockstep across ranks: every rank of a process group runs each step at the same padded size.

Collectives inside the model (tensor- or expert-parallel all-reduce, all-gather) need equal
shapes on every rank, and a rank must never replay a graph while another runs eagerly. Before
each step the ranks therefore agree, with one all-reduce MAX of a small preallocated int64
tensor, on the padded size (the maximum over ranks of real tokens and requests), the forward
mode, whether some rank must run eagerly, and which graph keys are not ready on some rank.
Ranks with no work take part with an all-padding step of the agreed size.

Tensor layout: ``[tokens, requests, must_eager, mode, -mode, not_ready(key) for each key]``.
An idle rank sends mode 0 and ``-mode`` = ``NO_MODE``, so after the MAX ``mode`` is the largest
and ``-(-mode)`` the smallest mode among working ranks: they differ only if working ranks disagree.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from graphrt.batch import REQUEST_FIELDS, TOKEN_FIELDS, ForwardBatch, ForwardMode
from graphrt.registry import Decision, EagerReason, GraphEntry, GraphKey, GraphStatus

logger = logging.getLogger(__name__)

HEADER = 5  # tokens, requests, must_eager, mode, -mode
NO_MODE = -(1 << 30)
TOKEN_PADDED = tuple(spec.name for spec in TOKEN_FIELDS)
REQUEST_PADDED = tuple(spec.name for spec in REQUEST_FIELDS)
# Local reasons that hold whatever the agreed size: one such rank makes every rank run eagerly.
SIZE_INDEPENDENT = frozenset({
    EagerReason.GRAPHS_DISABLED, EagerReason.UNSUPPORTED_FIELD,
    EagerReason.CONTEXT_MISMATCH, EagerReason.MODE_NOT_CAPTURED,
})


def pad_forward_batch(
    batch: ForwardBatch, num_tokens: int, num_reqs: int, pad_values: Mapping[str, int]
) -> ForwardBatch:
    """``batch`` padded eagerly to ``num_tokens``/``num_reqs`` rows the way graph staging pads.

    ``pad_values`` gives the fill of each of ``TOKEN_PADDED`` and ``REQUEST_PADDED``; ``seq_lens_sum`` and ``seq_lens_cpu``
    include the padding requests; extend padding requests have no tokens and start where the real
    tokens end, so start offsets never decrease. Other fields are kept as they are.
    """
    real_tokens, real_reqs = batch.num_tokens, batch.batch_size
    if type(num_tokens) is not int or num_tokens < real_tokens:
        raise ValueError(f"num_tokens: expected an int >= the batch's {real_tokens} tokens, got {num_tokens!r}")
    if type(num_reqs) is not int or num_reqs < real_reqs:
        raise ValueError(f"num_reqs: expected an int >= the batch's {real_reqs} requests, got {num_reqs!r}")
    missing = [name for name in TOKEN_PADDED + REQUEST_PADDED if name not in pad_values]
    if missing:
        raise ValueError(f"pad_values: missing {missing}")

    def pad(tensor: Optional[torch.Tensor], rows: int, value: int) -> Optional[torch.Tensor]:
        if tensor is None or tensor.shape[0] == rows:
            return tensor
        filler = torch.full((rows - tensor.shape[0],), value, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, filler])

    extra_reqs = num_reqs - real_reqs
    fields = {name: pad(getattr(batch, name), num_tokens, pad_values[name]) for name in TOKEN_PADDED}
    fields.update({name: pad(getattr(batch, name), num_reqs, pad_values[name]) for name in REQUEST_PADDED})
    fields["seq_lens_cpu"] = pad(batch.seq_lens_cpu, num_reqs, pad_values["seq_lens"])
    fields["seq_lens_sum"] = batch.seq_lens_sum + extra_reqs * pad_values["seq_lens"]
    if batch.forward_mode.is_extend():
        fields.update(
            extend_num_tokens=num_tokens,
            extend_seq_lens=pad(batch.extend_seq_lens, num_reqs, 0),
            extend_prefix_lens=pad(batch.extend_prefix_lens, num_reqs, 0),
            extend_start_loc=pad(batch.extend_start_loc, num_reqs, real_tokens),
            extend_seq_lens_cpu=None if batch.extend_seq_lens_cpu is None
            else list(batch.extend_seq_lens_cpu) + [0] * extra_reqs,
            extend_prefix_lens_cpu=None if batch.extend_prefix_lens_cpu is None
            else list(batch.extend_prefix_lens_cpu) + [0] * extra_reqs,
        )
    return dataclasses.replace(batch, batch_size=num_reqs, **fields)


def empty_batch(mode: ForwardMode, device: torch.device) -> ForwardBatch:
    """A batch of ``mode`` with no rows: what an idle rank pads to the agreed size."""

    def empty(dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    extend = mode.is_extend()
    return ForwardBatch(
        forward_mode=mode, batch_size=0, input_ids=empty(), req_pool_indices=empty(),
        seq_lens=empty(torch.int32), out_cache_loc=empty(), seq_lens_sum=0, positions=empty(),
        extend_num_tokens=0 if extend else None,
        extend_seq_lens=empty(torch.int32) if extend else None,
        extend_prefix_lens=empty(torch.int32) if extend else None,
        extend_start_loc=empty(torch.int32) if extend else None,
    )


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on for one step (identical on all ranks)."""

    mode: Optional[ForwardMode]  # None: every rank is idle, nothing runs
    num_tokens: int
    num_reqs: int
    any_eager: bool  # some rank must run eagerly whatever the size
    unready: FrozenSet[GraphKey]  # keys not replayable on some rank

    def decide(
        self, lookup: Callable[[ForwardMode, int, int], Decision], local_reason: Optional[EagerReason]
    ) -> Decision:
        """Graph or eager at the agreed size: the same answer on every rank (reasons may differ)."""
        if self.any_eager:
            return Decision(None, local_reason or EagerReason.PEER_EAGER)
        decision = lookup(self.mode, self.num_tokens, self.num_reqs)
        if decision.reason is None and decision.entry.key in self.unready:
            return Decision(decision.entry, EagerReason.PEER_EAGER)
        return decision


class Lockstep:
    """The collectives of one runner's process group: configuration at build/retune, one all-reduce per step."""

    def __init__(self, group: Any, device: torch.device) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialized (call init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # NCCL reduces device tensors (one host sync per step to read the result); gloo reduces host tensors.
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.bind_keys(())

    def agree_sizes(self, sizes: Sequence[int], config: Any) -> List[int]:
        """Rank 0's capture sizes, adopted by every rank; ValueError on all ranks if ``config`` differs.

        ``config`` is everything else that shapes the graph keys (max batch size, modes, extend
        sizes). One ``all_gather_object``, at build and retune time only.
        """
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (list(sizes), config), group=self.group)
        configs = [item[1] for item in gathered]
        if any(item != configs[0] for item in configs):
            raise ValueError(f"process_group: ranks disagree on max_batch_size/modes/extend_capture_sizes: {configs}")
        chosen = list(gathered[0][0])
        if chosen != list(sizes):
            logger.warning("rank %d: capture sizes %s replaced by rank 0's %s", self.rank, list(sizes), chosen)
        return chosen

    def bind_keys(self, keys: Sequence[GraphKey]) -> None:
        """Preallocate the per-step tensor for these graph keys (same keys, same order, on every rank)."""
        self._keys: Tuple[GraphKey, ...] = tuple(sorted(keys))
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(HEADER + len(self._keys), dtype=torch.int64, pin_memory=pinned)
        self._values = self._host.numpy()
        self._reduced = self._host if self.device.type == "cpu" else torch.zeros_like(self._host, device=self.device)

    def agree_step(
        self, batch: Optional[ForwardBatch], must_eager: bool, entries: Mapping[GraphKey, GraphEntry]
    ) -> StepAgreement:
        """The one collective of a step: all-reduce MAX of sizes, mode, eager flag and key readiness."""
        values = self._values
        if batch is None:
            values[:HEADER] = (0, 0, 0, 0, NO_MODE)
        else:
            mode = int(batch.forward_mode)
            values[:HEADER] = (batch.num_tokens, batch.batch_size, int(must_eager), mode, -mode)
        values[HEADER:] = [entries[key].status is not GraphStatus.READY for key in self._keys]
        if self._reduced is self._host:
            dist.all_reduce(self._host, op=dist.ReduceOp.MAX, group=self.group)
        else:
            self._reduced.copy_(self._host, non_blocking=True)
            dist.all_reduce(self._reduced, op=dist.ReduceOp.MAX, group=self.group)
            self._host.copy_(self._reduced)
        num_tokens, num_reqs, any_eager, high, low = (int(value) for value in values[:HEADER])
        if high == 0:
            return StepAgreement(None, 0, 0, False, frozenset())
        if high != -low:
            raise ValueError(
                f"forward_mode: ranks disagree ({ForwardMode(-low).name} and {ForwardMode(high).name}); "
                "in lockstep every rank with work must run the same mode"
            )
        unready = frozenset(self._keys[i] for i in np.flatnonzero(values[HEADER:]))
        return StepAgreement(ForwardMode(high), num_tokens, num_reqs, bool(any_eager), unready)
