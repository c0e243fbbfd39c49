"""Multi-step keys: one more kind of key in the runner's registry, K decode steps in one graph.

A multi-step key ``decode/bs=8,steps=4`` is a full graph of ``steps`` decode steps at one padded
batch size. Its static batch is step 0's (views of the runner's static slots); the slots of steps
1..K-1 stage into slots of their own (``out_cache_loc_step{j}``, one per step index, shared by
every step count, ``max_batch_size`` rows each). The graph runs step 0 on the staged batch, then
for each next step computes positions, sequence lengths and the input ids (``next_tokens`` of the
previous step's output) on the device, lets the attention backend advance its metadata
(``advance_step``, recorded between the steps), and returns the ``[steps, rows]`` tokens chosen.

It is captured, verified (against the same K steps run eagerly from the same generator state)
and replayed as every key is: ``KeyCapture`` and ``GraphEntry.replay`` with ``MultiStepStager``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.dispatch import DecodeStager, static_batch_for
from graphrt.entry import GraphEntry, GraphKey
from graphrt.forward_context import use_batch
from graphrt.multistep.decode import Reason, unavailable_reason
from graphrt.multistep.steps import NextTokens, batch_at_step, chosen_tokens
from graphrt.registry import GraphRegistry
from graphrt.sizes import SizeGrid
from graphrt.staging import BufferSpec, InputBufferManager, RowAxis, StagingPlan
from graphrt.stats import RuntimeStats

logger = logging.getLogger(__name__)
_request_fields = operator.attrgetter("input_ids", "positions", "req_pool_indices", "seq_lens")


def step_slot(step: int) -> str:
    """The static slot holding the ``out_cache_loc`` rows of step ``step`` >= 1 (step 0 stages into ``out_cache_loc``)."""
    return f"out_cache_loc_step{step}"


def register_step_slots(buffers: InputBufferManager, max_steps: int, pad_value: int) -> None:
    """The slots of steps 1..``max_steps``-1, allocated once: ``max_batch_size`` rows each, padded with
    the scratch slot as ``out_cache_loc`` is (``max_batch_size * max_steps`` slots in all, with step 0's)."""
    spec = BufferSpec((buffers.max_batch_size,), torch.int64, buffers.device)
    for step in range(1, max_steps):
        buffers.register_slot(step_slot(step), spec, axis=RowAxis.REQUESTS, pad_value=pad_value)


class MultiStepStager(DecodeStager):
    """Stages a ``decode(batch, steps)`` batch into a multi-step key: its fields and the slots of
    every step in one fused copy per dtype, then the attention backend's replay hook on step 0's
    static batch (the recorded ``advance_step`` refreshes the metadata of the later steps)."""

    def __init__(self, buffers: InputBufferManager, context: Mapping[str, Any], steps: int) -> None:
        super().__init__(buffers, context)
        self.steps = steps
        names = ["input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc",
                 *(step_slot(step) for step in range(1, steps))]
        self._plan = StagingPlan([buffers.slots[name] for name in names])

    def _live(self, batch: ForwardBatch, num_reqs: int) -> tuple:
        """The batch's tensors in the plan's order: its fields, then its slots split by step (views)."""
        return (*_request_fields(batch), *batch.out_cache_loc.view(self.steps, num_reqs).unbind(0))

    def stage(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        self._plan.stage(self._live(batch, num_reqs), num_tokens, num_reqs)
        self._finish(entry.key, entry.static_inputs, batch, num_reqs)

    def write_back(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch, num_tokens: int, num_reqs: int) -> None:
        key = entry.key
        self._plan.write_back(self._live(batch, num_reqs), entry.written_inputs, num_tokens, num_reqs,
                              key.num_tokens, key.num_reqs)


def multi_step(model: Callable[..., Any], static: ForwardBatch, slots: Sequence[torch.Tensor], next_tokens: NextTokens,
               advance_step: Optional[Callable[[ForwardBatch], None]]) -> Callable[[], torch.Tensor]:
    """What a multi-step key's capture records: ``len(slots)`` decode steps from ``static`` (step 0),
    step ``j`` writing its KV at ``slots[j]``; returns the tokens chosen, ``[steps, rows]`` int64.
    ``current_batch()`` is each step's batch as captured (step 0's a frozen copy: staging rewrites
    ``static``'s host values)."""
    frozen = dataclasses.replace(static)
    rows = static.batch_size

    def run() -> torch.Tensor:
        batch, current = static, frozen
        chosen: List[torch.Tensor] = []
        for step, slot in enumerate(slots):
            if step:
                batch = current = batch_at_step(static, step, chosen[-1], slot, host_mirror=False)
                if advance_step is not None:
                    advance_step(batch)
            with use_batch(current):
                output = model(batch.input_ids, batch.positions, batch)
            chosen.append(chosen_tokens(next_tokens(output, step), rows))
        return torch.stack(chosen)

    return run


def add_multistep_keys(registry: GraphRegistry, model: Callable[..., Any], decode_steps: Sequence[int],
                       sizes: Sequence[int], buffers: InputBufferManager, context: Mapping[str, Any],
                       graph_modes: Sequence[ForwardMode], stats: RuntimeStats, next_tokens: NextTokens,
                       pad_seq_len: int) -> Optional[Reason]:
    """Register a pending multi-step key per decode capture size and step count in ``decode_steps``,
    on the runner's static slots (``register_step_slots`` first) and attention backend; or, when no
    multi-step key could serve (``unavailable_reason``), register none and return why."""
    if not decode_steps:
        return None
    unavailable = unavailable_reason(context, graph_modes)
    if unavailable is not None:
        logger.info("decode_steps: no multi-step keys (%s); decode() runs its steps one by one", unavailable.value)
        return unavailable
    advance_step = getattr(context.get("attn_backend"), "advance_step", None)
    for steps in decode_steps:
        stager = MultiStepStager(buffers, context, steps)

        def count(real_tokens: int, padded_tokens: int, steps: int = steps) -> None:
            stats.record_multi_step(real_tokens * steps, padded_tokens * steps)

        def make_entry(key: GraphKey, stager: MultiStepStager = stager,
                       count: Callable[[int, int], None] = count) -> GraphEntry[ForwardBatch]:
            static = static_batch_for(key, buffers, context, pad_seq_len)
            slots = [static.out_cache_loc, *(buffers.slots[step_slot(step)].view(key.num_reqs)
                                             for step in range(1, key.steps))]
            return GraphEntry(key, static, multi_step(model, static, slots, next_tokens, advance_step),
                              stager=stager, count=count)

        registry.add_grid(ForwardMode.DECODE, SizeGrid.for_decode(sizes), make_entry, steps=steps)
    return None
