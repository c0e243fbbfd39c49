"""GraphRegistry: the captured keys of one front, found in O(1), and how their outputs are cut.

``GraphRegistry.lookup`` answers every step with a ``Decision``: the entry to replay (a key whose
outputs can be cut to the step's rows) or the ``EagerReason`` the step runs eagerly. The replay
itself is the entry's (``graphrt.entry``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from graphrt.backends import CapturedGraph
from graphrt.batch import ForwardMode
from graphrt.debug import GenerationCounter
from graphrt.entry import (
    CopiedOutputs, CutOutputs, EagerReason, GraphEntry, GraphKey, GraphStatus, GuardedOutputs, KeyKind, disable,
)
from graphrt.guards import KeyGuard, memory_of
from graphrt.layout.batch_axes import CannotCut, OutputAxes
from graphrt.layout.tensor_tree import flatten, unflatten
from graphrt.sizes import SizeGrid, build_pad_table

logger = logging.getLogger(__name__)


class Decision(NamedTuple):
    """Replay ``entry``, or run eagerly for ``reason`` (``entry`` then names the key that did not serve)."""

    entry: Optional[GraphEntry]
    reason: Optional[EagerReason]


STATUS_REASONS = {
    GraphStatus.PENDING: EagerReason.NOT_CAPTURED,
    GraphStatus.FAILED: EagerReason.CAPTURE_FAILED,
    GraphStatus.VERIFY_FAILED: EagerReason.VERIFY_FAILED,
    GraphStatus.DISABLED: EagerReason.DISABLED,
}
TOO_LARGE = Decision(None, EagerReason.BATCH_TOO_LARGE)
NO_MODE = Decision(None, EagerReason.MODE_NOT_CAPTURED)


class GraphRegistry:
    """One GraphEntry per key, lookup tables per (mode, kind, steps), and the batch axes of the outputs
    (learned from captured graphs and eager runs) that decide how a padded replay is cut."""

    def __init__(self, copy_outputs: bool = False, debug: bool = False,
                 pool_replays: Optional[GenerationCounter] = None) -> None:
        self.copy_outputs = copy_outputs
        self.debug = debug
        # Replays of the graphs sharing this registry's memory pool (other registries may share it: wrap()'s layouts).
        self.pool_replays = GenerationCounter() if pool_replays is None else pool_replays
        self.entries: Dict[GraphKey, GraphEntry] = {}
        # Per table (mode, kind, steps): the grid and its pad tables; diagonal grids also by row count.
        self.grids: Dict[Tuple[ForwardMode, KeyKind, int], Tuple[SizeGrid, List[Optional[int]], List[Optional[int]]]] = {}
        self._by_rows: Dict[Tuple[ForwardMode, KeyKind, int], List[Optional[GraphEntry]]] = {}
        self.axes = OutputAxes()
        self.uncut_outputs: Dict[str, str] = {}  # key -> why its padded outputs cannot be cut

    # ---- keys ---------------------------------------------------------------------------------

    def add_grid(self, mode: ForwardMode, grid: SizeGrid, make_entry: Callable[[GraphKey], GraphEntry],
                 kind: KeyKind = KeyKind.FULL, steps: int = 1) -> None:
        """Register every key of ``grid`` for ``mode`` (pending capture) and precompute its padded-size
        tables; ``steps`` > 1: the multi-step keys of that many decode steps, a table of their own."""
        self.grids[mode, kind, steps] = (grid, build_pad_table(grid.token_sizes), build_pad_table(grid.req_sizes))
        for num_tokens, num_reqs in grid.pairs():
            key = GraphKey(mode, num_tokens, num_reqs, kind, steps)
            self.entries[key] = make_entry(key)
        if grid.diagonal:
            padded = build_pad_table(grid.token_sizes)
            self._by_rows[mode, kind, steps] = [self.entries[GraphKey(mode, size, size, kind, steps)] for size in padded]

    def add_size(self, mode: ForwardMode, size: int, make_entry: Callable[[GraphKey], GraphEntry],
                 kind: KeyKind = KeyKind.FULL) -> GraphEntry:
        """Register the diagonal key (size, size) beside ``mode``'s grid, keeping its other keys and
        graphs: calls of exactly ``size`` rows use it from now on (a size padding cannot serve)."""
        return self.add_sizes(mode, [size], make_entry, kind)[0]

    def add_sizes(self, mode: ForwardMode, sizes: Sequence[int], make_entry: Callable[[GraphKey], GraphEntry],
                  kind: KeyKind = KeyKind.FULL) -> List[GraphEntry]:
        """``add_size`` for each of ``sizes`` (a key already there is kept); their entries."""
        table = (mode, kind, 1)
        grid = self.grids[table][0]
        for size in sizes:
            key = GraphKey(mode, size, size, kind)
            if key not in self.entries:
                self.entries[key] = make_entry(key)
        merged = sorted({*grid.token_sizes, *sizes})
        pad_table = build_pad_table(merged)
        self.grids[table] = (SizeGrid.for_decode(merged), pad_table, pad_table)
        self._by_rows[table] = [self.entries[GraphKey(mode, padded, padded, kind)] for padded in pad_table]
        return [self.entries[GraphKey(mode, size, size, kind)] for size in sizes]

    def smallest_padded(self, mode: ForwardMode, size: int, kind: KeyKind = KeyKind.FULL) -> int:
        """The fewest rows a diagonal key of ``size`` serves (padding the rest): one more than the
        next smaller size of ``mode``'s grid."""
        smaller = [other for other in self.grids[mode, kind, 1][0].token_sizes if other < size]
        return max(smaller, default=0) + 1

    def remove_mode(self, mode: ForwardMode) -> None:
        """Forget every full-graph key of ``mode`` (multi-step keys too) and their tables; dropped
        graphs free their memory."""
        for key in [key for key in self.entries if key.mode is mode and key.kind is KeyKind.FULL]:
            del self.entries[key]
        for table in [table for table in self.grids if table[:2] == (mode, KeyKind.FULL)]:
            self.grids.pop(table)
            self._by_rows.pop(table, None)

    def clear(self) -> None:
        """Forget every entry and graph (their pool memory returns when the graphs are freed)."""
        self.entries.clear()
        self.grids.clear()
        self._by_rows.clear()

    def uncapture(self, keys: Optional[Iterable[GraphKey]] = None) -> None:
        """Every key (or ``keys``) back to pending capture, its graph, cut outputs and guard dropped
        (their memory returns when the graphs are freed); keys and tables stay."""
        for entry in self.entries.values() if keys is None else [self.entries[key] for key in keys]:
            entry.status, entry.reason, entry.graph, entry.guard = GraphStatus.PENDING, None, None, None
            entry.cuts.clear()

    def pending(self) -> List[GraphEntry]:
        """Keys waiting for capture, largest first (smaller graphs reuse the largest one's pool blocks)."""
        return sorted((entry for entry in self.entries.values() if entry.status is GraphStatus.PENDING),
                      key=lambda entry: (entry.key.num_tokens, entry.key.num_reqs, entry.key.mode, entry.key.steps),
                      reverse=True)

    # ---- per step -------------------------------------------------------------------------------

    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int, kind: KeyKind = KeyKind.FULL,
               steps: int = 1) -> Decision:
        """The entry whose key pads (num_tokens, num_reqs) least, in O(1), if it is ready and its
        outputs can be cut to these rows; else why the step runs eagerly. ``steps`` > 1: among the
        multi-step keys of that many steps."""
        by_rows = self._by_rows.get((mode, kind, steps))
        if by_rows is not None:  # diagonal grid: one list index
            if num_tokens >= len(by_rows):
                return TOO_LARGE
            entry = by_rows[num_tokens]
        else:
            grid_tables = self.grids.get((mode, kind, steps))
            if grid_tables is None:
                return NO_MODE
            _, token_table, req_table = grid_tables
            if num_tokens >= len(token_table) or num_reqs >= len(req_table):
                return TOO_LARGE
            entry = self.entries.get(GraphKey(mode, token_table[num_tokens], req_table[num_reqs], kind, steps))
            if entry is None:
                return TOO_LARGE
        if entry.status is not GraphStatus.READY:
            return Decision(entry, STATUS_REASONS[entry.status])
        if (num_tokens, num_reqs) not in entry.cuts:
            reason = self.prepare_cut(entry, num_tokens, num_reqs)
            if reason is not None:
                return Decision(entry, reason)
        serving = entry.serving
        if serving is None:
            serving = entry.serving = Decision(entry, None)
        return serving

    def prepare_cut(self, entry: GraphEntry, num_tokens: int, num_reqs: int) -> Optional[EagerReason]:
        """Cut ``entry``'s outputs to these real rows once (cached on the entry), or say why not."""
        if (num_tokens, num_reqs) in entry.cuts:
            return None
        key = entry.key
        if str(key) in self.uncut_outputs:
            return EagerReason.UNSLICEABLE_OUTPUT
        plan = self.axes.plan(_axes_group(key), entry.output_structure)
        if isinstance(plan, CannotCut):
            if not plan.final:
                return EagerReason.AXIS_PROBE  # an eager run of this size will show the axes
            self.uncut_outputs[str(key)] = plan.message
            logger.warning("padded steps of %s run eagerly: %s", key, plan.message)
            return EagerReason.UNSLICEABLE_OUTPUT
        if plan.tokens_equal_requests and num_tokens != num_reqs:
            return EagerReason.AXIS_PROBE
        self._set_cut(entry, num_tokens, num_reqs, plan.apply(entry.graph.outputs, num_tokens, num_reqs))
        return None

    def _set_cut(self, entry: GraphEntry, num_tokens: int, num_reqs: int, leaves: List[Any]) -> None:
        structure = entry.output_structure
        if self.copy_outputs:
            cut: CutOutputs = CopiedOutputs(leaves, structure)
        elif self.debug:
            cut = GuardedOutputs(leaves, structure, self.pool_replays, str(entry.key))
        else:
            cut = CutOutputs(leaves, structure)
        entry.cuts[num_tokens, num_reqs] = cut

    # ---- capture outcomes ---------------------------------------------------------------------

    def mark_ready(self, entry: GraphEntry, graph: CapturedGraph, written: Set[Tuple[torch.device, int]] = frozenset(),
                   reads_grad: bool = True, touched: Set[int] = frozenset()) -> None:
        """``entry`` replays ``graph`` from now on; its output shapes join the batch-axis evidence.
        ``written``: the storages the captured step wrote; the staged inputs among them are written
        back to the caller after every replay. ``reads_grad``: whether the step read a tensor that
        requires grad. ``touched``: the memory (addresses) the step read or wrote that existed
        before it, from which the key's guard finds its bindings and aliasing hazards."""
        key = entry.key
        entry.graph, entry.status, entry.pool_bytes, entry.reason = graph, GraphStatus.READY, graph.pool_bytes, None
        entry.reads_grad = reads_grad
        entry.written_inputs = entry.stager.written(written) if entry.stager is not None and written else ()
        if entry.written_inputs:
            logger.info("%s writes %d of its inputs in place: each replay copies them back to the caller",
                        key, len(entry.written_inputs))
        if entry.guard_spec is not None:  # the graph's own memory: its static slots and its outputs
            own: List[Any] = list(graph.outputs)
            flatten(entry.static_inputs, own)
            entry.guard = KeyGuard.capture(entry.guard_spec, entry.observation, touched,
                                           {memory for _, memory in written},
                                           bool(entry.written_inputs),
                                           {memory_of(leaf) for leaf in own if isinstance(leaf, torch.Tensor)})
        entry.observation = None  # what the guard needs of it is kept there
        entry.cuts.clear()
        self.axes.observe(_axes_group(key), key.num_tokens, key.num_reqs, entry.output_structure, graph.outputs)
        self._set_cut(entry, key.num_tokens, key.num_reqs, list(graph.outputs))

    def mark_failed(self, entry: GraphEntry, error: Exception, status: GraphStatus = GraphStatus.FAILED,
                    then: str = "") -> None:
        """``entry``'s capture failed, with the reason kept: a WARNING that its steps run eagerly, or
        an INFO saying ``then``, what happens instead (a graph at the call's own size)."""
        entry.status, entry.reason = status, f"{type(error).__name__}: {error}"
        if then:
            logger.info("capture of %s failed (%s); %s", entry.key, entry.reason, then)
        else:
            logger.warning("capture of %s failed, it will run eagerly: %s", entry.key, entry.reason)

    def disable(self, key: GraphKey, reason: str) -> None:
        """Take ``key`` out of use (its steps run eagerly) and drop its graph."""
        disable(self.entries[key], reason)

    # ---- eager runs ---------------------------------------------------------------------------

    def observe_eager(self, key: GraphKey, num_tokens: int, num_reqs: int, outputs: Any) -> None:
        """Learn output batch axes from an eager run of ``key``'s kind and mode (warm-up, probe)."""
        leaves: List[Any] = []
        structure = flatten(outputs, leaves)
        self.axes.observe(_axes_group(key), num_tokens, num_reqs, structure, leaves)

    def seen_other_size(self, key: GraphKey) -> bool:
        """Whether outputs of ``key``'s kind and mode were seen at a size other than the key's."""
        return self.axes.seen_other_size(_axes_group(key), key.num_tokens, key.num_reqs)

    def cut_eager(self, key: GraphKey, outputs: Any, num_tokens: int, num_reqs: int) -> Any:
        """Outputs of an eager run at ``key``'s padded size without the padding rows (lockstep)."""
        leaves: List[Any] = []
        structure = flatten(outputs, leaves)
        group = _axes_group(key)
        self.axes.observe(group, key.num_tokens, key.num_reqs, structure, leaves)
        if (num_tokens, num_reqs) == (key.num_tokens, key.num_reqs):
            return outputs
        plan = self.axes.plan(group, structure)
        if isinstance(plan, CannotCut):
            raise ValueError(f"outputs of the padded eager step at {key}: cannot cut them to {num_tokens} real "
                             f"rows: {plan.message}; capture at least two sizes per mode")
        return unflatten(structure, iter(plan.apply(leaves, num_tokens, num_reqs)))

    # ---- reporting ----------------------------------------------------------------------------

    def summary(self, prefix: str = "") -> Dict[str, Any]:
        """Per-key counters for ``stats()``: replays per key, captured keys, why keys are out of use,
        why padded outputs of a key cannot be cut, and why a key's compiled code runs eagerly; key
        names start with ``prefix``."""
        return {
            "key_hits": {prefix + str(key): entry.hits for key, entry in self.entries.items() if entry.hits},
            "captured_keys": [prefix + str(key) for key in self.ready_keys()],
            "failed_keys": {prefix + str(key): entry.reason for key, entry in self.entries.items()
                            if entry.reason is not None},
            "uncut_outputs": {prefix + key: why for key, why in self.uncut_outputs.items()},
            # keys whose step's torch.compile'd code runs eagerly at their shapes (graphrt.backends.compile_runs)
            "uncompiled_keys": {prefix + str(key): entry.compiled.detail for key, entry in self.entries.items()
                                if entry.compiled is not None and not entry.compiled.compiled},
        }

    def ready_keys(self) -> List[GraphKey]:
        """Keys whose graph replays."""
        return [key for key, entry in self.entries.items() if entry.status is GraphStatus.READY]


def _axes_group(key: GraphKey) -> Tuple[KeyKind, ForwardMode, int]:
    """Keys whose outputs share batch axes: one kind, mode and step count (a multi-step key returns
    ``[steps, rows]`` tokens, a single step the model's outputs)."""
    return key.kind, key.mode, key.steps


def merged_summary(registries: Mapping[str, GraphRegistry]) -> Dict[str, Any]:
    """Several registries' ``summary()`` as one, each key named with its registry's prefix
    (``wrap()`` holds one registry per call layout: ``layout1:decode/bs=4``)."""
    merged = GraphRegistry().summary()
    for prefix, registry in registries.items():
        for name, value in registry.summary(prefix).items():
            if isinstance(value, list):
                merged[name].extend(value)
            else:
                merged[name].update(value)
    return merged
