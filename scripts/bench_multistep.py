"""Several decode steps per launch (``GraphRunner.decode``): graphrt's own host cost per generated
token for K = 1, 2, 4, 8 on a one-op model, host calls per token, capture time and output memory per
multi-step key, and the reference model's greedy tokens per second for each K.

The host cost of ``decode(batch, K)`` is the call minus the raw replay of the graph it launches (for
K = 1 the single-step graph; the call also runs ``next_tokens``), in paired rounds of their own
(bench_timing: each round's difference divided by that round's trivial op), divided by K. The target
for K > 1 is the K = 1 cost divided by K plus one trivial op: staging the batch and replaying once
must cost about what one step costs, whatever the number of steps. Host calls are counted, not
timed: the torch ops graphrt issues on the host per call (staging copies, the views that split the
slots, the attention hook's ops) plus its graph launches, divided by K.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Sequence

import numpy as np
import torch
from bench_floor import CHECK_VARIANTS, LABELS, format_cost, one_op_model, without_context
from bench_lib import Workload
from bench_timing import COST_PARTS, Clock, Cost, Probe, Spread, Timed, time_rounds, verdict
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt import ForwardBatch, ForwardMode, GraphRunner
from graphrt.capture import CaptureReport
from graphrt.reference import generate_greedy, graph_runner_kwargs

K_VALUES = (1, 2, 4, 8)
MULTI_STEPS = tuple(k for k in K_VALUES if k > 1)


def identity_tokens(output: torch.Tensor, step: int) -> torch.Tensor:
    """The one-op model's sampler: its output (``input_ids + positions``) is the next step's ids."""
    return output


def one_op_multistep_runners(device: torch.device, backend: str, sizes: Sequence[int],
                             pad_values: Mapping[str, int]) -> Dict[str, GraphRunner]:
    """Captured one-op runners with multi-step keys for K in MULTI_STEPS at ``sizes``, per check variant."""
    runners = {}
    for name, extra in CHECK_VARIANTS.items():
        runner = GraphRunner(one_op_model, max_batch_size=max(sizes), capture_sizes=list(sizes), backend=backend,
                             device=device, decode_steps=MULTI_STEPS, next_tokens=identity_tokens,
                             pad_values=pad_values, progress=False, **extra)
        report = runner.capture()
        if report.failed:
            raise SystemExit(f"capture of the one-op multi-step runner {name!r} failed:\n{report}")
        runners[name] = runner
    return runners


def launch_batch(batch_size: int, steps: int, device: torch.device) -> ForwardBatch:
    """A DECODE batch of the one-op model with the slots of ``steps`` steps (requests and slots from 1)."""
    seq_lens = torch.arange(2, 2 + batch_size, dtype=torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=batch_size,
        input_ids=torch.arange(batch_size, device=device), req_pool_indices=torch.arange(1, 1 + batch_size, device=device),
        seq_lens=seq_lens.to(device), out_cache_loc=torch.arange(1, 1 + steps * batch_size, device=device),
        seq_lens_sum=int(seq_lens.sum()), positions=(seq_lens.long() - 1).to(device))


def graph_of(runner: GraphRunner, batch: ForwardBatch, steps: int) -> Any:
    """The graph ``runner.decode(batch, steps)`` replays (K = 1: the single-step key's)."""
    first = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc[:batch.batch_size])
    decision = runner.dispatcher.decide(first if steps == 1 else batch, steps)
    if decision.reason is not None:
        raise RuntimeError(f"decode of {batch.batch_size} requests, {steps} steps would not replay: "
                           f"{decision.reason.value}")
    return decision.entry.graph


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def launches_counted(runner: GraphRunner) -> Iterator[List[int]]:
    """Every graph of ``runner`` counts its replays instead of running them (so the ops counted are the host's)."""
    count = [0]
    graphs = [entry.graph for entry in runner.registry.entries.values() if entry.graph is not None]
    own = [(graph, graph.__dict__.get("replay")) for graph in graphs]  # a CUDA graph's replay is an attribute
    for graph in graphs:
        graph.replay = lambda: count.__setitem__(0, count[0] + 1)
    try:
        yield count
    finally:
        for graph, replay in own:
            if replay is None:
                del graph.replay
            else:
                graph.replay = replay


