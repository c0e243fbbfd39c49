"""wrap() with several call layouts: graphs per layout, the max_signatures bound, churn, exact sizes.

Every wrapped call is compared with the eager call on the same inputs.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphrt import wrap
from graphrt.graphed_callable import CHURN_LIMIT


def scaled(x, mask=None, scale=1.0):
    out = x * scale
    return out if mask is None else out * mask


def test_alternating_layouts_each_replay_their_own_graphs():
    fast = wrap(scaled, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, 3, generator=generator)
        mask = torch.rand(4, 3, generator=generator)
        torch.testing.assert_close(fast(x), scaled(x), rtol=0, atol=0)
        torch.testing.assert_close(fast(x, mask=mask, scale=0.5), scaled(x, mask, 0.5), rtol=0, atol=0)
        torch.testing.assert_close(fast(x[:, :2]), scaled(x[:, :2]), rtol=0, atol=0)  # other non-batch dim
    stats = fast.stats()
    # Each of the 3 layouts: a warm-up call, then a recording call that replays, then replays.
    assert stats["eager_reasons"] == {"warmup": 3} and stats["graph_runs"] == 9
    assert stats["key_hits"] == {"call/bs=4": 3, "layout1:call/bs=4": 3, "layout2:call/bs=4": 3}
    assert stats["layouts_dropped"] == 0 and stats["layout_churn"] == {}


def test_past_max_signatures_the_least_recently_used_layout_is_dropped_and_freed():
    fast = wrap(scaled, max_batch_size=4, capture_sizes=[4], backend="emulated", max_signatures=2)
    widths = (3, 5, 3, 7)  # the 7 opens a third layout: 5, used least recently, is dropped
    slots = {}
    for width in widths:
        for _ in range(3):
            x = torch.randn(4, width)
            torch.testing.assert_close(fast(x), scaled(x), rtol=0, atol=0)
        slots.setdefault(width, weakref.ref(fast.signature.buffers.slots["args[0]"].tensor))
    gc.collect()
    assert [slots[width]() is None for width in (3, 5, 7)] == [False, True, False]
    stats = fast.stats()
    assert stats["layouts_dropped"] == 1 and sorted(stats["layouts"]) == ["layout0", "layout2"]
    assert stats["eager_reasons"] == {"warmup": 3}  # the second round of width 3 replayed its graphs
    x = torch.randn(4, 5)
    torch.testing.assert_close(fast(x), scaled(x), rtol=0, atol=0)  # width 5 again: a new layout, warm-up
    assert fast.stats()["eager_reasons"] == {"warmup": 4} and fast.stats()["layouts_dropped"] == 2


def test_a_growing_argument_stops_opening_layouts_and_stats_say_why():
    fast = wrap(lambda x, history: x + history.sum(1, keepdim=True), max_batch_size=4, capture_sizes=[4],
                backend="emulated")
    x = torch.randn(4, 2)
    for length in range(1, 9):  # a 2-D history growing by one column per call, like an attention mask
        history = torch.randn(4, length)
        torch.testing.assert_close(fast(x, history), x + history.sum(1, keepdim=True), rtol=0, atol=0)
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": CHURN_LIMIT, "shape_mismatch": 8 - CHURN_LIMIT}
    assert len(stats["layouts"]) == CHURN_LIMIT and stats["captured_keys"] == []
    assert [info["static_bytes"] for info in stats["layouts"].values()] == [0] * CHURN_LIMIT, "warm-ups allocate none"
    assert list(stats["layout_churn"]) == ["args[1]"]
    assert f"got shape [4, {CHURN_LIMIT + 1}]" in stats["layout_churn"]["args[1]"]
    for _ in range(2):  # a layout seen before (its warm-up was the growing call) records, then replays
        history = torch.randn(4, CHURN_LIMIT)
        torch.testing.assert_close(fast(x, history), x + history.sum(1, keepdim=True), rtol=0, atol=0)
    assert fast.stats()["graph_runs"] == 2
    # the recorded layout's static slots: x [4 rows, 2] and history [4 rows, CHURN_LIMIT], float32
    assert fast.stats()["layouts"]["layout3"]["static_bytes"] == 4 * (2 + CHURN_LIMIT) * 4


class RowState(torch.nn.Module):
    """Accumulates each call's rows into a state sized to the real batch (like a StaticCache)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(rows, 4))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def test_a_padded_capture_that_fails_is_recorded_at_the_call_size():
    module, reference = RowState(3), RowState(3)
    fast = wrap(module, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(3, 4, generator=generator)
        torch.testing.assert_close(fast(x), reference(x), rtol=0, atol=0)
    assert torch.equal(module.total, reference.total), "each call wrote its rows exactly once"
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 1} and stats["key_hits"] == {"call/bs=3": 4}
    assert "call/bs=4" in stats["failed_keys"] and stats["padded_tokens"] == 0


@pytest.mark.parametrize("value,error", [(0, ValueError), ("8", TypeError), (True, TypeError)])
def test_max_signatures_must_be_a_positive_int(value, error):
    with pytest.raises(error, match="max_signatures"):
        wrap(scaled, max_batch_size=4, max_signatures=value)


def test_capture_of_a_churning_layout_raises_naming_why():
    fast = wrap(lambda x, history: x + history.sum(1, keepdim=True), max_batch_size=4, capture_sizes=[4],
                backend="emulated")
    x = torch.randn(4, 2)
    for length in range(1, CHURN_LIMIT + 2):
        fast(x, torch.randn(4, length))
    with pytest.raises(ValueError, match=r"args: no new layout is opened .* args\[1\]: expected shape"):
        fast.capture(x, torch.randn(4, 20))


def test_every_size_padded_to_a_failed_key_gets_a_key_of_its_own():
    def refuses_eight_rows(x):
        if x.shape[0] == 8:  # frozen at capture like any Python branch: only the 8-row recording raises
            raise RuntimeError("8 rows are not supported")
        return x * 2

    fast = wrap(refuses_eight_rows, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    generator = torch.Generator().manual_seed(2)
    for batch in (5, 5, 5, 6, 6, 6, 5):
        x = torch.randn(batch, 3, generator=generator)
        torch.testing.assert_close(fast(x), x * 2, rtol=0, atol=0)
    stats = fast.stats()
    # 5: warm-up, then the 8-row recording fails and 5 rows are recorded in the same call; 6: the key
    # for 8 failed, so a 6-row key is warmed up on its first call and recorded on the next.
    assert stats["eager_reasons"] == {"warmup": 2}, stats
    assert stats["key_hits"] == {"call/bs=5": 3, "call/bs=6": 2}
    assert stats["failed_keys"] == {"call/bs=8": "RuntimeError: 8 rows are not supported"}
