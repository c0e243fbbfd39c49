"""TensorEvidence: what the calls seen so far say about one tensor argument of a wrapped function.

Which dimension carries the batch is evidence, not a guess: a dimension stays a candidate while its
size was the batch size at every call seen and every other dimension kept its size; a tensor with
no candidate left but "fixed" is copied whole. Its class and the strides its slot keeps are part of
the layout too. ``Constant`` is the non-tensor leaf (graphrt.layout.call_signature).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, FrozenSet, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class TensorEvidence:
    """A tensor leaf as first seen, and the dims that can still be its batch axis (None: fixed).
    Its class and, where a slot can keep them, its strides are part of the layout: a static slot is
    a plain tensor, so a tensor subclass (its ``__torch_function__``) would not run; a strided
    tensor whose batch dim is outermost (a slice along another dim, permuted inner dims) gets a slot
    with the caller's strides, so the step sees what eager sees (``is_contiguous()``, a ``.view()``
    that raises). Other strided tensors (the batch dim inside: ``x.t()``, a ``[layers, batch,
    hidden]`` state cut from a graph's output) are staged into a contiguous slot, as CUDA-graph
    runtimes stage every input, in a layout of their own (``contiguous`` False): a step eager refuses
    on them (a ``.view()``) is refused by their own warm-up, never replayed from a layout recorded on
    contiguous calls."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    candidates: FrozenSet[Optional[int]]
    kind: type = torch.Tensor
    strides: Optional[Tuple[int, ...]] = None  # the slot's strides in the caller's dim order; None: contiguous
    contiguous: bool = True  # with a contiguous slot: whether the caller's tensors are contiguous (else staged so)

    @classmethod
    def first_seen(cls, tensor: torch.Tensor, batch_size: int, defines_batch: bool) -> "TensorEvidence":
        shape = tuple(tensor.shape)
        dims = {0} if defines_batch else {None, *(dim for dim, size in enumerate(shape) if size == batch_size)}
        evidence = cls(shape, tensor.dtype, tensor.device, frozenset(dims), type(tensor))
        if tensor.is_contiguous():
            return evidence
        if not evidence.keeps(tensor):
            return replace(evidence, contiguous=False)
        return replace(evidence, strides=tuple(tensor.stride()))

    def same_layout(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has this leaf's class and the strides its slot keeps (contiguous: one C call)."""
        if type(tensor) is not self.kind:
            return False
        if self.strides is None:
            if self.contiguous:
                return tensor.is_contiguous()
            return not tensor.is_contiguous() and not self.keeps(tensor)
        return tensor.stride() == self.strides

    def keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a slot with ``tensor``'s strides can hold it padded along this leaf's batch dim:
        no element shared (an expanded dim), the batch dim outermost (its stride then does not
        depend on the batch size)."""
        axis, strides, shape = self.axis, tuple(tensor.stride()), tuple(tensor.shape)
        dims = sorted((stride, size, index) for index, (stride, size) in enumerate(zip(strides, shape))
                      if size > 1 or index == axis)
        extent = 1
        for stride, size, _ in dims:
            if stride < extent:
                return False
            extent += stride * (size - 1)
        return axis is None or not dims or dims[-1][2] == axis

    def slot_strides(self) -> Optional[Tuple[int, ...]]:
        """The strides of this leaf's slot (stored batch-first), None for a contiguous slot."""
        axis = self.axis
        if self.strides is None or not axis:
            return self.strides
        return (self.strides[axis], *self.strides[:axis], *self.strides[axis + 1:])

    @property
    def batch_dims(self) -> List[int]:
        return sorted(dim for dim in self.candidates if dim is not None)

    @property
    def axis(self) -> Optional[int]:
        """The batch dim used (the lowest candidate), or None for a fixed tensor."""
        dims = self.batch_dims
        return dims[0] if dims else None

    @property
    def tentative(self) -> bool:
        return len(self.batch_dims) > 1

    def refined(self, tensor: Any, batch_size: int) -> Optional["TensorEvidence"]:
        """The evidence with ``tensor`` seen too, or None when no candidate fits it."""
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype or tensor.device != self.device or (
                not self.same_layout(tensor)):
            return None
        shape = tuple(tensor.shape)
        if len(shape) != len(self.shape):
            return None
        kept = frozenset(dim for dim in self.candidates if self._fits(dim, shape, batch_size))
        return replace(self, candidates=kept) if kept else None

    def _fits(self, dim: Optional[int], shape: Tuple[int, ...], batch_size: int) -> bool:
        if dim is None:
            return shape == self.shape
        return shape[dim] == batch_size and all(
            size == seen for index, (size, seen) in enumerate(zip(shape, self.shape)) if index != dim
        )

    def describe(self) -> str:
        axis = self.axis
        shape = ["n" if index == axis else size for index, size in enumerate(self.shape)]
        strides = "" if self.strides is None else f", strides {list(self.strides)}"
        staged = "" if self.contiguous else ", strided (staged contiguous)"
        return f"shape {shape} {self.dtype} on {self.device}{strides}{staged}"


@dataclass(frozen=True)
class Constant:
    """A non-tensor leaf: later calls must pass an equal plain value, or the same object."""

    value: Any
