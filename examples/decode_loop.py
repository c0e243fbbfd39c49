"""Greedy decoding of graphrt's reference decoder, eagerly and through a GraphRunner.

Prefill runs eagerly; every decode step goes through ``runner(batch)``, which stages
the batch into static buffers, refreshes the attention metadata in place and replays
the graph captured for the padded batch size. Both runs must produce the same tokens.

    python examples/decode_loop.py                      # tiny model, emulated graphs on CPU
    python examples/decode_loop.py --config realistic --device cuda
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from graphrt import GraphRunner
from graphrt.reference import ReferenceConfig, build_reference, generate_greedy, graph_runner_kwargs


def main() -> None:
    """Generate for a handful of prompts both ways, check the tokens agree, print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("tiny", "realistic"), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", help="graph backend: auto, cuda, emulated")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    config = ReferenceConfig.tiny() if args.config == "tiny" else ReferenceConfig.realistic(dtype=torch.bfloat16)
    model, backend, pools = build_reference(config, num_requests=args.prompts + 1, device=args.device)
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(1, 24))] for _ in range(args.prompts)]

    runner = GraphRunner(
        model, max_batch_size=max(8, args.prompts), backend=args.backend, device=args.device, progress=False,
        **graph_runner_kwargs(backend, pools),
    )
    report = runner.capture()
    print(report)

    timings = {}
    outputs = {}
    for name, step in (("eager", None), ("graph", runner)):
        start = time.perf_counter()
        outputs[name] = generate_greedy(model, backend, pools, prompts, args.new_tokens, step=step)
        timings[name] = time.perf_counter() - start

    for prompt, tokens in zip(prompts, outputs["graph"]):
        print(f"prompt {len(prompt):2d} tokens -> {tokens}")
    same = outputs["eager"] == outputs["graph"]
    print(f"eager {timings['eager']:.3f}s, graph ({runner.backend_name}) {timings['graph']:.3f}s, same tokens: {same}")
    print(f"runner stats: {runner.stats()}")
    if not same:
        raise SystemExit("graph and eager generation disagree")


if __name__ == "__main__":
    main()
