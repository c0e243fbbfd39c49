"""graphrt's per-call guard cost as the model gets deeper: graph_generate() and wrap() of a tiny random
Llama at 2, 8, 32 and 64 layers, in trivial ops of the same rounds (bench_timing).

A key's guard (graphrt.guards) checks, per call, autocast, the state epoch (one integer compare while
no API able to change the step's Python state ran), the few values no API tells of (globals and
closure cells the step's own code reads, the lists it reached tensors through: a cache's ``layers``)
and, for a step that writes memory, aliasing of its staged tensors. None of that may grow with the
model's depth: the figure at 64 layers is the one at 2. Target: at most 0.5 trivial ops per call at
every depth (``TARGET``); the one-op figures of bench_floor stay the budget's whole.

After an API bumped the epoch, a key re-reads only what the bump names (graphrt.guards.epoch): the
second figure (``reread_scaling``) is the check right after one attribute of a watched module was
assigned (its own value again, so the guard still holds), minus the assignment alone, for the root
model and for the last layer's attention, at 2 and 64 layers. Target: at most 10 trivial ops
(``REREAD_TARGET``) at every depth.

Run alone: ``PYTHONPATH=. python scripts/bench_guards.py`` (``make bench`` runs it too).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from bench_floor import format_cost, guard_check, target_summary
from bench_timing import Clock, Probe, Timed, time_costs

import graphrt
from graphrt.hf import graph_generate
from graphrt import wrap

DEPTHS = (2, 8, 32, 64)
TARGET = 0.5  # trivial ops per call, at every depth
REREAD_DEPTHS = (2, 64)
REREAD_TARGET = 10.0  # trivial ops: one attribute assigned, then a call's check
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


def generate_probe(layers: int, device: torch.device, model: Any = None) -> Callable[[], Any]:
    """graph_generate() of the tiny Llama (``model``, else a new one): the guard check of its decode key
    on a real decode call."""
    model = tiny_llama(layers, device) if model is None else model
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


def reassign(module: torch.nn.Module, name: str) -> Callable[[], None]:
    """Assign ``module.name`` its own value again: a bump of the epoch (a watched module) that leaves
    every guard holding."""
    value = getattr(module, name)

    def assign() -> None:
        setattr(module, name, value)

    return assign


def reread_scaling(device: torch.device, clock: Clock, iters: int, warmup: int,
                   depths: Sequence[int] = REREAD_DEPTHS) -> Timed:
    """graph_generate()'s decode-key check right after one attribute assignment, minus the assignment
    alone, at each depth: on the root model and on the last layer's attention, in trivial ops."""
    probes: List[Probe] = []
    pairs: Dict[str, Tuple[str, Optional[str], int]] = {}
    with torch.no_grad():
        for layers in depths:
            model = tiny_llama(layers, device)
            check = generate_probe(layers, device, model)
            for where, module, name in (("the model", model, "vocab_size"),
                                        ("the last layer's attention", model.model.layers[-1].self_attn,
                                         "layer_idx")):
                assign = reassign(module, name)
                label = f"graph_generate, {layers} layers, after an assignment to {where}"

                def assign_and_check(assign: Callable[[], None] = assign) -> None:
                    assign()
                    checked(check)

                probes += [(label, assign_and_check), (f"{label} (assignment alone)", assign)]
                pairs[label] = (label, f"{label} (assignment alone)", 1)
    return time_costs(clock, probes, pairs, iters, warmup)


def guard_summary(costs: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Every depth's figure against TARGET (bench_floor.target_summary)."""
    return target_summary("guards per call, tiny Llama at 2 to 64 layers (graph_generate and wrap())", TARGET,
                          list(costs.values()))


def format_guards(timed: Mapping[str, Any]) -> List[str]:
    """Report lines: one per front and depth (the JSON form of a Timed)."""
    return _lines(f"graphrt's guards per call as the model deepens (tiny random Llama, hidden 64): trivial ops; "
                  f"target <= {TARGET:g} at every depth", timed)


def _lines(title: str, timed: Mapping[str, Any]) -> List[str]:
    return ["", title, *(f"  {name}: {format_cost(cost, digits=2)}" for name, cost in timed["costs"].items())]


def reread_summary(costs: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Every depth's re-read figure against REREAD_TARGET (bench_floor.target_summary)."""
    return target_summary("guards' re-read after one assignment, tiny Llama at 2 and 64 layers (graph_generate)",
                          REREAD_TARGET, list(costs.values()))


def format_reread(timed: Mapping[str, Any]) -> List[str]:
    """Report lines of reread_scaling (the JSON form of its Timed)."""
    return _lines(f"graphrt's guards after one attribute assignment (check after it - the assignment alone): trivial "
                  f"ops; target <= {REREAD_TARGET:g} at every depth", timed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reread-only", action="store_true", help="only the re-read after one assignment")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--depths", type=int, nargs="+", help="layer counts (default: 2, 8, 32, 64; re-read: 2, 64)")
    options = parser.parse_args(argv)
    device = torch.device("cpu")
    if not options.reread_only:
        timed = dataclasses.asdict(guard_scaling(device, Clock(device, 2e-3), options.iters, 3,
                                                 options.depths or DEPTHS))
        print("\n".join(format_guards(timed)))
    reread = dataclasses.asdict(reread_scaling(device, Clock(device, 2e-3), options.iters, 3,
                                               options.depths or REREAD_DEPTHS))
    print("\n".join(format_reread(reread)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
