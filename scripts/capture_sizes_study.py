"""Padding waste of the default capture sizes vs sizes tuned from traffic, on three synthetic traces.

Each trace is a seeded sequence of decode batch sizes in 1..64. Sizes are tuned on one trace
(seed 1) and measured on a fresh trace of the same kind (seed 2), so the tuned figures are
held-out. Waste is padded tokens in percent of real tokens (graphrt.sizes.padding_waste); held-out
steps larger than the largest tuned size run eagerly and are counted in their own column.

"Default with N graphs" is the default policy made denser or sparser by its step: the powers of
two below ``step``, then every multiple of ``step`` up to 64 (step 8 is ``default_capture_sizes``,
11 graphs); the steps tried are 32, 16, 8, 4, 2, 1 (7 to 64 graphs).

    PYTHONPATH=. python scripts/capture_sizes_study.py [--steps 20000]
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from graphrt.sizes import choose_capture_sizes, default_capture_sizes, padding_waste, uncovered_steps

MAX_BS = 64
TARGET = 0.05
STEPS_TRIED = (32, 16, 8, 4, 2, 1)


def uniform_trace(rng: np.random.Generator, steps: int) -> np.ndarray:
    return rng.integers(1, MAX_BS + 1, steps)


def poisson_trace(rng: np.random.Generator, steps: int) -> np.ndarray:
    return np.clip(rng.poisson(12, steps), 1, MAX_BS)


def bursty_trace(rng: np.random.Generator, steps: int) -> np.ndarray:
    """Alternating phases (geometric length, mean 50 steps) of 1-4 and of 48-64 requests."""
    sizes: List[int] = []
    high = False
    while len(sizes) < steps:
        length = int(rng.geometric(1 / 50))
        low, top = (48, 64) if high else (1, 4)
        sizes.extend(rng.integers(low, top + 1, length).tolist())
        high = not high
    return np.array(sizes[:steps])


TRACES: Dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "uniform 1..64": uniform_trace,
    "Poisson mean 12": poisson_trace,
    "bursty 1-4 / 48-64": bursty_trace,
}


def histogram(trace: np.ndarray) -> Dict[int, int]:
    return {int(size): count for size, count in Counter(trace.tolist()).items()}


def default_family(step: int) -> List[int]:
    """Powers of two below ``step``, then multiples of ``step`` up to MAX_BS."""
    sizes = [1 << i for i in range(8) if (1 << i) < step] + list(range(step, MAX_BS + 1, step))
    return sorted(set(sizes) | {MAX_BS})


def default_graphs_needed(hist: Dict[int, int]) -> Optional[Tuple[int, int]]:
    """(graphs, step) of the sparsest default-family list within TARGET waste, or None."""
    for step in STEPS_TRIED:
        sizes = default_family(step)
        if padding_waste(hist, sizes) <= TARGET:
            return len(sizes), step
    return None


def tuned_graphs_needed(train: Dict[int, int], test: Dict[int, int]) -> int:
    """Fewest graphs whose tuned sizes (from ``train``) keep ``test`` within TARGET waste."""
    for max_graphs in range(1, MAX_BS + 1):
        if padding_waste(test, choose_capture_sizes(train, max_graphs, MAX_BS)) <= TARGET:
            return max_graphs
    return MAX_BS


def study(steps: int = 20000) -> List[Dict[str, object]]:
    """One row per trace: waste of the default list and of tuned sizes (tuned on one seeded trace,
    measured on a fresh one), and the graphs each needs to reach TARGET waste."""
    default = default_capture_sizes(MAX_BS)
    assert default == default_family(8)
    rows = []
    for name, make in TRACES.items():
        train = histogram(make(np.random.default_rng(1), steps))
        test = histogram(make(np.random.default_rng(2), steps))
        tuned = choose_capture_sizes(train, len(default), MAX_BS)
        needed = default_graphs_needed(test)
        rows.append({
            "trace": name, "steps": steps, "graphs": len(default), "default_sizes": default, "tuned_sizes": tuned,
            "default_waste": padding_waste(test, default), "tuned_waste": padding_waste(test, tuned),
            "tuned_eager_steps": uncovered_steps(test, tuned),
            "default_graphs_for_target": None if needed is None else needed[0],
            "default_step_for_target": None if needed is None else needed[1],
            "tuned_graphs_for_target": tuned_graphs_needed(train, test),
        })
    return rows


def format_study(rows: List[Dict[str, object]]) -> List[str]:
    """The study as a Markdown table plus the tuned size lists."""
    graphs = rows[0]["graphs"]
    lines = [
        f"| trace | default, {graphs} graphs | tuned, {graphs} graphs | tuned: eager steps "
        f"| graphs for <= {TARGET:.0%}: default (step) | graphs for <= {TARGET:.0%}: tuned |",
        "|" + "---|" * 6,
    ]
    for row in rows:
        needed = ("never" if row["default_graphs_for_target"] is None
                  else f"{row['default_graphs_for_target']} (step {row['default_step_for_target']})")
        lines.append(f"| {row['trace']} | {100 * row['default_waste']:.2f} % | {100 * row['tuned_waste']:.2f} % "
                     f"| {row['tuned_eager_steps']} of {row['steps']} | {needed} | {row['tuned_graphs_for_target']} |")
    lines.append("")
    lines += [f"tuned {graphs} sizes, {row['trace']}: {row['tuned_sizes']}" for row in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20000, help="decode steps per trace")
    args = parser.parse_args()
    print("\n".join(format_study(study(args.steps))))


if __name__ == "__main__":
    main()
