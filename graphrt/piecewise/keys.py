"""Piecewise keys: one more kind of key in the runner's registry, recorded in pieces.

A piecewise key is a padded token count only: the step is recorded once on a dummy EXTEND batch
of that many tokens and one request, so a piece may read token-shaped static slots only
(``input_ids``, ``positions``, ``out_cache_loc``, staged every step) and request metadata reaches
the splitting ops live, through ``graphrt.current_batch()``. A step takes a piecewise key when no
full graph serves it and its token count fits a piecewise size (any mode): ``Dispatcher.decide``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from graphrt.backends.state_journal import storage_key
from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.dispatch import TokenStager, static_batch_for
from graphrt.entry import PIECEWISE_REQS, GraphEntry, GraphKey, KeyKind
from graphrt.forward_context import use_batch
from graphrt.piecewise.graph import PieceRecorder
from graphrt.piecewise.ops import SplittingOps
from graphrt.registry import GraphRegistry
from graphrt.sizes import SizeGrid
from graphrt.staging import InputBufferManager, RowAxis
from graphrt.stats import RuntimeStats


def add_piecewise_keys(
    registry: GraphRegistry,
    model: Callable[..., Any],
    splitting: SplittingOps,
    sizes: Sequence[int],
    buffers: InputBufferManager,
    context: Mapping[str, Any],
    stats: RuntimeStats,
) -> None:
    """Register a pending piecewise key per size in ``sizes``, sharing the runner's static slots."""
    request_fields = {storage_key(slot.tensor): name for name, slot in buffers.slots.items()
                      if slot.axis is RowAxis.REQUESTS}
    recorder = PieceRecorder(splitting, request_fields)
    stager = TokenStager(buffers)

    def make_entry(key: GraphKey) -> GraphEntry[ForwardBatch]:
        """The dummy batch a key is recorded on: ``num_tokens`` tokens of one request, no prefix,
        every tensor a view of a static slot (request slots hold their pad values)."""
        static = static_batch_for(key, buffers, context, 1)
        num_tokens = key.num_tokens
        dummy = dataclasses.replace(
            static, seq_lens_sum=num_tokens, seq_lens_cpu=buffers.slots["seq_lens_cpu"].view(PIECEWISE_REQS),
            extend_num_tokens=num_tokens, extend_seq_lens_cpu=[num_tokens], extend_prefix_lens_cpu=[0],
        )

        def step() -> Any:
            with use_batch(dummy):
                return model(dummy.input_ids, dummy.positions, dummy)

        return GraphEntry(key, dummy, step, stager=stager, count=stats.record_piecewise, record=recorder)

    grid = SizeGrid.for_extend(sizes, [PIECEWISE_REQS])
    registry.add_grid(ForwardMode.EXTEND, grid, make_entry, KeyKind.PIECEWISE)
