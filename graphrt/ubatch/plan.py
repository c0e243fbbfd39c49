"""Micro-batch planning and slicing: which rows each micro-batch gets.

``_SizePlanner`` cuts a batch between requests into pieces that land on captured
graph sizes (least padding, then fewest pieces); ``split_forward_batch`` turns the
plan into valid sub-ForwardBatches, and ``_slice_tree`` cuts a whole call's
arguments (any pytree of tensors and ForwardBatches) per piece. The underscored
helpers are shared with ``graphrt.ubatch`` only.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from graphrt.batch import EXTEND_FIELDS, MULTIMODAL_FIELDS, REQUEST_FIELDS, TOKEN_FIELDS, ForwardBatch

logger = logging.getLogger(__name__)

__all__ = ["UBatchSlice", "split_forward_batch"]

CallInputs = Tuple[tuple, Dict[str, Any]]
# Planning costs in one int, compared lexicographically: eager pieces, then padded tokens, then pieces.
_COST_EAGER, _COST_PAD = 1 << 48, 1 << 16
_PLAN_CACHE_LIMIT = 4096
_TOKEN_FIELDS = tuple(spec.name for spec in TOKEN_FIELDS)
_REQUEST_FIELDS = tuple(spec.name for spec in REQUEST_FIELDS + EXTEND_FIELDS if spec.name != "extend_start_loc") + (
    "seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "top_logprobs_nums", "mrope_position_deltas")
_UNSPLITTABLE = tuple(name for name in MULTIMODAL_FIELDS if name != "mrope_position_deltas")


@dataclass(frozen=True)
class UBatchSlice:
    """Token rows and request rows of one micro-batch."""

    token_slice: slice
    req_slice: slice
    num_tokens: int
    num_reqs: int

    @classmethod
    def from_range(cls, token_start: int, token_end: int, req_start: int, req_end: int) -> "UBatchSlice":
        """Slice of tokens [token_start, token_end) and requests [req_start, req_end)."""
        if not (0 <= token_start <= token_end and 0 <= req_start <= req_end):
            raise ValueError(
                f"UBatchSlice: bad ranges tokens [{token_start}, {token_end}) reqs [{req_start}, {req_end})")
        return cls(slice(token_start, token_end), slice(req_start, req_end),
                   token_end - token_start, req_end - req_start)


class _SizePlanner:
    """Cuts batches between requests into pieces padded onto captured sizes: least padding, then fewest pieces."""

    def __init__(self, sizes: Sequence[int], num_ubatches: int) -> None:
        self.sizes = list(sizes)
        self.num_ubatches = num_ubatches  # pieces of a balanced split when no sizes are captured
        self._array = np.asarray(self.sizes, dtype=np.int64)
        self._coins: Dict[int, Tuple[List[float], List[int]]] = {}  # limit -> (fewest exact pieces, largest piece)
        self._plans: Dict[Tuple[int, int], List[int]] = {}
        self._lock = threading.Lock()

    def plan(self, num_tokens: int, num_reqs: int, tokens_per_req: Optional[Sequence[int]],
             limit: Optional[int], threshold: Optional[int]) -> List[UBatchSlice]:
        """Slices of at most ``limit`` tokens; batches of at most ``threshold`` tokens (default limit) stay whole."""
        counts = _check_counts(num_tokens, num_reqs, tokens_per_req)
        threshold = (limit or 0) if threshold is None else threshold
        if num_tokens <= threshold or num_reqs <= 1:
            return [UBatchSlice.from_range(0, num_tokens, 0, num_reqs)]
        if self.sizes:
            groups = self.unit_pieces(num_tokens, limit) if counts is None else self.request_groups(counts, limit)
        else:
            pieces = max(self.num_ubatches, -(-num_tokens // limit) if limit else 1)
            groups = _balanced_groups(np.ones(num_reqs, np.int64) if counts is None else counts, min(pieces, num_reqs))
        return _slices_from_groups(groups, counts)

    def graph_size(self, tokens: int) -> Optional[int]:
        """Smallest captured size holding ``tokens``, or None when none does (the piece runs eagerly)."""
        index = bisect.bisect_left(self.sizes, tokens)
        return self.sizes[index] if index < len(self.sizes) else None

    def unit_pieces(self, total: int, limit: int) -> List[int]:
        """Piece sizes for ``total`` one-token requests (decode), cached per (total, limit)."""
        with self._lock:
            plan = self._plans.get((total, limit))
            if plan is None:
                if len(self._plans) >= _PLAN_CACHE_LIMIT:
                    self._plans.clear()
                plan = self._plans[(total, limit)] = self._plan_units(total, limit)
        return plan

    def _plan_units(self, total: int, limit: int) -> List[int]:
        # Some optimal plan pads at most one piece (move tokens from one padded piece into the
        # other until one is full): take exact pieces for total - r plus one padded piece of r.
        fewest, largest = self._coin_table(limit, total)
        best, best_r = float("inf"), 0
        for r in range(min(total, limit) + 1):
            cost = fewest[total - r] + (((self.graph_size(r) or r) - r) * _COST_PAD + 1 if r else 0)
            if cost < best:
                best, best_r = cost, r
        pieces, rest = ([best_r] if best_r else []), total - best_r
        while rest:
            pieces.append(largest[rest])
            rest -= largest[rest]
        return sorted(pieces, reverse=True)

    def _coin_table(self, limit: int, upto: int) -> Tuple[List[float], List[int]]:
        fewest, largest = self._coins.setdefault(limit, ([0], [0]))
        coins = [size for size in reversed(self.sizes) if size <= limit]
        for value in range(len(fewest), upto + 1):
            best, pick = float("inf"), 0
            for size in coins:
                if size <= value and fewest[value - size] + 1 < best:
                    best, pick = fewest[value - size] + 1, size
            fewest.append(best)
            largest.append(pick)
        return fewest, largest

    def request_groups(self, counts: np.ndarray, limit: int) -> List[int]:
        """Requests per piece for per-request token ``counts``, cutting only between requests (DP)."""
        prefix = np.concatenate(([0], np.cumsum(counts)))
        ends = prefix.tolist()
        best = np.zeros(len(ends), dtype=np.int64)
        back = np.zeros(len(ends), dtype=np.int64)
        low = 0
        for j in range(1, len(ends)):
            while low < j - 1 and ends[j] - ends[low] > limit:  # a group over the limit only as one request
                low += 1
            tokens = prefix[j] - prefix[low:j]
            index = np.minimum(np.searchsorted(self._array, tokens), len(self.sizes) - 1)
            padding = np.where(self._array[index] >= tokens, self._array[index] - tokens, 0)
            cost = best[low:j] + np.where(tokens > limit, _COST_EAGER, padding * _COST_PAD) + 1
            pick = int(np.argmin(cost))
            best[j], back[j] = cost[pick], low + pick
        groups, j = [], len(ends) - 1
        while j:
            groups.append(j - int(back[j]))
            j = int(back[j])
        return groups[::-1]


def _balanced_groups(counts: np.ndarray, pieces: int) -> List[int]:
    """Requests per piece, cutting between requests where the running token count passes k/pieces."""
    ends = np.cumsum(counts)
    targets = ends[-1] * np.arange(1, pieces) / pieces
    cuts = np.unique(np.searchsorted(ends, targets, side="left") + 1)
    bounds = [0, *cuts[(cuts > 0) & (cuts < len(counts))].tolist(), len(counts)]
    return np.diff(bounds).tolist()


def _slices_from_groups(groups: Sequence[int], counts: Optional[np.ndarray]) -> List[UBatchSlice]:
    """Contiguous slices from requests per piece (``counts`` None: one token per request)."""
    bounds = _prefix(groups)
    if counts is None:
        return [UBatchSlice.from_range(a, b, a, b) for a, b in zip(bounds, bounds[1:])]
    token_ends = _prefix(counts)
    return [UBatchSlice.from_range(token_ends[a], token_ends[b], a, b) for a, b in zip(bounds, bounds[1:])]


def _check_counts(num_tokens: int, num_reqs: int, tokens_per_req: Optional[Sequence[int]]) -> Optional[np.ndarray]:
    """Validated per-request token counts, or None when every request has one token."""
    if tokens_per_req is None:
        if num_tokens != num_reqs:
            raise ValueError(f"tokens_per_req: required when num_tokens ({num_tokens}) != num_reqs ({num_reqs})")
        return None
    counts = np.asarray(tokens_per_req, dtype=np.int64).reshape(-1)
    if len(counts) != num_reqs or int(counts.sum()) != num_tokens or (num_reqs and int(counts.min()) < 1):
        raise ValueError(f"tokens_per_req: expected {num_reqs} positive counts summing to {num_tokens}, "
                         f"got {len(counts)} summing to {int(counts.sum())}")
    return None if num_tokens == num_reqs else counts


def _host_ints(batch: ForwardBatch, name: str) -> List[int]:
    """Host values of a per-request field: its ``*_cpu`` mirror, else the tensor (a device read if on GPU)."""
    mirror = getattr(batch, f"{name}_cpu", None)
    if mirror is None:
        mirror = getattr(batch, name)
        if mirror is None:
            raise ValueError(f"{name}: required to split a {batch.forward_mode.name} batch, got None")
        if mirror.device.type != "cpu":
            logger.debug("%s_cpu is missing: reading %s from %s to split the batch (synchronizes)",
                         name, name, mirror.device)
    return mirror.tolist() if isinstance(mirror, torch.Tensor) else list(mirror)


def _prefix(values: Sequence[int]) -> List[int]:
    """Running sums of ``values`` starting at 0 (one more entry than ``values``)."""
    return np.concatenate(([0], np.cumsum(values, dtype=np.int64))).tolist()


def split_forward_batch(batch: ForwardBatch, slices: Sequence[UBatchSlice]) -> List[ForwardBatch]:
    """One valid sub-ForwardBatch per slice, sharing the pools and the attention backend.

    Per-token and per-request tensors and their CPU mirrors are sliced; ``batch_size``,
    ``extend_num_tokens`` and ``seq_lens_sum`` are recomputed (``seq_lens_sum`` from
    ``seq_lens_cpu``, else from ``seq_lens``, which is a device read when it lives on a GPU);
    ``extend_start_loc`` is rebased to start at 0. A slice that splits a request is a ValueError.
    """
    for name in _UNSPLITTABLE:
        if getattr(batch, name) is not None:
            raise ValueError(f"{name}: a multimodal batch cannot be split into micro-batches")
    extend = batch.forward_mode.is_extend()
    seq_ends = _prefix(_host_ints(batch, "seq_lens"))
    token_ends = _prefix(_host_ints(batch, "extend_seq_lens")) if extend else list(range(batch.batch_size + 1))
    parts = []
    for info in slices:
        rows, reqs = info.token_slice, info.req_slice
        if reqs.stop > batch.batch_size or (token_ends[reqs.start], token_ends[reqs.stop]) != (rows.start, rows.stop):
            raise ValueError(f"slices: tokens [{rows.start}, {rows.stop}) are not the tokens of requests "
                             f"[{reqs.start}, {reqs.stop}) (a micro-batch must hold whole requests)")
        changes: Dict[str, Any] = {name: _cut(getattr(batch, name), rows) for name in _TOKEN_FIELDS}
        changes.update({name: _cut(getattr(batch, name), reqs) for name in _REQUEST_FIELDS})
        changes.update(batch_size=info.num_reqs, seq_lens_sum=seq_ends[reqs.stop] - seq_ends[reqs.start])
        if batch.extend_start_loc is not None:
            changes["extend_start_loc"] = batch.extend_start_loc[reqs] - rows.start
        if batch.extend_num_tokens is not None:
            changes["extend_num_tokens"] = info.num_tokens
        parts.append(dataclasses.replace(batch, **changes))
    return parts


def _cut(value: Any, rows: slice) -> Any:
    """``value[rows]``, or None for a field that is not set."""
    return None if value is None else value[rows]


@dataclass(frozen=True)
class _CallShape:
    """Rows of one call: tokens, requests, tokens per request (None: one each), and the device."""

    num_tokens: int
    num_reqs: int
    tokens_per_req: Optional[List[int]]
    device: torch.device


def _call_shape(inputs: CallInputs) -> Optional[_CallShape]:
    """Shape from the first ForwardBatch argument, else from the first tensor's dim 0 (one row per request)."""
    leaves = tree_leaves(inputs)  # a ForwardBatch is a pytree leaf: its fields are not walked
    batch = next((leaf for leaf in leaves if isinstance(leaf, ForwardBatch)), None)
    if batch is not None:
        per_req = _host_ints(batch, "extend_seq_lens") if batch.forward_mode.is_extend() else None
        return _CallShape(batch.num_tokens, batch.batch_size, per_req, batch.input_ids.device)
    tensor = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0), None)
    return None if tensor is None else _CallShape(tensor.shape[0], tensor.shape[0], None, tensor.device)


def _slice_leaf(leaf: Any, slices: Sequence[UBatchSlice], shape: _CallShape) -> List[Any]:
    """One leaf per slice: a ForwardBatch split, a tensor with token or request rows sliced, anything else shared."""
    if isinstance(leaf, ForwardBatch):
        return split_forward_batch(leaf, slices)
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        if leaf.shape[0] == shape.num_tokens:
            return [leaf[info.token_slice] for info in slices]
        if leaf.shape[0] == shape.num_reqs:
            return [leaf[info.req_slice] for info in slices]
    return [leaf] * len(slices)


def _slice_tree(value: Any, slices: Sequence[UBatchSlice], shape: _CallShape) -> List[Any]:
    """``value`` (tuples, lists, dicts, namedtuples: any pytree) cut per slice, leaf by leaf."""
    leaves, spec = tree_flatten(value)
    columns = [_slice_leaf(leaf, slices, shape) for leaf in leaves]
    return [tree_unflatten([column[i] for column in columns], spec) for i in range(len(slices))]