def host_calls_per_token(runner: GraphRunner, batch: ForwardBatch, steps: int) -> float:
    """Torch ops on the host plus graph launches of one ``decode(batch, steps)`` call, per token."""
    runner.decode(batch, steps)  # warm: cut views and staging views are built once per size
    with launches_counted(runner) as launches, _OpCounter() as counter:
        runner.decode(batch, steps)
    return (counter.ops + launches[0]) / steps


@dataclass
class StepsFloor:
    """graphrt's host cost per generated token at one batch size, per check variant and K."""

    batch_size: int
    timed: Timed  # probes decode_K / replay_K per variant; costs "<variant>/K=<k>" per token
    targets: Dict[str, float]  # "<variant>/K=<k>": the K = 1 cost / k + 1 trivial op (k > 1)
    verdicts: Dict[str, str]
    host_calls_per_token: Dict[str, float]  # "K=<k>"


def steps_floor(runners: Mapping[str, GraphRunner], batch_size: int, clock: Clock, iters: int,
                warmup: int) -> StepsFloor:
    """Time ``decode(batch, K)`` against the raw replay of its graph for every K and variant."""
    device = next(iter(runners.values())).device
    batches = {k: without_context(launch_batch(batch_size, k, device)) for k in K_VALUES}
    probes: List[Probe] = []
    for name, runner in runners.items():
        for k, batch in batches.items():
            probes += [(f"{name}/decode/K={k}", lambda runner=runner, batch=batch, k=k: runner.decode(batch, k)),
                       (f"{name}/replay/K={k}", graph_of(runner, batch, k).replay)]
    trivial = torch.zeros(1, device=device)
    inner, samples = time_rounds(clock, [*probes, ("trivial", lambda: trivial.add_(1))], iters, warmup,
                                 best_of=COST_PARTS)
    timed = Timed(inner, {name: Spread.of(values) for name, values in samples.items()}, {})
    for name in runners:
        for k in K_VALUES:
            per_token = [(call - replay) / k for call, replay in zip(samples[f"{name}/decode/K={k}"],
                                                                      samples[f"{name}/replay/K={k}"])]
            timed.costs[f"{name}/K={k}"] = Cost.of(per_token, samples["trivial"])
    targets, verdicts = {}, {}
    for name in runners:
        single = timed.costs[f"{name}/K=1"].trivial_ops.median
        for k in MULTI_STEPS:
            label = f"{name}/K={k}"
            targets[label] = single / k + 1
            verdicts[label] = verdict(dataclasses.asdict(timed.costs[label]), targets[label])
    plain = runners["runner_metadata_only"]
    calls = {f"K={k}": host_calls_per_token(plain, batch, k) for k, batch in batches.items()}
    return StepsFloor(batch_size, timed, targets, verdicts, calls)


@dataclass
class StepsThroughput:
    """Greedy generation through one runner with K decode steps per launch."""

    steps_per_launch: int
    seconds: float  # median wall seconds of one generate_greedy call
    tokens_per_s: float
    same_tokens: bool  # as K = 1
    multi_step_runs: int  # per generate call
    fallbacks: Dict[str, int]  # multi_step_fallbacks per generate call


