"""Decision, ReplayDispatcher: graph-or-eager per step, then staging, replay and output cutting.

The per-step path reads only metadata (dtypes, shapes, Python ints) and never reads
device memory: one table lookup, one fused staging copy, the attention replay hook,
the replay, and a cached cut of the static outputs. Outputs are cut along the batch axes
learned from their shapes (graphrt.layout.batch_axes); a padded step whose outputs cannot be cut
runs eagerly instead.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Collection, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.debug import GenerationCounter, guard_outputs
from graphrt.layout.batch_axes import CannotCut, CutPlan, OutputAxes
from graphrt.layout.tensor_tree import flatten, is_plain_constant, leaf_paths, unflatten
from graphrt.registry import GraphEntry, GraphKey, GraphRegistry, GraphStatus
from graphrt.staging import InputBufferManager, InputSlot, StagingPlan
from graphrt.stats import RuntimeStats

logger = logging.getLogger(__name__)

CONTEXT_FIELDS = ("attn_backend", "req_to_token_pool", "token_to_kv_pool")
DECODE_STAGED = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
EXTEND_STAGED = ("extend_seq_lens", "extend_prefix_lens", "extend_start_loc")


class EagerReason(str, enum.Enum):
    """Why a step ran eagerly instead of replaying a graph (a fixed set, each counted)."""

    GRAPHS_DISABLED = "graphs_disabled"  # backend="eager" or GRAPHRT_DISABLE=1
    WARMUP = "warmup"  # wrap(): a size's first call is its warm-up, run eagerly as the real step
    NOT_CAPTURED = "not_captured"  # capture() has not run (or was interrupted) for this key
    MODE_NOT_CAPTURED = "mode_not_captured"
    BATCH_TOO_LARGE = "batch_too_large"
    SHAPE_MISMATCH = "shape_mismatch"
    CAPTURE_FAILED = "capture_failed"
    DISABLED = "disabled"
    UNSUPPORTED_FIELD = "unsupported_field"
    CONTEXT_MISMATCH = "context_mismatch"  # attn_backend or a pool other than the captured one
    REPLAY_FAILED = "replay_failed"  # the replay raised; the step re-ran eagerly
    PEER_EAGER = "peer_eager"  # lockstep: another rank must run this step eagerly, so every rank does
    AXIS_PROBE = "axis_probe"  # padded, and the outputs' batch axes are not known yet: this run's shapes show them
    UNSLICEABLE_OUTPUT = "unsliceable_output"  # padded, and an output has no batch axis to cut the padding off
    AUTOGRAD = "autograd"  # wrap(): grad mode on and an input requires grad; eager so gradients flow
    AMBIGUOUS_BATCH_AXIS = "ambiguous_batch_axis"  # wrap(): padded, and an argument has the batch size in two dims


STATUS_REASONS = {
    GraphStatus.PENDING: EagerReason.NOT_CAPTURED,
    GraphStatus.FAILED: EagerReason.CAPTURE_FAILED,
    GraphStatus.DISABLED: EagerReason.DISABLED,
}


class Decision(NamedTuple):
    """Replay ``entry`` (its key), or run eagerly for ``reason``."""

    entry: Optional[GraphEntry]
    reason: Optional[EagerReason]

    @property
    def key(self) -> Optional[GraphKey]:
        return self.entry.key if self.entry is not None else None

    @property
    def use_graph(self) -> bool:
        return self.reason is None


class GraphOutputs:
    """One replay's result for a given real size: the (cut) static output leaves and the value built from them."""

    __slots__ = ("leaves", "structure", "value")

    def __init__(self, leaves: List[Any], structure: Any) -> None:
        self.leaves = leaves
        self.structure = structure
        self.value = unflatten(structure, iter(leaves))

    def rebuild(self, leaves: List[Any]) -> Any:
        return unflatten(self.structure, iter(leaves))


