"""Batches above the largest captured size: eager on the whole batch vs micro-batched graphs."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
from bench_lib import Workload
from bench_timing import Clock, Spread, time_rounds

from graphrt import GraphRunner
from graphrt.reference import run_eager


@dataclass
class UBatchResult:
    """One oversized decode batch: how it was split and what each path costs (µs per call)."""

    batch_size: int
    pieces: Dict[str, int]  # graph key -> replays per call
    eager_runs_per_call: int
    max_abs_diff: float
    times_us: Dict[str, Spread]
    speedup: float  # median eager / median micro-batched


def measure_ubatch(work: Workload, runner: GraphRunner, clock: Clock, sizes: Sequence[int], iters: int,
                   warmup: int, rng: random.Random, tolerance: float) -> List[UBatchResult]:
    """For each size: check the micro-batched result against eager on the whole batch, then time both."""
    results = []
    for batch_size in sizes:
        with work.decode_batch(batch_size, rng) as batch:
            before = runner.stats()
            out = runner(batch).clone()
            after = runner.stats()
            expected = run_eager(work.model, batch)
            diff = float((out - expected).abs().max())
            if not torch.allclose(out, expected, atol=tolerance, rtol=tolerance):
                raise RuntimeError(f"micro-batched batch of {batch_size} differs from eager by {diff:.3g}")
            pieces = {key: hits - before["key_hits"].get(key, 0) for key, hits in after["key_hits"].items()
                      if hits != before["key_hits"].get(key, 0)}
            probes = [("eager", lambda: run_eager(work.model, batch)), ("ubatch", lambda: runner(batch))]
            _, samples = time_rounds(clock, probes, iters, warmup)
        times = {name: Spread.of(values) for name, values in samples.items()}
        results.append(UBatchResult(batch_size, pieces, after["eager_runs"] - before["eager_runs"], diff, times,
                                    times["eager"].median / times["ubatch"].median))
    return results


def format_ubatch(results: Sequence[UBatchResult], largest: int) -> List[str]:
    """Report lines for the micro-batch section."""
    lines = ["", f"batches above the largest captured size ({largest}): eager whole batch vs micro-batched graphs, us"]
    for result in results:
        pieces = " + ".join(f"{key.split('=')[-1]}x{count}" if count > 1 else key.split("=")[-1]
                            for key, count in sorted(result.pieces.items(), key=lambda kv: -int(kv[0].split("=")[-1])))
        lines.append(
            f"bs {result.batch_size:>4}: eager {result.times_us['eager'].median:,.0f}, micro-batched "
            f"{result.times_us['ubatch'].median:,.0f} ({result.speedup:.2f}x), pieces {pieces}, "
            f"eager pieces {result.eager_runs_per_call}, max |diff| {result.max_abs_diff:.2e}"
        )
    return lines
