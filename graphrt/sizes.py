"""Capture-size policies: the default list, O(1) padded-size lookup, and sizes chosen from traffic."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


def default_capture_sizes(max_batch_size: int) -> List[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (always included).

    Small sizes are powers of two because single-request latency matters most there;
    above 8 a step of 8 bounds padding waste at under 8 rows (vLLM and SGLang use the same shape).
    """
    if type(max_batch_size) is not int or max_batch_size < 1:
        raise ValueError(f"max_batch_size: expected a positive int, got {max_batch_size!r}")
    sizes = [s for s in SMALL_SIZES if s <= max_batch_size]
    sizes += list(range(2 * SIZE_STEP, max_batch_size + 1, SIZE_STEP))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def default_piecewise_sizes(largest: int) -> List[int]:
    """Powers of two from 1 up to ``largest``, and ``largest`` itself: padding a prefill or mixed
    step to the next size at most doubles it, with one key per doubling (few captures)."""
    sizes = [1 << power for power in range(largest.bit_length()) if 1 << power < largest]
    return sizes + [largest]


def normalize_capture_sizes(sizes: Iterable[int], limit: int, field: str = "capture_sizes") -> List[int]:
    """Sorted unique sizes, each a positive int not above ``limit``; ValueError names the field."""
    result = sorted(set(sizes))
    if not result:
        raise ValueError(f"{field}: expected at least one size, got none")
    for size in result:
        if type(size) is not int or not 1 <= size <= limit:
            raise ValueError(f"{field}: expected ints in [1, {limit}], got {size!r}")
    return result


def build_pad_table(sizes: Sequence[int]) -> List[Optional[int]]:
    """table[n] = smallest size >= n, for n in 0..max(sizes): one list index per step."""
    table: List[Optional[int]] = [None] * (max(sizes) + 1)
    ordered = sorted(sizes)
    position = 0
    for n in range(len(table)):
        while ordered[position] < n:
            position += 1
        table[n] = ordered[position]
    return table


@dataclass(frozen=True)
class SizeGrid:
    """Capture sizes of one forward mode: per-token rows and per-request rows.

    Decode-style grids are diagonal (one token per request): a key is (s, s).
    Extend/mixed grids pair every token size with every request size not above it.
    """

    token_sizes: Tuple[int, ...]
    req_sizes: Tuple[int, ...]
    diagonal: bool

    @classmethod
    def for_decode(cls, sizes: Sequence[int]) -> "SizeGrid":
        return cls(tuple(sizes), tuple(sizes), diagonal=True)

    @classmethod
    def for_extend(cls, token_sizes: Sequence[int], req_sizes: Sequence[int]) -> "SizeGrid":
        return cls(tuple(token_sizes), tuple(req_sizes), diagonal=False)

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def max_reqs(self) -> int:
        return self.req_sizes[-1]

    def pairs(self) -> List[Tuple[int, int]]:
        """Every (padded tokens, padded requests) pair to capture, largest first."""
        if self.diagonal:
            pairs = [(s, s) for s in self.token_sizes]
        else:
            pairs = [(t, r) for t in self.token_sizes for r in self.req_sizes if r <= t]
        return sorted(pairs, reverse=True)


# ---- capture sizes from traffic ---------------------------------------------------------------