def output_leaves_step(
    entry: GraphEntry, step: Callable[[], Any], passthrough: Collection[int] = ()
) -> Callable[[], List[Any]]:
    """``step`` made to return its output leaves, which the backend keeps as the graph's outputs
    (so tensors inside dataclasses are refreshed too); the structure goes on the entry to rebuild
    results. An output leaf that is neither a tensor, a plain constant nor one of the objects
    passed in (``passthrough``: their ids) fails the capture with a message naming it."""

    def run() -> List[Any]:
        leaves: List[Any] = []
        structure = flatten(step(), leaves)
        for path, leaf in zip(leaf_paths(structure, "output"), leaves):
            if not isinstance(leaf, torch.Tensor) and not is_plain_constant(leaf) and id(leaf) not in passthrough:
                kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
                raise TypeError(
                    f"{path} is a {kind}, not a tensor pytree: a graph can return only tensors (in tuples, lists, "
                    "dicts or dataclasses), plain constants, and objects passed in as arguments; return the "
                    f"tensors you need from the {type(leaf).__name__} instead"
                )
        entry.output_structure = structure
        return leaves

    return run


class GraphDispatcher:
    """The adapter-free core: O(1) key lookup, replay of a staged entry, cached output slicing."""

    def __init__(
        self, registry: GraphRegistry, stats: RuntimeStats, copy_outputs: bool = False, debug: bool = False
    ) -> None:
        self.registry = registry
        self.stats = stats
        self.copy_outputs = copy_outputs
        self.debug = debug
        self.axes = OutputAxes()
        self.uncut_outputs: Dict[str, str] = {}  # key -> why its padded outputs cannot be cut
        self._generations: Dict[GraphKey, GenerationCounter] = {}

    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Decision:
        """Table lookup plus the key's status, and for a padded step whether its outputs can be cut."""
        entry, why = self.registry.lookup(mode, num_tokens, num_reqs)
        if entry is None:
            return Decision(None, EagerReason(why))
        if entry.status is not GraphStatus.READY:
            return Decision(entry, STATUS_REASONS[entry.status])
        prepared = entry.result_cache.get((num_tokens, num_reqs))
        if prepared is None:
            prepared = self._prepare(entry, num_tokens, num_reqs)
        if prepared.__class__ is EagerReason:
            return Decision(entry, prepared)
        return Decision(entry, None)

    def _prepare(self, entry: GraphEntry, num_tokens: int, num_reqs: int) -> Union[GraphOutputs, EagerReason]:
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
        prepared = entry.result_cache[(num_tokens, num_reqs)] = GraphOutputs(leaves, entry.output_structure)
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

    def replay(self, entry: GraphEntry, num_tokens: int, num_reqs: int) -> Any:
        """Replay an already-staged entry and return its outputs cut to the real rows."""
        entry.graph.replay()
        prepared = entry.result_cache.get((num_tokens, num_reqs))
        if prepared is None or prepared.__class__ is EagerReason:
            prepared = self._prepare(entry, num_tokens, num_reqs)
            if prepared.__class__ is EagerReason:  # only a caller that skipped lookup() gets here (lockstep)
                raise ValueError(f"graph {entry.key}: its outputs cannot be cut to {num_tokens} real rows "
                                 f"({prepared.value}); capture at least two sizes per mode")
        entry.hits += 1
        self.stats.record_graph(num_tokens, entry.key.num_tokens)
        if self.copy_outputs:
            copies = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in prepared.leaves]
            return prepared.rebuild(copies)
        if self.debug:
            counter = self._generations.get(entry.key)
            if counter is None:
                counter = self._generations[entry.key] = GenerationCounter(str(entry.key))
            return prepared.rebuild(guard_outputs(prepared.leaves, counter))
        return prepared.value

    def disable(self, key: GraphKey, reason: str) -> None:
        """Take a key out of use; its steps run eagerly from now on."""
        self.registry.disable(key, reason)


