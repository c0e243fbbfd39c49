"""How scripts/bench.py times: calibrated samples, interleaved rounds, spreads and costs.

Every figure is a sample of ``inner`` back-to-back calls, after one untimed call, bracketed by a
device synchronization and divided by ``inner`` (so timer resolution and launch queueing do
not distort short calls); the callables compared with each other are sampled in interleaved
rounds, so slow drifts of machine load hit every column alike. A cost (what one callable adds
over another) is the per-round difference of two samples of the same round, each the fastest of
``COST_PARTS`` parts, and is printed as a cost only when it rises above the noise (``Cost``).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

Probe = Tuple[str, Callable[[], Any]]
# cost name -> (minuend probe, subtrahend probe or None for the minuend's own time, calls per minuend call)
Pairs = Mapping[str, Tuple[str, Optional[str], int]]
COST_PARTS = 3  # a cost's samples are each the best of this many parts (time_costs)


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
    best_of: int = 1,
) -> Tuple[Dict[str, int], Dict[str, List[float]]]:
    """Calls per sample and ``iters`` samples (µs per call) per probe, in interleaved rounds run
    in ``probes`` order, with the heap built so far frozen; the first ``warmup`` rounds are discarded.
    ``best_of`` > 1: a sample is the fastest of that many parts of it (a preemption only ever adds
    time, and one landing on either side of a paired difference would swing it)."""
    with frozen_gc():
        inner = {name: clock.calibrate(fn) for name, fn in probes}
        samples: Dict[str, List[float]] = {name: [] for name, _ in probes}
        for round_index in range(warmup + iters):
            for name, fn in probes:
                calls = max(1, inner[name] // best_of)
                value = min(clock.sample_us(fn, calls) for _ in range(best_of))
                if round_index >= warmup:
                    samples[name].append(value)
            on_round()
    return inner, samples


@dataclass
class Cost:
    """What one callable adds over another, from the differences of their samples in the same
    rounds: µs per call, and trivial ops of the same round (each round's difference divided by
    that round's trivial-op sample, so a slower round does not read as a costlier call).

    The noise rule, one for every cost the bench prints: a cost is ``above_noise`` when the
    differences' 10th percentile is above zero, in µs and in trivial ops (at least 9 rounds in 10
    found the callable slower; both, as the two percentiles interpolate between different
    rounds) and their median is above the trivial op's own p10-to-p90 spread in the same rounds
    (the smallest difference these rounds resolve). Otherwise the figure is printed as
    "below noise", never as a (possibly negative) cost; the JSON keeps the numbers.
    """

    us: Spread
    trivial_ops: Spread
    above_noise: bool

    @classmethod
    def of(cls, differences_us: Sequence[float], trivial_us: Sequence[float]) -> "Cost":
        """The cost of per-round ``differences_us``, with ``trivial_us`` the same rounds' trivial-op samples."""
        us, unit = Spread.of(differences_us), Spread.of(trivial_us)
        ops = Spread.of([value / trivial for value, trivial in zip(differences_us, trivial_us)])
        return cls(us, ops, us.p10 > 0 and ops.p10 > 0 and us.median > unit.p90 - unit.p10)

    @classmethod
    def paired(cls, samples: Dict[str, List[float]], minuend: str, subtrahend: Optional[str] = None,
               calls: int = 1, trivial: str = "trivial") -> "Cost":
        """``samples[minuend]`` (a sample of ``calls`` calls, per call) minus ``samples[subtrahend]``
        round by round; without a subtrahend, the minuend's own time in trivial ops."""
        minus = samples[subtrahend] if subtrahend is not None else [0.0] * len(samples[minuend])
        return cls.of([value / calls - other for value, other in zip(samples[minuend], minus)], samples[trivial])


def stability(cost: Mapping[str, Any]) -> float:
    """p90 / p10 of a cost (the JSON form of a Cost) in trivial ops: how still the figure holds;
    inf when p10 <= 0."""
    low, high = cost["trivial_ops"]["p10"], cost["trivial_ops"]["p90"]
    return high / low if low > 0 else math.inf


def verdict(cost: Mapping[str, Any], target: float) -> str:
    """"yes" / "NO": the median of a cost (the JSON form of a Cost) in trivial ops against
    ``target``. A cost below noise is within target only when its whole p10-p90 band is, and
    "unclear" otherwise."""
    ops = cost["trivial_ops"]
    if cost["above_noise"]:
        return "yes" if ops["median"] <= target else "NO"
    return "yes" if ops["p90"] <= target else "unclear"


@dataclass
class Timed:
    """One set of interleaved rounds: calls per sample, every probe's spread (µs per call), and the
    costs asked for."""

    inner_calls: Dict[str, int]
    times_us: Dict[str, Spread]
    costs: Dict[str, Cost]


def time_costs(clock: Clock, probes: Sequence[Probe], pairs: Pairs, iters: int, warmup: int,
               on_round: Callable[[], None] = lambda: None) -> Timed:
    """Time ``probes`` and the trivial op (``x.add_(1)`` on a one-element tensor of the clock's
    device, last in every round) in interleaved rounds, each sample the best of ``COST_PARTS``
    parts, and each cost of ``pairs`` from them."""
    trivial = torch.zeros(1, device=clock.device)
    inner, samples = time_rounds(clock, [*probes, ("trivial", lambda: trivial.add_(1))], iters, warmup, on_round,
                                 best_of=COST_PARTS)
    return Timed(inner, {name: Spread.of(values) for name, values in samples.items()},
                 {name: Cost.paired(samples, *pair) for name, pair in pairs.items()})
