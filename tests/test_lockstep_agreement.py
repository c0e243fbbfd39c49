"""Where lockstep agrees: on a CPU (gloo) group whatever the model's backend, after each phase of
each key's capture, and under inference mode. Two gloo ranks in child processes; the user's group
is made to report "nccl" where a test needs an NCCL-like group (no NCCL on CPU). The ``cuda`` twin
runs a real 1-rank NCCL group with the model's all-reduce captured inside the graph."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from conftest import decode_batch
from lockstep_helpers import CAPTURE_SIZES, SCHEDULE, AllReduceModel, agreed_size, run_ranks, run_schedule
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt import ForwardMode, GraphRunner, RunnerConfig
from graphrt.entry import GraphKey
from graphrt.parallel.lockstep import Lockstep, pad_forward_batch

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TIMEOUT_S = 30  # each run; a hang fails the test and its processes are killed
WARMUP_ITERS = 2
FAILING_SIZE = 4  # rank 1's model reads a host value at this size: its capture fails there only
FAILURE_SCHEDULE = [(3, 2), (5, 1), (0, 4)]  # agreed 3 and 4 -> the failed key bs=4, eager; 5 -> bs=8, graph


@contextlib.contextmanager
def spied_collectives(simulate_nccl: bool) -> Iterator[List[Dict[str, Any]]]:
    """Log every agreement collective (the model's own ``all_reduce`` passes no group and is not
    logged); with ``simulate_nccl`` the user's group (WORLD) reports the "nccl" backend."""
    user_group = dist.group.WORLD
    real = {name: getattr(dist, name) for name in ("get_backend", "all_reduce", "all_gather_object")}
    log: List[Dict[str, Any]] = []

    def describe(kind: str, group: Any, tensor: Any = None) -> Dict[str, Any]:
        entry = dict(kind=kind, on_user_group=group is None or group is user_group,
                     backend=real["get_backend"](group), inference_mode=torch.is_inference_mode_enabled())
        if tensor is not None:
            entry.update(device=str(tensor.device), dtype=str(tensor.dtype), inference_tensor=tensor.is_inference())
        return entry

    def get_backend(group=None):
        if simulate_nccl and (group is None or group is user_group):
            return "nccl"
        return real["get_backend"](group)

    def all_reduce(tensor, *args, group=None, **kwargs):
        if group is not None:
            log.append(describe("all_reduce", group, tensor))
        return real["all_reduce"](tensor, *args, group=group, **kwargs)

    def all_gather_object(objects, obj, group=None):
        log.append(describe("all_gather_object", group))
        return real["all_gather_object"](objects, obj, group=group)

    patched = dict(get_backend=get_backend, all_reduce=all_reduce, all_gather_object=all_gather_object)
    for name, spy in patched.items():
        setattr(dist, name, spy)
    try:
        yield log
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


class OpLog(TorchDispatchMode):
    """The name of every torch op run under it (c10d collectives included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def record_step_ops(runner: GraphRunner) -> List[List[str]]:
    """Make ``runner``'s per-step agreement log the torch ops each call runs."""
    agree_step, per_call = runner.lockstep.agree_step, []

    def logged(*args, **kwargs):
        with OpLog() as log:
            try:
                return agree_step(*args, **kwargs)
            finally:  # a step whose ranks disagree on the mode raises after its agreement
                per_call.append(log.ops)

    runner.lockstep.agree_step = logged
    return per_call


def run_spied_schedule(rank: int, inference: bool) -> dict:
    """Build, capture and run ``SCHEDULE`` with an NCCL-like user group, spying the agreements;
    with ``inference`` all of it under ``torch.inference_mode()``."""
    mode = torch.inference_mode() if inference else contextlib.nullcontext()
    with spied_collectives(simulate_nccl=True) as log, mode:
        model = AllReduceModel()
        runner = GraphRunner(model, max_batch_size=16, capture_sizes=CAPTURE_SIZES, backend="emulated",
                             progress=False, process_group=dist.group.WORLD)
        runner.capture()
        setup = list(log)
        log.clear()
        step_ops = record_step_ops(runner)
        steps: list = []
        run_schedule(runner, model, rank, SCHEDULE, CAPTURE_SIZES, steps)
    return dict(setup=setup, steps=list(log), step_ops=step_ops, results=steps, graph_runs=runner.stats()["graph_runs"])


def simulated_nccl_worker(rank: int) -> dict:
    return run_spied_schedule(rank, inference=False)


def inference_mode_worker(rank: int) -> dict:
    return run_spied_schedule(rank, inference=True)


