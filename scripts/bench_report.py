"""Reporting for scripts/bench.py: machine description, terminal tables, JSON document, PNG plot."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from bench_floor import LABELS, TARGETS, format_cost, format_stability, format_wrap
from bench_load import format_load
from bench_timing import verdict

BACKEND_NOTES = {
    "emulated": (
        "EMULATED backend (no CUDA graphs on this machine): a replay runs the aten ops recorded at capture "
        "without the model's Python, one Python call per op; on CPU each op's own cost dominates, so "
        "'eager/raw replay' shows the model Python saved, not a CUDA-graph speedup, and the graph column "
        "adds graphrt's own per-step work"
    ),
    "cuda": "CUDA graphs: the graph column is one graph launch per step plus graphrt's staging and checks",
}
POOL_LABELS = {
    "emulated": "output bytes (emulated backend: no graph memory pool)",
    "cuda": "graph pool bytes (growth of torch.cuda.memory_reserved during capture)",
}
LATENCY_COLUMNS = (("eager", "eager"), ("compile", "compile"), ("graph", "graph"), ("replay", "raw replay"))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> Dict[str, Any]:
    """Where the figures were taken: device, CPU, core count, versions (the load: bench_load)."""
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "transformers": installed_version("transformers"),  # the Hugging Face section's; None without it
    }


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _us(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _spread(spread: Mapping[str, float]) -> str:
    return f"{_us(spread['median'])} [{_us(spread['p10'])}-{_us(spread['p90'])}]"


def _cost_us(cost: Mapping[str, Any]) -> str:
    """A cost in µs, ``median [p10-p90]``, or "below noise" (bench_timing.Cost's rule)."""
    return _spread(cost["us"]) if cost["above_noise"] else "below noise"


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> List[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return lines


def format_report(doc: Dict[str, Any]) -> str:
    """The terminal report: header and load, latency table, graphrt's own cost at the floor, the
    reference model's overhead in parts, wrap()'s floor, throughput and capture lines."""
    machine, model = doc["machine"], doc["model"]
    config = model["config"]
    lines = [
        f"graphrt decode benchmark | backend: {doc['backend'].upper()} | device: {machine['device_name']} "
        f"({machine['cpu_cores']} CPU cores) | torch {machine['torch']}",
        f"NOTE: {doc['backend_note']}.",
        *format_load(doc["load"]),
        f"model {model['preset']}: {config['num_layers']} layers, hidden {config['hidden_size']}, "
        f"heads {config['num_heads']}/{config['num_kv_heads']} kv, vocab {config['vocab_size']}, "
        f"context {config['max_context_len']}, {config['dtype']}, {model['parameters'] / 1e6:.1f}M parameters",
        f"trivial eager op (x.add_(1), one element): {_spread(doc['trivial_op_us'])} us; "
        f"graph logits checked against eager at the padded size: {'ok' if doc['verified'] else 'FAILED'}",
        "",
        "latency per decode step, us: median [p10-p90]",
    ]
    batches = doc["batches"]
    columns = [(name, title) for name, title in LATENCY_COLUMNS if any(name in b["times_us"] for b in batches)]
    rows = [
        [str(b["batch_size"]), str(b["padded_size"]),
         *(_spread(b["times_us"][name]) if name in b["times_us"] else "-" for name, _ in columns),
         f"{b['graph_speedup']:.2f}x", f"{b['replay_speedup']:.2f}x"]
        for b in batches
    ]
    lines += _table(["bs", "padded", *(title for _, title in columns), "eager/graph", "eager/raw replay"], rows)
    lines += format_runner_floor(batches, machine["device"])
    lines += format_parts(batches)
    lines += format_wrap(doc["floor"]["wrap"])
    throughput, capture = doc["throughput"], doc["capture"]
    lines += [
        "",
        f"generate_greedy, {throughput['prompts']} prompts x {throughput['new_tokens']} new tokens (prefill eager "
        f"in both): eager {throughput['eager_tokens_per_s']:,.0f} tok/s, runner "
        f"{throughput['graph_tokens_per_s']:,.0f} tok/s, same tokens: {throughput['same_tokens']}, "
        f"runner steps run eagerly: {throughput['runner_eager_steps']}",
        f"capture: {capture['keys']} keys in {capture['seconds']:.2f} s (of which verifying each key against "
        f"eager {capture.get('verify_seconds', 0.0):.2f} s, {capture.get('verify_seconds', 0.0) / max(capture['keys'], 1) * 1e3:.1f} ms a key), "
        f"{capture['pool_bytes'] / 2**20:.2f} MiB {capture['pool_bytes_label']}",
    ]
    if doc["compile"]["skipped"]:
        lines.append(f"torch.compile peer: skipped ({doc['compile']['skipped']})")
    return "\n".join(lines)


def format_runner_floor(batches: Sequence[Mapping[str, Any]], device: str) -> List[str]:
    """The GraphRunner one-op table: with value checks and metadata only, validate() alone, debug mode
    (``device``: where the batches live; off the CPU the default reads no values)."""
    target = TARGETS["runner"]
    lines = ["", "graphrt's own cost per GraphRunner call: a runner of a one-op model (runner - raw replay of the "
                 "same graph, paired samples, rounds of their own), trivial ops median [p10-p90], "
                 f"target <= {target:g}"]
    rows = []
    for b in batches:
        floor = b["floor"]
        costs = floor["costs"]
        row = [str(b["batch_size"]), _us(floor["times_us"]["trivial"]["median"])]
        for name in LABELS:
            row += [format_cost(costs[name]), format_stability(costs[name]), verdict(costs[name], target)]
        row += [f"{format_cost(costs['validate'])} / {format_cost(costs['validate_metadata_only'])}",
                format_cost(costs["guards"], digits=2), format_cost(costs["debug"], "us")]
        rows.append(row)
    header = ["bs", "trivial op us"]
    for title in ("value checks", "metadata only"):
        header += [title, "p90/p10", f"<= {target:g}"]
    lines += _table([*header, "validate(): values / metadata only", "guards", "debug: + us"], rows)
    lines += [
        f"value checks: {LABELS['runner']}: GraphRunner's default; on CPU validate() also reads the index values of "
        "the batch's host tensors" + ("" if device == "cpu" else
                                      f" (on {device} the default checks metadata only: both columns check the same)"),
        f"metadata only: {LABELS['runner_metadata_only']}: GraphRunner(check_values=False), validate() checks "
        "metadata only: the figure a GPU user pays",
        "validate(): batch.validate() alone, with and without the value checks, same rounds (part of the runner's "
        "figure), trivial ops",
        "guards: the key's per-call guard check alone (state token, state, bindings; the one-op model writes "
        "nothing, so no aliasing check), same rounds (part of the runner's figure), trivial ops",
        "debug: extra cost per call of the same one-op runner with debug=True (stale-output guard)",
        "p90/p10: how still the figure holds over the rounds; below noise: the paired differences do not rise above "
        "the noise (bench_timing.Cost)",
    ]
    return lines


def format_parts(batches: Sequence[Mapping[str, Any]]) -> List[str]:
    """The reference model's runner - raw replay, in parts (µs)."""
    lines = ["", "the reference model's runner - raw replay, in parts, us (the target does not apply: the attention "
                 "hook is work eager steps do too)"]
    rows = [
        [str(b["batch_size"]), _cost_us(b["costs"]["overhead"]), _us(b["times_us"]["hook"]["median"]),
         _us(b["floor"]["costs"]["runner"]["us"]["median"]), _cost_us(b["costs"]["rest"])]
        for b in batches
    ]
    lines += _table(["bs", "runner - raw replay", "attn hook", "graphrt (one-op figure)", "rest"], rows)
    lines += [
        "attn hook: the attention backend's init_forward_metadata_replay alone (the attention metadata refresh)",
        "graphrt: validate, lookup, staging, replay call and cut, as measured on the one-op model above "
        "(value checks on)",
        "rest: runner - raw replay - attn hook - graphrt, round by round: wider staging copies and cache effects of "
        "a real model's larger tensors",
    ]
    return lines


def write_json(doc: Dict[str, Any], path: Path) -> None:
    """Write ``doc`` as indented JSON (dtypes, devices and paths as strings)."""
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


BAND_ALPHA = 0.12  # p10-p90 bands: light, under the median curves


def plot_latency(doc: Dict[str, Any], path: Path) -> Optional[str]:
    """Three panels against batch size as a PNG: latency; graphrt's own cost per GraphRunner call
    (one-op model, both validate modes, the target); the reference model's runner - raw replay in
    parts. Returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not installed ({error})"
    batches = doc["batches"]
    figure, axes = plt.subplots(1, 3, figsize=(16, 5))
    plot_latency_panel(axes[0], batches)
    plot_floor_panel(axes[1], batches)
    plot_parts_panel(axes[2], batches)
    sizes = [b["batch_size"] for b in batches]
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_xlabel("batch size")
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=8, framealpha=0.85)
    busy = " | MACHINE BUSY: figures unreliable" if doc["load"]["busy"] else ""
    figure.suptitle(f"graphrt, {doc['model']['preset']} model on {doc['machine']['device_name']}, "
                    f"backend {doc['backend']}; medians, bands p10-p90{busy}", fontsize=11,
                    color="red" if busy else "black")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return None


def _curve(axis: Any, xs: Sequence[int], spreads: Sequence[Mapping[str, float]], label: str,
           solid: Optional[Sequence[bool]] = None, **style: Any) -> bool:
    """A median curve over a light p10-p90 band. Where ``solid`` is False (a cost below noise) the
    curve and its band break and an x sits on the zero line: no median below noise is drawn as a
    cost, and no band of noise covers the figures that mean something. Returns whether any point
    was below noise."""
    solid = [True] * len(xs) if solid is None else list(solid)
    medians = [s["median"] if keep else math.nan for s, keep in zip(spreads, solid)]
    line, = axis.plot(xs, medians, marker="o", label=label, zorder=3, **style)
    axis.fill_between(xs, [s["p10"] for s in spreads], [s["p90"] for s in spreads], where=solid,
                      color=line.get_color(), alpha=BAND_ALPHA, linewidth=0, zorder=1)
    noisy = [x for x, keep in zip(xs, solid) if not keep]
    if noisy:
        axis.plot(noisy, [0.0] * len(noisy), linestyle="none", marker="x", markersize=9, markeredgewidth=2,
                  color=line.get_color(), zorder=4, clip_on=False)
    return bool(noisy)


def _noise_legend(axis: Any) -> None:
    """One legend entry for the x marks of costs below noise."""
    axis.plot([], [], linestyle="none", marker="x", color="grey", markeredgewidth=2, label="x on 0: below noise")


def plot_latency_panel(axis: Any, batches: Sequence[Mapping[str, Any]]) -> None:
    """Latency per decode step, log-log, every tick labelled in µs."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    for name, title in LATENCY_COLUMNS:
        points = [(b["batch_size"], b["times_us"][name]) for b in batches if name in b["times_us"]]
        if points:
            xs, spreads = zip(*points)
            _curve(axis, xs, spreads, title)
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}"))
    axis.yaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
    axis.set_ylabel("us per decode step (log scale)")
    axis.set_title("latency per decode step", fontsize=11)


def plot_floor_panel(axis: Any, batches: Sequence[Mapping[str, Any]]) -> None:
    """graphrt's own cost per GraphRunner call in trivial ops, with and without value checks, and the target."""
    sizes = [b["batch_size"] for b in batches]
    medians, noisy = [0.0], False
    for name, label in LABELS.items():
        costs = [b["floor"]["costs"][name] for b in batches]
        noisy |= _curve(axis, sizes, [c["trivial_ops"] for c in costs], label, [c["above_noise"] for c in costs])
        medians += [c["trivial_ops"]["median"] for c in costs]
    target = TARGETS["runner"]
    axis.axhline(target, color="red", linestyle="--", label=f"target {target:g}")
    if noisy:
        _noise_legend(axis)
    axis.set_ylim(0, 1.4 * max(2 * target, *medians))
    axis.set_ylabel("trivial eager ops per call")
    axis.set_title("graphrt's own cost per GraphRunner call\n(one-op model: runner - raw replay)", fontsize=11)


def plot_parts_panel(axis: Any, batches: Sequence[Mapping[str, Any]]) -> None:
    """The reference model's runner - raw replay and its parts, µs (no target: model noise included)."""
    sizes = [b["batch_size"] for b in batches]
    overhead = [b["costs"]["overhead"] for b in batches]
    if _curve(axis, sizes, [c["us"] for c in overhead], "runner - raw replay", [c["above_noise"] for c in overhead]):
        _noise_legend(axis)
    axis.plot(sizes, [b["times_us"]["hook"]["median"] for b in batches], marker=".", linestyle=":",
              label="of which attention hook")
    axis.plot(sizes, [b["floor"]["costs"]["runner"]["us"]["median"] for b in batches], marker=".", linestyle=":",
              label="of which graphrt (one-op figure)")
    axis.set_ylim(0, 1.4 * max(c["us"]["median"] for c in overhead + [{"us": {"median": 1.0}}]))
    axis.set_ylabel("us per call")
    axis.set_title("the reference model's runner - raw replay\n(model noise included; no target)", fontsize=11)
