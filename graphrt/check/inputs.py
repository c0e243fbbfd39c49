"""The inputs the check gives a step: the named example, a rolled variant, a padded copy, and
how ``wrap()`` treats each argument.

Arguments are pytrees as ``wrap()`` sees them (graphrt.layout.tensor_tree): tensors nested in tuples,
lists, dicts and dataclasses (a ForwardBatch) are inputs, named by their path from the
parameter name (``forward_batch.input_ids``). The variant must be valid for the model or the
comparison reports noise, so it is made of the example's own values: each input tensor rolled
by one element (a row shift for 1-D batch fields, the same shift for every field of one length,
so rows stay consistent); index tensors keep their range. The padded copy adds zero rows along
each argument's batch dimension, as wrap()'s static buffers do.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from graphrt.check.report import ArgumentInfo, Finding
from graphrt.layout.call_signature import CallSignature, call_paths, flatten_call, unflatten_call
from graphrt.layout.tensor_evidence import Constant, TensorEvidence
from graphrt.layout.tensor_tree import is_plain_constant
from graphrt.sizes import default_capture_sizes

NEW_LAYOUT = "a new argument layout (a warm-up call, then graphs of its own)"

Arguments = Tuple[Tuple[Any, ...], Dict[str, Any]]


def argument_names(fn: Callable[..., Any], count: int) -> List[str]:
    """Names of the first ``count`` positional parameters of ``fn`` (``arg<i>`` where unknown)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        parameters = [p for p in inspect.signature(target).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    return [parameters[i].name if i < len(parameters) else f"arg{i}" for i in range(count)]


class CallTree:
    """One call's arguments as flat leaves with readable paths, and the way to rebuild them."""

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], positional_names: Sequence[str]) -> None:
        self.names = list(positional_names)
        self.kw_names = tuple(kwargs)
        self.leaves, self.structure = flatten_call(args, kwargs, self.kw_names)
        self.paths = call_paths(self.structure, self.kw_names, self.names)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor leaf by path: what the step is handed (and what wrap() stages)."""
        return {path: leaf for path, leaf in zip(self.paths, self.leaves) if isinstance(leaf, torch.Tensor)}

    def rebuild(self, leaves: Sequence[Any]) -> Arguments:
        """Arguments of the same structure with other leaves."""
        return unflatten_call(self.structure, self.kw_names, leaves)

    def pads(self, pad_values: Mapping[str, float]) -> List[float]:
        """Per leaf, what wrap(pad_values=...) puts in its padding rows (by path, or ``args[i]`` path; else 0)."""
        indexed = call_paths(self.structure, self.kw_names)
        return [pad_values.get(path, pad_values.get(index_path, 0)) for path, index_path in zip(self.paths, indexed)]

    def rolled(self) -> Arguments:
        """A variant: every tensor leaf's values rolled by one element (``roll``)."""
        return self.rebuild([roll(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves])


def roll(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own values shifted by one element, with its strides (so no op path changes);
    tensors with overlapping memory (expanded) or fewer than two elements are kept as they are."""
    rolled = torch.empty_like(tensor)
    if tensor.numel() < 2 or rolled.stride() != tensor.stride():
        return tensor
    rolled.copy_(tensor.flatten().roll(1).view(tensor.shape))
    return rolled


@dataclass
class Signature:
    """How wrap() classifies the example's argument leaves, and the problem if it cannot."""

    arguments: List[ArgumentInfo]
    axes: List[Optional[int]]  # per leaf of the CallTree: the batch dim wrap() pads, or None
    rows: int  # the example's batch size
    problem: Optional[Finding] = None

    def padded(self, tree: CallTree, pad_values: Mapping[str, float] = {}) -> Arguments:  # noqa: B006 - read only
        """The example with padding rows (``pad_values``, else 0) added along each batched leaf's batch
        dim, up to ``padded_size``."""
        size = padded_size(self.rows)
        leaves = [leaf if axis is None else _pad(leaf, axis, size, pad)
                  for leaf, axis, pad in zip(tree.leaves, self.axes, tree.pads(pad_values))]
        return tree.rebuild(leaves)


def _pad(tensor: torch.Tensor, axis: int, size: int, value: float) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[axis] = size - shape[axis]
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=axis)


def wrap_signature(tree: CallTree, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Signature:
    """The classification ``wrap()`` makes on its first call (graphrt.layout.call_signature), per leaf."""
    try:
        signature = CallSignature.first_call(args, kwargs, max_batch_size=1)
    except ValueError as error:
        return Signature([], [None] * len(tree.leaves), 0, Finding("no_batch_dim", f"wrap() cannot graph this call: {error}"))
    arguments, axes = [], []
    for path, leaf, value in zip(tree.paths, signature.leaves, tree.leaves):
        axis = leaf.axis if isinstance(leaf, TensorEvidence) else None
        axes.append(axis)
        arguments.append(_argument_info(path, leaf, value))
    return Signature(arguments, axes, tree.leaves[signature.batch_leaf].shape[0])


def _argument_info(path: str, leaf: Any, value: Any) -> ArgumentInfo:
    if isinstance(leaf, Constant):
        rule = "another value" if is_plain_constant(value) else "another object (compared by identity)"
        return ArgumentInfo(path, "constant", _summary(value), f"{rule}: {NEW_LAYOUT}")
    shape = f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')} {value.device.type}"
    if leaf.axis is None:
        return ArgumentInfo(path, "fixed", shape, f"shape other than {list(value.shape)}, another dtype or device: "
                                                  f"{NEW_LAYOUT}")
    if leaf.tentative:
        return ArgumentInfo(path, f"batch dim {leaf.axis}?", shape,
                            f"dims {leaf.batch_dims} all have the batch size: padded calls until a call at another "
                            "size decides (ambiguous_batch_axis)")
    return ArgumentInfo(path, f"batch dim {leaf.axis}", shape,
                        "more rows than max_batch_size (batch_too_large); other sizes in the other dims, another "
                        f"dtype or device: {NEW_LAYOUT}")


def _summary(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 28 else text[:25] + "..."


def padded_size(rows: int) -> int:
    """The capture size a batch of ``rows`` pads to by default (the next one above it)."""
    return next(size for size in default_capture_sizes(2 * rows + 8) if size > rows)
