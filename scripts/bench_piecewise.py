"""Prefill and mixed steps with varlen attention: eager vs piecewise graphs, graphrt's own piecewise
cost, and which path a chunked-prefill trace's tokens take (full graph, pieces, eager).

The reference model runs with ``attention="varlen"``: decode through full graphs, prefill and
mixed steps through the ``varlen_attention`` custom op, the runner's splitting op.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
from bench_floor import CHECK_VARIANTS, LABELS, TARGETS, format_figure, one_op_runners, piecewise_floor, raw_replay
from bench_lib import Workload, graph_entry
from bench_timing import Clock, Spread, Timed, time_rounds

from graphrt import ForwardBatch, ForwardMode, GraphRunner
from graphrt.parallel.lockstep import pad_forward_batch
from graphrt.reference import VARLEN_OP, ReferenceConfig, build_reference, graph_runner_kwargs, run_eager
from graphrt.reference.generate import make_decode_batch, make_extend_batch

PIECEWISE_SIZES = (16, 32, 64, 128)
# Chunked-prefill budgets per step: the largest piecewise size, and twice it (its fuller steps run eagerly).
TRACE_TOKEN_BUDGETS = (PIECEWISE_SIZES[-1], 2 * PIECEWISE_SIZES[-1])
TRACE_REQUESTS = 16


@torch.library.custom_op("graphrt_bench::copy_rows", mutates_args=())
def copy_rows(x: torch.Tensor) -> torch.Tensor:
    """The splitting op of the one-op piecewise model: a copy (the cheapest op that returns fresh memory)."""
    return x.clone()


def one_op_piecewise_model(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """One op between two splits (3 pieces of one op each): runner minus raw replay is graphrt's
    own cost per piecewise step."""
    return copy_rows(copy_rows(input_ids + positions) + 1) + 1


@dataclass
class PiecewiseResult:
    """One prefill/mixed step: how it replays and what each path costs (µs per call)."""

    num_tokens: int
    requests: int
    mode: str
    padded_size: int
    pieces: int
    bitwise_equal_padded_eager: bool
    max_abs_diff_unpadded: float
    times_us: Dict[str, Spread]
    speedup: float  # median eager / median piecewise
    floor: Timed  # graphrt's own cost: one-op piecewise runners on the same batch, rounds of their own (bench_floor)


@dataclass
class TraceShares:
    """Tokens of a chunked-prefill trace by the path their step took."""

    steps: int
    tokens: int
    token_budget: int
    shares: Dict[str, float]  # full / piecewise / eager -> share of tokens
    eager_reasons: Dict[str, int]


def varlen_workload(config: ReferenceConfig, max_requests: int, device: torch.device) -> Workload:
    """The reference model with varlen attention and a KV cache of random values."""
    model, backend, pools = build_reference(config, num_requests=max_requests + 1, device=device, attention="varlen")
    for buffer in (*pools.kv.k_buffers, *pools.kv.v_buffers):
        buffer.normal_(generator=torch.Generator(device=device).manual_seed(config.seed))
    return Workload(config, model, backend, pools, device)


def piecewise_runners(work: Workload, backend: str, max_batch_size: int
                      ) -> Tuple[GraphRunner, Dict[str, GraphRunner]]:
    """The varlen model's runner (full decode graphs + piecewise keys) and one-op piecewise runners:
    ``runner`` (value checks: the default) and ``runner_metadata_only`` (``check_values=False``)."""
    kwargs = graph_runner_kwargs(work.backend, work.pools)
    runner = GraphRunner(work.model, max_batch_size=max_batch_size, device=work.device, backend=backend,
                         modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED), progress=False,
                         splitting_ops=[VARLEN_OP], piecewise_sizes=PIECEWISE_SIZES, **kwargs)
    report = runner.capture()
    if report.failed:
        raise SystemExit(f"piecewise capture failed, nothing to benchmark:\n{report}")
    one_op = one_op_runners(one_op_piecewise_model, CHECK_VARIANTS, max_batch_size=1, capture_sizes=[1],
                            device=work.device, backend=backend, splitting_ops=[copy_rows],
                            piecewise_sizes=PIECEWISE_SIZES, pad_values=kwargs["pad_values"])
    return runner, one_op


def mixed_batch(work: Workload, num_tokens: int, rng: random.Random) -> Tuple[ForwardBatch, List[Tuple[int, int]]]:
    """A MIXED batch of ``num_tokens``: two decode requests and prefill chunks of the rest (cached prefixes)."""
    chunks = [1, 1]
    while sum(chunks) < num_tokens:
        chunks.append(min(num_tokens - sum(chunks), rng.randint(4, 24)))
    pools = work.pools
    reqs = [pools.req_to_token.alloc() for _ in chunks]
    prefixes = [rng.randint(1, work.config.max_context_len // 4) for _ in chunks]
    pools.assign(reqs, [0] * len(reqs), prefixes)
    out_loc = pools.assign(reqs, prefixes, chunks)
    tokens = [[rng.randrange(work.config.vocab_size) for _ in range(count)] for count in chunks]
    batch = make_extend_batch(tokens, reqs, prefixes, out_loc, work.device, mode=ForwardMode.MIXED, pools=pools,
                              attn_backend=work.backend)
    return batch, [(req, prefix + count) for req, prefix, count in zip(reqs, prefixes, chunks)]


def measure_piecewise(work: Workload, runner: GraphRunner, one_op: Dict[str, GraphRunner], clock: Clock,
                      token_counts: Sequence[int], iters: int, warmup: int, floor_iters: int, rng: random.Random,
                      tolerance: float) -> List[PiecewiseResult]:
    """For each token count: check piecewise against eager, time eager, piecewise and raw replay in
    their rounds, and the one-op piecewise runners against their raw replays in rounds of their
    own (graphrt's own cost, ``floor_iters`` rounds)."""
    results = []
    for num_tokens in token_counts:
        batch, owned = mixed_batch(work, num_tokens, rng)
        try:
            entry = graph_entry(runner, batch)
            padded = pad_forward_batch(batch, entry.key.num_tokens, batch.batch_size, runner.pad_values)
            expected_padded = run_eager(work.model, padded)[:num_tokens].clone()
            expected = run_eager(work.model, batch).clone()
            actual = runner(batch).clone()
            diff = float((actual - expected).abs().max())
            if not torch.allclose(actual, expected_padded, atol=tolerance, rtol=tolerance):
                raise RuntimeError(f"piecewise step of {num_tokens} tokens differs from eager at the padded size")
            floor = piecewise_floor(one_op, batch, clock, floor_iters, warmup)
            probes = [("eager", lambda: run_eager(work.model, batch)), ("piecewise", lambda: runner(batch)),
                      ("raw_replay", raw_replay(entry, batch))]
            _, samples = time_rounds(clock, probes, iters, warmup)
        finally:
            for req, length in owned:
                work.pools.release(req, length)
        times = {name: Spread.of(values) for name, values in samples.items()}
        results.append(PiecewiseResult(
            num_tokens, batch.batch_size, batch.forward_mode.name, entry.key.num_tokens, entry.graph.piece_count,
            bool(torch.equal(actual, expected_padded)), diff, times, times["eager"].median / times["piecewise"].median,
            floor,
        ))
    return results


def chunked_prefill_trace(work: Workload, runner: GraphRunner, requests: int, new_tokens: int, token_budget: int,
                          rng: random.Random) -> TraceShares:
    """Serve ``requests`` prompts with chunked prefill (at most ``token_budget`` tokens per step: running
    decodes first, then prefill chunks) and count each step's tokens under the path the runner took."""
    context = work.config.max_context_len
    prompts = [rng.randint(8, max(8, context - new_tokens - 1)) for _ in range(requests)]
    waiting = list(range(requests))
    done = [0] * requests  # tokens in the cache per request
    rows: Dict[int, int] = {}
    tokens_by_path = {"full": 0, "piecewise": 0, "eager": 0}
    before = runner.stats()
    steps = 0
    while waiting or rows:
        decoding = [r for r in rows if done[r] >= prompts[r]]
        budget = token_budget - len(decoding)
        chunks: Dict[int, int] = {r: 1 for r in decoding}
        for r in [r for r in rows if r not in chunks] + waiting:
            if budget <= 0:
                break
            if r not in rows:
                rows[r] = work.pools.req_to_token.alloc()
                waiting.remove(r)
            chunks[r] = min(budget, prompts[r] - done[r])
            budget -= chunks[r]
        batch = trace_batch(work, rows, done, chunks, prompts, rng)
        counts = runner.stats()
        runner(batch)
        after = runner.stats()
        path = ("full" if after["graph_runs"] > counts["graph_runs"] else
                "piecewise" if after["piecewise_runs"] > counts["piecewise_runs"] else "eager")
        tokens_by_path[path] += batch.num_tokens
        steps += 1
        for r, count in chunks.items():
            done[r] += count
            if done[r] >= prompts[r] + new_tokens:
                work.pools.release(rows.pop(r), done[r])
    total = sum(tokens_by_path.values())
    reasons = {reason: count - before["eager_reasons"].get(reason, 0)
               for reason, count in runner.stats()["eager_reasons"].items()
               if count != before["eager_reasons"].get(reason, 0)}
    return TraceShares(steps, total, token_budget, {path: n / total for path, n in tokens_by_path.items()},
                       reasons)


def trace_batch(work: Workload, rows: Dict[int, int], done: List[int], chunks: Dict[int, int], prompts: List[int],
                rng: random.Random) -> ForwardBatch:
    """One step of the trace: DECODE when every request adds one token after its prompt, else EXTEND/MIXED."""
    order = list(chunks)
    reqs = [rows[r] for r in order]
    out_loc = work.pools.assign(reqs, [done[r] for r in order], [chunks[r] for r in order])
    vocab = work.config.vocab_size
    if all(done[r] >= prompts[r] for r in order):
        return make_decode_batch([rng.randrange(vocab) for _ in order], reqs, [done[r] + 1 for r in order], out_loc,
                                 work.device, work.pools, work.backend)
    mode = ForwardMode.MIXED if any(done[r] >= prompts[r] for r in order) else ForwardMode.EXTEND
    tokens = [[rng.randrange(vocab) for _ in range(chunks[r])] for r in order]
    return make_extend_batch(tokens, reqs, [done[r] for r in order], out_loc, work.device, mode=mode,
                             pools=work.pools, attn_backend=work.backend)


def format_piecewise(section: Dict[str, Any]) -> List[str]:
    """Report lines for the piecewise section of the JSON document."""
    lines = ["", f"prefill/mixed steps, varlen attention as the splitting op (piecewise sizes {section['sizes']}): "
                 "eager vs piecewise graphs, us (median)"]
    for step in section["steps"]:
        times = step["times_us"]
        lines.append(
            f"{step['num_tokens']:>4} tokens ({step['requests']} reqs, {step['mode']}) -> {step['padded_size']}, "
            f"{step['pieces']} pieces: eager {times['eager']['median']:,.0f}, piecewise "
            f"{times['piecewise']['median']:,.0f} ({step['speedup']:.2f}x), raw replay "
            f"{times['raw_replay']['median']:,.0f}; bitwise equal to padded eager: {step['bitwise_equal_padded_eager']}, "
            f"max |diff| vs unpadded eager {step['max_abs_diff_unpadded']:.1e}")
        lines.append("      graphrt's own cost per piecewise step (one-op model: one op between two splits, 3 pieces; "
                     "runner - raw replay, rounds of their own):")
        lines += [f"        {label}: {format_figure(step['floor']['costs'][name], TARGETS['piecewise'])}"
                  for name, label in LABELS.items()]
    for trace in section["traces"]:
        shares = ", ".join(f"{path} {share:.0%}" for path, share in trace["shares"].items())
        lines.append(f"chunked-prefill trace, at most {trace['token_budget']} tokens/step ({trace['steps']} steps, "
                     f"{trace['tokens']} tokens): tokens by path: {shares}; eager reasons: "
                     f"{trace['eager_reasons'] or 'none'}")
    lines.append(f"piecewise section: {section['seconds']:.1f} s (capture, checks, timing and traces)")
    return lines
