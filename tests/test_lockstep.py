"""Lockstep across 2 gloo ranks on CPU: same padded size everywhere, graph or eager together, no hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import decode_batch
from lockstep_helpers import (
    CAPTURE_SIZES, SCHEDULE, AllReduceModel, extend_batch, run_launches_and_piecewise, run_ranks, run_schedule,
)

from graphrt import ForwardMode, GraphRunner
from graphrt.parallel.lockstep import empty_batch, pad_forward_batch

TIMEOUT_S = 60  # the whole run; a process still alive after it fails the test
RETUNED_SCHEDULE = [(5, 3), (1, 0), (6, 6)]


def worker(rank: int) -> dict:
    model = AllReduceModel()
    # Different requested sizes: rank 0's win everywhere.
    requested = CAPTURE_SIZES if rank == 0 else [2, 16]
    runner = GraphRunner(model, max_batch_size=16, capture_sizes=requested, backend="emulated",
                         progress=False, process_group=dist.group.WORLD)
    assert runner.capture_sizes == CAPTURE_SIZES
    runner.capture()
    steps = []
    run_schedule(runner, model, rank, SCHEDULE, CAPTURE_SIZES, steps)
    first = runner.stats()
    runner.retune(max_graphs=2)  # the agreed histograms are equal on both ranks
    tuned = runner.capture_sizes
    run_schedule(runner, model, rank, RETUNED_SCHEDULE, tuned, steps)
    return dict(stats=first, tuned=tuned, steps=steps, final=runner.stats(), launches=run_launches_and_piecewise(rank))


@pytest.fixture(scope="module")
def reports() -> dict:
    """Both ranks' reports of one spawned pair (the two lockstep tests below read them)."""
    return run_ranks(worker, timeout_s=TIMEOUT_S)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_run_every_step_in_lockstep(reports):
    zero, one = reports[0], reports[1]
    assert zero["steps"] == one["steps"], "ranks disagreed on graph-or-eager"
    stats = zero["stats"], one["stats"]
    assert stats[0]["histogram"] == stats[1]["histogram"] == {"DECODE": {2: 2, 3: 1, 4: 1, 5: 1, 8: 1, 12: 1}}
    # 7 steps ran (one with nobody working): graphs for agreed 5, 2, 4, 3 (rank 0 bad), 8.
    assert [s["graph_runs"] for s in stats] == [5, 5]
    assert stats[0]["eager_reasons"] == {"batch_too_large": 1, "peer_eager": 1}
    assert stats[1]["eager_reasons"] == {"batch_too_large": 1, "unsupported_field": 1}
    assert zero["tuned"] == one["tuned"] == [5, 12]  # least padding of the agreed sizes with 2 graphs
    assert zero["final"]["key_hits"] == one["final"]["key_hits"] == {"decode/bs=5": 2, "decode/bs=12": 1}


def test_pad_forward_batch_pads_like_graph_staging():
    batch = decode_batch(3, seed=4)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    pad_values = {"input_ids": 0, "positions": 0, "seq_lens": 1, "out_cache_loc": 7, "req_pool_indices": 0}
    padded = pad_forward_batch(batch, 5, 5, pad_values)
    assert padded.batch_size == 5 and padded.num_tokens == 5
    assert padded.out_cache_loc[3:].tolist() == [7, 7] and padded.seq_lens[3:].tolist() == [1, 1]
    assert torch.equal(padded.input_ids[:3], batch.input_ids) and padded.input_ids[3:].eq(0).all()
    assert padded.seq_lens_sum == batch.seq_lens_sum + 2 and padded.seq_lens_cpu.tolist() == padded.seq_lens.tolist()
    padded.validate()
    with pytest.raises(ValueError, match="num_tokens"):
        pad_forward_batch(batch, 2, 3, pad_values)
    with pytest.raises(ValueError, match=r"pad_values: missing \['seq_lens'\]"):
        pad_forward_batch(batch, 5, 5, {k: v for k, v in pad_values.items() if k != "seq_lens"})


def test_pad_forward_batch_extend_padding_requests_start_after_the_real_tokens():
    batch = extend_batch(3, seed=1)
    batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu = [3], [0]
    pad_values = {"input_ids": 0, "positions": 0, "seq_lens": 1, "out_cache_loc": 0, "req_pool_indices": 0}
    padded = pad_forward_batch(batch, 8, 4, pad_values)
    assert padded.extend_num_tokens == 8 and padded.num_tokens == 8 and padded.batch_size == 4
    assert padded.extend_start_loc.tolist() == [0, 3, 3, 3], "start offsets must not decrease"
    assert padded.extend_seq_lens.tolist() == [3, 0, 0, 0] and padded.extend_seq_lens_cpu == [3, 0, 0, 0]
    assert padded.extend_prefix_lens_cpu == [0, 0, 0, 0]
    idle = pad_forward_batch(empty_batch(ForwardMode.EXTEND, torch.device("cpu")), 4, 2, pad_values)
    assert idle.input_ids.tolist() == [0, 0, 0, 0] and idle.extend_start_loc.tolist() == [0, 0]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_launches_and_piecewise_steps_in_lockstep_with_different_work_per_rank(reports):
    zero, one = reports[0]["launches"], reports[1]["launches"]
    # Rank 0 launches 2 steps of 3 rows, rank 1 is idle: both replay decode/bs=4,steps=2 (no Python runs).
    assert zero["launch"] == ([], True) and one["launch"] == ([], True)
    # 3 steps were not captured: each step agreed and replayed one by one (single-step keys, no Python).
    assert zero["fallback"] == ([], True) and one["fallback"] == ([], True)
    # Rank 0 prefills 5 tokens of 2 requests, rank 1 is idle: both replay piecewise/tokens=8, the splitting op
    # (no Python of the model runs; the op itself runs eagerly between the pieces, on each rank's live batch).
    assert zero["piecewise"] == ([], True) and one["piecewise"] == ([], True)
    for launches in (zero, one):
        assert "steps: ranks disagree (1 and 2 decode steps" in launches["disagree"]
        assert launches["stats"] == {"multi_step_runs": 1, "piecewise_runs": 1,
                                     "multi_step_fallbacks": {"steps_not_captured": 1}}
        # Each launch counts once at its agreed rows, also when its steps ran one by one.
        assert launches["histogram"] == {"DECODE": {3: 1, 2: 1}, "EXTEND": {2: 1}}
