"""Reporting for scripts/bench.py: machine description, terminal tables, JSON document, PNG plot."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from bench_lib import BatchResult
from bench_load import format_load
from bench_timing import Spread

OVERHEAD_TARGET = 10.0  # trivial eager ops per runner call (DESIGN.md)
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
    }


def _us(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _spread(spread: Spread) -> str:
    return f"{_us(spread.median)} [{_us(spread.p10)}-{_us(spread.p90)}]"


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> List[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return lines


def format_report(doc: Dict[str, Any], results: Sequence[BatchResult]) -> str:
    """The terminal report: header, latency table, overhead table, throughput and capture lines."""
    machine, model, capture = doc["machine"], doc["model"], doc["capture"]
    config = model["config"]
    lines = [
        f"graphrt decode benchmark | backend: {doc['backend'].upper()} | device: {machine['device_name']} "
        f"({machine['cpu_cores']} CPU cores) | torch {machine['torch']}",
        f"NOTE: {doc['backend_note']}.",
        *format_load(doc["load"]),
        f"model {model['preset']}: {config['num_layers']} layers, hidden {config['hidden_size']}, "
        f"heads {config['num_heads']}/{config['num_kv_heads']} kv, vocab {config['vocab_size']}, "
        f"context {config['max_context_len']}, {config['dtype']}, {model['parameters'] / 1e6:.1f}M parameters",
        f"trivial eager op (x.add_(1), one element): {_spread(Spread(**doc['trivial_op_us']))} us; "
        f"graph logits checked against eager at the padded size: {'ok' if doc['verified'] else 'FAILED'}",
        "",
        "latency per decode step, us: median [p10-p90]",
    ]
    columns = [(name, title) for name, title in LATENCY_COLUMNS if any(name in r.times_us for r in results)]
    rows = [
        [str(r.batch_size), str(r.padded_size),
         *(_spread(r.times_us[name]) if name in r.times_us else "-" for name, _ in columns),
         f"{r.graph_speedup:.2f}x", f"{r.replay_speedup:.2f}x"]
        for r in results
    ]
    lines += _table(["bs", "padded", *(title for _, title in columns), "eager/graph", "eager/raw replay"], rows)
    lines += ["", f"graphrt's own cost per call: a runner of a one-op model (runner - raw replay, paired samples), "
                  f"target <= {OVERHEAD_TARGET:g} trivial ops"]
    rows = [
        [str(r.batch_size), _us(r.times_us["trivial"].median), _spread(r.times_us["one_op_overhead"]),
         _spread(r.one_op_overhead_trivial_ops), "yes" if r.one_op_overhead_trivial_ops.median <= OVERHEAD_TARGET else "NO",
         _spread(r.times_us["debug_cost"]) if "debug_cost" in r.times_us else "-"]
        for r in results
    ]
    lines += _table(["bs", "trivial op us", "overhead us", "/ trivial", "<= target", "debug mode: + us"], rows)
    lines += ["", "the reference model's runner - raw replay, in parts, us (medians; the target does not apply: "
                  "the attention hook is work eager steps do too)"]
    rows = [
        [str(r.batch_size), _spread(r.times_us["overhead"]), _us(r.times_us["validate"].median),
         _us(r.times_us["hook"].median), _us(r.times_us["one_op_overhead"].median),
         _us(r.times_us["overhead"].median - r.times_us["validate"].median - r.times_us["hook"].median
             - r.times_us["one_op_overhead"].median)]
        for r in results
    ]
    lines += _table(["bs", "runner - raw replay", "validate", "attn hook", "graphrt (one-op figure)", "rest"], rows)
    lines += [
        "validate: batch.validate() alone (on CPU it also reads index values; on GPU metadata only)",
        "attn hook: the attention backend's init_forward_metadata_replay alone (the attention metadata refresh)",
        "graphrt: lookup, staging, replay call and cut, as measured on the one-op model above",
        "rest: what is left: wider staging copies and cache effects of a real model's larger tensors",
        "debug mode: extra cost per call of the one-op runner with debug=True (stale-output guard)",
    ]
    throughput = doc["throughput"]
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


def write_json(doc: Dict[str, Any], path: Path) -> None:
    """Write ``doc`` as indented JSON (dtypes, devices and paths as strings)."""
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")


def plot_latency(doc: Dict[str, Any], results: Sequence[BatchResult], path: Path) -> Optional[str]:
    """Latency and overhead against batch size as a PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not installed ({error})"
    sizes = [r.batch_size for r in results]
    figure, (latency_ax, overhead_ax, model_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for name, title in LATENCY_COLUMNS:
        points = [(r.batch_size, r.times_us[name]) for r in results if name in r.times_us]
        if not points:
            continue
        xs, spreads = zip(*points)
        latency_ax.plot(xs, [s.median for s in spreads], marker="o", label=title)
        latency_ax.fill_between(xs, [s.p10 for s in spreads], [s.p90 for s in spreads], alpha=0.2)
    latency_ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="us per decode step",
                   title="latency (median, p10-p90 band)")
    latency_ax.legend()
    # graphrt's own cost (a one-op model) leads; the reference model's figure carries its step's
    # noise (the step is 100x the overhead), so it gets its own panel and scale.
    for axis, label, ratios, title in (
        (overhead_ax, "runner - raw replay", [r.one_op_overhead_trivial_ops for r in results],
         "graphrt's own cost per call (one-op model)"),
        (model_ax, "runner - raw replay", [r.overhead_trivial_ops for r in results],
         "same on the reference model (model noise)"),
    ):
        axis.plot(sizes, [s.median for s in ratios], marker="o", label=label)
        axis.fill_between(sizes, [s.p10 for s in ratios], [s.p90 for s in ratios], alpha=0.2)
        axis.axhline(OVERHEAD_TARGET, color="red", linestyle="--", label=f"target {OVERHEAD_TARGET:g}")
        medians = [s.median for s in ratios]
        axis.set(xscale="log", xlabel="batch size", ylabel="trivial eager ops", title=title,
                 ylim=(1.2 * min(0.0, *medians), 1.5 * max(2 * OVERHEAD_TARGET, *medians)))
    validate = [r.times_us["validate"].median / r.times_us["trivial"].median for r in results]
    model_ax.plot(sizes, validate, marker=".", linestyle=":", label="of which validate()")
    overhead_ax.legend()
    model_ax.legend()
    for axis in (latency_ax, overhead_ax, model_ax):
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.minorticks_off()
    figure.suptitle(f"graphrt, {doc['model']['preset']} model on {doc['machine']['device_name']}, "
                    f"backend {doc['backend']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return None
