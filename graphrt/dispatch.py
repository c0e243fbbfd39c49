"""The ForwardBatch front: which key serves a batch, and how a batch is staged into a key's inputs.

``Dispatcher.decide`` reads only metadata (dtypes, shapes, Python ints) and never device memory:
a full graph when a key fits the batch, else a piecewise key when splitting ops are set, else
the reason the step runs eagerly. The stagers write a batch into a key's static batch: one fused
copy of the live rows (``StagingPlan``), the padding rules of extend steps, and the attention
backend's replay hook. The replay itself belongs to the key (``GraphEntry.replay``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Set, Tuple

import torch

from graphrt.batch import (
    CONTEXT_FIELDS, DECODE_SPECS, EXTEND_SPECS, TOKEN_FIELDS, ForwardBatch, ForwardMode, field_getter,
)
from graphrt.entry import PIECEWISE_REQS, EagerReason, GraphEntry, GraphKey, KeyKind
from graphrt.guards import GuardFailure, StateWatch
from graphrt.registry import Decision, GraphRegistry
from graphrt.staging import InputBufferManager, InputSlot, StagingPlan

GRAPHS_OFF = Decision(None, EagerReason.GRAPHS_DISABLED)
UNSUPPORTED = Decision(None, EagerReason.UNSUPPORTED_FIELD)
OTHER_CONTEXT = Decision(None, EagerReason.CONTEXT_MISMATCH)
# A full graph that cannot serve the step for one of these reasons leaves it to a piecewise key.
PIECEWISE_FALLBACK = frozenset({
    EagerReason.MODE_NOT_CAPTURED, EagerReason.BATCH_TOO_LARGE, EagerReason.NOT_CAPTURED,
    EagerReason.CAPTURE_FAILED, EagerReason.DISABLED, EagerReason.UNSLICEABLE_OUTPUT,
})
_decode_fields = field_getter(DECODE_SPECS)
_extend_fields = field_getter(EXTEND_SPECS)
_token_fields = field_getter(TOKEN_FIELDS)


class Dispatcher:
    """Which key of ``registry`` serves a ForwardBatch: a full graph, else (``piecewise``) a
    piecewise key of the padded token count, else eager with a reason."""

    def __init__(self, registry: GraphRegistry, context: Mapping[str, Any], graphs_enabled: bool = True,
                 piecewise: bool = False, watch: Optional[StateWatch] = None,
                 on_guard_failure: Callable[[GuardFailure], None] = lambda failure: None, debug: bool = False) -> None:
        self.registry = registry
        self.watch = watch
        self.on_guard_failure = on_guard_failure
        self.debug = debug
        self._attn_backend, self._req_to_token_pool, self._token_to_kv_pool = (
            context.get(name) for name in CONTEXT_FIELDS
        )
        self.graphs_enabled = graphs_enabled
        self.piecewise = piecewise

    def decide(self, batch: ForwardBatch, steps: int = 1) -> Decision:
        """Graph key for this (already validated) batch, or the reason it must run eagerly;
        ``steps`` > 1: the multi-step key of that many decode steps (no piecewise fallback)."""
        if not self.graphs_enabled:
            return GRAPHS_OFF
        if (
            batch.positions is None or batch.return_logprob or batch.top_logprobs_nums is not None
            or batch.pixel_values is not None or batch.image_grid_thw is not None
            or batch.mrope_position_deltas is not None
        ):
            return UNSUPPORTED
        if (
            (batch.attn_backend is not None and batch.attn_backend is not self._attn_backend)
            or (batch.token_to_kv_pool is not None and batch.token_to_kv_pool is not self._token_to_kv_pool)
            or (batch.req_to_token_pool is not None and batch.req_to_token_pool is not self._req_to_token_pool)
        ):
            return OTHER_CONTEXT
        decision = self.lookup(batch.forward_mode, batch.input_ids.shape[0], batch.batch_size, steps)
        guard = decision.entry.guard if decision.reason is None else None
        if guard is not None:
            failure = guard.failure(self.watch.token(), decision.entry.stager.sources, batch, self.debug)
            if failure is not None:
                self.on_guard_failure(failure)
                return Decision(decision.entry, EagerReason(failure.reason))
        return decision


    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int, steps: int = 1) -> Decision:
        """The key of a step of this size (lockstep: the agreed size): a full graph, else for a single
        step the piecewise key of its token count; or the reason it runs eagerly. No guard is checked."""
        decision = self.registry.lookup(mode, num_tokens, num_reqs, KeyKind.FULL, steps)
        if self.piecewise and decision.reason in PIECEWISE_FALLBACK and steps == 1:
            decision = self.registry.lookup(ForwardMode.EXTEND, num_tokens, PIECEWISE_REQS, KeyKind.PIECEWISE)
        return decision


class DecodeStager:
    """Stages a DECODE-style batch: one fused copy of the token and request fields, then the
    attention backend's replay hook on the padded static batch."""

    def __init__(self, buffers: InputBufferManager, context: Mapping[str, Any]) -> None:
        slots = buffers.slots
        self.buffers = buffers
        self._seq_lens_pad = int(slots["seq_lens"].pad_value)
        self._plan = StagingPlan([slots[spec.name] for spec in self.specs])
        self._seq_lens_cpu: Optional[InputSlot] = slots.get("seq_lens_cpu")
        self._replay_hook = getattr(context.get("attn_backend"), "init_forward_metadata_replay", None)

    specs = DECODE_SPECS
    fields = staticmethod(_decode_fields)

    def stage(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        self._plan.stage(_decode_fields(batch), num_tokens, num_reqs)
        self._finish(entry.key, entry.static_inputs, batch, num_reqs)

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        return self._plan.written(storages)

    def sources(self, batch: ForwardBatch) -> tuple:
        return self.fields(batch)

    def write_back(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        key = entry.key
        self._plan.write_back(self.fields(batch), entry.written_inputs, num_tokens, num_reqs, key.num_tokens,
                              key.num_reqs)

    def _finish(self, key: GraphKey, static: ForwardBatch, batch: ForwardBatch, num_reqs: int) -> None:
        """The padded ``seq_lens_sum``, then the attention backend refreshes its metadata from the
        static batch (host values included)."""
        static.seq_lens_sum = batch.seq_lens_sum + (key.num_reqs - num_reqs) * self._seq_lens_pad
        if self._replay_hook is not None:
            static.seq_lens_cpu = None
            if batch.seq_lens_cpu is not None and self._seq_lens_cpu is not None:
                self._seq_lens_cpu.set_data(batch.seq_lens_cpu)
                static.seq_lens_cpu = self._seq_lens_cpu.view(key.num_reqs)
            self._replay_hook(static)

    def reset(self) -> None:
        self.buffers.reset()


class ExtendStager(DecodeStager):
    """Stages an EXTEND/MIXED batch: padding requests start where the real tokens end (start
    offsets never decrease) and the host mirrors are rebuilt, never left from a previous step."""

    specs = EXTEND_SPECS
    fields = staticmethod(_extend_fields)

    def __init__(self, buffers: InputBufferManager, context: Mapping[str, Any]) -> None:
        super().__init__(buffers, context)
        self._extend_start_loc = buffers.slots["extend_start_loc"].tensor

    def stage(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        self._plan.stage(_extend_fields(batch), num_tokens, num_reqs)
        key, static = entry.key, entry.static_inputs
        self._extend_start_loc[num_reqs : key.num_reqs].fill_(num_tokens)
        padding = [0] * (key.num_reqs - num_reqs)
        for name in ("extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
            mirror = getattr(batch, name)
            setattr(static, name, None if mirror is None else list(mirror) + padding)
        self._finish(key, static, batch, num_reqs)


class TokenStager:
    """Stages a piecewise step: its token fields only (request metadata reaches the splitting ops
    live, through ``graphrt.current_batch()``)."""

    def __init__(self, buffers: InputBufferManager) -> None:
        self.buffers = buffers
        self._plan = StagingPlan([buffers.slots[spec.name] for spec in TOKEN_FIELDS])

    def stage(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        self._plan.stage(_token_fields(batch), num_tokens, num_tokens)

    def reset(self) -> None:
        self.buffers.reset()

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        return self._plan.written(storages)

    sources = staticmethod(_token_fields)

    def write_back(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        padded = entry.key.num_tokens
        self._plan.write_back(_token_fields(batch), entry.written_inputs, num_tokens, num_tokens, padded, padded)


def with_context(batch: ForwardBatch, context: Mapping[str, Any]) -> ForwardBatch:
    """``batch`` with the runner's context objects (attention backend, pools) where it has none."""
    missing = {name: value for name, value in context.items() if getattr(batch, name) is None}
    return dataclasses.replace(batch, **missing) if missing else batch


def static_batch_for(
    key: GraphKey, buffers: InputBufferManager, context: Mapping[str, Any], pad_seq_len: int
) -> ForwardBatch:
    """The padded ForwardBatch a key's graph reads: every tensor a view of a static slot."""
    views = buffers.get_static_tensors(num_tokens=key.num_tokens, num_reqs=key.num_reqs)
    extend = key.mode.is_extend()
    return ForwardBatch(
        forward_mode=key.mode,
        batch_size=key.num_reqs,
        input_ids=views["input_ids"],
        req_pool_indices=views["req_pool_indices"],
        seq_lens=views["seq_lens"],
        out_cache_loc=views["out_cache_loc"],
        seq_lens_sum=key.num_reqs * pad_seq_len,
        positions=views["positions"],
        extend_num_tokens=key.num_tokens if extend else None,
        extend_seq_lens=views.get("extend_seq_lens") if extend else None,
        extend_prefix_lens=views.get("extend_prefix_lens") if extend else None,
        extend_start_loc=views.get("extend_start_loc") if extend else None,
        **{name: context.get(name) for name in CONTEXT_FIELDS},
    )
