"""graphrt's own cost at the floor: models of one op run through GraphRunner, wrap() and a
3-piece piecewise step, each against the raw replay of its own graph, in trivial ops.

Every figure is sampled as the decode figures are (bench_timing: calibrated samples, paired
differences of interleaved rounds, each round's difference divided by that round's trivial op),
in rounds of its own: only the floor probes and the trivial op, so no millisecond-long model
step (which evicts the caches and leaves garbage behind) runs just before a probe of a few
microseconds. Interleaved with the model's probes, short samples of the piecewise step read
higher, and swung from run to run with the calibration (bench_timing.Clock.calibrate).

GraphRunner validates every batch; on CPU (host tensors) it also reads index values, on a GPU it
checks metadata only. Both are measured: the runner with the default (value checks on CPU) and a
runner with ``check_values=False`` (metadata only: the figure a GPU user pays), and validate()
alone each way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from bench_lib import graph_entry
from bench_timing import Clock, Probe, Timed, stability, time_costs, verdict

from graphrt import ForwardBatch, GraphRunner, wrap
from graphrt.batch import CONTEXT_FIELDS
from graphrt.forward_context import use_batch

# Trivial ops per call (docs/DESIGN.md): GraphRunner one-op model, wrap() one-op with one layout,
# a piecewise step of 3 pieces (one op between two splits).
TARGETS = {"runner": 6.0, "wrap": 3.0, "piecewise": 9.0}
# GraphRunner variants of the same one-op model (name -> extra keyword arguments): validate() with
# the value checks (the default on CPU), metadata checks only; and, for decode, debug mode.
CHECK_VARIANTS: Dict[str, Dict[str, Any]] = {"runner": {}, "runner_metadata_only": {"check_values": False}}
RUNNER_VARIANTS: Dict[str, Dict[str, Any]] = {**CHECK_VARIANTS, "debug": {"debug": True}}
LABELS = {
    "runner": "with value checks (CPU default)",
    "runner_metadata_only": "metadata only (as on a GPU)",
}


def one_op_model(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """A model of one op, so that runner minus raw replay is graphrt's own per-step cost without model noise."""
    return input_ids + positions


