"""The optional peer of scripts/bench.py: the reference model under torch.compile(mode="reduce-overhead").

GPU only (the benchmark skips it on CPU or with --no-compile). The attention metadata is built
eagerly before each call, as in an eager step; inductor may run a graph without CUDA graphs
(e.g. when the model mutates an input such as the KV cache) and counts it in ``cudagraph_skips``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from bench_lib import Workload
from bench_timing import Clock

from graphrt import ForwardBatch
from graphrt.reference import ReferenceDecoder, run_eager


@dataclass
class CompileWarmup:
    """First calls of the torch.compile peer at one batch size: compile seconds, agreement with eager."""

    seconds: float
    max_abs_diff: float
    cudagraph_skips: int  # inductor's count so far of graphs it ran without CUDA graphs (e.g. mutated inputs)


def compiled_step(model: ReferenceDecoder) -> Callable[[ForwardBatch], torch.Tensor]:
    """The peer: eager attention metadata, then the model under torch.compile(mode="reduce-overhead")."""
    for limit in ("cache_size_limit", "recompile_limit"):  # one graph per batch size, no silent eager fallback
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def step(batch: ForwardBatch) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        model.attn_backend.init_forward_metadata(batch)
        return compiled(batch.input_ids, batch.positions, batch)

    return step


def warm_compiled(step: Callable[[ForwardBatch], torch.Tensor], work: Workload, batch: ForwardBatch,
                  clock: Clock) -> CompileWarmup:
    """Compile and record the peer's graphs for ``batch`` (three calls), then compare with eager."""
    clock.sync()
    start = time.perf_counter()
    for _ in range(3):
        logits = step(batch).clone()
    clock.sync()
    seconds = time.perf_counter() - start
    skips = int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0))
    return CompileWarmup(seconds, float((logits - run_eager(work.model, batch)).abs().max()), skips)
