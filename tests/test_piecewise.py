"""Piecewise graphs: prefill, mixed and oversized decode steps replay graph pieces around eager varlen attention."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import python_runs
from piecewise_helpers import PIECEWISE_SIZES, VarlenSetup
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt import ForwardMode
from graphrt.parallel.lockstep import pad_forward_batch
from graphrt.reference import VARLEN_OP, make_decode_batch, run_eager

# Unpadded eager runs its GEMMs at another row count than the padded replay: rounding may differ.
ATOL, RTOL = 1e-5, 1e-5


class OpCounter(TorchDispatchMode):
    """Counts the calls of one op while active."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is self.op
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def setup():
    return VarlenSetup()


def padded_size(num_tokens: int) -> int:
    return min(size for size in PIECEWISE_SIZES if size >= num_tokens)


@pytest.mark.parametrize("seed", range(6))
def test_prefill_and_mixed_steps_equal_eager(setup, seed):
    check_random_steps(setup, seed)


@pytest.mark.cuda
def test_prefill_and_mixed_steps_equal_eager_on_cuda():
    check_random_steps(VarlenSetup(backend="cuda", device="cuda"), seed=0)


def check_random_steps(setup: VarlenSetup, seed: int) -> None:
    """Three random prefill/mixed steps through the runner: each piecewise, bitwise equal to eager
    at the padded size and close to unpadded eager; at least one of them padded."""
    rng = random.Random(seed)
    runner = setup.runner
    padded_steps = 0
    for _ in range(3):
        batch = setup.step_batch(rng)
        before = runner.stats()["piecewise_runs"]
        unpadded = run_eager(setup.model, batch).clone()
        padded_steps += padded_size(batch.num_tokens) > batch.num_tokens
        padded = pad_forward_batch(batch, padded_size(batch.num_tokens), batch.batch_size, runner.pad_values)
        padded_eager = run_eager(setup.model, padded)[: batch.num_tokens].clone()
        actual = runner(batch)
        assert runner.stats()["piecewise_runs"] == before + 1, runner.stats()["eager_reasons"]
        assert actual.shape == (batch.num_tokens, setup.model.config.vocab_size)
        assert torch.equal(actual, padded_eager), f"{batch.forward_mode.name}, {batch.num_tokens} tokens"
        torch.testing.assert_close(actual, unpadded, atol=ATOL, rtol=RTOL)
    assert runner.stats()["eager_runs"] == 0 and padded_steps > 0


def test_only_the_splitting_op_runs_at_replay(setup):
    model_calls = []
    forward = type(setup.model).forward
    batch = setup.step_batch(random.Random(10), max_reqs=3)
    counter = OpCounter(VARLEN_OP)
    with counter, python_runs(forward, model_calls):
        run_eager(setup.model, batch)
    assert model_calls and counter.calls == setup.model.config.num_layers  # the probes see an eager step
    model_calls.clear()
    counter = OpCounter(VARLEN_OP)
    with counter, python_runs(forward, model_calls):
        setup.runner(setup.step_batch(random.Random(11), max_reqs=3))
    assert model_calls == [], "the model's forward ran during a piecewise replay"
    assert counter.calls == setup.model.config.num_layers  # once per call site (one per layer)


def test_capture_report_lists_piecewise_keys_with_piece_counts(setup):
    header, *rows, total = str(setup.report).splitlines()
    columns = header.replace("pool MiB", "pool_MiB").replace("out MiB", "out_MiB").replace("verify s", "verify_s").split()
    table = {row.split()[0]: dict(zip(columns, row.split())) for row in rows}
    assert total.startswith("pool total")
    for size in PIECEWISE_SIZES:
        key = f"piecewise/tokens={size}"
        assert key in setup.runner.stats()["captured_keys"]
        # 2 layers, one attention call each: 3 pieces.
        assert (table[key]["status"], table[key]["pieces"]) == ("ok", "3"), table[key]
    assert [report.pieces for report in setup.report.keys if str(report.key).startswith("decode")] == [None] * 3


def test_steps_above_the_largest_piecewise_size_run_eagerly_with_a_reason():
    setup = VarlenSetup(sizes=[8, 16])
    rng = random.Random(3)
    batch = setup.step_batch(rng, max_reqs=6, max_new=9)
    while batch.num_tokens <= 16:
        batch = setup.step_batch(rng, max_reqs=6, max_new=9)
    expected = run_eager(setup.model, batch).clone()
    torch.testing.assert_close(setup.runner(batch), expected, atol=0, rtol=0)
    stats = setup.runner.stats()
    assert stats["eager_reasons"] == {"batch_too_large": 1} and stats["piecewise_runs"] == 0


def test_decode_batch_above_the_largest_full_graph_replays_piecewise(setup):
    pools, runner = setup.pools, setup.runner
    prompts = setup.step_batch(random.Random(5), max_new=4, mode=ForwardMode.EXTEND, num_reqs=6)
    run_eager(setup.model, prompts)
    reqs = prompts.req_pool_indices.tolist()
    lens = [setup.lengths[req] + 1 for req in reqs]
    out_loc = pools.assign(reqs, [length - 1 for length in lens], [1] * len(reqs))
    for req in reqs:
        setup.lengths[req] += 1
    batch = make_decode_batch(list(range(len(reqs))), reqs, lens, out_loc, "cpu", pools, setup.attn)
    stats_before = runner.stats()
    expected = run_eager(setup.model, batch).clone()
    actual = runner(batch)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    # 6 requests, above max_batch_size=4: no decode graph fits, the 8-token piecewise key does.
    assert runner.stats()["piecewise_runs"] == stats_before["piecewise_runs"] + 1
    assert runner.stats()["key_hits"]["piecewise/tokens=8"] >= 1


def state_of(setup) -> list:
    pools = setup.pools
    return [t.clone() for t in (*pools.kv.k_buffers, *pools.kv.v_buffers, pools.req_to_token.req_to_token,
                                 *setup.model.state_dict().values())]


def test_capture_leaves_the_model_state_bitwise_unchanged():
    setup = VarlenSetup(sizes=[8, 16], capture=False)
    batch = setup.step_batch(random.Random(1))
    run_eager(setup.model, batch)  # a cache with real content
    before = state_of(setup)
    report = setup.runner.capture()
    assert not report.failed, report.failed
    after = state_of(setup)
    assert all(torch.equal(old, new) for old, new in zip(before, after))


def test_check_lists_where_the_step_splits():
    setup = VarlenSetup(sizes=[8, 16], capture=False)
    example = setup.step_batch(random.Random(0), num_reqs=2, max_new=4)
    report = setup.runner.check(example)
    assert report.notes == ["example 0 replays piecewise (piecewise/tokens=8): its pieces are checked on that "
                            "key's dummy batch, not on the example"]
    assert report.ok, str(report)
    assert report.pieces == 3
    [site] = report.splits
    assert (site.op, site.count) == ("graphrt_reference::varlen_attention", 2)
    assert site.source.startswith("graphrt/reference/varlen.py:") and site.source.endswith("in forward")
    assert "splits (a piecewise step runs these ops eagerly between 3 graph pieces):" in str(report)
    assert report.to_dict()["splits"] == [{"op": site.op, "source": site.source, "count": 2}]