def _observed(histogram: Mapping[int, int], limit: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Sorted observed sizes >= 1 (and <= ``limit``) with positive counts, as int64 arrays."""
    pairs = []
    for size, count in histogram.items():
        if type(size) is not int or size < 0 or type(count) is not int or count < 0:
            raise ValueError(f"histogram: expected {{size: count}} with non-negative ints, got {size!r}: {count!r}")
        if size >= 1 and count > 0 and (limit is None or size <= limit):
            pairs.append((size, count))
    pairs.sort()
    return np.array([s for s, _ in pairs], dtype=np.int64), np.array([c for _, c in pairs], dtype=np.int64)


def _least_padding_subset(sizes: np.ndarray, counts: np.ndarray, candidates: Sequence[int], k: int) -> List[int]:
    """Exact DP: the ``k`` candidates (the largest always among them) that pad the traffic least.

    Candidates are sorted and the largest covers every observed size. ``best[i]`` is the least
    padding of the traffic up to candidate ``i`` with ``i`` the largest chosen; a group of observed
    sizes in (a_j, a_i] padded to a_i costs ``a_i * count - tokens`` from prefix sums: O(k m^2).
    """
    cand = np.asarray(candidates, dtype=np.int64)
    upto = np.searchsorted(sizes, cand, side="right")  # observed sizes <= each candidate
    count_prefix = np.concatenate([[0], np.cumsum(counts)])[upto]
    token_prefix = np.concatenate([[0], np.cumsum(counts * sizes)])[upto]
    count_before = np.concatenate([[0], count_prefix])  # index 0: nothing chosen below
    token_before = np.concatenate([[0], token_prefix])
    # cost[j, i]: padding of the observed sizes in (cand[j-1], cand[i]] (j = 0: from size 1).
    counts_in = count_prefix[None, :] - count_before[:, None]
    cost = cand[None, :] * counts_in - (token_prefix[None, :] - token_before[:, None])
    infeasible = np.arange(len(cand) + 1)[:, None] > np.arange(len(cand))[None, :]
    inf = np.int64(1) << 61
    cost[infeasible] = inf
    best = cost[0].copy()
    parents = []
    for _ in range(1, min(k, len(cand))):
        total = np.concatenate([[inf], best])[:, None] + cost  # row j+1: previous largest is cand[j]
        parent = total.argmin(axis=0)
        best = np.minimum(total[parent, np.arange(len(cand))], inf)
        parents.append(parent)
    chosen, i = [], len(cand) - 1
    for parent in reversed(parents):
        chosen.append(int(cand[i]))
        i = int(parent[i]) - 1
    chosen.append(int(cand[i]))
    return sorted(chosen)


def fallback_capture_sizes(max_batch_size: int, max_graphs: int) -> List[int]:
    """Sizes without traffic history: ``default_capture_sizes``, compressed to ``max_graphs``.

    When the default list is longer, keep the ``max_graphs`` of its sizes that pad least if every
    size in 1..max_batch_size were equally likely; ``max_batch_size`` is always kept.
    """
    _check_max_graphs(max_graphs)
    sizes = default_capture_sizes(max_batch_size)
    if len(sizes) <= max_graphs:
        return sizes
    uniform = np.arange(1, max_batch_size + 1, dtype=np.int64)
    return _least_padding_subset(uniform, np.ones_like(uniform), sizes, max_graphs)


def choose_capture_sizes(
    histogram: Mapping[int, int], max_graphs: int, max_batch_size: Optional[int] = None
) -> List[int]:
    """At most ``max_graphs`` sizes minimizing the padded tokens of ``histogram`` ({size: steps}), exactly.

    Only observed sizes are candidates (any other choice can move down to one at no cost), and
    the largest observed size is always chosen, so every observed step fits a graph. Sizes above
    ``max_batch_size`` are ignored (they run eagerly whatever the list); size 0 carries no tokens.
    With no usable history, ``fallback_capture_sizes(max_batch_size, max_graphs)``.
    """
    _check_max_graphs(max_graphs)
    sizes, counts = _observed(histogram, max_batch_size)
    if not len(sizes):
        if max_batch_size is None:
            raise ValueError("histogram: no observed size >= 1, and no max_batch_size for the default list")
        return fallback_capture_sizes(max_batch_size, max_graphs)
    return _least_padding_subset(sizes, counts, sizes.tolist(), max_graphs)


def padding_waste(histogram: Mapping[int, int], sizes: Sequence[int]) -> float:
    """Padded tokens per real token (0.05 = 5 %) when each step replays the smallest size that fits.

    Steps larger than ``max(sizes)`` run eagerly with no padding: they are left out of both sums
    (count them with ``uncovered_steps``). 0.0 when no step fits a graph.
    """
    sizes = normalize_capture_sizes(sizes, sys.maxsize, "sizes")
    observed, counts = _observed(histogram, sizes[-1])
    if not len(observed):
        return 0.0
    table = np.array(build_pad_table(sizes), dtype=np.int64)
    real = int((observed * counts).sum())
    return int(((table[observed] - observed) * counts).sum()) / real


def uncovered_steps(histogram: Mapping[int, int], sizes: Sequence[int]) -> int:
    """Steps of ``histogram`` larger than every size in ``sizes``: they run eagerly."""
    largest = normalize_capture_sizes(sizes, sys.maxsize, "sizes")[-1]
    return sum(count for size, count in histogram.items() if size > largest)


def _check_max_graphs(max_graphs: int) -> None:
    if type(max_graphs) is not int or max_graphs < 1:
        raise ValueError(f"max_graphs: expected a positive int, got {max_graphs!r}")
