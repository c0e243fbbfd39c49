"""GraphRegistry, GraphKey, CaptureReport and the typed Decision every lookup returns, used directly."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_batch

from graphrt import CaptureReport, EagerReason, ForwardMode, GraphedCallable, GraphKey, GraphRunner, wrap
from graphrt.backends import BACKEND_NAMES, EmulatedBackend, resolve_backend_name
from graphrt.backends.emulated import OutputArena
from graphrt.dispatch import Dispatcher
from graphrt.entry import GraphEntry, GraphStatus
from graphrt.pools.buffers import BufferPool, SimpleBufferPool
from graphrt.capture import KeyCapture
from graphrt.registry import Decision, GraphRegistry
from graphrt.sizes import SizeGrid

DECODE, EXTEND = ForwardMode.DECODE, ForwardMode.EXTEND


def doubling_entry(key: GraphKey) -> GraphEntry:
    """An entry whose step doubles a static input of the key's token rows, filled with its request count."""
    static = torch.full((key.num_tokens,), float(key.num_reqs))
    return GraphEntry(key, static, lambda: static * 2)


def registry_with(grid: SizeGrid, mode=DECODE) -> GraphRegistry:
    registry = GraphRegistry()
    registry.add_grid(mode, grid, doubling_entry)
    return registry


TOO_LARGE = Decision(None, EagerReason.BATCH_TOO_LARGE)


def test_decode_lookup_pads_to_the_smallest_key_in_one_index():
    registry = registry_with(SizeGrid.for_decode([1, 4, 8]))
    expected = {1: 1, 2: 4, 3: 4, 4: 4, 5: 8, 8: 8}
    for rows, padded in expected.items():
        entry, reason = registry.lookup(DECODE, rows, rows)
        assert isinstance(entry, GraphEntry) and entry.key == GraphKey(DECODE, padded, padded)
        assert reason is EagerReason.NOT_CAPTURED, "a pending key names its entry and why it cannot replay"
    assert registry.lookup(DECODE, 9, 9) == TOO_LARGE
    assert registry.lookup(EXTEND, 2, 2) == Decision(None, EagerReason.MODE_NOT_CAPTURED)


def test_extend_lookup_pads_tokens_and_requests_independently():
    registry = registry_with(SizeGrid.for_extend([8, 16], [2, 4, 16]), mode=EXTEND)
    assert sorted(registry.entries) == [GraphKey(EXTEND, 8, 2), GraphKey(EXTEND, 8, 4), GraphKey(EXTEND, 16, 2),
                                        GraphKey(EXTEND, 16, 4), GraphKey(EXTEND, 16, 16)]
    assert registry.lookup(EXTEND, 5, 3).entry.key == GraphKey(EXTEND, 8, 4)
    assert registry.lookup(EXTEND, 9, 1).entry.key == GraphKey(EXTEND, 16, 2)
    assert registry.lookup(EXTEND, 7, 5) == TOO_LARGE, "(8, 16) has more requests than tokens"
    assert registry.lookup(EXTEND, 17, 1) == TOO_LARGE


def test_capture_all_reports_largest_first_and_disable_drops_the_graph():
    registry = registry_with(SizeGrid.for_decode([1, 2, 4]))
    report = KeyCapture(EmulatedBackend(), warmup_iters=1).capture_all(registry, progress=False)
    assert isinstance(report, CaptureReport) and [key.num_reqs for key in report.ok] == [4, 2, 1]
    assert report.output_bytes == 4 * (4 + 2 + 1) and not report.failed
    # The keys share the pool's output memory: it holds the largest key's 16 bytes (one aligned block).
    assert report.pool_bytes == OutputArena.ALIGN
    assert registry.lookup(DECODE, 3, 3) == Decision(registry.entries[GraphKey(DECODE, 4, 4)], None)
    entry = registry.entries[GraphKey(DECODE, 2, 2)]
    entry.static_inputs.fill_(5.0)
    entry.graph.replay()
    (output,) = entry.graph.outputs  # the step's output leaves
    assert output.tolist() == [10.0, 10.0], "replay reads the static input as it is now"
    registry.disable(entry.key, "test")
    assert entry.status is GraphStatus.DISABLED and entry.graph is None and entry.reason == "test"
    assert registry.lookup(DECODE, 2, 2) == Decision(entry, EagerReason.DISABLED)
    assert sorted(key.num_reqs for key in registry.ready_keys()) == [1, 4]
    registry.clear()
    assert registry.lookup(DECODE, 1, 1) == Decision(None, EagerReason.MODE_NOT_CAPTURED)


def test_runner_decisions_name_the_key_or_the_reason():
    runner = GraphRunner(lambda ids, pos, batch: ids * 2, max_batch_size=8, backend="emulated", progress=False)
    assert isinstance(runner.dispatcher, Dispatcher)
    before = runner.dispatcher.decide(decode_batch(3))
    assert isinstance(before, Decision) and before.reason is EagerReason.NOT_CAPTURED
    runner.capture()
    decision = runner.dispatcher.decide(decode_batch(3))
    assert decision.reason is None and decision.entry.key == GraphKey(DECODE, 4, 4)
    assert runner.dispatcher.decide(decode_batch(9)) == TOO_LARGE


def test_public_types_and_backend_names():
    assert isinstance(wrap(lambda x: x, max_batch_size=2, backend="emulated"), GraphedCallable)
    assert issubclass(SimpleBufferPool, BufferPool)
    with pytest.raises(TypeError):
        BufferPool()
    assert BACKEND_NAMES == ("auto", "cuda", "emulated", "eager")
    assert resolve_backend_name("auto") == ("cuda" if torch.cuda.is_available() else "emulated")