def without_context(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` without the cache context (a one-op model has none)."""
    return dataclasses.replace(batch, **{name: None for name in CONTEXT_FIELDS})


def one_op_runners(model: Callable[..., Any], variants: Mapping[str, Mapping[str, Any]],
                   **kwargs: Any) -> Dict[str, GraphRunner]:
    """A captured GraphRunner of ``model`` per variant (its extra keyword arguments), all with ``kwargs``."""
    runners = {name: GraphRunner(model, progress=False, **kwargs, **extra) for name, extra in variants.items()}
    for name, runner in runners.items():
        report = runner.capture()
        if report.failed:
            raise SystemExit(f"capture of the one-op runner {name!r} failed, nothing to benchmark:\n{report}")
    return runners


def decode_floor(runners: Mapping[str, GraphRunner], batch: ForwardBatch, clock: Clock, iters: int,
                 warmup: int) -> Timed:
    """The one-op runners on ``batch`` (without its cache context) against their raw replays, the
    debug runner against the plain one, and validate() alone with and without value checks."""
    bare = without_context(batch)
    plain, metadata_only, debug = runners["runner"], runners["runner_metadata_only"], runners["debug"]
    entry = graph_entry(plain, bare)
    probes: List[Probe] = [
        ("runner", lambda: plain(bare)),
        ("runner_replay", graph_entry(plain, bare).graph.replay),
        ("runner_metadata_only", lambda: metadata_only(bare)),
        ("runner_metadata_only_replay", graph_entry(metadata_only, bare).graph.replay),
        ("debug_runner", lambda: debug(bare)),
        ("validate", lambda: bare.validate(plain.device, plain.debug, plain.config.check_values)),
        ("validate_metadata_only", lambda: bare.validate(plain.device, plain.debug, False)),
        ("guards", guard_check(entry, bare)),
    ]
    pairs = {
        "runner": ("runner", "runner_replay", 1),
        "runner_metadata_only": ("runner_metadata_only", "runner_metadata_only_replay", 1),
        "debug": ("debug_runner", "runner", 1),  # what debug mode (the stale-output guard) adds
        "validate": ("validate", None, 1),
        "validate_metadata_only": ("validate_metadata_only", None, 1),
        "guards": ("guards", None, 1),
    }
    return time_costs(clock, probes, pairs, iters, warmup)


def piecewise_floor(runners: Mapping[str, GraphRunner], batch: ForwardBatch, clock: Clock, iters: int,
                    warmup: int) -> Timed:
    """One-op piecewise runners (``runner``: value checks by default; ``runner_metadata_only``) on
    ``batch`` without its cache context, each against its raw replay with the batch current."""
    bare = without_context(batch)
    probes: List[Probe] = []
    for name in LABELS:
        runner = runners[name]
        probes += [(name, lambda runner=runner: runner(bare)),
                   (f"{name}_replay", raw_replay(graph_entry(runner, bare), bare))]
    return time_costs(clock, probes, {name: (name, f"{name}_replay", 1) for name in LABELS}, iters, warmup)


def guard_check(entry: Any, call: Any) -> Callable[[], Any]:
    """What a key's guards cost per call (part of the runner's and wrap()'s figures): the state
    token, then the key's check of state, bindings and aliasing (graphrt.guards)."""
    guard, sources = entry.guard, entry.stager.sources
    watch = guard.watch

    def check() -> Any:
        return guard.failure(watch.token(), sources, call)

    return check


def raw_replay(entry: Any, batch: ForwardBatch) -> Callable[[], None]:
    """``entry``'s graph replayed with ``batch`` current (as the runner sets it for splitting ops), nothing staged."""
    graph = entry.graph

    def replay() -> None:
        with use_batch(batch):
            graph.replay()

    return replay


def wrap_floor(device: torch.device, clock: Clock, iters: int, warmup: int) -> Timed:
    """wrap()'s own cost per call of a one-op function (wrapped call - raw replay of the same graph):
    one layout (the target's figure); four layouts holding graphs, the same one called; two
    layouts called in turn (per call)."""
    def one_op(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    x = torch.randn(4, 8, device=device)
    others = [torch.randn(4, width, device=device) for width in (9, 10, 11)]
    single = wrap(one_op, max_batch_size=4, capture_sizes=[4])
    several = wrap(one_op, max_batch_size=4, capture_sizes=[4])
    for fast, inputs in ((single, [x]), (several, others + [x])):
        for value in inputs:
            for _ in range(3):  # warm-up, recording, replay
                fast(value)
    if single.stats()["graph_runs"] != 2 or several.stats()["graph_runs"] != 8:  # each layout: 2 of its 3 calls
        raise RuntimeError(f"wrap() layouts did not all replay: {several.stats()['eager_reasons']}")
    entry = next(entry for entry in single.layouts.current.graphs.registry.entries.values() if entry.graph is not None)
    probes: List[Probe] = [
        ("1 layout", lambda: single(x)),
        ("4 layouts, the same one called", lambda: several(x)),
        ("2 layouts called in turn (per call)", lambda: (several(x), several(others[0]))),
        ("replay", entry.graph.replay),
        ("guards", guard_check(entry, [x])),
    ]
    pairs = {name: (name, "replay", 2 if "in turn" in name else 1) for name, _ in probes if name != "replay"}
    pairs["guards"] = ("guards", None, 1)
    return time_costs(clock, probes, pairs, iters, warmup)


def target_summary(label: str, target: float, costs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One floor figure against ``target``: its costs in trivial ops (the JSON form of a Cost: one per
    batch size, token count...), their verdicts, and whether every one is within target."""
    verdicts = [verdict(cost, target) for cost in costs]
    stabilities = [stability(cost) for cost in costs]
    return {
        "label": label, "target": target,
        "medians": [cost["trivial_ops"]["median"] for cost in costs],
        "above_noise": [cost["above_noise"] for cost in costs],
        "stability": [None if math.isinf(value) else value for value in stabilities],  # JSON has no inf
        "verdicts": verdicts,
        "within_target": bool(costs) and all(each == "yes" for each in verdicts),
    }


def floor_targets(batches: Sequence[Mapping[str, Any]], wrap_costs: Mapping[str, Any],
                  piecewise_steps: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Every floor figure of a run (the JSON forms of its decode batches, wrap()'s floor and the
    piecewise steps) against its target; a figure the run did not measure is left out."""
    def of(results: Sequence[Mapping[str, Any]], name: str) -> List[Mapping[str, Any]]:
        return [result["floor"]["costs"][name] for result in results]

    figures = {
        "runner_metadata_only": ("GraphRunner one-op, metadata only (as on a GPU)", "runner",
                                 of(batches, "runner_metadata_only")),
        "runner": ("GraphRunner one-op, with value checks (CPU default)", "runner", of(batches, "runner")),
        "wrap": ("wrap() one-op, 1 layout", "wrap", [wrap_costs["1 layout"]]),
        "piecewise_metadata_only": ("piecewise step, 3 pieces, metadata only (as on a GPU)", "piecewise",
                                    of(piecewise_steps, "runner_metadata_only")),
        "piecewise": ("piecewise step, 3 pieces, with value checks (CPU default)", "piecewise",
                      of(piecewise_steps, "runner")),
    }
    return {name: target_summary(label, TARGETS[target], costs) for name, (label, target, costs) in figures.items()
            if costs}


def format_targets(summaries: Mapping[str, Mapping[str, Any]]) -> List[str]:
    """The closing block: every floor figure against its target."""
    return ["", "graphrt's own cost at the floor against the targets (medians, trivial ops of the same rounds):",
            *(format_target(summary) for summary in summaries.values())]


def format_target(summary: Mapping[str, Any]) -> str:
    """One line: the figure (the range of its medians above noise, to two decimals: the verdict is
    on the unrounded median), the target and the verdict."""
    medians = sorted(median for median, above in zip(summary["medians"], summary["above_noise"]) if above)
    figure = "below noise"
    if medians:
        figure = f"{medians[0]:.2f}" if f"{medians[0]:.2f}" == f"{medians[-1]:.2f}" else (
            f"{medians[0]:.2f} to {medians[-1]:.2f}")
        figure += " trivial ops"
        if len(medians) < len(summary["medians"]):
            figure += f" ({len(summary['medians']) - len(medians)} below noise)"
    stable = [value for value in summary["stability"] if value is not None]
    spread = f", p90/p10 up to {max(stable):.2f}" if stable else ""
    outcome = "yes" if summary["within_target"] else ("NO" if "NO" in summary["verdicts"] else "unclear (noise)")
    return f"  {summary['label']}: {figure}{spread}; target <= {summary['target']:g}: {outcome}"


def format_figure(cost: Mapping[str, Any], target: Optional[float] = None) -> str:
    """A cost in trivial ops with its stability and, given a ``target``, the verdict:
    ``9.4 [9.1-9.8] trivial ops, p90/p10 1.08; <= 6: NO`` (or ``below noise; <= 6: yes``)."""
    text = format_cost(cost)
    if cost["above_noise"]:
        text += f" trivial ops, p90/p10 {format_stability(cost)}"
    return text if target is None else f"{text}; <= {target:g}: {verdict(cost, target)}"


def format_cost(cost: Optional[Mapping[str, Any]], unit: str = "trivial_ops", digits: int = 1) -> str:
    """``median [p10-p90]`` of a cost (the JSON form of a Cost) in ``unit``, or "below noise"."""
    if cost is None:
        return "-"
    if not cost["above_noise"]:
        return "below noise"
    spread = cost[unit]
    return f"{spread['median']:,.{digits}f} [{spread['p10']:,.{digits}f}-{spread['p90']:,.{digits}f}]"


def format_stability(cost: Mapping[str, Any]) -> str:
    """p90/p10 of a cost in trivial ops, or "-" when it is below noise."""
    value = stability(cost)
    return f"{value:.2f}" if cost["above_noise"] and value != float("inf") else "-"


def format_wrap(floor: Mapping[str, Any]) -> List[str]:
    """Report lines for wrap()'s floor (the JSON form of its Timed)."""
    lines = ["", f"wrap(): a one-op function (wrapped call - raw replay of the same graph, paired samples), "
                 f"trivial ops per call; target <= {TARGETS['wrap']:g} with one layout"]
    for name, cost in floor["costs"].items():
        if name != "guards":
            lines.append(f"  {name}: {format_figure(cost, TARGETS['wrap'] if name == '1 layout' else None)}")
    lines.append(f"  of which the key's guards (state token, state, bindings; no aliasing check: the function writes "
                 f"nothing): {format_cost(floor['costs']['guards'], digits=2)}")
    return lines
