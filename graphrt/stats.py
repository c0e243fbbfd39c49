"""Runtime counters: graph hits, eager runs by reason, padding waste, traffic histogram."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Mapping, Union

from graphrt.batch import ForwardMode

if TYPE_CHECKING:
    from graphrt.entry import EagerReason


@dataclass
class RuntimeStats:
    """Counters updated once per step; plain ints and Counters so the hot path stays cheap."""

    graph_runs: int = 0
    piecewise_runs: int = 0
    eager_runs: int = 0
    eager_reasons: Counter = field(default_factory=Counter)
    multi_step_runs: int = 0  # decode() calls served by one multi-step replay
    multi_step_fallbacks: Counter = field(default_factory=Counter)  # decode() calls run step by step, by reason
    real_tokens: int = 0
    padded_tokens: int = 0
    guard_failures: Counter = field(default_factory=Counter)  # what differed from a key's capture, by words
    histogram: Dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def record_graph(self, real_tokens: int, padded_tokens: int) -> None:
        """Count one replay carrying ``real_tokens`` rows padded to ``padded_tokens``."""
        self.graph_runs += 1
        self._count_padded(real_tokens, padded_tokens)

    def record_piecewise(self, real_tokens: int, padded_tokens: int) -> None:
        """Count one piecewise replay (graph pieces around eager splitting ops), padded like a replay."""
        self.piecewise_runs += 1
        self._count_padded(real_tokens, padded_tokens)

    def record_multi_step(self, real_tokens: int, padded_tokens: int) -> None:
        """Count one multi-step replay: every step's real and padded rows."""
        self.multi_step_runs += 1
        self._count_padded(real_tokens, padded_tokens)

    def record_multi_step_fallback(self, reason: str) -> None:
        """Count one decode() call whose steps ran one by one, and why no multi-step replay served it
        (its steps count as graph or eager runs of their own)."""
        self.multi_step_fallbacks[reason] += 1

    def _count_padded(self, real_tokens: int, padded_tokens: int) -> None:
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens - real_tokens

    def record_eager(self, reason: "EagerReason", real_tokens: int) -> None:
        """Count one eager run and why it was not a replay (counted under the reason's value)."""
        self.eager_runs += 1
        self.eager_reasons[reason.value] += 1
        self.real_tokens += real_tokens

    def record_guard_failure(self, detail: str) -> None:
        """Count one call a key's guard kept from replaying (``detail``: what differed from its capture)."""
        self.guard_failures[detail] += 1

    def record_size(self, mode: int, batch_size: int) -> None:
        """Add one observation of a real batch size to the per-mode traffic histogram."""
        self.histogram[mode][batch_size] += 1

    def merge_histogram(self, histogram: Mapping[ForwardMode, Mapping[int, int]]) -> None:
        """Add per-mode counts (e.g. from ``load_histogram``) to the traffic histogram."""
        for mode, counts in histogram.items():
            self.histogram[mode].update(counts)

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-friendly snapshot (keys as strings)."""
        total = self.real_tokens + self.padded_tokens
        return {
            "graph_runs": self.graph_runs,
            "piecewise_runs": self.piecewise_runs,
            "eager_runs": self.eager_runs,
            "eager_reasons": dict(self.eager_reasons),
            "multi_step_runs": self.multi_step_runs,
            "multi_step_fallbacks": dict(self.multi_step_fallbacks),
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_waste": self.padded_tokens / total if total else 0.0,
            "guard_failures": dict(self.guard_failures),
            "histogram": {
                ForwardMode(mode).name: dict(sorted(counts.items())) for mode, counts in self.histogram.items()
            },
        }


HISTOGRAM_VERSION = 1
Histogram = Dict[ForwardMode, Counter]


def parse_histogram(data: Mapping[Any, Any]) -> Histogram:
    """Per-mode counts from ``{size: count}`` (DECODE) or ``{mode name: {size: count}}``.

    Sizes may be strings of ints (as JSON writes them); ValueError names the bad entry.
    """
    if data and all(isinstance(value, Mapping) for value in data.values()):
        per_mode = data
    else:
        per_mode = {ForwardMode.DECODE: data}
    result: Histogram = {}
    for mode, counts in per_mode.items():
        try:
            forward_mode = ForwardMode[mode] if isinstance(mode, str) else ForwardMode(mode)
        except (KeyError, ValueError):
            names = [member.name for member in ForwardMode]
            raise ValueError(f"histogram: expected mode names among {names}, got {mode!r}") from None
        parsed = Counter()
        for size, count in counts.items():
            try:
                size_int = int(size)
            except (TypeError, ValueError):
                size_int = -1
            if size_int < 0 or type(count) is not int or count < 0:
                raise ValueError(f"histogram[{forward_mode.name}]: expected non-negative int sizes and counts, "
                                 f"got {size!r}: {count!r}")
            parsed[size_int] += count
        result[forward_mode] = parsed
    return result


def save_histogram(histogram: Mapping[int, Mapping[int, int]], path: Union[str, os.PathLike]) -> None:
    """Write per-mode counts as JSON, atomically (a reader never sees a half-written file)."""
    payload = {
        "version": HISTOGRAM_VERSION,
        "histogram": {ForwardMode(mode).name: {str(size): count for size, count in sorted(counts.items())}
                      for mode, counts in histogram.items()},
    }
    temporary = f"{os.fspath(path)}.tmp"
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(temporary, path)


def load_histogram(path: Union[str, os.PathLike]) -> Histogram:
    """Read a file written by ``save_histogram``; ValueError names the file if it is not one."""
    with open(path) as handle:
        try:
            payload = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"histogram: {os.fspath(path)} is not JSON ({error})") from None
    if not isinstance(payload, dict) or payload.get("version") != HISTOGRAM_VERSION or "histogram" not in payload:
        raise ValueError(f"histogram: {os.fspath(path)} is not a graphrt histogram file (version {HISTOGRAM_VERSION})")
    return parse_histogram(payload["histogram"])


def histogram_from(source: Union[Mapping[Any, Any], str, os.PathLike]) -> Histogram:
    """Per-mode counts from a mapping (see ``parse_histogram``) or a file from ``save_histogram``."""
    if isinstance(source, (str, os.PathLike)):
        return load_histogram(source)
    if isinstance(source, Mapping):
        return parse_histogram(source)
    raise TypeError(f"histogram: expected a {{size: count}} mapping or a JSON file path, got {type(source).__name__}")

