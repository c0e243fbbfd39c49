"""CallSignature: how wrap() stages one call's arguments, learned from the calls themselves.

Arguments are pytrees (graphrt.layout.tensor_tree): a tensor nested in tuples, lists, dicts or
dataclasses gets a static slot like a top-level one. The batch size of a call is dim 0 of its
first tensor that has a dimension. Every other tensor is *batched* along the one dimension whose
size is the batch size (padded; its slot is stored batch-first and the function sees a
``movedim`` view, so an LSTM state ``[layers, batch, hidden]`` is padded along dim 1), or *fixed*
(copied whole, same shape every call). Non-tensor leaves are constants: plain values compared by
value, objects by identity.

Which dimension is the batch is evidence, not a guess: a dimension stays a candidate while its
size was the batch size at every call seen and every other dimension kept its size. One
candidate (with or without "fixed") decides; several (the LSTM state seen at batch == layers)
make the leaf *tentative*: the lowest is used, which is exact at unpadded sizes, and padded calls
run eagerly until a call at another size decides. A call that contradicts a choice but fits the
evidence yields a refined signature (``refine``), and wrap() captures again with it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from graphrt.layout.tensor_evidence import Constant, TensorEvidence
from graphrt.layout.tensor_tree import TENSOR, flatten, is_plain_constant, leaf_paths, same_value, unflatten
from graphrt.staging import BufferSpec, InputBufferManager, InputSlot, RowAxis, StagingPlan


class StaticCall(NamedTuple):
    """The arguments one graph reads: the call's structure with static-slot views for its tensors."""

    args: tuple
    kwargs: Dict[str, Any]


