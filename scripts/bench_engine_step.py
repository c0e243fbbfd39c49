"""The engine's host cost per decode step, at growing depths and request counts, beside the nano-vllm-shaped anchor.

    PYTHONPATH=. python scripts/bench_engine_step.py [--layers 1,4,16,32] [--requests 1,4,16] [--repeats 3]

"Host" is a decode step's time minus the time spent inside graph replays: what graphrt's engine adds to
the graph it replays (scheduling, batch building and staging, the runner's call, sampling, reading the
tokens). Each figure is the difference of two ``generate()`` calls of the same prompts (4 tokens each,
``eos_token_id=None``) that differ only in how many tokens they generate, divided by the extra decode
steps, so the prefill and each call's setup cancel; each call is the best of ``--repeats``. Two clocks:
this thread's CPU time (``time.thread_time``: what the step costs the host, unmoved by other processes
on a shared machine; torch runs on one thread here) and wall time. The model is a tiny random Llama
(hidden 64, intermediate 128, head_dim 16) at each depth of ``--layers``; the engine captures decode
graphs at the request count only (``capture_sizes``) and one piecewise size for the prefill.

The anchor is the nano-vllm-shaped engine of tests/client_helpers.py (``ModelRunner``, mode ``runner``:
its own host-built decode batches through a GraphRunner, ``argmax().tolist()`` per step) on its own
Qwen3-shaped model of the same depth, measured the same way. On CPU every graph is the emulated
backend; the replay time it excludes is not a GPU's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from client_helpers import ModelRunner, Qwen3ForCausalLM  # noqa: E402
from hf_engine_helpers import ragged_prompts  # noqa: E402
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.backends.emulated import EmulatedGraph  # noqa: E402

PROMPT_TOKENS = 4
SHORT, LONG = 5, 21  # new tokens of the two calls: LONG - SHORT extra decode steps
DEPTHS = (1, 4, 16, 32)
REQUESTS = (1, 4, 16)
QUICK_DEPTHS, QUICK_REQUESTS = (1, 4), (1, 4)


@dataclass
class HostCost:
    """One path's cost per decode step (ms): this thread's CPU time outside replays, wall time outside
    replays, and the CPU time inside them."""

    cpu_ms: float
    wall_ms: float
    replay_ms: float


@dataclass
class StepRow:
    """The engine and the anchor at one depth and request count."""

    layers: int
    requests: int
    engine: HostCost
    anchor: HostCost


class ReplayClock:
    """Time spent inside graph replays (emulated graphs; CUDA graphs' replay calls where CUDA is present),
    by this thread's CPU clock and the wall clock."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    @contextmanager
    def installed(self) -> Iterator["ReplayClock"]:
        classes = [EmulatedGraph] + ([torch.cuda.CUDAGraph] if torch.cuda.is_available() else [])
        originals = [(cls, cls.replay) for cls in classes]
        clock = self

        def timed(original: Callable[..., None]) -> Callable[..., None]:
            def replay(graph: object) -> None:
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    original(graph)
                finally:
                    clock.cpu += time.thread_time() - cpu
                    clock.wall += time.perf_counter() - wall
            return replay

        for cls, original in originals:
            cls.replay = timed(original)
        try:
            yield self
        finally:
            for cls, original in originals:
                cls.replay = original


def host_cost(call: Callable[[int], object], repeats: int, after_warmup: Callable[[], None] = lambda: None) -> HostCost:
    """The cost per extra decode step of ``call(new_tokens)`` (see the module docstring); ``after_warmup``
    runs after the first, untimed call."""
    clock = ReplayClock()

    def outside(new_tokens: int) -> Tuple[float, float, float]:
        clock.cpu = clock.wall = 0.0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.thread_time()
        call(new_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.thread_time() - cpu - clock.cpu, time.perf_counter() - wall - clock.wall, clock.cpu

    with clock.installed():
        call(LONG)  # warm-up: captures, and every decode width the timed calls read
        after_warmup()
        runs = {length: [outside(length) for _ in range(repeats)] for length in (SHORT, LONG)}
    best = {length: [min(run[part] for run in runs[length]) for part in range(3)] for length in runs}
    steps = LONG - SHORT
    return HostCost(*(1e3 * (best[LONG][part] - best[SHORT][part]) / steps for part in range(3)))


def engine_call(layers: int, requests: int, device: str) -> Tuple[Callable[[int], object], graphrt.hf.HFEngine]:
    """``generate`` of ``requests`` prompts on an engine over a tiny Llama of ``layers`` layers, and the engine."""
    model = tiny_model("llama", device, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16)
    budget = PROMPT_TOKENS * requests
    engine = graphrt.hf.engine_model(model, max_requests=requests, max_context=64, max_step_tokens=budget,
                                     capture_sizes=[requests], piecewise_sizes=[budget])
    prompts = ragged_prompts([PROMPT_TOKENS] * requests)
    return lambda new_tokens: engine.generate(prompts, max_new_tokens=new_tokens, eos_token_id=None), engine


def anchor_call(layers: int, requests: int) -> Callable[[int], object]:
    """nano-vllm's ModelRunner (graphs through a GraphRunner) on its model of ``layers`` layers."""
    blocks_per_request = -(-(PROMPT_TOKENS + LONG) // 4)
    runner = ModelRunner(Qwen3ForCausalLM(block_size=4, layers=layers), "runner", num_blocks=requests * blocks_per_request,
                         max_num_seqs=requests, max_blocks_per_seq=blocks_per_request, capture_sizes=[requests])
    prompts = ragged_prompts([PROMPT_TOKENS] * requests)
    prompts = [[token % 64 for token in prompt] for prompt in prompts]  # the anchor's vocabulary
    return lambda new_tokens: runner.generate(prompts, [new_tokens] * requests)


def unwatched(engine: object) -> Callable[[], None]:
    """Takes ``engine`` off the guards' watch list (graphrt.guards.epoch.WATCHED): its own attribute
    assignments then move no state epoch (issue 47's first item makes this needless)."""
    from graphrt.guards import epoch

    return lambda: epoch.WATCHED.pop(id(engine), None)


def measure(depths: Sequence[int], requests: Sequence[int], repeats: int, device: str = "cpu",
            unwatch: bool = False) -> List[StepRow]:
    """Every (depth, request count): the engine's and the anchor's cost per decode step (``unwatch``: the
    engine taken off the guards' watch list after its first call)."""
    rows = []
    with torch.no_grad():
        for layers in depths:
            for count in requests:
                call, built = engine_call(layers, count, device)
                engine = host_cost(call, repeats, unwatched(built) if unwatch else lambda: None)
                anchor = host_cost(anchor_call(layers, count), repeats)
                rows.append(StepRow(layers, count, engine, anchor))
    return rows


def format_rows(rows: Sequence[StepRow]) -> List[str]:
    """A Markdown table: host ms per decode step (CPU clock, then wall), the engine against the anchor."""
    lines = ["| layers | requests | engine host ms/step (CPU) | anchor (CPU) | engine/anchor | engine wall | "
             "anchor wall | replay ms/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ratio = row.engine.cpu_ms / row.anchor.cpu_ms if row.anchor.cpu_ms > 0 else float("nan")
        lines.append(f"| {row.layers} | {row.requests} | {row.engine.cpu_ms:.3f} | {row.anchor.cpu_ms:.3f} | "
                     f"{ratio:.2f} | {row.engine.wall_ms:.3f} | {row.anchor.wall_ms:.3f} | {row.engine.replay_ms:.2f} |")
    return lines


def depth_ratios(rows: Sequence[StepRow]) -> Dict[int, float]:
    """Per request count: the engine's host CPU ms at the deepest model over the shallowest's."""
    ratios = {}
    for count in sorted({row.requests for row in rows}):
        by_depth = sorted((row.layers, row.engine.cpu_ms) for row in rows if row.requests == count)
        if len(by_depth) > 1 and by_depth[0][1] > 0:
            ratios[count] = by_depth[-1][1] / by_depth[0][1]
    return ratios


def as_json(rows: Sequence[StepRow]) -> Dict[str, object]:
    return {"rows": [asdict(row) for row in rows], "depth_ratio": depth_ratios(rows),
            "method": f"generate() of {SHORT} and {LONG} new tokens, prompts of {PROMPT_TOKENS}, difference per step"}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--requests", default=",".join(map(str, REQUESTS)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unwatch", action="store_true",
                        help="take the engine off the guards' watch list after its first call")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    depths = [int(value) for value in args.layers.split(",")]
    counts = [int(value) for value in args.requests.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows = measure(depths, counts, args.repeats, unwatch=args.unwatch)
    print("\n".join(format_rows(rows)))
    print("deepest over shallowest (engine, CPU):", {count: round(ratio, 2) for count, ratio in depth_ratios(rows).items()})
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
