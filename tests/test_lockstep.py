"""Lockstep across 2 gloo ranks on CPU: same padded size everywhere, graph or eager together, no hang."""

from __future__ import annotations

import datetime
import queue
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import decode_batch

from graphrt import ForwardMode, GraphRunner
from graphrt.parallel.lockstep import empty_batch, pad_forward_batch

WORLD_SIZE = 2
TIMEOUT_S = 60  # the whole run; a process still alive after it fails the test
CAPTURE_SIZES = [1, 2, 4, 8]
# Per step, each rank's batch size: 0 = no work (idle), "bad" = an invalid batch, "logprob" = 2 rows
# with return_logprob (a field graphs do not support: that rank must run eagerly, so every rank does).
SCHEDULE = [
    (3, 5),            # agreed 5 -> graph bs=8 on both ranks
    (0, 2),            # rank 0 idle: all-padding replay of bs=2
    (1, 12),           # 12 > largest capture size: both run eagerly at 12
    (4, 0),            # rank 1 idle
    (0, 0),            # nobody has work: nothing runs
    (2, "logprob"),    # rank 1 must run eagerly -> rank 0 too (peer_eager), both at 2
    ("bad", 3),        # rank 0's batch is invalid: it pads like an idle rank, then raises
    (2, "extend"),     # working ranks disagree on the mode: both raise, nothing runs
    (8, 7),
]
RETUNED_SCHEDULE = [(5, 3), (1, 0), (6, 6)]


class AllReduceModel(torch.nn.Module):
    """Sums every row's hidden state over the ranks: gloo needs equal shapes on every rank."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, 16, generator=generator))
        self.pos = torch.nn.Parameter(torch.randn(512, 16, generator=generator))
        self.proj = torch.nn.Parameter(torch.randn(16, 11, generator=generator))
        self.calls = []

    def forward(self, input_ids, positions, forward_batch):
        self.calls.append(input_ids.shape[0])
        hidden = self.embed[input_ids] + self.pos[positions]
        dist.all_reduce(hidden)
        return hidden @ self.proj + forward_batch.seq_lens.to(hidden.dtype)[:, None]


def rank_batch(entry, step: int, rank: int):
    if entry == 0:
        return None
    if entry == "bad":
        return decode_batch(2, seed=step, input_ids=torch.zeros(2))
    if entry == "extend":
        return extend_batch(2, seed=step)
    if entry == "logprob":
        return decode_batch(2, seed=1000 * rank + step, return_logprob=True)
    return decode_batch(entry, seed=1000 * rank + step)


def extend_batch(tokens: int, seed: int):
    """One request extending by ``tokens`` tokens with no prefix."""
    return decode_batch(1, seed=seed, forward_mode=ForwardMode.EXTEND, extend_num_tokens=tokens,
                        input_ids=torch.arange(1, tokens + 1), positions=torch.arange(tokens),
                        out_cache_loc=torch.arange(10, 10 + tokens), seq_lens=torch.tensor([tokens], dtype=torch.int32),
                        seq_lens_sum=tokens, extend_seq_lens=torch.tensor([tokens], dtype=torch.int32),
                        extend_prefix_lens=torch.zeros(1, dtype=torch.int32),
                        extend_start_loc=torch.zeros(1, dtype=torch.int32))


def rows(entry) -> int:
    return {"bad": 0, "logprob": 2}.get(entry, entry)


def agreed_size(step_entries, sizes) -> tuple:
    """What the ranks must agree on: (padded size, graph?) for one step."""
    largest = max(rows(entry) for entry in step_entries)
    if not largest:
        return 0, False
    if "logprob" in step_entries or largest > sizes[-1]:
        return largest, False
    return min(size for size in sizes if size >= largest), True


def run_schedule(runner, model, rank, schedule, sizes, results) -> None:
    """Run each step through the runner, then the same step eagerly with the expected padding."""
    for step, step_entries in enumerate(schedule):
        entry = step_entries[rank]
        batch = rank_batch(entry, step, rank)
        model.calls.clear()
        if "extend" in step_entries:
            with pytest.raises(ValueError, match="forward_mode: ranks disagree"):
                runner(batch)
            assert model.calls == []
            continue
        if entry == "bad":
            with pytest.raises(TypeError, match="input_ids"):
                runner(batch)
            out = None
        elif batch is None:
            out = runner.idle_step()
        else:
            out = runner(batch)
            out = out.clone() if out is not None else None
        padded, graph = agreed_size(step_entries, sizes)
        if not padded:
            assert model.calls == [] and out is None
            continue
        # A replay runs the recorded ops (collectives included), never the model's Python.
        expected_calls = [] if graph else [padded]
        assert model.calls == expected_calls, f"step {step}: ran at {model.calls}, expected {expected_calls}"
        real = batch if entry not in (0, "bad") else empty_batch(ForwardMode.DECODE, torch.device("cpu"))
        padded_batch = pad_forward_batch(real, padded, padded, runner.pad_values)
        expected = model(padded_batch.input_ids, padded_batch.positions, padded_batch)[: real.batch_size]
        if entry in (0, "bad"):
            assert out is None
        else:
            assert torch.equal(out, expected), f"rank {rank} step {step}: differs from eager at {padded}"
        results.append((step, graph))


def worker(rank: int, port: int, outbox) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=30))
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
        outbox.put((rank, "ok", dict(stats=first, tuned=tuned, steps=steps, final=runner.stats())))
        dist.destroy_process_group()
    except BaseException:  # report to the parent instead of dying silently
        outbox.put((rank, "error", traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_run_every_step_in_lockstep():
    context = mp.get_context("spawn")
    outbox = context.Queue()
    port = free_port()
    processes = [context.Process(target=worker, args=(rank, port, outbox), daemon=True) for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()
    reports = {}
    try:
        for _ in processes:
            rank, status, payload = outbox.get(timeout=TIMEOUT_S)
            assert status == "ok", f"rank {rank} failed:\n{payload}"
            reports[rank] = payload
    except queue.Empty:
        pytest.fail(f"lockstep run did not finish in {TIMEOUT_S}s (hang?); reports from ranks {sorted(reports)}")
    finally:
        for process in processes:
            process.join(timeout=10)
        alive = [process for process in processes if process.is_alive()]
        for process in alive:
            process.kill()
    assert not alive, "a rank was still alive after the run"
    assert all(process.exitcode == 0 for process in processes)

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