class CallSignature:
    """The captured layout of a call: structure, per-leaf evidence, static slots, staging plan."""

    def __init__(self, structure: Any, kw_names: Tuple[str, ...], leaves: Sequence[Any], batch_leaf: int,
                 max_batch_size: int) -> None:
        self.structure = structure
        self.kw_names = kw_names
        self._kw_set = frozenset(kw_names)
        # Positional tensors only (the common case): a call's leaves are its arguments, no tree to walk.
        self._flat_arity = len(structure[0]) if not kw_names and all(child is TENSOR for child in structure[0]) else -1
        self.leaves = tuple(leaves)  # TensorEvidence or Constant per leaf
        self.batch_leaf = batch_leaf
        self.max_batch_size = max_batch_size
        self.paths = call_paths(structure, kw_names)
        self.tentative = _any_tentative(self.leaves)
        self.objects = [(path, leaf.value) for path, leaf in zip(self.paths, self.leaves)
                        if isinstance(leaf, Constant) and not is_plain_constant(leaf.value)]
        self._tensors = [index for index, leaf in enumerate(self.leaves) if isinstance(leaf, TensorEvidence)]
        self._expected: Dict[int, Tuple[Any, ...]] = {}
        self._axes = [(index, self.leaves[index].axis) for index in self._tensors]
        # Every leaf a tensor batched along dim 0: the call's leaves are already the values the slots take.
        self._leaves_are_live = self._tensors == list(range(len(self.leaves))) and all(axis == 0 for _, axis in self._axes)
        self._buffers: Optional[InputBufferManager] = None  # allocated when a call is first staged
        self._slots: Dict[int, InputSlot] = {}
        self._plan: Optional[StagingPlan] = None
        self.pad_values: Dict[int, float] = {}  # leaf index -> what its padding rows hold (default 0)
        self.named_paths = self.paths  # the paths with positional arguments by parameter name (``name_arguments``)

    @classmethod
    def first_call(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any], max_batch_size: int) -> "CallSignature":
        """The signature of the first call: its tensors' shapes are the first evidence."""
        kw_names = tuple(kwargs)
        leaves, structure = flatten_call(args, kwargs, kw_names)
        batch_leaf = next((index for index, leaf in enumerate(leaves)
                           if isinstance(leaf, torch.Tensor) and leaf.dim()), None)
        if batch_leaf is None:
            raise ValueError("args: expected at least one tensor whose first dimension is the batch")
        batch_size = leaves[batch_leaf].shape[0]
        evidence = [
            TensorEvidence.first_seen(leaf, batch_size, index == batch_leaf) if isinstance(leaf, torch.Tensor)
            else Constant(leaf)
            for index, leaf in enumerate(leaves)
        ]
        return cls(structure, kw_names, evidence, batch_leaf, max_batch_size)

    @property
    def buffers(self) -> InputBufferManager:
        """The static slots, allocated on first use: a layout that never records holds none."""
        if self._buffers is None:
            self._allocate()
        return self._buffers

    @property
    def static_bytes(self) -> int:
        """Bytes held by the static slots (0 while none are allocated)."""
        return sum(slot.tensor.numel() * slot.tensor.element_size() for slot in self._slots.values())

    def _allocate(self) -> None:
        self._buffers = InputBufferManager(max_batch_size=self.max_batch_size, register_defaults=False)
        self._slots = {index: self._register(index) for index in self._tensors}
        self._plan = StagingPlan([self._slots[index] for index in self._tensors])

    def _register(self, index: int) -> InputSlot:
        evidence: TensorEvidence = self.leaves[index]
        axis = evidence.axis
        if axis is None:
            spec, rows = BufferSpec(evidence.shape, evidence.dtype, evidence.device), RowAxis.FIXED
        else:  # stored batch-first: staging pads rows; the function sees a movedim view
            others = evidence.shape[:axis] + evidence.shape[axis + 1:]
            spec, rows = BufferSpec((self.max_batch_size, *others), evidence.dtype, evidence.device), RowAxis.TOKENS
        return self.buffers.register_slot(self.paths[index], spec, axis=rows, pad_value=self.pad_values.get(index, 0),
                                          strides=evidence.slot_strides())

    def name_arguments(self, positional_names: Sequence[str]) -> None:
        """Name positional arguments by their parameters in ``named_paths`` (``slot_mapping``, not ``args[1]``)."""
        self.named_paths = call_paths(self.structure, self.kw_names, positional_names)

    def set_pad_values(self, values: Mapping[str, float]) -> None:
        """What the padding rows of the tensors ``values`` names hold, before any slot is allocated.
        A key is a leaf's path with positional arguments by index (``args[1]``) or by parameter name
        (``slot_mapping``, ``batch.slot_mapping``: ``name_arguments`` first); keys naming no tensor of
        this layout are left for other layouts. A value that does not fit its tensor's dtype raises TypeError."""
        resolved: Dict[int, float] = {}
        for index in self._tensors:
            for path in (self.paths[index], self.named_paths[index]):
                if path in values:
                    resolved[index] = _pad_value(path, values[path], self.leaves[index].dtype)
        self.pad_values = resolved

    def slot_paths(self) -> Dict[Tuple[torch.device, int], str]:
        """The storage of each allocated argument slot and the argument's path (parameters by name)."""
        return {(slot.tensor.device, slot.tensor.untyped_storage().data_ptr()): self.named_paths[index]
                for index, slot in self._slots.items()}

    # ---- per call ---------------------------------------------------------------------------

    def flatten(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[List[Any], Any]:
        """The call's leaves and structure (None when its keywords differ from the captured ones)."""
        if len(args) == self._flat_arity and not kwargs:
            for arg in args:  # a loop, not all(): no generator per call
                if type(arg) is not torch.Tensor:
                    break
            else:
                return list(args), self.structure
        if kwargs.keys() != self._kw_set:
            leaves: List[Any] = []
            flatten((args, kwargs), leaves)
            return leaves, None
        return flatten_call(args, kwargs, self.kw_names)

    def match(self, leaves: List[Any], structure: Any) -> Tuple[int, bool]:
        """The call's batch size, and whether it fits this signature (metadata checks only)."""
        if structure != self.structure:
            return 0, False
        definer = leaves[self.batch_leaf]
        if not definer.dim():
            return 0, False
        batch_size = definer.shape[0]
        expected = self._expected.get(batch_size)
        if expected is None:
            expected = self._expected_shapes(batch_size)
        for value, leaf, shape in zip(leaves, self.leaves, expected):
            if shape is None:
                if not same_value(value, leaf.value):
                    return batch_size, False
            elif value.shape != shape or value.dtype != leaf.dtype or value.device != leaf.device or (
                    not leaf.same_layout(value)):
                return batch_size, False
        return batch_size, True

    def _expected_shapes(self, batch_size: int) -> Tuple[Any, ...]:
        shapes = []
        for leaf in self.leaves:
            if isinstance(leaf, Constant):
                shapes.append(None)
            else:
                axis = leaf.axis
                shapes.append(leaf.shape if axis is None else leaf.shape[:axis] + (batch_size,) + leaf.shape[axis + 1:])
        result = tuple(shapes)
        if batch_size <= self.max_batch_size:
            self._expected[batch_size] = result
        return result

    def live(self, leaves: List[Any], rows: int, cut: bool = False) -> List[torch.Tensor]:
        """The call's tensors as the slots store them: batched ones batch-first (views of the
        caller's tensors; ``cut``: longer than ``rows`` cut to it, for capture examples)."""
        if self._leaves_are_live and not cut:
            return leaves
        live = []
        for index, axis in self._axes:
            value = leaves[index]
            if axis is not None:
                if cut and value.shape[axis] > rows:
                    value = value.narrow(axis, 0, rows)
                if axis:
                    value = value.movedim(axis, 0)
            live.append(value)
        return live

    def stage(self, leaves: List[Any], rows: int, cut: bool = False) -> None:
        """Copy the call's tensors into the static slots, batched ones padded above ``rows``
        (``cut``: batched tensors longer than ``rows`` are cut to it, for capture examples)."""
        live = self.live(leaves, rows, cut)
        if self._plan is None:
            self._allocate()
        if torch.is_grad_enabled():  # staging never records autograd (a torch.no_grad() block costs 10x more)
            torch._C._set_grad_enabled(False)
            try:
                self._plan.stage(live, rows, rows)
            finally:
                torch._C._set_grad_enabled(True)
        else:
            self._plan.stage(live, rows, rows)

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        """Positions (in staging order) of the argument slots a captured step wrote."""
        return () if self._plan is None else self._plan.written(storages)

    def write_back(self, leaves: List[Any], rows: int, padded: int, positions: Tuple[int, ...]) -> None:
        """After a replay that wrote argument slots: their live rows back into the caller's tensors."""
        self._plan.write_back(self.live(leaves, rows), positions, rows, rows, padded, padded)

    def written_paths(self, positions: Tuple[int, ...]) -> List[str]:
        """The argument paths of slot positions (for messages)."""
        return [self.paths[self._axes[position][0]] for position in positions]

    def static_arguments(self, rows: int) -> StaticCall:
        """The arguments a graph of ``rows`` rows reads: views of the static slots."""
        if self._plan is None:
            self._allocate()
        leaves = []
        for index, leaf in enumerate(self.leaves):
            if isinstance(leaf, Constant):
                leaves.append(leaf.value)
                continue
            view = self._slots[index].view(rows)
            axis = leaf.axis
            leaves.append(view.movedim(0, axis) if axis else view)
        return StaticCall(*unflatten_call(self.structure, self.kw_names, leaves))

    # ---- evidence ------------------------------------------------------------------------------

    def refine(self, leaves: List[Any], structure: Any) -> Optional["CallSignature"]:
        """For a call that does not match: a new signature that fits it and every call seen before
        (the call decided a batch axis, or showed a tensor to be fixed), or None if none does."""
        refined = self._evidence_with(leaves, structure)
        if refined is None:
            return None
        return CallSignature(self.structure, self.kw_names, refined, self.batch_leaf, self.max_batch_size)

    def confirm(self, leaves: List[Any], structure: Any) -> None:
        """For a matching call while some leaf is tentative: narrow its candidates (same layout)."""
        refined = self._evidence_with(leaves, structure)
        if refined is not None:
            self.leaves = tuple(refined)
            self.tentative = _any_tentative(self.leaves)

    def _evidence_with(self, leaves: List[Any], structure: Any) -> Optional[List[Any]]:
        if structure != self.structure or not leaves[self.batch_leaf].dim():
            return None
        batch_size = leaves[self.batch_leaf].shape[0]
        refined = []
        for value, leaf in zip(leaves, self.leaves):
            if isinstance(leaf, Constant):
                if not same_value(value, leaf.value):
                    return None
                refined.append(leaf)
                continue
            evidence = leaf.refined(value, batch_size)
            if evidence is None:
                return None
            refined.append(evidence)
        return refined

    def first_difference(self, leaves: List[Any], structure: Any) -> Tuple[str, str]:
        """The first argument path where a call differs from this signature, and how."""
        if structure != self.structure:
            return "args", (f"expected the captured argument structure (keywords {list(self.kw_names)}, "
                            f"leaves {self.paths})")
        batch_size = leaves[self.batch_leaf].shape[0] if leaves[self.batch_leaf].dim() else 0
        expected = self._expected_shapes(batch_size)
        for path, value, leaf, shape in zip(self.paths, leaves, self.leaves, expected):
            if isinstance(leaf, Constant):
                if not same_value(value, leaf.value):
                    return path, f"expected {leaf.value!r} (a constant of the captured calls), got {value!r}"
            elif value.shape != shape or value.dtype != leaf.dtype or value.device != leaf.device or (
                    not leaf.same_layout(value)):
                got = f"shape {list(value.shape)} {value.dtype} on {value.device}{_kind_words(value)}"
                return path, f"expected {leaf.describe()} with n = {batch_size}, got {got}"
        return "args", "the call fits the signature"

    @property
    def tensor_positions(self) -> Tuple[int, ...]:
        """The positions of the tensor leaves among a call's leaves."""
        return tuple(self._tensors)

    @property
    def eager_reason(self) -> Optional[str]:
        """Why calls of this layout run eagerly whatever their size, else None: a tensor of a
        subclass other than ``nn.Parameter`` (``"tensor_subclass"``: its ``__torch_function__``
        would not run on a static slot)."""
        if any(leaf.kind not in (torch.Tensor, torch.nn.Parameter) for leaf in self.leaves
               if isinstance(leaf, TensorEvidence)):
            return "tensor_subclass"
        return None

    def family(self) -> Tuple[Any, ...]:
        """What this layout shares with layouts that differ from it only in tensor sizes: structure,
        keywords, constants, and per tensor its rank, dtype and device (hashable, for churn counts)."""
        kinds = tuple(
            _constant_key(leaf.value) if isinstance(leaf, Constant) else (
                len(leaf.shape), leaf.dtype, leaf.device, leaf.kind, leaf.strides)
            for leaf in self.leaves
        )
        return self.structure, self.kw_names, kinds

    def layout(self) -> Dict[str, Any]:
        """Per argument leaf: its batch dim, "fixed", or "constant" (for stats)."""
        result: Dict[str, Any] = {}
        for path, leaf in zip(self.paths, self.leaves):
            if isinstance(leaf, Constant):
                result[path] = "constant"
            else:
                axis = leaf.axis
                result[path] = "fixed" if axis is None else (f"dim {axis}?" if leaf.tentative else f"dim {axis}")
        return result


def _pad_value(path: str, value: Any, dtype: torch.dtype) -> float:
    """``value`` as a pad of a ``dtype`` tensor, or TypeError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"pad_values[{path!r}]: expected an int or float, got {value!r}")
    if not (dtype.is_floating_point or dtype.is_complex) and not float(value).is_integer():
        raise TypeError(f"pad_values[{path!r}]: expected an int for a {dtype} tensor, got {value!r}")
    return value


def flatten_call(args: Tuple[Any, ...], kwargs: Dict[str, Any], kw_names: Tuple[str, ...]) -> Tuple[List[Any], Any]:
    """Leaves and structure of a call, keywords taken in ``kw_names`` order (any order at the call)."""
    leaves: List[Any] = []
    positional = tuple([flatten(value, leaves) for value in args])
    keywords = tuple([flatten(kwargs[name], leaves) for name in kw_names])
    return leaves, (positional, keywords)


def _kind_words(tensor: torch.Tensor) -> str:
    kind = "" if type(tensor) in (torch.Tensor, torch.nn.Parameter) else f", a {type(tensor).__qualname__}"
    return kind + ("" if tensor.is_contiguous() else f", strides {list(tensor.stride())}")


def _constant_key(value: Any) -> Any:
    """A hashable stand-in for a constant leaf: plain values by value, objects by identity."""
    if is_plain_constant(value):
        try:
            return type(value), hash(value), value
        except TypeError:
            return type(value), repr(value)
    return "object", id(value)


def _any_tentative(leaves: Sequence[Any]) -> bool:
    """Whether some tensor leaf has several candidate batch dims (read on every call: kept as a flag)."""
    return any(isinstance(leaf, TensorEvidence) and leaf.tentative for leaf in leaves)


def unflatten_call(structure: Any, kw_names: Tuple[str, ...], leaves: Sequence[Any]) -> Tuple[tuple, Dict[str, Any]]:
    """The ``(args, kwargs)`` that ``flatten_call`` took apart, with ``leaves`` in place of its leaves."""
    iterator = iter(leaves)
    positional, keywords = structure
    args = tuple(unflatten(child, iterator) for child in positional)
    return args, {name: unflatten(child, iterator) for name, child in zip(kw_names, keywords)}


def call_paths(structure: Any, kw_names: Tuple[str, ...],
               positional_names: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """A readable path per leaf of a call: ``args[0].h`` (or the parameter's name), ``mask['a']``."""
    positional, keywords = structure
    paths = []
    for index, child in enumerate(positional):
        named = positional_names is not None and index < len(positional_names)
        paths.extend(leaf_paths(child, positional_names[index] if named else f"args[{index}]"))
    for name, child in zip(kw_names, keywords):
        paths.extend(leaf_paths(child, name))
    return tuple(paths)


__all__ = ["CallSignature", "StaticCall", "call_paths", "flatten_call", "unflatten_call"]
