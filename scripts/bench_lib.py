"""Measurement core of scripts/bench.py: model setup, decode batches, verification, the timed
decode figures and throughput (how samples are taken: bench_timing)."""

from __future__ import annotations

import functools
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from bench_timing import Clock, Cost, Probe, Spread, Timed, time_rounds

from graphrt import ForwardBatch, GraphRunner
from graphrt.parallel.lockstep import pad_forward_batch
from graphrt.reference import (
    CachePools,
    ReferenceConfig,
    ReferenceDecoder,
    build_reference,
    generate_greedy,
    make_decode_batch,
    run_eager,
)

# Model presets; ``realistic`` keeps the 16-layer, hidden-1024 shape of ReferenceConfig.realistic()
# with a shorter context, since the torch-native attention gathers
# [tokens, max_context_len, kv_heads, head_dim] per layer.
PRESETS: Dict[str, Callable[..., ReferenceConfig]] = {
    "tiny": ReferenceConfig.tiny,
    "small": functools.partial(
        ReferenceConfig, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=704,
        vocab_size=4096, max_context_len=256,
    ),
    "realistic": functools.partial(ReferenceConfig.realistic, max_context_len=512),
}
TOLERANCE = {torch.float32: 1e-4}  # atol = rtol for graph vs eager logits; 2e-2 for 16-bit types


def model_config(preset: str, dtype: torch.dtype, overrides: Dict[str, Optional[int]]) -> ReferenceConfig:
    """The preset's shape with the ``overrides`` that are not None, in ``dtype``."""
    return PRESETS[preset](dtype=dtype, **{name: value for name, value in overrides.items() if value is not None})


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(param.numel() for param in model.parameters())


