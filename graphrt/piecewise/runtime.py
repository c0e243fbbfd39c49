"""PiecewiseGraphs: the piecewise keys of a runner, their capture, the dispatch to them and the replay.

A piecewise key is a padded token count only: the step is recorded once on a dummy EXTEND batch
of that many tokens and one request, so a piece may read token-shaped static slots only
(``input_ids``, ``positions``, ``out_cache_loc``, staged every step) and request metadata reaches
the splitting ops live, through ``graphrt.current_batch()``. A step takes a piecewise key when no
full graph serves it and its token count fits a piecewise size (any mode).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from graphrt.backends.base import GraphBackend
from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.backends.state_journal import storage_key
from graphrt.dispatch import OutputCutter, static_batch_for
from graphrt.forward_context import use_batch
from graphrt.piecewise.capture import PiecewiseBackend
from graphrt.piecewise.ops import SplittingOps
from graphrt.registry import CaptureReport, Decision, EagerReason, GraphEntry, GraphKey, GraphRegistry
from graphrt.sizes import SizeGrid
from graphrt.staging import InputBufferManager, RowAxis, StagingPlan
from graphrt.stats import RuntimeStats

DUMMY_REQUESTS = 1  # every piecewise key is recorded with one request holding all its tokens
TOKEN_STAGED = ("input_ids", "positions", "out_cache_loc")
# A full graph that cannot serve the step for one of these reasons leaves it to a piecewise key.
FALLBACK_REASONS = frozenset({
    EagerReason.MODE_NOT_CAPTURED, EagerReason.BATCH_TOO_LARGE, EagerReason.NOT_CAPTURED,
    EagerReason.CAPTURE_FAILED, EagerReason.DISABLED, EagerReason.UNSLICEABLE_OUTPUT,
})


class PiecewiseKey(GraphKey):
    """A piecewise key: (EXTEND, padded tokens, 1 dummy request); shown as ``piecewise/tokens=N``."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"piecewise/tokens={self.num_tokens}"


class PiecewiseGraphs:
    """The piecewise keys of one runner: capture, decide, replay; they share the runner's static slots."""

    def __init__(
        self,
        model: Callable[..., Any],
        backend: GraphBackend,
        splitting: SplittingOps,
        sizes: Sequence[int],
        buffers: InputBufferManager,
        context: Mapping[str, Any],
        stats: RuntimeStats,
        warmup_iters: int = 2,
        verify: bool = True,
        copy_outputs: bool = False,
        debug: bool = False,
    ) -> None:
        self.model = model
        self.stats = stats
        self._buffers = buffers
        self._context = context
        request_fields = {storage_key(slot.tensor): name for name, slot in buffers.slots.items()
                          if slot.axis is RowAxis.REQUESTS}
        self.registry = GraphRegistry(PiecewiseBackend(backend, splitting, request_fields), warmup_iters, verify)
        self.registry.add_grid(ForwardMode.EXTEND, SizeGrid.for_extend(sizes, [DUMMY_REQUESTS]), self._make_entry)
        self.registry.entries = {entry.key: entry for entry in self.registry.entries.values()}  # PiecewiseKey names
        self.outputs = OutputCutter(self.registry, copy_outputs, debug)
        self._plan = StagingPlan([buffers.slots[name] for name in TOKEN_STAGED])

    def _make_entry(self, key: GraphKey) -> GraphEntry[ForwardBatch]:
        """The dummy batch a key is recorded on: ``num_tokens`` tokens of one request, no prefix,
        every tensor a view of a static slot (request slots hold their pad values)."""
        static = static_batch_for(key, self._buffers, self._context, 1)
        num_tokens = key.num_tokens
        dummy = dataclasses.replace(
            static, forward_mode=ForwardMode.EXTEND, seq_lens_sum=num_tokens,
            seq_lens_cpu=self._buffers.slots["seq_lens_cpu"].view(DUMMY_REQUESTS),
            extend_num_tokens=num_tokens, extend_seq_lens_cpu=[num_tokens], extend_prefix_lens_cpu=[0],
        )

        def step() -> Any:
            with use_batch(dummy):
                return self.model(dummy.input_ids, dummy.positions, dummy)

        return GraphEntry(PiecewiseKey(*key), dummy, step)

    def capture(self, progress: bool = True) -> CaptureReport:
        """Capture every pending piecewise key, largest first (a failed key leaves its steps eager)."""
        report = self.registry.capture_all(progress=progress)
        for key_report in report.keys:
            entry = self.registry.entries[key_report.key]
            key_report.pieces = entry.graph.piece_count if entry.graph is not None else None
        return report

    def decide(self, batch: ForwardBatch, full: Decision) -> Decision:
        """A piecewise key for a step no full graph serves, else why the step runs eagerly."""
        if full.reason not in FALLBACK_REASONS:
            return full
        return self.outputs.lookup(ForwardMode.EXTEND, batch.num_tokens, DUMMY_REQUESTS)

    def replay(self, entry: GraphEntry[ForwardBatch], batch: ForwardBatch) -> Any:
        """Stage the token fields, replay piece by piece with ``batch`` current, cut the real rows."""
        num_tokens = batch.num_tokens
        self._plan.stage([batch.input_ids, batch.positions, batch.out_cache_loc], num_tokens, num_tokens)
        with use_batch(batch):
            entry.graph.replay()
        outputs = self.outputs.cut(entry, num_tokens, DUMMY_REQUESTS)
        entry.hits += 1
        self.stats.record_piecewise(num_tokens, entry.key.num_tokens)
        return outputs

    def summary(self) -> dict:
        """Per-key counters for ``stats()``, as ``GraphRegistry.summary`` gives them."""
        return self.registry.summary()
