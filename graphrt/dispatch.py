"""Graph or eager for each step, and the replay: stage, pad, hook, replay, cut, count.

The per-step path reads only metadata (dtypes, shapes, Python ints) and never reads device
memory: one table lookup, one fused staging copy, the attention replay hook, the replay, and a
cached cut of the static outputs. Outputs are cut along the batch axes learned from their
shapes (graphrt.layout.batch_axes); a padded step whose outputs cannot be cut runs eagerly.
``OutputCutter`` is shared with ``wrap()``; ``Dispatcher`` is the ForwardBatch path.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Mapping, Union

import torch

from graphrt.batch import CONTEXT_FIELDS, DECODE_SPECS, EXTEND_FIELDS, ForwardBatch, ForwardMode
from graphrt.debug import GenerationCounter, guard_outputs
from graphrt.layout.batch_axes import CannotCut, CutPlan, OutputAxes
from graphrt.layout.tensor_tree import flatten, unflatten
from graphrt.registry import Decision, EagerReason, GraphEntry, GraphKey, GraphRegistry, GraphStatus
from graphrt.staging import InputBufferManager, StagingPlan
from graphrt.stats import RuntimeStats

logger = logging.getLogger(__name__)

DECODE_STAGED = tuple(spec.name for spec in DECODE_SPECS)  # the order Dispatcher.replay passes them in
EXTEND_STAGED = tuple(spec.name for spec in EXTEND_FIELDS)
GRAPHS_OFF = Decision(None, EagerReason.GRAPHS_DISABLED)
UNSUPPORTED = Decision(None, EagerReason.UNSUPPORTED_FIELD)
OTHER_CONTEXT = Decision(None, EagerReason.CONTEXT_MISMATCH)


class CutOutputs:
    """One replay's result for one real size: the (cut) static output leaves and the value built from them."""

    __slots__ = ("leaves", "structure", "value")

    def __init__(self, leaves: List[Any], structure: Any) -> None:
        self.leaves = leaves
        self.structure = structure
        self.value = unflatten(structure, iter(leaves))

    def rebuild(self, leaves: List[Any]) -> Any:
        return unflatten(self.structure, iter(leaves))


class OutputCutter:
    """What a replay returns for a real size: static outputs cut along learned batch axes (cached
    per entry and size), copied (``copy_outputs``) or guarded against staleness (``debug``)."""

    def __init__(self, registry: GraphRegistry, copy_outputs: bool = False, debug: bool = False) -> None:
        self.registry = registry
        self.copy_outputs = copy_outputs
        self.debug = debug
        self.axes = OutputAxes()
        self.uncut_outputs: Dict[str, str] = {}  # key -> why its padded outputs cannot be cut
        self._generations: Dict[GraphKey, GenerationCounter] = {}

    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Decision:
        """The registry's decision, unless the replay's outputs cannot be cut to these real rows."""
        decision = self.registry.lookup(mode, num_tokens, num_reqs)
        entry = decision.entry
        if decision.reason is not None or (num_tokens, num_reqs) == (entry.key.num_tokens, entry.key.num_reqs):
            return decision
        prepared = entry.result_cache.get((num_tokens, num_reqs))
        if prepared is None:
            prepared = self._prepare(entry, num_tokens, num_reqs)
        if prepared.__class__ is EagerReason:
            return Decision(entry, prepared)
        return decision

    def cut(self, entry: GraphEntry, num_tokens: int, num_reqs: int) -> Any:
        """The outputs of the replay that just ran, without padding rows (views unless copied)."""
        prepared = entry.result_cache.get((num_tokens, num_reqs))
        if prepared is None or prepared.__class__ is EagerReason:
            prepared = self._prepare(entry, num_tokens, num_reqs)
            if prepared.__class__ is EagerReason:  # only lockstep replays without a lookup at its own size
                raise ValueError(f"graph {entry.key}: its outputs cannot be cut to {num_tokens} real rows "
                                 f"({prepared.value}); capture at least two sizes per mode")
        if self.copy_outputs:
            return prepared.rebuild([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf
                                     for leaf in prepared.leaves])
        if self.debug:
            counter = self._generations.get(entry.key)
            if counter is None:
                counter = self._generations[entry.key] = GenerationCounter(str(entry.key))
            return prepared.rebuild(guard_outputs(prepared.leaves, counter))
        return prepared.value

    def _prepare(self, entry: GraphEntry, num_tokens: int, num_reqs: int) -> Union[CutOutputs, EagerReason]:
        """The outputs a replay of ``entry`` returns for these real counts (cut, cached), or why not."""
        leaves = entry.graph.outputs
        if num_tokens != entry.key.num_tokens or num_reqs != entry.key.num_reqs:
            plan = self._plan(entry.key.mode, entry.output_structure)
            if isinstance(plan, CannotCut) and plan.final:
                entry.result_cache[(num_tokens, num_reqs)] = EagerReason.UNSLICEABLE_OUTPUT
                if str(entry.key) not in self.uncut_outputs:
                    self.uncut_outputs[str(entry.key)] = plan.message
                    logger.warning("padded steps of %s run eagerly: %s", entry.key, plan.message)
                return EagerReason.UNSLICEABLE_OUTPUT
            if isinstance(plan, CannotCut) or (plan.tokens_equal_requests and num_tokens != num_reqs):
                return EagerReason.AXIS_PROBE  # not cached: the probe's observation may settle it
            leaves = plan.apply(leaves, num_tokens, num_reqs)
        prepared = entry.result_cache[(num_tokens, num_reqs)] = CutOutputs(leaves, entry.output_structure)
        return prepared

    def _plan(self, mode: ForwardMode, structure: Any) -> Union[CutPlan, CannotCut]:
        """The cut plan of one output structure, after observing every captured graph's outputs once."""
        for entry in self.registry.entries.values():
            if entry.status is GraphStatus.READY and not entry.outputs_observed:
                key = entry.key
                self.axes.observe(key.mode, key.num_tokens, key.num_reqs, entry.output_structure, entry.graph.outputs)
                entry.outputs_observed = True
        return self.axes.plan(mode, structure)

    def observe_eager(self, mode: ForwardMode, num_tokens: int, num_reqs: int, outputs: Any) -> None:
        """Learn output batch axes from an eager run's outputs (warm-up and probe runs)."""
        leaves: List[Any] = []
        structure = flatten(outputs, leaves)
        self.axes.observe(mode, num_tokens, num_reqs, structure, leaves)

    def cut_eager(self, key: GraphKey, outputs: Any, num_tokens: int, num_reqs: int) -> Any:
        """Outputs of an eager run at ``key``'s padded size without the padding rows (lockstep)."""
        leaves: List[Any] = []
        structure = flatten(outputs, leaves)
        self.axes.observe(key.mode, key.num_tokens, key.num_reqs, structure, leaves)
        if (num_tokens, num_reqs) == (key.num_tokens, key.num_reqs):
            return outputs
        plan = self._plan(key.mode, structure)
        if isinstance(plan, CannotCut):
            raise ValueError(f"outputs of the padded eager step at {key}: cannot cut them to {num_tokens} real "
                             f"rows: {plan.message}; capture at least two sizes per mode")
        return unflatten(structure, iter(plan.apply(leaves, num_tokens, num_reqs)))


