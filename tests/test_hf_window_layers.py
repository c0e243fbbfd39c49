"""graphrt.hf_cache: graph-safe sliding-window layers against transformers' own.

The replacements must answer like transformers' StaticSlidingWindowLayer (mask offset, sequence
length, keys and values at every position the mask shows) for any window and any sequence of
token counts; the comparison itself must catch a replacement that answers otherwise.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import graphrt  # noqa: E402
from graphrt.hf_cache.window_layers import (  # noqa: E402
    SlidingRingLayer, cache_long_mismatch, replacement_mismatch, ring_mismatch,
)


def test_both_replacements_answer_like_this_transformers_version():
    assert ring_mismatch() is None
    assert cache_long_mismatch() is None


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 5), script=st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_the_ring_answers_like_transformers_for_any_window_and_token_counts(window, script):
    ring = lambda length: SlidingRingLayer(max_cache_len=length)  # noqa: E731
    assert replacement_mismatch(ring, window, 64, [script]) is None


class ReversedRing(SlidingRingLayer):
    """A replacement that returns the right positions in the wrong order."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return keys.flip(2), values.flip(2)


class LateOffset(SlidingRingLayer):
    """A replacement whose mask offset lags one position once the window is full."""

    def get_mask_sizes(self, query_length):
        length, offset = super().get_mask_sizes(query_length)
        return length, max(offset - 1, 0)


def test_the_comparison_catches_a_replacement_that_answers_otherwise():
    scripts = [(2, 1, 1, 1, 2, 1)]
    reversed_ring = replacement_mismatch(lambda length: ReversedRing(max_cache_len=length), 3, 16, scripts)
    assert reversed_ring == "update of 2 token(s) after 0: the keys returned for the visible positions differ"
    late = replacement_mismatch(lambda length: LateOffset(max_cache_len=length), 3, 16, scripts)
    assert late == "update of 1 token(s) after 3: mask offset 1, the replacement's 0"


def test_a_host_read_of_the_ring_count_inside_a_recorded_step_fails_its_capture():
    """get_mask_sizes() reads the count on the host; generate() calls it outside the model call. A step that
    calls it inside is refused (the graph would freeze the offset), and runs eagerly."""
    ring = SlidingRingLayer(max_cache_len=3)

    def step(keys):
        length, offset = ring.get_mask_sizes(1)
        cached_keys, _ = ring.update(keys, keys)
        return cached_keys[:, :, :length].sum(-1) + offset

    fast = graphrt.wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated")
    for _ in range(3):
        fast(torch.ones(2, 1, 1, 4))
    assert fast.stats()["graph_runs"] == 0
    assert fast.stats()["failed_keys"]["decode/bs=2"].startswith("HostSyncError: host sync in the captured step")
    assert int(ring.cumulative_length) == 3  # every call advanced the ring once
