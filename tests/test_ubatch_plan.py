"""Micro-batch planning: plans land on captured sizes with least padding, pieces hold whole requests."""

from __future__ import annotations

import bisect
import itertools

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ubatch_helpers import SIZE_SETS, SIZES, batch_model  # noqa: E402

from graphrt.ubatch import UBatchConfig, UBatchState, UBatchWrapper, make_ubatch_contexts

FAST = settings(max_examples=40, deadline=None)


def padding_of(tokens: int, sizes) -> int:
    """Padded rows of one piece (0 when no size holds it: it runs eagerly)."""
    index = bisect.bisect_left(sizes, tokens)
    return sizes[index] - tokens if index < len(sizes) else 0


def test_decode_70_lands_on_captured_sizes_without_padding():
    slices = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=SIZES)).compute_slices(70, 70)
    sizes = [s.num_tokens for s in slices]
    assert sum(sizes) == 70 and len(sizes) == 3 and set(sizes) <= set(SIZES)
    assert [(s.token_slice, s.req_slice) for s in slices[:1]] == [(slice(0, 64), slice(0, 64))]


def test_batches_within_the_largest_size_run_whole():
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=SIZES))
    assert [s.num_tokens for s in wrapper.compute_slices(63, 63)] == [63]
    assert len(wrapper.compute_slices(65, 65)) == 2


def brute_unit_cost(total: int, sizes, limit: int):
    """(padding, pieces) of the best split of ``total`` one-token requests, by exhaustive DP over piece sizes."""
    best = [(0, 0)]
    for value in range(1, total + 1):
        best.append(min((best[value - t][0] + padding_of(t, sizes), best[value - t][1] + 1)
                        for t in range(1, min(value, limit) + 1)))
    return best[total]


@FAST
@given(total=st.integers(1, 300), sizes=st.sampled_from(SIZE_SETS))
def test_unit_plan_has_least_padding_then_fewest_pieces(total, sizes):
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=sizes, split_threshold=0))
    slices = wrapper.compute_slices(total, total)
    assert [s.token_slice for s in slices] == [s.req_slice for s in slices]
    assert sum(s.num_tokens for s in slices) == total and all(s.num_tokens <= sizes[-1] for s in slices)
    cost = (sum(padding_of(s.num_tokens, sizes) for s in slices), len(slices))
    assert cost == brute_unit_cost(total, sizes, sizes[-1])


def brute_request_cost(counts, sizes, limit: int):
    """(eager pieces, padding, pieces) of the best contiguous grouping, over every set of cuts."""
    best = None
    for mask in range(1 << (len(counts) - 1)):
        cuts = [0] + [i + 1 for i in range(len(counts) - 1) if mask >> i & 1] + [len(counts)]
        groups = [counts[a:b] for a, b in zip(cuts, cuts[1:])]
        if any(sum(g) > limit and len(g) > 1 for g in groups):
            continue
        cost = (sum(sum(g) > limit for g in groups), sum(padding_of(sum(g), sizes) for g in groups), len(groups))
        best = cost if best is None else min(best, cost)
    return best


@FAST
@given(counts=st.lists(st.integers(1, 30), min_size=2, max_size=9), sizes=st.sampled_from(SIZE_SETS))
def test_request_plan_keeps_requests_whole_with_least_padding(counts, sizes):
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=sizes, split_threshold=0))
    slices = wrapper.compute_slices(sum(counts), len(counts), counts)
    ends = list(itertools.accumulate(counts, initial=0))
    assert slices[0].token_slice.start == 0 and slices[-1].token_slice.stop == ends[-1]
    for s, nxt in zip(slices, slices[1:]):
        assert s.token_slice.stop == nxt.token_slice.start and s.req_slice.stop == nxt.req_slice.start
    for s in slices:
        assert (ends[s.req_slice.start], ends[s.req_slice.stop]) == (s.token_slice.start, s.token_slice.stop)
    cost = (sum(s.num_tokens > sizes[-1] for s in slices), sum(padding_of(s.num_tokens, sizes) for s in slices),
            len(slices))
    assert cost == brute_request_cost(counts, sizes, sizes[-1])


def test_balanced_split_without_capture_sizes():
    wrapper = UBatchWrapper(batch_model, UBatchConfig(num_ubatches=3))
    assert [s.num_tokens for s in wrapper.compute_slices(10, 10)] == [4, 3, 3]
    slices = wrapper.compute_slices(12, 3, [10, 1, 1])
    assert [(s.num_tokens, s.num_reqs) for s in slices] == [(10, 1), (2, 2)]  # cuts only between requests


def test_bad_token_counts_are_value_errors():
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=SIZES))
    with pytest.raises(ValueError, match="tokens_per_req"):
        wrapper.compute_slices(100, 5)
    with pytest.raises(ValueError, match="tokens_per_req"):
        wrapper.compute_slices(100, 2, [60, 30])
    with pytest.raises(ValueError, match="max_ubatch_size"):
        UBatchConfig(capture_sizes=[8, 16], max_ubatch_size=4)


@FAST
@given(ubatches=st.integers(1, 8), reqs=st.integers(0, 50), extra=st.integers(0, 100))
def test_make_ubatch_contexts_covers_every_token_and_request_once(ubatches, reqs, extra):
    contexts = make_ubatch_contexts(ubatches, reqs + extra, reqs)
    assert 1 <= len(contexts) <= ubatches
    for attr, total in (("token_slice", reqs + extra), ("req_slice", reqs)):
        ranges = [getattr(c.slice_info, attr) for c in contexts]
        covered = [i for r in ranges for i in range(r.start, r.stop)]
        assert covered == list(range(total))
    assert all(c.state is UBatchState.IDLE for c in contexts)
