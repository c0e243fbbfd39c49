"""Shared prompt prefixes computed once (issue 50, item 7): ``--requests`` requests sharing a ``--system``-token
system prompt plus ``--own`` tokens each, through the engine path with prefix sharing off and on.

    PYTHONPATH=. python scripts/bench_prefix_sharing.py [--requests 32] [--system 256] [--own 16] [--new-tokens 16]
        [--max-requests 8] [--step-tokens 256] [--hidden 256] [--device cpu] [--eager]

Per path: prompt tokens computed in prefill steps, prompt tokens reused from the prefix cache, generated
tokens per second, the call's seconds, and whether the tokens equal those of sharing off (and of the model's
own ``generate()`` per prompt). "sharing on" empties the prefix cache before each timed call, so the system
prompt is computed once inside the call; "sharing on, cached" leaves the cache of the previous call (the
system prompt and every prompt already cached: each prompt's last token is computed). Each path runs once to
warm up (graphs captured), then ``--repeats`` times alternating with the others; the best time is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_engine import workload  # noqa: E402
from hf_engine_helpers import generate_alone, ragged_prompts  # noqa: E402

import graphrt.hf  # noqa: E402


def shared_prompts(requests: int, system: int, own: int) -> List[List[int]]:
    """One system prompt of ``system`` tokens, then ``own`` tokens of each request."""
    prefix = ragged_prompts([system], seed=7)[0]
    return [prefix + tail for tail in ragged_prompts([own] * requests, seed=8)]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (intermediate 2x, 4 layers)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system", type=int, default=256)
    parser.add_argument("--own", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=8)
    parser.add_argument("--step-tokens", type=int, default=256, help="max_step_tokens (the prefill chunk budget)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--eager", action="store_true", help="graphs=False (eager steps)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    context = args.system + args.own + args.new_tokens + 1
    model, _ = workload(args.family, args.hidden, 1, args.device)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, context)  # generate() warns past it
    prompts = shared_prompts(args.requests, args.system, args.own)
    options = dict(max_requests=args.max_requests, max_context=context, max_step_tokens=args.step_tokens)
    engines = {sharing: graphrt.hf.engine_model(model, prefix_sharing=sharing, **options) for sharing in (False, True)}
    graphs = not args.eager

    def call(sharing: bool, emptied: bool) -> Callable[[], List[List[int]]]:
        def run() -> List[List[int]]:
            engine = engines[sharing]
            if emptied:
                engine.reset_prefix_cache()
            return engine.generate(prompts, max_new_tokens=args.new_tokens, eos_token_id=None, graphs=graphs)
        return run

    paths = {"sharing off": (False, call(False, True)), "sharing on": (True, call(True, True)),
             "sharing on, cached": (True, call(True, False))}
    best: Dict[str, float] = {}
    tokens: Dict[str, List[List[int]]] = {}
    serve: Dict[str, dict] = {}
    for name, (_, run) in paths.items():
        run()  # warm-up: graphs captured
    for _ in range(args.repeats):  # alternating: A, B, C, A, B, C, ...
        for name, (sharing, run) in paths.items():
            synchronize(args.device)
            start = time.perf_counter()
            tokens[name] = run()
            synchronize(args.device)
            seconds = time.perf_counter() - start
            if seconds < best.get(name, float("inf")):
                best[name] = seconds
                serve[name] = engines[sharing].stats()["serve"]
    expected = tokens["sharing off"]
    alone = generate_alone(model, prompts, args.new_tokens)

    print(f"prefix sharing: {args.family}, hidden {args.hidden}, 4 layers, {args.requests} requests of a "
          f"{args.system}-token system prompt + {args.own} own tokens, {args.new_tokens} new tokens each, "
          f"{args.max_requests} at once, {args.step_tokens} tokens per step, {'eager' if args.eager else 'graphs'}, "
          f"device {args.device}, {torch.get_num_threads()} CPU threads, load average {os.getloadavg()[0]:.1f}")
    print("| path | prompt tokens computed | prompt tokens reused | tokens/s | seconds | against sharing off | "
          "tokens equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in paths:
        generated = sum(len(row) for row in tokens[name])
        equal = tokens[name] == expected == alone
        print(f"| {name} | {serve[name]['prefill_tokens']} | {serve[name]['prefix_tokens_reused']} | "
              f"{generated / best[name]:.0f} | {best[name]:.3f} | {best['sharing off'] / best[name]:.2f}x | "
              f"{'yes' if equal else '**no**'} |")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
