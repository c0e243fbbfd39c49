"""graphrt's per-call guard cost as the model gets deeper: graph_generate() and wrap() of a tiny random
Llama at 2, 8, 32 and 64 layers, in trivial ops of the same rounds (bench_timing).

A key's guard (graphrt.guards) checks, per call, autocast, the state epoch (one integer compare while
no API able to change the step's Python state ran), the few values no API tells of (globals and
closure cells the step's own code reads, the lists it reached tensors through: a cache's ``layers``)
and, for a step that writes memory, aliasing of its staged tensors. None of that may grow with the
model's depth: the figure at 64 layers is the one at 2. Target: at most 0.5 trivial ops per call at
every depth (``TARGET``); the one-op figures of bench_floor stay the budget's whole.

Run alone: ``PYTHONPATH=. python scripts/bench_guards.py`` (``make bench`` runs it too).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from bench_floor import format_cost, guard_check, target_summary
from bench_timing import Clock, Probe, Timed, time_costs

import graphrt
from graphrt.hf import graph_generate
from graphrt import wrap

DEPTHS = (2, 8, 32, 64)
TARGET = 0.5  # trivial ops per call, at every depth
PROMPTS, PROMPT_LEN, NEW_TOKENS = 3, 6, 4


def tiny_llama(layers: int, device: torch.device) -> torch.nn.Module:
    """A tiny random Llama (hidden 64, vocab 128) of ``layers`` decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5, pad_token_id=0)
    return LlamaForCausalLM(config).to(device).eval()


def last_replay(fast: graphrt.GraphedCallable, run: Callable[[], Any]) -> Tuple[Any, List[Any]]:
    """``run()`` (calls of ``fast``), then the entry and call leaves of the last call that replayed."""
    seen: Dict[str, Any] = {}
    replay = fast._replay

    def spy(entry: Any, state: Any, layout: Any, batch_size: int, leaves: List[Any], *rest: Any) -> Any:
        seen["entry"], seen["leaves"] = entry, leaves
        return replay(entry, state, layout, batch_size, leaves, *rest)

    fast._replay = spy  # type: ignore[method-assign]
    try:
        run()
    finally:
        del fast._replay
    if "entry" not in seen:
        raise RuntimeError(f"no call replayed: {fast.stats()['eager_reasons']}")
    return seen["entry"], seen["leaves"]


def generate_probe(layers: int, device: torch.device) -> Callable[[], Any]:
    """graph_generate() of the tiny Llama: the guard check of its decode key on a real decode call."""
    model = tiny_llama(layers, device)
    fast = graph_generate(model, max_batch_size=4)
    prompts = torch.randint(3, 128, (PROMPTS, PROMPT_LEN), device=device)

    def generate() -> None:
        for _ in range(2):  # the first call records; the second replays every decode step
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)

    entry, leaves = last_replay(fast, generate)
    return checked(guard_check(entry, leaves))


def wrap_probe(layers: int, device: torch.device) -> Callable[[], Any]:
    """wrap() of the tiny Llama's forward (no cache): the guard check of its key."""
    model = tiny_llama(layers, device)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    ids = torch.randint(3, 128, (4, 8), device=device)
    entry, leaves = last_replay(fast, lambda: [fast(input_ids=ids, use_cache=False) for _ in range(3)])
    return checked(guard_check(entry, leaves))


def checked(check: Callable[[], Any]) -> Callable[[], Any]:
    """``check``, after making sure it passes (a failing guard would time the failure path)."""
    failure = check()
    if failure is not None:
        raise RuntimeError(f"the guard does not hold: {failure}")
    return check


def guard_scaling(device: torch.device, clock: Clock, iters: int, warmup: int,
                  depths: Sequence[int] = DEPTHS) -> Timed:
    """The per-call guard cost of graph_generate() and wrap() at each depth, in trivial ops."""
    probes: List[Probe] = []
    with torch.no_grad():
        for layers in depths:
            probes.append((f"graph_generate, {layers} layers", generate_probe(layers, device)))
            probes.append((f"wrap(), {layers} layers", wrap_probe(layers, device)))
    return time_costs(clock, probes, {name: (name, None, 1) for name, _ in probes}, iters, warmup)


def guard_summary(costs: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Every depth's figure against TARGET (bench_floor.target_summary)."""
    return target_summary("guards per call, tiny Llama at 2 to 64 layers (graph_generate and wrap())", TARGET,
                          list(costs.values()))


def format_guards(timed: Mapping[str, Any]) -> List[str]:
    """Report lines: one per front and depth (the JSON form of a Timed)."""
    lines = ["", f"graphrt's guards per call as the model deepens (tiny random Llama, hidden 64): trivial ops; "
                 f"target <= {TARGET:g} at every depth"]
    for name, cost in timed["costs"].items():
        lines.append(f"  {name}: {format_cost(cost, digits=2)}")
    return lines


def main() -> int:
    import dataclasses

    device = torch.device("cpu")
    timed = dataclasses.asdict(guard_scaling(device, Clock(device, 2e-3), 30, 3))
    print("\n".join(format_guards(timed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
