"""Property tests (hypothesis): random valid and malformed batches, wrap() calls, exact size choice.

Kept apart from the CUDA-marked tests so that a bare GPU image without hypothesis can still
collect and run ``pytest -m cuda``; this module is skipped there.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("hypothesis")
from conftest import ToyPagedModel, decode_batch, pad_batch, static_checksums  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_sizes_autotune import padded_tokens  # noqa: E402

from graphrt import ForwardMode, GraphRunner, wrap  # noqa: E402
from graphrt.sizes import choose_capture_sizes  # noqa: E402

MAX_BS = 16
# A non-default scratch KV slot that no real token writes (decode_batch: slots 1-200) and no request
# reads (requests 1-100): slot 3 was both, so a padded replay could change a real row's result.
SCRATCH = 255
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def captured():
    model = ToyPagedModel()
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend="emulated", progress=False,
                         pad_values={"out_cache_loc": SCRATCH})
    runner.capture()
    return model, runner


@PROPERTY_SETTINGS
@given(batch_size=st.integers(1, MAX_BS + 4), seed=st.integers(0, 10_000),
       with_positions=st.booleans(), with_cpu_mirror=st.booleans(), int32_ids=st.booleans())
def test_random_valid_batches_equal_eager(captured, batch_size, seed, with_positions, with_cpu_mirror, int32_ids):
    model, runner = captured
    batch = decode_batch(batch_size, seed=seed)
    if int32_ids:
        batch.input_ids = batch.input_ids.int()
        batch.req_pool_indices = batch.req_pool_indices.int()
    if not with_positions:
        batch.positions = None
    if with_cpu_mirror:
        batch.seq_lens_cpu = batch.seq_lens.clone()
    graph_runs = runner.stats()["graph_runs"]
    out = runner(batch).clone()
    torch.testing.assert_close(out, model(batch.input_ids, batch.positions, batch), atol=1e-5, rtol=1e-5)
    hit = runner.stats()["graph_runs"] > graph_runs
    assert hit == (with_positions and batch_size <= MAX_BS)
    if hit:
        padded = pad_batch(batch, runner.registry.lookup(ForwardMode.DECODE, batch_size, batch_size).entry.key.num_reqs,
                           scratch=SCRATCH)
        assert torch.equal(out, model(padded.input_ids, padded.positions, padded)[:batch_size])


CORRUPTIONS = {
    "input_ids": [lambda t: t.float(), lambda t: t[:-1], lambda t: t.to("meta"), lambda t: t.reshape(-1, 1)],
    "positions": [lambda t: t.double(), lambda t: torch.cat([t, t]), lambda t: -t - 1],
    "req_pool_indices": [lambda t: -t, lambda t: t.to(torch.int16), lambda t: t[:0]],
    "out_cache_loc": [lambda t: t - 1000, lambda t: None, lambda t: t.bool()],
    "seq_lens": [lambda t: t + 1, lambda t: t.float(), lambda t: None],
}


@PROPERTY_SETTINGS
@given(batch_size=st.integers(1, MAX_BS), seed=st.integers(0, 10_000),
       field=st.sampled_from(sorted(CORRUPTIONS)), choice=st.integers(0, 3))
def test_random_malformed_batches_name_the_field_and_write_nothing(captured, batch_size, seed, field, choice):
    _, runner = captured
    runner(decode_batch(MAX_BS, seed=seed + 1))  # dirty every static row first
    before = static_checksums(runner)
    batch = decode_batch(batch_size, seed=seed)
    corrupt = CORRUPTIONS[field][choice % len(CORRUPTIONS[field])]
    setattr(batch, field, corrupt(getattr(batch, field)))
    expected_field = "seq_lens_sum" if field == "seq_lens" and choice % 3 == 0 else field
    with pytest.raises((ValueError, TypeError), match=expected_field):
        runner(batch)
    after = static_checksums(runner)
    assert all(torch.equal(before[name], after[name]) for name in before)


@PROPERTY_SETTINGS
@given(batch_size=st.integers(1, 20), scale=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 1000))
def test_wrap_random_calls_equal_eager(batch_size, scale, seed):
    weight = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    fast = WRAPPED.setdefault("fn", wrap(lambda x, scale=1.0: (x @ weight) * scale, max_batch_size=16,
                                         capture_sizes=[2, 8, 16], backend="emulated"))
    x = torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(fast(x, scale=scale), (x @ weight) * scale, atol=1e-5, rtol=1e-5)


WRAPPED: dict = {}


histograms = st.dictionaries(st.integers(1, 16), st.integers(1, 50), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(histogram=histograms, max_graphs=st.integers(1, 6))
def test_choice_is_exactly_optimal_against_brute_force(histogram, max_graphs):
    chosen = choose_capture_sizes(histogram, max_graphs)
    observed = sorted(histogram)
    assert chosen == sorted(set(chosen)) and len(chosen) <= max_graphs
    assert set(chosen) <= set(observed) and chosen[-1] == observed[-1], "the largest observed size must be chosen"
    best = min(
        padded_tokens(histogram, list(rest) + [observed[-1]])
        for r in range(min(max_graphs, len(observed)))
        for rest in itertools.combinations(observed[:-1], r)
    )
    assert padded_tokens(histogram, chosen) == best
