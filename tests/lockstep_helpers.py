"""Multi-rank test harness for lockstep: spawned gloo ranks with a bounded run, a model with a
collective, and a schedule of per-rank batches checked step by step against eager."""

from __future__ import annotations

import datetime
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import decode_batch

from graphrt import ForwardMode
from graphrt.parallel.lockstep import empty_batch, pad_forward_batch

WORLD_SIZE = 2
# Imported once by the fork server (a clean single-threaded process), so each rank starts in
# milliseconds instead of importing torch again (torch._dynamo is imported on the first capture).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "graphrt", "lockstep_helpers"]
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


class AllReduceModel(torch.nn.Module):
    """Sums every row's hidden state over the ranks: gloo needs equal shapes on every rank.

    ``sync_at``: at this many rows the step reads a value on the host after its collective (it
    logs the norm), which a CUDA graph cannot capture: that key's capture fails on this rank
    only, after every collective of the phase ran.
    ``calls`` lists the rows of every Python call of ``forward`` (replays make none).
    """

    def __init__(self, sync_at: Optional[int] = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, 16, generator=generator))
        self.pos = torch.nn.Parameter(torch.randn(512, 16, generator=generator))
        self.proj = torch.nn.Parameter(torch.randn(16, 11, generator=generator))
        self.sync_at = sync_at
        self.calls = []

    def forward(self, input_ids, positions, forward_batch):
        self.calls.append(input_ids.shape[0])
        hidden = self.embed[input_ids] + self.pos[positions]
        dist.all_reduce(hidden)
        if input_ids.shape[0] == self.sync_at:
            self.logged_norm = float(hidden.norm())
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


def agreed_size(step_entries, sizes, failed=()) -> tuple:
    """What the ranks must agree on: (padded size, graph?) for one step; ``failed``: sizes whose capture failed."""
    largest = max(rows(entry) for entry in step_entries)
    if not largest:
        return 0, False
    if "logprob" in step_entries or largest > sizes[-1]:
        return largest, False
    size = min(size for size in sizes if size >= largest)
    return (largest, False) if size in failed else (size, True)


def run_schedule(runner, model, rank, schedule, sizes, results, failed=()) -> None:
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
        padded, graph = agreed_size(step_entries, sizes, failed)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_REPORT: Dict[str, Any] = {}  # in a rank: where report_now() sends its result


def report_now(result: Any) -> None:
    """Send this rank's result to the parent now, flushed: a rank about to die by design reports first."""
    outbox = _REPORT["outbox"]
    outbox.put((_REPORT["rank"], "ok", result))
    outbox.close()
    outbox.join_thread()
    _REPORT["sent"] = True


def _rank_main(rank: int, world_size: int, backend: str, port: int, timeout_s: float, outbox: Any,
               target: Callable[..., Any], args: tuple) -> None:
    """One rank: join the group, run ``target(rank, *args)``, report its result or traceback."""
    _REPORT.update(outbox=outbox, rank=rank, sent=False)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = target(rank, *args)
        if not _REPORT["sent"]:
            outbox.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:  # report to the parent instead of dying silently
        outbox.put((rank, "error", traceback.format_exc()))


def run_ranks(target: Callable[..., Any], *args: Any, world_size: int = WORLD_SIZE, backend: str = "gloo",
              timeout_s: float = 60.0) -> Dict[int, Any]:
    """``target(rank, *args)`` in ``world_size`` child processes sharing one ``backend`` group; each
    rank's return value (picklable). Fails the test when a rank raises or the whole run takes
    more than ``timeout_s`` (a hang): ranks still alive then are killed, so it never blocks CI.
    ``target`` must be a module-level function (a rank imports it by name).

    gloo ranks fork from a fork server that imported ``PRELOAD`` once; NCCL ranks are spawned
    fresh (a process that queried CUDA, as conftest does, cannot hand a usable CUDA to a fork)."""
    if backend == "nccl":
        context = mp.get_context("spawn")
    else:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
    outbox = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, world_size, backend, port, timeout_s / 2, outbox, target, args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    reports: Dict[int, Any] = {}
    try:
        for _ in processes:
            rank, status, payload = outbox.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert status == "ok", f"rank {rank} failed:\n{payload}"
            reports[rank] = payload
    except queue.Empty:
        pytest.fail(f"{target.__name__} did not finish in {timeout_s}s (hang?); reports from ranks {sorted(reports)}")
    finally:
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 5.0))
        alive = [process for process in processes if process.is_alive()]
        for process in alive:
            process.kill()
    assert not alive, "a rank was still alive after the run"
    assert all(process.exitcode == 0 for process in processes)
    return reports


class SplitAllReduceModel(AllReduceModel):
    """Token rows only (any mode): all-reduced, doubled by a splitting op (run eagerly between the pieces
    of a piecewise graph), all-reduced again: each piece holds a collective."""

    def forward(self, input_ids, positions, forward_batch):
        self.calls.append(input_ids.shape[0])
        hidden = self.embed[input_ids] + self.pos[positions]
        dist.all_reduce(hidden)
        hidden = torch.ops.graphrt_test.double_rows(hidden)
        dist.all_reduce(hidden)
        return hidden @ self.proj