def reference_throughput(work: Workload, runner: GraphRunner, prompts: List[List[int]], new_tokens: int,
                         repeats: int) -> List[StepsThroughput]:
    """``generate_greedy(steps_per_launch=K)`` for each K, interleaved over ``repeats`` rounds (the
    generation ends with a host read of the tokens), each after a short warm-up."""
    seconds: Dict[int, List[float]] = {k: [] for k in K_VALUES}
    tokens: Dict[int, List[List[int]]] = {}
    runs: Dict[int, Counter] = {k: Counter() for k in K_VALUES}

    def generate(k: int, count: int) -> List[List[int]]:
        return generate_greedy(work.model, work.backend, work.pools, prompts, count, step=runner, steps_per_launch=k)

    for k in K_VALUES:
        generate(k, 2)
    for _ in range(repeats):
        for k in K_VALUES:
            before = runner.stats()
            start = time.perf_counter()
            tokens[k] = generate(k, new_tokens)
            seconds[k].append(time.perf_counter() - start)
            after = runner.stats()
            runs[k]["multi_step_runs"] += after["multi_step_runs"] - before["multi_step_runs"]
            runs[k].update({reason: count - before["multi_step_fallbacks"].get(reason, 0)
                            for reason, count in after["multi_step_fallbacks"].items()})
    results = []
    for k in K_VALUES:
        median = float(np.median(seconds[k]))
        per_call = {name: count // repeats for name, count in runs[k].items() if count}
        results.append(StepsThroughput(k, median, len(prompts) * new_tokens / median, tokens[k] == tokens[1],
                                       per_call.pop("multi_step_runs", 0), per_call))
    return results


def capture_per_key(report: CaptureReport) -> List[Dict[str, Any]]:
    """Capture time and memory of each key of a report (multi-step keys and the single-step keys beside them)."""
    return [{"key": str(key.key), "steps": key.key.steps, "seconds": key.seconds, "verify_seconds": key.verify_seconds,
             "output_bytes": key.output_bytes, "pool_bytes": key.pool_bytes, "ok": key.ok} for key in report.keys]


def measure_multistep(work: Workload, backend: str, clock: Clock, batch_sizes: Sequence[int], prompts: List[List[int]],
                      new_tokens: int, repeats: int, iters: int, warmup: int) -> Dict[str, Any]:
    """The whole section: the one-op floor per batch size, then the reference model's runner with
    multi-step keys at the prompts' batch size (its capture per key, its tokens per second per K)."""
    start = time.perf_counter()
    runner_kwargs = graph_runner_kwargs(work.backend, work.pools)
    sizes = sorted({batch_sizes[0], batch_sizes[-1]})
    one_op = one_op_multistep_runners(work.device, backend, sizes, runner_kwargs["pad_values"])
    floors = [steps_floor(one_op, size, clock, iters, warmup) for size in sizes]
    runner = GraphRunner(work.model, max_batch_size=len(prompts), capture_sizes=[len(prompts)], backend=backend,
                         device=work.device, decode_steps=MULTI_STEPS, progress=False, **runner_kwargs)
    report = runner.capture()
    if report.failed:
        raise SystemExit(f"capture of the reference model's multi-step keys failed:\n{report}")
    throughput = reference_throughput(work, runner, prompts, new_tokens, repeats)
    if not all(result.same_tokens for result in throughput):
        raise RuntimeError("generation with several steps per launch gave other tokens than one step per launch")
    verdicts = [each for floor in floors for name, each in floor.verdicts.items() if name.startswith("runner_metadata_only/")]
    return {"k_values": list(K_VALUES), "floor": [dataclasses.asdict(floor) for floor in floors],
            "within_target": bool(verdicts) and all(each == "yes" for each in verdicts),  # metadata only (as on a GPU)
            "capture": capture_per_key(report),
            "throughput": [dataclasses.asdict(result) for result in throughput],
            "emulated": runner.backend_name == "emulated", "seconds": time.perf_counter() - start}


def format_multistep(section: Mapping[str, Any]) -> List[str]:
    """Report lines for the multi-step section of the JSON document."""
    lines = ["", "several decode steps per launch (GraphRunner.decode): graphrt's host cost per generated token, "
                 "one-op model (decode - raw replay of its graph, / K; trivial ops of the same rounds); "
                 "target for K > 1: the K=1 cost / K + 1"]
    for floor in section["floor"]:
        lines.append(f"  bs {floor['batch_size']}: host calls per token (torch ops + launches): "
                     + ", ".join(f"{k} {calls:.2f}" for k, calls in floor["host_calls_per_token"].items()))
        for name, label in LABELS.items():
            figures = []
            for k in section["k_values"]:
                key = f"{name}/K={k}"
                figure = f"K={k} {format_cost(floor['timed']['costs'][key])}"
                if key in floor["targets"]:
                    figure += f" (<= {floor['targets'][key]:.2f}: {floor['verdicts'][key]})"
                figures.append(figure)
            lines.append(f"    {label}: " + "; ".join(figures))
    lines.append(f"  within target, metadata only (as on a GPU), every batch size and K: "
                 f"{'yes' if section['within_target'] else 'NO or unclear (noise)'}")
    lines.append("  capture per key (reference model): " + ", ".join(
        f"{key['key']} {key['seconds']:.2f}s {key['output_bytes'] / 2**10:.1f} KiB out" for key in section["capture"]))
    label = " (EMULATED backend: CPU replay of recorded ops, not a GPU figure)" if section["emulated"] else ""
    lines.append(f"  reference model, greedy tokens/s per K{label}: " + ", ".join(
        f"K={row['steps_per_launch']} {row['tokens_per_s']:,.0f}" + ("" if row["same_tokens"] else " (OTHER TOKENS)")
        for row in section["throughput"]))
    lines.append(f"multi-step section: {section['seconds']:.1f} s")
    return lines