class ReplayDispatcher(GraphDispatcher):
    """Runs ForwardBatches through the registry's graphs, staging into the buffer manager's slots."""

    def __init__(
        self,
        registry: GraphRegistry,
        buffers: InputBufferManager,
        stats: RuntimeStats,
        context: Dict[str, Any],
        copy_outputs: bool = False,
        graphs_enabled: bool = True,
        debug: bool = False,
    ) -> None:
        super().__init__(registry, stats, copy_outputs, debug)
        self.buffers = buffers
        self.context = context
        self.graphs_enabled = graphs_enabled
        self._replay_hook: Optional[Callable[[ForwardBatch], None]] = getattr(
            context.get("attn_backend"), "init_forward_metadata_replay", None
        )
        self.seq_lens_pad = int(buffers.get_slot("seq_lens").pad_value)
        self._decode_plan = StagingPlan(self._slots(*DECODE_STAGED))
        self._extend_plan: Optional[StagingPlan] = None
        self._seq_lens_cpu: Optional[InputSlot] = None

    def _slots(self, *names: str) -> Tuple[InputSlot, ...]:
        return tuple(self.buffers.get_slot(name) for name in names)

    def enable_extend_slots(self) -> None:
        """Stage the extend fields too (for EXTEND/MIXED keys)."""
        self._extend_plan = StagingPlan(self._slots(*DECODE_STAGED, *EXTEND_STAGED))

    def enable_seq_lens_cpu(self, slot: InputSlot) -> None:
        """Keep a padded host mirror of seq_lens for the replay hook when batches carry one."""
        self._seq_lens_cpu = slot

    # ---- decision -------------------------------------------------------------------------

    def decide(self, batch: ForwardBatch) -> Decision:
        """Graph key for this (already validated) batch, or the reason it must run eagerly."""
        if not self.graphs_enabled:
            return Decision(None, EagerReason.GRAPHS_DISABLED)
        if (
            batch.positions is None or batch.return_logprob or batch.top_logprobs_nums is not None
            or batch.pixel_values is not None or batch.image_grid_thw is not None
            or batch.mrope_position_deltas is not None
        ):
            return Decision(None, EagerReason.UNSUPPORTED_FIELD)
        context = self.context
        if (
            (batch.attn_backend is not None and batch.attn_backend is not context.get("attn_backend"))
            or (batch.token_to_kv_pool is not None and batch.token_to_kv_pool is not context.get("token_to_kv_pool"))
            or (batch.req_to_token_pool is not None
                and batch.req_to_token_pool is not context.get("req_to_token_pool"))
        ):
            return Decision(None, EagerReason.CONTEXT_MISMATCH)
        return self.lookup(batch.forward_mode, batch.input_ids.shape[0], batch.batch_size)

    # ---- graph path -----------------------------------------------------------------------

    def run_graph(self, entry: GraphEntry, batch: ForwardBatch) -> Any:
        """Stage ``batch`` into the static tensors, run the replay hook, replay, slice outputs."""
        num_tokens, num_reqs = batch.input_ids.shape[0], batch.batch_size
        live = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens]
        if batch.forward_mode.is_extend():
            live += [batch.extend_seq_lens, batch.extend_prefix_lens, batch.extend_start_loc]
            self._extend_plan.stage(live, num_tokens, num_reqs)
        else:
            self._decode_plan.stage(live, num_tokens, num_reqs)
        static_batch: ForwardBatch = entry.inputs
        padding = entry.key.num_reqs - num_reqs
        if batch.forward_mode.is_extend():
            self._pad_extend(entry, batch, padding)
        static_batch.seq_lens_sum = batch.seq_lens_sum + padding * self.seq_lens_pad
        if self._replay_hook is not None:  # the padded host mirror exists for the hook alone
            static_batch.seq_lens_cpu = self._stage_seq_lens_cpu(batch, entry.key.num_reqs)
            self._replay_hook(static_batch)
        return self.replay(entry, num_tokens, num_reqs)

    def _pad_extend(self, entry: GraphEntry, batch: ForwardBatch, padding: int) -> None:
        """Padding requests start where the real tokens end, so start offsets never decrease."""
        start_loc = self.buffers.get_slot("extend_start_loc").tensor
        start_loc[batch.batch_size : entry.key.num_reqs].fill_(batch.input_ids.shape[0])
        static_batch: ForwardBatch = entry.inputs
        for name in ("extend_seq_lens_cpu", "extend_prefix_lens_cpu"):  # never leave a previous step's mirror
            mirror = getattr(batch, name)
            setattr(static_batch, name, None if mirror is None else list(mirror) + [0] * padding)

    def _stage_seq_lens_cpu(self, batch: ForwardBatch, padded_reqs: int) -> Optional[torch.Tensor]:
        if batch.seq_lens_cpu is None or self._seq_lens_cpu is None:
            return None
        self._seq_lens_cpu.set_data(batch.seq_lens_cpu)
        return self._seq_lens_cpu.view(padded_reqs)


def static_batch_for(key: GraphKey, buffers: InputBufferManager, context: Dict[str, Any], pad_seq_len: int) -> ForwardBatch:
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


__all__: List[str] = [
    "EagerReason", "Decision", "GraphDispatcher", "GraphOutputs", "ReplayDispatcher", "output_leaves_step",
    "static_batch_for",
]
