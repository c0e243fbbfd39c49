"""Which dimension of each output scales with the batch: learned from shapes, never guessed by value.

Graph outputs are observed at the padded sizes their graphs were recorded at, and eager outputs
at real sizes. For one output structure (per mode) a tensor leaf's batch axis is the single
dimension whose size is the token count (or the request count) in every observation while every
other dimension keeps its size; that takes observations at two sizes at least. A padded replay
is cut only along those axes. A leaf that cannot be cut makes padded calls run eagerly: a tensor
with no such dimension (the same shape at every size, e.g. a sum over the batch, which would mix
in the padding rows) or with several, and a non-tensor value that changes with the size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from graphrt.layout.tensor_tree import is_plain_constant, leaf_paths
from graphrt.staging import RowAxis


class LeafCut(NamedTuple):
    """Cut one output leaf along ``dim`` to the real token or request count."""

    dim: int
    rows: RowAxis  # TOKENS or REQUESTS


@dataclass(frozen=True)
class CutPlan:
    """How to cut every leaf of one output structure (None: the leaf is returned as it is)."""

    cuts: Tuple[Optional[LeafCut], ...]
    tokens_equal_requests: bool  # every observation had as many tokens as requests (decode)

    def apply(self, leaves: Sequence[Any], num_tokens: int, num_reqs: int) -> List[Any]:
        """Views of ``leaves`` without padding rows."""
        return [
            leaf if cut is None else leaf.narrow(cut.dim, 0, num_tokens if cut.rows is RowAxis.TOKENS else num_reqs)
            for leaf, cut in zip(leaves, self.cuts)
        ]


class CannotCut(NamedTuple):
    """Why padded outputs of a structure cannot be cut: ``final`` when no further observation can help."""

    final: bool
    message: str


class _Shape(tuple):
    """A tensor leaf's shape in an observation."""


class _Identity:
    """A non-tensor output object in an observation: equal only to itself (plain constants are
    stored as they are and compared by value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class _Observation(NamedTuple):
    num_tokens: int
    num_reqs: int
    leaves: Tuple[Any, ...]  # per leaf: a tensor's _Shape, a plain constant, or an _Identity


class OutputAxes:
    """Observations of output shapes per (mode, structure), and the cut plans derived from them."""

    def __init__(self) -> None:
        self._observations: Dict[Tuple[Any, Any], List[_Observation]] = {}
        self._plans: Dict[Tuple[Any, Any], Union[CutPlan, CannotCut]] = {}

    def observe(self, mode: Any, num_tokens: int, num_reqs: int, structure: Any, leaves: Sequence[Any]) -> None:
        """Record the output leaves of one run of ``num_tokens`` tokens and ``num_reqs`` requests."""
        group = (mode, structure)
        observation = _Observation(num_tokens, num_reqs, tuple(_signature(leaf) for leaf in leaves))
        observations = self._observations.setdefault(group, [])
        if observation not in observations:  # repeated sizes add nothing (lockstep observes every eager step)
            observations.append(observation)
            self._plans.pop(group, None)

    def seen_other_size(self, mode: Any, num_tokens: int, num_reqs: int) -> bool:
        """Whether some output of ``mode`` was observed at another size than (num_tokens, num_reqs)."""
        return any(
            (seen.num_tokens, seen.num_reqs) != (num_tokens, num_reqs)
            for (seen_mode, _), observations in self._observations.items() if seen_mode == mode
            for seen in observations
        )

    def plan(self, mode: Any, structure: Any) -> Union[CutPlan, CannotCut]:
        """The cut plan of one output structure, or why padded outputs of it cannot be cut."""
        group = (mode, structure)
        plan = self._plans.get(group)
        if plan is None:
            plan = self._plans[group] = _derive(self._observations.get(group, []), structure)
        return plan


def _signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return _Shape(leaf.shape)
    return leaf if is_plain_constant(leaf) else _Identity(leaf)


def _derive(observations: List[_Observation], structure: Any) -> Union[CutPlan, CannotCut]:
    sizes = {(seen.num_tokens, seen.num_reqs) for seen in observations}
    if len(sizes) < 2:
        return CannotCut(False, "outputs seen at one size only: their batch axes are not known yet")
    # A leaf of fixed shape is final only once both counts have varied: in extend modes a leaf
    # sized by requests keeps its shape across keys that differ in tokens alone.
    both_varied = all(tokens == reqs for tokens, reqs in sizes) or (
        len({tokens for tokens, _ in sizes}) > 1 and len({reqs for _, reqs in sizes}) > 1
    )
    cuts = []
    for index, path in enumerate(leaf_paths(structure, "output")):
        cut = _leaf_cut([(seen.num_tokens, seen.num_reqs, seen.leaves[index]) for seen in observations])
        if cut is _FIXED_SHAPE:
            shape = list(observations[0].leaves[index])
            return CannotCut(both_varied, f"{path}: has shape {shape} at every batch size, so its values may "
                                          "mix in the padding rows (a sum or mean over the batch)")
        if isinstance(cut, str):
            return CannotCut(True, f"{path}: {cut}")
        cuts.append(cut)
    return CutPlan(tuple(cuts), all(tokens == reqs for tokens, reqs in sizes))


_FIXED_SHAPE = "fixed shape"


def _leaf_cut(seen: List[Tuple[int, int, Any]]) -> Union[LeafCut, None, str]:
    """One leaf's cut from its observations, None to return it as it is, or why it has no cut."""
    first = seen[0][2]
    if not isinstance(first, _Shape):
        if all(value is first or value == first for _, _, value in seen):
            return None
        return f"the non-tensor value {first!r} changes with the batch size"
    shapes = [shape for _, _, shape in seen]
    if any(not isinstance(shape, _Shape) or len(shape) != len(first) for shape in shapes):
        return "its rank or kind changes with the batch size"
    varying = [dim for dim in range(len(first)) if len({shape[dim] for shape in shapes}) > 1]
    if not varying:
        return _FIXED_SHAPE
    if len(varying) > 1:
        return f"dims {varying} all change with the batch size (shapes {[list(shape) for shape in shapes]})"
    dim = varying[0]
    if all(shape[dim] == tokens for tokens, _, shape in seen):
        return LeafCut(dim, RowAxis.TOKENS)
    if all(shape[dim] == reqs for _, reqs, shape in seen):
        return LeafCut(dim, RowAxis.REQUESTS)
    return (f"dim {dim} changes with the batch size but is not the batch size itself "
            f"(shapes {[list(shape) for shape in shapes]}; a flattened batch?)")