def test_each_step_agrees_with_one_host_all_reduce_on_a_gloo_group_when_the_user_group_is_nccl():
    reports = run_ranks(simulated_nccl_worker, timeout_s=TIMEOUT_S)
    for rank, report in reports.items():
        steps = report["steps"]
        assert len(steps) == len(SCHEDULE), f"rank {rank}: expected one agreement per step, got {steps}"
        for call in steps:
            assert call["kind"] == "all_reduce" and call["device"] == "cpu" and call["dtype"] == "torch.int64", call
            assert not call["on_user_group"], f"rank {rank}: the per-step agreement ran on the user's NCCL group"
            assert call["backend"] == "gloo", call
        # Nothing but the collective itself: no copy to or from a device, no other op.
        assert len(report["step_ops"]) == len(SCHEDULE)
        for ops in report["step_ops"]:
            assert [op for op in ops if op != "aten.detach.default"] == ["c10d.allreduce_.default"], ops
        assert all(not call["on_user_group"] and call["backend"] == "gloo" for call in report["setup"]), report["setup"]
    assert reports[0]["results"] == reports[1]["results"]
    assert reports[0]["graph_runs"] == reports[1]["graph_runs"] == 5


def test_runner_built_captured_and_stepped_under_inference_mode():
    reports = run_ranks(inference_mode_worker, timeout_s=TIMEOUT_S)
    for rank, report in reports.items():
        agreements = report["setup"] + report["steps"]
        assert len(report["steps"]) == len(SCHEDULE)
        # gloo writes on worker threads; before pytorch#142184 (torch 2.6) they did not see inference
        # mode, so an inference tensor, or an object collective entered in inference mode, failed there.
        for call in agreements:
            assert not call.get("inference_tensor"), f"rank {rank}: an agreement tensor is an inference tensor: {call}"
        gathers = [call for call in agreements if call["kind"] == "all_gather_object"]
        assert gathers and not any(call["inference_mode"] for call in gathers), gathers
    assert reports[0]["results"] == reports[1]["results"]


def failing_capture_worker(rank: int) -> dict:
    """Rank 1's capture of bs=4 fails after the phase's collectives; every rank must fail it, and
    rank 0 must skip its verification (an eager step whose collective rank 1 would never join)."""
    model = AllReduceModel(sync_at=FAILING_SIZE if rank == 1 else None)
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=CAPTURE_SIZES, backend="emulated", progress=False,
                         warmup_iters=WARMUP_ITERS, process_group=dist.group.WORLD)
    report = runner.capture()
    calls_at_failing_size = model.calls.count(FAILING_SIZE)
    steps: list = []
    run_schedule(runner, model, rank, FAILURE_SCHEDULE, CAPTURE_SIZES, steps, failed={FAILING_SIZE})
    stats = runner.stats()
    return dict(ok=[str(key) for key in report.ok], failed={str(key): reason for key, reason in report.failed.items()},
                calls=calls_at_failing_size, steps=steps, eager_reasons=stats["eager_reasons"],
                graph_runs=stats["graph_runs"])


def test_a_key_failing_on_one_rank_fails_on_every_rank_and_skips_the_phases_after():
    reports = run_ranks(failing_capture_worker, timeout_s=TIMEOUT_S)
    zero, one = reports[0], reports[1]
    key = f"decode/bs={FAILING_SIZE}"
    assert list(one["failed"]) == [key] and one["failed"][key].startswith("HostSyncError"), one["failed"]
    assert list(zero["failed"]) == [key], zero["failed"]
    assert "rank 1" in zero["failed"][key] and "HostSyncError" in zero["failed"][key], zero["failed"][key]
    assert zero["ok"] == one["ok"] == ["decode/bs=8", "decode/bs=2", "decode/bs=1"]
    # Rank 0 warmed up and recorded bs=4 with rank 1, then verified nothing: no eager step at 4.
    assert zero["calls"] == WARMUP_ITERS + 1, f"rank 0 ran bs={FAILING_SIZE} {zero['calls']} times"
    assert zero["steps"] == one["steps"] == [(0, False), (1, True), (2, False)]
    assert zero["eager_reasons"] == one["eager_reasons"] == {"capture_failed": 2}
    assert zero["graph_runs"] == one["graph_runs"] == 1