class Dispatcher:
    """Runs ForwardBatches through the registry's graphs, staging into the buffer manager's slots.

    Built once every slot exists: the extend fields are staged when ``buffers`` has their slots,
    and a padded host mirror of seq_lens is kept for the replay hook when it has ``seq_lens_cpu``.
    """

    def __init__(
        self,
        buffers: InputBufferManager,
        context: Mapping[str, Any],
        outputs: OutputCutter,
        stats: RuntimeStats,
        graphs_enabled: bool = True,
    ) -> None:
        self._attn_backend, self._req_to_token_pool, self._token_to_kv_pool = (
            context.get(name) for name in CONTEXT_FIELDS
        )
        self.outputs = outputs  # its registry is the one this dispatcher looks keys up in
        self.stats = stats
        self.graphs_enabled = graphs_enabled
        slots = buffers.slots
        self._seq_lens_pad = int(slots["seq_lens"].pad_value)
        self._decode_plan = StagingPlan([slots[name] for name in DECODE_STAGED])
        has_extend = all(name in slots for name in EXTEND_STAGED)
        self._extend_plan = StagingPlan([slots[name] for name in DECODE_STAGED + EXTEND_STAGED]) if has_extend else None
        self._extend_start_loc = slots["extend_start_loc"].tensor if has_extend else None
        self._seq_lens_cpu = slots.get("seq_lens_cpu")
        self._replay_hook = getattr(self._attn_backend, "init_forward_metadata_replay", None)

    def decide(self, batch: ForwardBatch) -> Decision:
        """Graph key for this (already validated) batch, or the reason it must run eagerly."""
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
        return self.outputs.lookup(batch.forward_mode, batch.input_ids.shape[0], batch.batch_size)

    def replay(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch) -> Any:
        """Stage ``batch`` into the static slots, pad, run the replay hook, replay, cut, count."""
        key, static = entry.key, entry.static_inputs
        num_tokens, num_reqs = batch.input_ids.shape[0], batch.batch_size
        padding = key.num_reqs - num_reqs
        # 1. Stage: one fused copy of the live rows; rows a larger earlier step dirtied are re-padded.
        live = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens]
        if key.mode.is_extend():
            live += [batch.extend_seq_lens, batch.extend_prefix_lens, batch.extend_start_loc]
            self._extend_plan.stage(live, num_tokens, num_reqs)
            # 2. Extend padding: padding requests start where the real tokens end (offsets never decrease),
            #    and the host mirrors are rebuilt (never left from a previous step).
            self._extend_start_loc[num_reqs : key.num_reqs].fill_(num_tokens)
            for name in ("extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
                mirror = getattr(batch, name)
                setattr(static, name, None if mirror is None else list(mirror) + [0] * padding)
        else:
            self._decode_plan.stage(live, num_tokens, num_reqs)
        static.seq_lens_sum = batch.seq_lens_sum + padding * self._seq_lens_pad
        # 3. The attention backend refreshes its metadata from the static batch (host values included).
        if self._replay_hook is not None:
            static.seq_lens_cpu = None
            if batch.seq_lens_cpu is not None and self._seq_lens_cpu is not None:
                self._seq_lens_cpu.set_data(batch.seq_lens_cpu)
                static.seq_lens_cpu = self._seq_lens_cpu.view(key.num_reqs)
            self._replay_hook(static)
        # 4. Replay, 5. cut the real rows out of the static outputs, 6. count.
        entry.graph.replay()
        outputs = self.outputs.cut(entry, num_tokens, num_reqs)
        entry.hits += 1
        self.stats.record_graph(num_tokens, key.num_tokens)
        return outputs


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