@dataclass
class Workload:
    """The reference model wired to its attention backend and paged KV cache on one device."""

    config: ReferenceConfig
    model: ReferenceDecoder
    backend: Any
    pools: CachePools
    device: torch.device

    @classmethod
    def build(cls, config: ReferenceConfig, max_requests: int, device: torch.device) -> "Workload":
        """Model, backend and pools for ``max_requests`` live requests; the KV cache holds random values."""
        model, backend, pools = build_reference(config, num_requests=max_requests + 1, device=device)
        generator = torch.Generator(device=device).manual_seed(config.seed)
        for buffer in (*pools.kv.k_buffers, *pools.kv.v_buffers):
            buffer.normal_(generator=generator)
        return cls(config, model, backend, pools, device)

    @contextmanager
    def decode_batch(self, batch_size: int, rng: random.Random) -> Iterator[ForwardBatch]:
        """A DECODE batch of ``batch_size`` requests with cached contexts of 1/4 to 1/2 of the
        maximum context; its requests and KV slots are released on exit."""
        context = self.config.max_context_len
        pools = self.pools
        reqs = [pools.req_to_token.alloc() for _ in range(batch_size)]
        lens = [rng.randint(max(2, context // 4), max(2, context // 2)) for _ in reqs]
        pools.assign(reqs, [0] * batch_size, [n - 1 for n in lens])
        out_cache_loc = pools.assign(reqs, [n - 1 for n in lens], [1] * batch_size)
        input_ids = [rng.randrange(self.config.vocab_size) for _ in reqs]
        try:
            yield make_decode_batch(
                input_ids, reqs, lens, out_cache_loc, self.device, pools=pools, attn_backend=self.backend
            )
        finally:
            for req, seq_len in zip(reqs, lens):
                pools.release(req, seq_len)

    def prompts(self, count: int, new_tokens: int, rng: random.Random) -> List[List[int]]:
        """``count`` random prompts of 4 to 32 tokens that leave room for ``new_tokens``."""
        longest = max(1, min(32, self.config.max_context_len - new_tokens))
        return [
            [rng.randrange(self.config.vocab_size) for _ in range(rng.randint(min(4, longest), longest))]
            for _ in range(count)
        ]


@dataclass
class Verification:
    """Graph logits of the real rows against eager logits of the same batch padded like the runner pads it."""

    padded_size: int
    max_abs_diff: float
    bitwise_equal: bool
    tolerance: float
    max_abs_diff_unpadded: float  # against eager at the real size (other GEMM shapes: informative only)
    ok: bool


def verify_graph(work: Workload, runner: GraphRunner, batch: ForwardBatch, padded: int) -> Verification:
    """Run ``batch`` through the runner and eagerly (padded and unpadded) and compare the logits."""
    graph = runner(batch).clone()
    eager_padded = run_eager(work.model, pad_forward_batch(batch, padded, padded, runner.pad_values))[
        : batch.batch_size]
    eager = run_eager(work.model, batch)
    tolerance = TOLERANCE.get(work.config.dtype, 2e-2)
    return Verification(
        padded_size=padded,
        max_abs_diff=float((graph - eager_padded).abs().max()),
        bitwise_equal=bool(torch.equal(graph, eager_padded)),
        tolerance=tolerance,
        max_abs_diff_unpadded=float((graph - eager).abs().max()),
        ok=bool(torch.allclose(graph, eager_padded, atol=tolerance, rtol=tolerance)),
    )


@dataclass
class BatchResult:
    """Every figure measured for one decode batch size (times in µs per call)."""

    batch_size: int
    padded_size: int
    verification: Verification
    inner_calls: Dict[str, int]
    times_us: Dict[str, Spread]  # eager, compile, graph, replay, hook, trivial
    # overhead: graph - raw replay, paired; rest: overhead - attention hook - graphrt's own cost at the floor
    costs: Dict[str, Cost]
    floor: Timed  # graphrt's own cost at the floor on the same batch, in rounds of its own (bench_floor)
    graph_speedup: float  # median eager / median graph
    replay_speedup: float  # median eager / median raw replay (emulated: the model's Python saved)


def graph_entry(runner: GraphRunner, batch: ForwardBatch) -> Any:
    """The registry entry the runner replays for ``batch`` (it must not run eagerly)."""
    decision = runner.dispatcher.decide(batch)
    if decision.reason is not None:
        raise RuntimeError(f"{batch.forward_mode.name} batch of {batch.batch_size} requests, {batch.num_tokens} tokens "
                           f"would run eagerly: {decision.reason.value}")
    return decision.entry


def probes_for(work: Workload, runner: GraphRunner, batch: ForwardBatch, compiled: Optional[Callable]) -> List[Probe]:
    """The timed callables of one batch size, in an order where each keeps its preconditions:
    the raw replay and the attention hook follow a runner call, which leaves the backend
    pointing at the graph's static metadata (the emulated replay reads it)."""
    trivial = torch.zeros(1, device=work.device)
    static_batch = graph_entry(runner, batch).static_inputs
    hook = work.backend.init_forward_metadata_replay
    probes = [("eager", lambda: run_eager(work.model, batch))]
    if compiled is not None:
        probes.append(("compile", lambda: compiled(batch)))
    probes += [
        ("graph", lambda: runner(batch)),
        ("replay", graph_entry(runner, batch).graph.replay),
        ("hook", lambda: hook(static_batch)),
        ("trivial", lambda: trivial.add_(1)),
    ]
    return probes


def measure_batch(
    work: Workload,
    runner: GraphRunner,
    batch: ForwardBatch,
    clock: Clock,
    iters: int,
    warmup: int,
    floor_of: Callable[[ForwardBatch], Timed],
    compiled: Optional[Callable] = None,
    on_round: Callable[[], None] = lambda: None,
) -> BatchResult:
    """Verify the graph against eager for ``batch``, take graphrt's own cost at the floor on it
    (``floor_of``, rounds of its own), then time the reference model's probes in their rounds."""
    entry = graph_entry(runner, batch)
    verification = verify_graph(work, runner, batch, entry.key.num_reqs)
    if not verification.ok:
        raise RuntimeError(
            f"batch size {batch.batch_size}: graph logits differ from eager at padded size "
            f"{entry.key.num_reqs} by {verification.max_abs_diff:.3g} (tolerance {verification.tolerance})"
        )
    floor = floor_of(batch)
    inner, samples = time_rounds(clock, probes_for(work, runner, batch, compiled), iters, warmup, on_round)
    times = {name: Spread.of(values) for name, values in samples.items()}
    overhead = [graph - replay for graph, replay in zip(samples["graph"], samples["replay"])]
    own = floor.costs["runner"].us.median  # the one-op runner validates the same way (the default check_values)
    rest = [value - hook - own for value, hook in zip(overhead, samples["hook"])]
    return BatchResult(
        batch_size=batch.batch_size,
        padded_size=entry.key.num_reqs,
        verification=verification,
        inner_calls=inner,
        times_us=times,
        costs={"overhead": Cost.of(overhead, samples["trivial"]), "rest": Cost.of(rest, samples["trivial"])},
        floor=floor,
        graph_speedup=times["eager"].median / times["graph"].median,
        replay_speedup=times["eager"].median / times["replay"].median,
    )


@dataclass
class Throughput:
    """Greedy generation of ``new_tokens`` per prompt, eagerly and with ``step=runner`` (prefill eager in both)."""

    prompts: int
    new_tokens: int
    repeats: int
    eager_s: float  # median wall seconds of one generate_greedy call
    graph_s: float
    same_tokens: bool
    runner_eager_steps: int  # decode steps the runner ran eagerly instead of replaying (expected 0)

    @property
    def eager_tokens_per_s(self) -> float:
        return self.prompts * self.new_tokens / self.eager_s

    @property
    def graph_tokens_per_s(self) -> float:
        return self.prompts * self.new_tokens / self.graph_s


def measure_throughput(
    work: Workload, runner: GraphRunner, prompts: List[List[int]], new_tokens: int, repeats: int
) -> Throughput:
    """Median wall time of ``repeats`` generations each way, after one short warm-up each."""
    steps = {"eager": None, "graph": runner}
    seconds: Dict[str, List[float]] = {name: [] for name in steps}
    tokens: Dict[str, List[List[int]]] = {}
    for step in steps.values():
        generate_greedy(work.model, work.backend, work.pools, prompts, 2, step=step)
    eager_steps_before = runner.stats()["eager_runs"]
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            tokens[name] = generate_greedy(work.model, work.backend, work.pools, prompts, new_tokens, step=step)
            seconds[name].append(time.perf_counter() - start)  # generate_greedy ends with a host read
    return Throughput(
        prompts=len(prompts), new_tokens=new_tokens, repeats=repeats,
        eager_s=float(np.median(seconds["eager"])), graph_s=float(np.median(seconds["graph"])),
        same_tokens=tokens["eager"] == tokens["graph"],
        runner_eager_steps=runner.stats()["eager_runs"] - eager_steps_before,
    )

