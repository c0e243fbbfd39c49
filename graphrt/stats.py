"""Runtime counters: graph hits, eager runs by reason, padding waste, traffic histogram."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict

from .batch import ForwardMode


@dataclass
class RuntimeStats:
    """Counters updated once per step; plain ints and Counters so the hot path stays cheap."""

    graph_runs: int = 0
    eager_runs: int = 0
    eager_reasons: Counter = field(default_factory=Counter)
    real_tokens: int = 0
    padded_tokens: int = 0
    histogram: Dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def record_graph(self, real_tokens: int, padded_tokens: int) -> None:
        """Count one replay carrying ``real_tokens`` rows padded to ``padded_tokens``."""
        self.graph_runs += 1
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens - real_tokens

    def record_eager(self, reason: str, real_tokens: int) -> None:
        """Count one eager run and why it was not a replay."""
        self.eager_runs += 1
        self.eager_reasons[reason] += 1
        self.real_tokens += real_tokens

    def record_size(self, mode: int, batch_size: int) -> None:
        """Add one observation of a real batch size to the per-mode traffic histogram."""
        self.histogram[mode][batch_size] += 1

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-friendly snapshot (keys as strings)."""
        total = self.real_tokens + self.padded_tokens
        return {
            "graph_runs": self.graph_runs,
            "eager_runs": self.eager_runs,
            "eager_reasons": dict(self.eager_reasons),
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_waste": self.padded_tokens / total if total else 0.0,
            "histogram": {
                ForwardMode(mode).name: dict(sorted(counts.items())) for mode, counts in self.histogram.items()
            },
        }
