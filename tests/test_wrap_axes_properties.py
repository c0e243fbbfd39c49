"""Property test (hypothesis): random output and argument layouts never return a padding row.

Outputs put the batch on any axis, or on none (a sum over the batch); every other dim, and the
dims of a state argument batched on any axis, are drawn from the capture sizes, so they often
coincide with the batch size. Whatever wrap() replays, runs eagerly or captures again, each
call must equal the eager call: same shapes, same values.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from graphrt import wrap  # noqa: E402

SIZES = [1, 2, 4, 8]
CAPTURE_SIZES = [2, 4, 8]
ALLOWED_REASONS = {"warmup", "axis_probe", "unsliceable_output", "ambiguous_batch_axis", "shape_mismatch"}


@st.composite
def layouts(draw):
    """(other dims, batch axis or None) per output, and (other dims, batch axis) of the state."""
    outputs = []
    for _ in range(draw(st.integers(1, 3))):
        others = draw(st.lists(st.sampled_from(SIZES), min_size=0, max_size=2))
        axis = draw(st.one_of(st.none(), st.integers(0, len(others))))
        outputs.append((tuple(others), axis))
    state_others = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=2))
    return outputs, (tuple(state_others), draw(st.integers(0, len(state_others))))


def make_fn(outputs, weights):
    def fn(x, state):
        results = []
        for (others, axis), weight in zip(outputs, weights):
            rows = x.view(x.shape[0], *([1] * len(others))) * weight  # [batch, *others], rows differ
            results.append(rows.sum(0) if axis is None else rows.movedim(0, axis))
        return results, state * 2
    return fn


def batch_first_state(others, axis, batch, generator):
    shape = list(others)
    shape.insert(axis, batch)
    return torch.randn(shape, generator=generator)


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), batches=st.lists(st.sampled_from([1, 2, 3, 4, 5, 8]), min_size=2, max_size=7),
       seed=st.integers(0, 1000))
def test_random_layouts_equal_eager_and_never_return_a_padding_row(layout, batches, seed):
    outputs, (state_others, state_axis) = layout
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.rand(others, generator=generator) + 0.5 for others, _ in outputs]
    fn = make_fn(outputs, weights)
    fast = wrap(fn, max_batch_size=8, capture_sizes=CAPTURE_SIZES, backend="emulated")
    for batch in batches:
        x = torch.rand(batch, 1, generator=generator) + 1.0  # no row is zero, like no padding row
        state = batch_first_state(state_others, state_axis, batch, generator)
        got, expected = fast(x, state), fn(x, state)
        for value, reference in zip([*got[0], got[1]], [*expected[0], expected[1]]):
            assert value.shape == reference.shape
            torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-5)
    assert set(fast.stats()["eager_reasons"]) <= ALLOWED_REASONS, fast.stats()
