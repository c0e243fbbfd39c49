"""How scripts/bench.py times: calibrated samples, interleaved rounds, spreads and costs.

Every figure is a sample of ``inner`` back-to-back calls, after one untimed call, bracketed by a
device synchronization and divided by ``inner`` (so timer resolution and launch queueing do
not distort short calls); the callables compared with each other are sampled in interleaved
rounds, so slow drifts of machine load hit every column alike.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

@dataclass
class Spread:
    """Median and 10th/90th percentiles of a list of samples (microseconds unless noted)."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """Summarize ``samples`` (at least one)."""
        p10, median, p90 = np.percentile(np.asarray(samples, dtype=np.float64), [10, 50, 90])
        return cls(float(median), float(p10), float(p90))

    def scaled(self, factor: float) -> "Spread":
        """The same spread multiplied by ``factor`` (e.g. divided by a unit cost)."""
        return Spread(self.median * factor, self.p10 * factor, self.p90 * factor)


class Clock:
    """Times a callable in samples of many calls, bracketed by device synchronization."""

    def __init__(self, device: torch.device, target_s: float, max_inner: int = 10_000) -> None:
        self.device = device
        self.sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        )
        self.target_s = target_s
        self.max_inner = max_inner

    def _elapsed(self, fn: Callable[[], Any], calls: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return time.perf_counter() - start

    def calibrate(self, fn: Callable[[], Any], warm_calls: int = 3) -> int:
        """Calls per sample so that one sample lasts about ``target_s`` (doubles as warm-up).

        The first calls after a capture or after another probe can be many times slower than
        the steady ones; calibrating on them gave samples of 2 or 3 calls, whose figure then
        swung with whatever ran just before. So ``warm_calls`` untimed calls come first, and the
        final count is timed twice, the faster time kept (a preemption only ever adds time).
        """
        for _ in range(warm_calls):
            fn()
        calls = 1
        while True:
            elapsed = self._elapsed(fn, calls)
            if elapsed >= self.target_s / 4 or calls >= self.max_inner:
                break
            calls *= 2
        elapsed = min(elapsed, self._elapsed(fn, calls))
        return max(1, min(self.max_inner, round(calls * self.target_s / max(elapsed, 1e-9))))

    def sample_us(self, fn: Callable[[], Any], calls: int) -> float:
        """Microseconds per call over one sample of ``calls`` calls, after one untimed call, so every
        probe is timed warm whatever ran before it."""
        fn()
        return self._elapsed(fn, calls) / calls * 1e6


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Move every object alive now to the garbage collector's permanent generation for the block
    (``gc.freeze()``), as serving engines do once started (SGLang's ``freeze_gc``, vLLM's
    ``freeze_gc_heap``). A full collection walks the whole heap a benchmark builds (models,
    recordings, runners: hundreds of thousands of objects, far longer than a sample) and would
    land in one random sample; collections of what the timed calls themselves allocate still
    run, and count."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def time_rounds(
    clock: Clock,
    probes: Sequence[Tuple[str, Callable[[], Any]]],
    iters: int,
    warmup: int,
    on_round: Callable[[], None] = lambda: None,
) -> Tuple[Dict[str, int], Dict[str, List[float]]]:
    """Calls per sample and ``iters`` samples (µs per call) per probe, in interleaved rounds run
    in ``probes`` order, with the heap built so far frozen; the first ``warmup`` rounds are discarded."""
    with frozen_gc():
        inner = {name: clock.calibrate(fn) for name, fn in probes}
        samples: Dict[str, List[float]] = {name: [] for name, _ in probes}
        for round_index in range(warmup + iters):
            for name, fn in probes:
                value = clock.sample_us(fn, inner[name])
                if round_index >= warmup:
                    samples[name].append(value)
            on_round()
    return inner, samples
