"""Capture-size policies: the default size list and O(1) padded-size lookup tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

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