def agreement_worker(rank: int) -> dict:
    """``Lockstep.agree_capture`` and the choice of CPU group, called directly on each rank."""
    lockstep = Lockstep(dist.group.WORLD)
    entry = SimpleNamespace(key=GraphKey(ForwardMode.DECODE, 4, 4))
    everyone_ok = lockstep.agree_capture(entry, "capture", None)
    peer_error = lockstep.agree_capture(entry, "verify", RuntimeError("boom") if rank == 1 else None)
    try:
        lockstep.agree_capture(SimpleNamespace(key=GraphKey(ForwardMode.DECODE, rank + 1, rank + 1)), "prepare", None)
        out_of_step = None
    except RuntimeError as error:
        out_of_step = str(error)
    rank_zero_only = dist.new_group([0], backend="gloo")  # every rank takes part in creating it
    try:
        Lockstep(dist.group.WORLD, cpu_group=rank_zero_only)
        wrong_ranks = None
    except ValueError as error:
        wrong_ranks = str(error)
    return dict(own_group=lockstep.cpu_group is dist.group.WORLD, everyone_ok=everyone_ok,
                peer_error=None if peer_error is None else f"{type(peer_error).__name__}: {peer_error}",
                out_of_step=out_of_step, wrong_ranks=wrong_ranks)


def test_capture_agreement_names_the_failed_rank_and_refuses_ranks_out_of_step():
    reports = run_ranks(agreement_worker, timeout_s=TIMEOUT_S)
    for rank, report in reports.items():
        assert report["own_group"], "a gloo process group carries the agreements itself"
        assert report["everyone_ok"] is None
        assert "every rank must capture the same keys in the same order" in report["out_of_step"]
        assert report["wrong_ranks"].startswith("cpu_group: expected the ranks of process_group [0, 1]")
    assert reports[0]["peer_error"] == "PeerCaptureError: verify of decode/bs=4 failed on rank 1: RuntimeError: boom"
    assert reports[1]["peer_error"] is None, "the failed rank keeps its own error"


def test_cpu_group_without_a_process_group_is_refused():
    with pytest.raises(ValueError, match="cpu_group: expected None without process_group"):
        RunnerConfig(cpu_group=object())


NCCL_STEPS = [3, 8, 1, 5, 12]  # 12 > the largest capture size: eager, the all-reduce outside a graph


def nccl_step(runner: GraphRunner, model: AllReduceModel, size: int) -> dict:
    """One step of ``size`` rows with host syncs made errors; what ran, and its largest difference from eager."""
    batch = decode_batch(size, device="cuda", seed=size)
    model.calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, sync_error = runner(batch), None
    except RuntimeError as error:  # a synchronizing call in the step
        out, sync_error = None, str(error)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    calls = list(model.calls)
    padded, graph = agreed_size((size,), CAPTURE_SIZES)
    padded_batch = pad_forward_batch(batch, padded, padded, runner.pad_values)
    expected = model(padded_batch.input_ids, padded_batch.positions, padded_batch)[:size]
    difference = None if out is None else float((out - expected).abs().max())
    return dict(size=size, graph=graph, padded=padded, calls=calls, sync_error=sync_error, difference=difference)


def nccl_worker(rank: int) -> dict:
    """A 1-rank NCCL group whose model all-reduces inside every captured graph."""
    model = AllReduceModel().cuda()
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=CAPTURE_SIZES, backend="cuda", device="cuda",
                         progress=False, process_group=dist.group.WORLD)
    report = runner.capture()
    steps = [nccl_step(runner, model, size) for size in NCCL_STEPS]
    return dict(user_backend=dist.get_backend(dist.group.WORLD), agreement_backend=dist.get_backend(runner.lockstep.cpu_group),
                ok=[str(key) for key in report.ok], failed={str(key): reason for key, reason in report.failed.items()},
                steps=steps, graph_runs=runner.stats()["graph_runs"])


@pytest.mark.cuda
def test_one_rank_nccl_group_captures_the_models_all_reduce_in_the_graph():
    if not dist.is_nccl_available():
        pytest.skip("this torch was built without NCCL")
    report = run_ranks(nccl_worker, world_size=1, backend="nccl", timeout_s=180)[0]
    assert report["user_backend"] == "nccl" and report["agreement_backend"] == "gloo"
    assert report["failed"] == {} and report["ok"] == ["decode/bs=8", "decode/bs=4", "decode/bs=2", "decode/bs=1"]
    for step in report["steps"]:
        assert step["sync_error"] is None, f"step of {step['size']} rows synchronized with the device: {step}"
        # A replay runs the captured kernels (the NCCL all-reduce included), never the model's Python.
        assert step["calls"] == ([] if step["graph"] else [step["padded"]]), step
        assert step["difference"] <= 1e-5, f"step of {step['size']} rows differs from eager: {step}"
    assert report["graph_runs"] == sum(step["graph"] for step in report["steps"]) == 4
