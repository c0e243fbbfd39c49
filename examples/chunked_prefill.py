"""Chunked prefill with varlen attention: prefill and mixed steps replay piecewise graphs.

The reference decoder runs with ``attention="varlen"``: decode steps use graph-safe attention
(full graphs), prefill and mixed steps a varlen attention custom op that reads each request's
lengths on the host through ``graphrt.current_batch()``. With ``splitting_ops=[VARLEN_OP]`` the
runner captures those steps in pieces around the op and replays everything else. A small
scheduler serves the prompts with at most ``--budget`` tokens per step (running decodes first,
then prefill chunks), eagerly and through the runner; both must produce the same tokens.

    python examples/chunked_prefill.py
"""

from __future__ import annotations

import argparse
import logging
import random
from typing import Callable, List, Optional

import torch

from graphrt import ForwardMode, GraphRunner
from graphrt.reference import (
    VARLEN_OP,
    CachePools,
    ReferenceConfig,
    build_reference,
    graph_runner_kwargs,
    make_decode_batch,
    make_extend_batch,
    run_eager,
)


def serve(model: torch.nn.Module, pools: CachePools, prompts: List[List[int]], new_tokens: int, budget: int,
          step: Callable) -> List[List[int]]:
    """Greedy generation of ``new_tokens`` per prompt with chunked prefill; ``step(batch) -> logits``."""
    backend = model.attn_backend
    reqs = [pools.req_to_token.alloc() for _ in prompts]
    cached = [0] * len(prompts)  # tokens in each request's KV cache
    generated: List[List[int]] = [[] for _ in prompts]
    while any(len(tokens) < new_tokens for tokens in generated):
        chunks = {}  # request index -> tokens this step
        for index, prompt in enumerate(prompts):
            if cached[index] >= len(prompt) and len(generated[index]) < new_tokens and len(chunks) < budget:
                chunks[index] = [generated[index][-1]]
        room = budget - len(chunks)
        for index, prompt in enumerate(prompts):
            if cached[index] < len(prompt) and room > 0:
                chunks[index] = prompt[cached[index]: cached[index] + room]
                room -= len(chunks[index])
        order = list(chunks)
        rows = [reqs[index] for index in order]
        out_loc = pools.assign(rows, [cached[index] for index in order], [len(chunks[index]) for index in order])
        if all(cached[index] >= len(prompts[index]) for index in order):
            batch = make_decode_batch([chunks[index][0] for index in order], rows,
                                      [cached[index] + 1 for index in order], out_loc, "cpu", pools, backend)
        else:
            mode = ForwardMode.MIXED if any(cached[index] >= len(prompts[index]) for index in order) else ForwardMode.EXTEND
            batch = make_extend_batch([chunks[index] for index in order], rows, [cached[index] for index in order],
                                      out_loc, "cpu", mode=mode, pools=pools, attn_backend=backend)
        logits = step(batch)
        last_row = -1
        for index in order:
            last_row += len(chunks[index])
            cached[index] += len(chunks[index])
            if cached[index] >= len(prompts[index]):  # the prompt is in the cache: this row is a new token
                generated[index].append(int(logits[last_row].argmax()))
    for req, count in zip(reqs, cached):
        pools.release(req, count)
    return generated


def main(argv: Optional[List[str]] = None) -> None:
    """Serve a handful of prompts both ways, check the tokens agree, print which path each step took."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--budget", type=int, default=24, help="tokens per step (chunked prefill)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    config = ReferenceConfig.tiny()
    model, backend, pools = build_reference(config, num_requests=args.prompts + 1, attention="varlen")
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(args.prompts)]
    runner = GraphRunner(model, max_batch_size=4, modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED),
                         backend="emulated", progress=False, splitting_ops=[VARLEN_OP], piecewise_sizes=[8, 16, 32],
                         **graph_runner_kwargs(backend, pools))
    print(runner.capture())
    with torch.no_grad():
        eager = serve(model, pools, prompts, args.new_tokens, args.budget, lambda batch: run_eager(model, batch))
        graphed = serve(model, pools, prompts, args.new_tokens, args.budget, runner)
    stats = runner.stats()
    print(f"steps: {stats['graph_runs']} full graph, {stats['piecewise_runs']} piecewise, {stats['eager_runs']} eager "
          f"{stats['eager_reasons'] or ''}")
    print(f"same tokens: {eager == graphed}")
    if eager != graphed:
        raise SystemExit("piecewise and eager generation disagree")


if __name__ == "__main__":
    main()
