"""Static input slots and staging: the tensors every graph reads, refilled each step.

Every graph key reads views of the same static tensors, allocated once for the
largest key. Staging copies the live rows with one ``torch._foreach_copy_`` for
all slots and re-pads only rows that a larger earlier step dirtied: each slot
remembers its high-water mark, and every row at or above it already holds the
pad value, so steady decode at one batch size stages with a single call.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Set, Tuple

import torch

from graphrt.batch import DECODE_SPECS, FieldSpec


@dataclass(frozen=True)
class BufferSpec:
    """Shape, dtype and device of a buffer; equal specs are interchangeable in a pool."""

    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.int64
    device: torch.device = torch.device("cpu")
    pin_memory: bool = False

    def size_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, str(self.device), self.pin_memory))


class SlotPool(Protocol):
    """Where an InputBufferManager built with ``pool=`` gets its slots (graphrt.pools.BufferPool is one)."""

    def allocate(self, spec: BufferSpec) -> torch.Tensor: ...

    def release(self, tensor: torch.Tensor) -> None: ...


class RowAxis(enum.Enum):
    """Which count sizes a slot's first dimension: tokens, requests, or neither (whole tensor)."""

    TOKENS = "tokens"
    REQUESTS = "requests"
    FIXED = "fixed"


@dataclass
class InputSlot:
    """One static tensor with its pad value; staging writes rows into it, never replaces it."""

    name: str
    spec: BufferSpec
    tensor: torch.Tensor
    axis: RowAxis = RowAxis.TOKENS
    pad_value: float = 0
    is_static: bool = True  # False: scratch staged beside the graph inputs, which no graph reads
    high_water: int = 0
    _views: List[Optional[torch.Tensor]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        rows = self.tensor.shape[0] if self.axis is not RowAxis.FIXED else -1
        self._views = [None] * (rows + 1)
        self.tensor.fill_(self.pad_value)

    @property
    def rows(self) -> int:
        return self.tensor.shape[0]

    def view(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows (a view of the static tensor, created once per row count)."""
        if self.axis is RowAxis.FIXED:
            return self.tensor
        view = self._views[rows]
        if view is None:
            view = self._views[rows] = self.tensor[:rows]
        return view

    def check(self, data: torch.Tensor) -> None:
        """Raise TypeError/ValueError naming this slot if ``data`` cannot be staged into it."""
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(data).__name__}")
        if data.dtype != self.tensor.dtype and (data.dtype.is_floating_point or self.tensor.dtype.is_floating_point):
            raise TypeError(f"{self.name}: expected dtype {self.tensor.dtype}, got {data.dtype}")
        if self.axis is RowAxis.FIXED:
            if data.shape != self.tensor.shape:
                raise ValueError(f"{self.name}: expected shape {list(self.tensor.shape)}, got {list(data.shape)}")
            return
        if data.dim() != self.tensor.dim() or data.shape[1:] != self.tensor.shape[1:]:
            expected = ["n"] + list(self.tensor.shape[1:])
            raise ValueError(f"{self.name}: expected shape {expected}, got {list(data.shape)}")
        if data.shape[0] > self.rows:
            raise ValueError(f"{self.name}: expected at most {self.rows} rows, got {data.shape[0]}")

    def set_data(self, data: torch.Tensor) -> None:
        """Copy ``data`` into the leading rows and pad the rest; bad data leaves the slot untouched."""
        self.check(data)
        if self.axis is RowAxis.FIXED:
            self.tensor.copy_(data)
            return
        self.view(data.shape[0]).copy_(data)
        self.pad(data.shape[0])

    def pad(self, live_rows: int) -> None:
        """Restore the pad value on rows a larger earlier step left dirty, keeping rows >= live_rows padded."""
        if self.high_water > live_rows:
            self.tensor[live_rows : self.high_water].fill_(self.pad_value)
        self.high_water = live_rows

    def reset(self) -> None:
        """The pad value in every row (a fixed slot: the whole tensor)."""
        if self.axis is RowAxis.FIXED:
            self.tensor.fill_(self.pad_value)
        else:
            self.pad(0)


class InputBufferManager:
    """Owns the static input slots of one runner: registration, staging, views.

    ``max_batch_size`` sizes per-request slots; ``max_seq_len`` sizes per-token slots
    (the most tokens one step stages; equal to ``max_batch_size`` for decode-only graphs).
    Slots are allocated directly, once; with ``pool`` they come from (and return to) that pool.
    """

    def __init__(
        self,
        pool: Optional[SlotPool] = None,
        max_batch_size: int = 64,
        max_seq_len: Optional[int] = None,
        device: Optional[torch.device] = None,
        register_defaults: bool = True,
    ) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len if max_seq_len is not None else max_batch_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slots: Dict[str, InputSlot] = {}
        if register_defaults:
            self._init_default_slots()

    def _init_default_slots(self) -> None:
        """The decode fields of a ForwardBatch, as ``graphrt.batch`` declares them."""
        for spec in DECODE_SPECS:
            self.register_field(spec)

    def register_field(self, spec: FieldSpec) -> InputSlot:
        """The static slot of one declared ForwardBatch field: its dtype, rows and pad value."""
        rows = self.max_seq_len if spec.per_token else self.max_batch_size
        axis = RowAxis.TOKENS if spec.per_token else RowAxis.REQUESTS
        return self.register_slot(spec.name, BufferSpec((rows,), spec.slot_dtype, self.device), axis=axis,
                                  pad_value=spec.pad_value)

    def register_slot(
        self,
        name: str,
        spec: BufferSpec,
        is_static: bool = True,
        axis: RowAxis = RowAxis.TOKENS,
        pad_value: float = 0,
        strides: Optional[Tuple[int, ...]] = None,
    ) -> InputSlot:
        """Allocate the static tensor for ``name`` once; re-registering replaces the slot.
        ``strides``: the slot has these strides (a caller's strided tensor, mirrored), not from the pool."""
        if name in self.slots:
            self._free(self.slots.pop(name).tensor)
        tensor = self._allocate(spec) if strides is None else self._allocate_strided(spec, strides)
        slot = InputSlot(name, spec, tensor, axis=axis, pad_value=pad_value, is_static=is_static)
        self.slots[name] = slot
        return slot

    def get_slot(self, name: str) -> InputSlot:
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"{name}: no such input slot (have {sorted(self.slots)})") from None

    def set_pad_value(self, name: str, value: float) -> None:
        """Change a slot's pad value and rewrite its padding rows with it."""
        slot = self.get_slot(name)
        slot.pad_value = value
        slot.tensor.fill_(value)
        slot.high_water = 0

    def stage_inputs(
        self,
        inputs: Mapping[str, torch.Tensor],
        num_tokens: int,
        num_reqs: Optional[int] = None,
    ) -> None:
        """Copy live rows of ``inputs`` (by slot name) into their slots and pad every other row.

        Everything is checked before anything is written, so bad input leaves every slot unchanged.
        """
        slots = [self.get_slot(name) for name in inputs]
        num_reqs = num_tokens if num_reqs is None else num_reqs
        for slot in slots:
            data = inputs[slot.name]
            slot.check(data)
            expected = {RowAxis.TOKENS: num_tokens, RowAxis.REQUESTS: num_reqs}.get(slot.axis, data.shape[0])
            if slot.axis is not RowAxis.FIXED and data.shape[0] != expected:
                raise ValueError(f"{slot.name}: expected {expected} rows, got {data.shape[0]}")
        # A one-off plan: hot paths keep their StagingPlan across steps.
        StagingPlan(slots).stage([inputs[slot.name] for slot in slots], num_tokens, num_reqs)

    def get_static_tensors(self, num_tokens: Optional[int] = None, num_reqs: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """Views of every static tensor cut to the given row counts (whole tensors when None)."""
        result = {}
        for name, slot in self.slots.items():
            rows = {RowAxis.TOKENS: num_tokens, RowAxis.REQUESTS: num_reqs}.get(slot.axis)
            result[name] = slot.tensor if rows is None else slot.view(rows)
        return result

    def static_bytes(self) -> int:
        """Bytes held by static input tensors: one maximum batch, whatever the number of keys
        (slots registered with ``is_static=False``, scratch no graph reads, are not counted)."""
        return sum(slot.spec.size_bytes() for slot in self.slots.values() if slot.is_static)

    def reset(self) -> None:
        """Every slot back to its pad value: no value of an earlier step stays where a capture or a
        later padded step reads it."""
        for slot in self.slots.values():
            slot.reset()

    def release_all(self) -> None:
        """Give every slot's tensor back to its pool (if any) and forget the slots."""
        for slot in self.slots.values():
            self._free(slot.tensor)
        self.slots.clear()

    def _allocate(self, spec: BufferSpec) -> torch.Tensor:
        """A slot's tensor, made outside inference mode: a graph captured under ``inference_mode()``
        then stages and replays under ``no_grad()`` too (an inference tensor refuses in-place
        writes outside inference mode), and the reset after a failed step never raises."""
        with torch.inference_mode(False):
            if self.pool is not None:
                return self.pool.allocate(spec)
            return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device, pin_memory=spec.pin_memory)

    @staticmethod
    def _allocate_strided(spec: BufferSpec, strides: Tuple[int, ...]) -> torch.Tensor:
        """A slot with the given (non-overlapping) strides, over memory of its own."""
        needed = 1 + sum((size - 1) * stride for size, stride in zip(spec.shape, strides)) if all(spec.shape) else 0
        with torch.inference_mode(False):
            memory = torch.zeros(needed, dtype=spec.dtype, device=spec.device, pin_memory=spec.pin_memory)
            return memory.as_strided(spec.shape, strides)

    def _free(self, tensor: torch.Tensor) -> None:
        if self.pool is not None:
            self.pool.release(tensor)


class StagingPlan:
    """A fixed list of slots staged together every step. Slots are grouped by dtype and device, so
    each step is one fused ``_foreach_copy_`` per group (a mixed-dtype list would take torch's
    per-tensor path: one copy kernel per slot on CUDA), plus re-padding of rows a larger earlier
    step dirtied. Destination views are built once per row count."""

    def __init__(self, slots: Sequence[InputSlot]) -> None:
        self.slots = tuple(slots)
        groups: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for index, slot in enumerate(self.slots):
            groups.setdefault((slot.tensor.dtype, slot.tensor.device), []).append(index)
        self._groups = [tuple(indices) for indices in groups.values()]
        self._pickers = [_picker(indices) for indices in self._groups]
        self._padded = tuple(slot for slot in self.slots if slot.axis is not RowAxis.FIXED)
        self._steps: Dict[Tuple[int, int], Tuple[list, tuple]] = {}

    def _step(self, num_tokens: int, num_reqs: int) -> Tuple[list, tuple]:
        """Per group its destination views and live-value picker, and per padded slot its live rows (cached)."""
        def rows(slot: InputSlot) -> int:
            return num_tokens if slot.axis is RowAxis.TOKENS else num_reqs

        copies = [([self.slots[index].view(rows(self.slots[index])) for index in indices], picker)
                  for indices, picker in zip(self._groups, self._pickers)]
        step = self._steps[num_tokens, num_reqs] = (copies, tuple((slot, rows(slot)) for slot in self._padded))
        return step

    def stage(self, live: Sequence[torch.Tensor], num_tokens: int, num_reqs: int) -> None:
        """Hot path, inputs already checked: copy live rows, restore padding above them."""
        step = self._steps.get((num_tokens, num_reqs))
        if step is None:
            step = self._step(num_tokens, num_reqs)
        copies, pads = step
        for destinations, pick in copies:
            torch._foreach_copy_(destinations, pick(live))
        for slot, rows in pads:
            if slot.high_water != rows:
                slot.pad(rows)

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        """Positions of the slots whose memory is among ``storages`` (what a captured step wrote)."""
        return tuple(position for position, slot in enumerate(self.slots)
                     if (slot.tensor.device, slot.tensor.untyped_storage().data_ptr()) in storages)

    def write_back(self, live: Sequence[torch.Tensor], positions: Tuple[int, ...], num_tokens: int, num_reqs: int,
                   padded_tokens: int, padded_reqs: int) -> None:
        """After a replay that wrote the slots at ``positions``: their live rows back into the
        caller's tensors (as eager would have left them), and their padding rows, which the replay
        wrote too, re-padded by the next ``stage``."""
        with torch.no_grad():
            for position in positions:
                slot = self.slots[position]
                if slot.axis is RowAxis.FIXED:
                    live[position].copy_(slot.tensor)
                    continue
                tokens = slot.axis is RowAxis.TOKENS
                live[position].copy_(slot.view(num_tokens if tokens else num_reqs))
                slot.high_water = max(slot.high_water, padded_tokens if tokens else padded_reqs)

    @property
    def copies_per_step(self) -> int:
        """Fused copies one ``stage`` issues: one per dtype and device among its slots."""
        return len(self._groups)


def _picker(indices: Tuple[int, ...]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """The live values at ``indices``, as a sequence (itemgetter of one index returns the item alone)."""
    if len(indices) == 1:
        (index,) = indices
        return lambda live: (live[index],)
    return operator.itemgetter(*indices)