def two_request_extend(seed: int):
    """Two requests extending by 3 and 2 tokens (prefixes of 4 and 0)."""
    generator = torch.Generator().manual_seed(seed)
    lengths, prefixes = [3, 2], [4, 0]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lengths)])
    seq_lens = torch.tensor([p + n for p, n in zip(prefixes, lengths)], dtype=torch.int32)
    return decode_batch(2, seed=seed, forward_mode=ForwardMode.EXTEND, extend_num_tokens=5,
                        input_ids=torch.randint(1, 97, (5,), generator=generator), positions=positions,
                        out_cache_loc=torch.arange(10, 15), seq_lens=seq_lens, seq_lens_sum=int(seq_lens.sum()),
                        extend_seq_lens=torch.tensor(lengths, dtype=torch.int32),
                        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
                        extend_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                        extend_seq_lens_cpu=lengths, extend_prefix_lens_cpu=prefixes)


def launch_batch(rows: int, steps: int, seed: int):
    """A decode batch of ``rows`` requests with the slots of ``steps`` steps (step-major)."""
    batch = decode_batch(rows, seed=seed)
    batch.out_cache_loc = torch.arange(1, 1 + rows * steps)
    return batch


def eager_launch(model, batch, rows: int, steps: int, pad_values, graphed: bool):
    """``steps`` greedy decode steps of ``batch`` (None: idle) at ``rows`` rows, run eagerly by every rank at
    once (the model all-reduces): padded once and advanced as one multi-step graph advances its padding rows
    (``graphed``), or each step padded afresh as single steps are. The real rows' tokens, [steps, real rows]."""
    import dataclasses

    from graphrt.multistep import batch_at_step, greedy

    real = batch if batch is not None else empty_batch(ForwardMode.DECODE, torch.device("cpu"))
    slots = real.out_cache_loc.view(steps, real.batch_size)
    if graphed:
        real = pad_forward_batch(dataclasses.replace(real, out_cache_loc=slots[0]), rows, rows, pad_values)
        slots = torch.zeros((steps, rows), dtype=torch.int64)
    tokens, ids = [], real.input_ids
    for step in range(steps):
        current = batch_at_step(real, step, ids, slots[step])
        padded = current if graphed else pad_forward_batch(current, rows, rows, pad_values)
        ids = greedy(model(padded.input_ids, padded.positions, padded), step)[:current.batch_size]
        tokens.append(ids)
    return torch.stack(tokens)[:, :(batch.batch_size if batch is not None else 0)]


def run_launches_and_piecewise(rank: int) -> dict:
    """Multi-step launches and piecewise steps in lockstep, ranks with different work: every rank replays
    the key of the agreed size (an idle rank an all-padding one), or all run the steps one by one; each
    rank's rows equal the same steps run eagerly at the agreed size. Ranks making different calls raise."""
    import piecewise_helpers  # noqa: F401  (registers graphrt_test::double_rows)

    from graphrt import GraphRunner

    model = SplitAllReduceModel()
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[1, 2, 4], decode_steps=(2,), backend="emulated",
                         modes=(ForwardMode.DECODE, ForwardMode.EXTEND), extend_capture_sizes=([8], [1]),
                         splitting_ops=["graphrt_test::double_rows"], piecewise_sizes=[4, 8], progress=False,
                         process_group=dist.group.WORLD)
    assert not runner.capture().failed
    seen = {}
    for name, rows, steps in (("launch", (3, 0), 2), ("fallback", (1, 2), 3)):
        mine = launch_batch(rows[rank], steps, seed=rank) if rows[rank] else None
        model.calls.clear()
        tokens = runner.decode(mine, steps) if mine is not None else runner.idle_step(steps)
        calls = list(model.calls)
        graphed = name == "launch"  # one multi-step replay at bs=4, else single steps at the agreed 2
        expected = eager_launch(model, mine, 4 if graphed else max(rows), steps, runner.pad_values, graphed)
        seen[name] = (calls, tokens is None if mine is None else torch.equal(tokens, expected))
    batch = two_request_extend(seed=7) if rank == 0 else None
    model.calls.clear()
    out = runner(batch) if batch is not None else runner.idle_step()
    calls = list(model.calls)
    padded = pad_forward_batch(batch if batch is not None else empty_batch(ForwardMode.EXTEND, torch.device("cpu")),
                               8, 2, runner.pad_values)
    expected = model(padded.input_ids, padded.positions, padded)
    seen["piecewise"] = (calls, out is None if batch is None else torch.equal(out, expected[:5]))
    try:
        runner.decode(launch_batch(2, 2, seed=rank), 2) if rank == 0 else runner(decode_batch(2, seed=rank))
        seen["disagree"] = None
    except ValueError as error:
        seen["disagree"] = str(error)
    stats = runner.stats()
    seen["stats"] = {name: stats[name] for name in ("multi_step_runs", "piecewise_runs", "multi_step_fallbacks")}
    seen["histogram"] = stats["histogram"]
    return seen
