"""ForwardMode and ForwardBatch: every tensor one forward pass needs.

``ForwardBatch.validate()`` is the single gate for bad input: it checks dtypes,
shapes, devices and counts from metadata only, and checks tensor *values* only
where they can be read without a device synchronization (host tensors, CPU
mirrors) or in debug mode.
"""

from __future__ import annotations

import enum
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
# Host batches whose index fields hold up to about this many values are value-checked as Python ints
# (tolist() and min/max in Python); past it the fused torch reductions are as fast or faster. Measured
# in a runner's call on CPU (one-op model, trivial ops): decode of 64 rows 9.3 as ints, 11.3 as
# reductions; 128 rows (640 values) 11.7 against 11.5; decode() of 64 rows x 8 steps 2.53 against
# 2.48 per token, x 4 steps 3.79 against 4.34.
HOST_LIST_VALUES = 640
HOST_SUM_ROWS = 128  # a seq_lens_cpu mirror up to this many rows is summed as Python ints
DEBUG_ENV = "GRAPHRT_DEBUG"


def debug_enabled() -> bool:
    """True when ``GRAPHRT_DEBUG=1`` asks for value checks that may synchronize."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


class ForwardMode(enum.IntEnum):
    """What kind of forward pass is being performed."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()

    def is_extend(self) -> bool:
        """True for EXTEND or MIXED (any prefill-style pass)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_prefill(self) -> bool:
        """Alias for ``is_extend()``."""
        return self.is_extend()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


@dataclass(frozen=True)
class FieldSpec:
    """One staged ForwardBatch tensor, declared once: rows per token or per request, the dtypes a
    batch may bring, and its static slot (dtype, and the pad value of rows no request owns)."""

    name: str
    per_token: bool
    dtypes: tuple = INDEX_DTYPES
    slot_dtype: torch.dtype = torch.int64
    pad_value: int = 0


# Tensor fields the runtime stages into static buffers, in staging order. Padding rows write KV
# slot 0 and read request 0 with a sequence length of 1, so they never touch a real request.
TOKEN_FIELDS = (
    FieldSpec("input_ids", per_token=True),
    FieldSpec("positions", per_token=True),
    FieldSpec("out_cache_loc", per_token=True),
)
REQUEST_FIELDS = (
    FieldSpec("req_pool_indices", per_token=False),
    FieldSpec("seq_lens", per_token=False, slot_dtype=torch.int32, pad_value=1),
)
EXTEND_FIELDS = (
    FieldSpec("extend_seq_lens", per_token=False, slot_dtype=torch.int32),
    FieldSpec("extend_prefix_lens", per_token=False, slot_dtype=torch.int32),
    FieldSpec("extend_start_loc", per_token=False, slot_dtype=torch.int32),
)
OUT_CACHE_LOC = TOKEN_FIELDS[2]
DECODE_SPECS = TOKEN_FIELDS + REQUEST_FIELDS
EXTEND_SPECS = DECODE_SPECS + EXTEND_FIELDS


def field_getter(specs: Sequence[FieldSpec]) -> Callable[[Any], tuple]:
    """The tensors of ``specs`` from a batch, in declaration order, in one C call (the staging hot path)."""
    return operator.attrgetter(*(spec.name for spec in specs))


_decode_tensors = field_getter(DECODE_SPECS)
_extend_tensors = field_getter(EXTEND_SPECS)


# The objects every batch of one runner shares; its graphs are bound to them.
CONTEXT_FIELDS = ("attn_backend", "req_to_token_pool", "token_to_kv_pool")
# Optional multimodal tensors: graphs are captured without them.
MULTIMODAL_FIELDS = ("mrope_position_deltas", "pixel_values", "image_grid_thw")


@dataclass
class ForwardBatch:
    """All tensors required by a single forward pass through the model."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    seq_lens_cpu: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    extend_num_tokens: Optional[int] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    return_logprob: bool = False
    top_logprobs_nums: Optional[List[int]] = None
    req_to_token_pool: Optional[Any] = None
    token_to_kv_pool: Optional[Any] = None
    attn_backend: Optional[Any] = None
    mrope_position_deltas: Optional[torch.Tensor] = None
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """Rows of every per-token tensor (``input_ids``, ``positions``, ``out_cache_loc``)."""
        return self.input_ids.shape[0] if isinstance(self.input_ids, torch.Tensor) else 0

    def validate(self, device: Optional[torch.device] = None, debug: Optional[bool] = None,
                 check_values: Optional[bool] = None, limits: Sequence[Tuple[str, int]] = (),
                 steps: int = 1) -> None:
        """Raise ValueError/TypeError naming the first bad field; never synchronizes a GPU unless asked.

        ``device``: where every staged tensor must live (default: where ``input_ids`` lives).
        ``check_values``: also read tensor values (non-negative indices, indices below ``limits``,
        ``seq_lens_sum``); default: for host tensors always, for device tensors only in debug mode
        (``debug``, default from GRAPHRT_DEBUG): reading them synchronizes once.
        ``limits``: (field, table size) pairs, e.g. ``table_sizes(context)``.
        ``steps``: a DECODE batch of ``GraphRunner.decode``, whose ``out_cache_loc`` holds ``steps``
        slots per request (step-major), each checked like a single step's.
        """
        mode = self.forward_mode
        if mode.__class__ is not ForwardMode:
            raise TypeError(f"forward_mode: expected a ForwardMode, got {type(mode).__name__}")
        batch_size = self.batch_size
        if batch_size.__class__ is not int or batch_size < 0:
            raise TypeError(f"batch_size: expected a non-negative int, got {batch_size!r}")
        if self.seq_lens_sum.__class__ is not int:
            raise TypeError(f"seq_lens_sum: expected a Python int, got {type(self.seq_lens_sum).__name__}")
        input_ids = self.input_ids
        if not isinstance(input_ids, torch.Tensor):
            check_tensor(TOKEN_FIELDS[0], input_ids, 0, device)
        if device is None:
            device = input_ids.device
        num_tokens = input_ids.shape[0] if input_ids.dim() else -1
        extend = mode is ForwardMode.EXTEND or mode is ForwardMode.MIXED
        if not extend and num_tokens != batch_size:
            raise ValueError(
                f"input_ids: expected shape [batch_size={batch_size}] for {mode.name}, got {list(input_ids.shape)}"
            )
        specs, tensors = (EXTEND_SPECS, _extend_tensors(self)) if extend else (DECODE_SPECS, _decode_tensors(self))
        token_shape, request_shape = (num_tokens,), (batch_size,)
        for spec, tensor in zip(specs, tensors):
            if tensor is None:
                if spec.name == "positions":
                    continue
                raise ValueError(f"{spec.name}: required field is missing (None) for {mode.name} batches")
            shape = token_shape if spec.per_token else request_shape
            if (not isinstance(tensor, torch.Tensor) or tensor.dtype not in spec.dtypes or tensor.shape != shape
                    or tensor.device != device):
                # Several decode steps: the slots of every step (off the single-step path's fast test).
                rows = shape[0] * steps if spec is OUT_CACHE_LOC else shape[0]
                check_tensor(spec, tensor, rows, device)
        if extend:
            self._validate_extend(num_tokens)
        mirror = self.seq_lens_cpu
        if mirror is not None:
            if not isinstance(mirror, torch.Tensor) or not mirror.is_cpu:
                raise TypeError("seq_lens_cpu: expected a CPU tensor mirror of seq_lens")
            if mirror.shape != request_shape:
                raise ValueError(f"seq_lens_cpu: expected shape [{batch_size}], got {list(mirror.shape)}")
        if check_values is None:
            check_values = device.type == "cpu" or (debug_enabled() if debug is None else debug)
        if check_values:
            longest = max(num_tokens, batch_size)  # an upper bound of each field's values, cheaper than counting
            if device.type == "cpu" and len(tensors) * longest + (steps - 1) * batch_size <= HOST_LIST_VALUES:
                self._check_host_values(specs, tensors, limits)
            else:
                self._check_values(specs, tensors, limits)
        elif mirror is not None:
            self._check_seq_lens_sum(mirror)

    def _check_host_values(self, specs: Sequence[FieldSpec], tensors: Sequence[Optional[torch.Tensor]],
                           limits: Sequence[Tuple[str, int]]) -> None:
        """The value checks of a small batch of host tensors, on their values as Python ints (a few
        rows convert faster than one torch reduction runs)."""
        bounds = dict(limits)
        for spec, tensor in zip(specs, tensors):
            if tensor is None:
                continue
            values = tensor.tolist()
            if values and min(values) < 0:
                raise ValueError(f"{spec.name}: expected non-negative entries, got min {min(values)}")
            size = bounds.get(spec.name)
            if size is not None and values and max(values) >= size:
                raise _past_table(spec.name, size, max(values))
            if tensor is self.seq_lens and self.seq_lens_cpu is None:
                self._check_seq_lens_sum(sum(values))
        if self.seq_lens_cpu is not None:
            self._check_seq_lens_sum(self.seq_lens_cpu)

    def _check_values(self, specs: Sequence[FieldSpec], tensors: Sequence[Optional[torch.Tensor]],
                      limits: Sequence[Tuple[str, int]]) -> None:
        """Value checks (they read the tensors): one minimum per dtype over the index fields (a
        concatenation of mixed dtypes would cost a type promotion), the maximum of each field with
        a known table size, and the sum of seq_lens; device values reach the host in one copy."""
        longs: List[torch.Tensor] = []
        others: List[torch.Tensor] = []
        for tensor in tensors:
            if tensor is not None and tensor.numel():
                (longs if tensor.dtype is torch.int64 else others).append(tensor)
        reductions = [(group[0] if len(group) == 1 else torch.cat(group)).min() for group in (longs, others) if group]
        minima = len(reductions)
        bounded = []
        for name, size in limits:
            tensor = getattr(self, name)
            if tensor is not None and tensor.numel():
                bounded.append((name, size))
                reductions.append(tensor.max())
        summed = self.seq_lens_cpu is None
        if summed:
            reductions.append(self.seq_lens.sum())
        values = _read(reductions)
        if min(values[:minima], default=0) < 0:
            for spec, tensor in zip(specs, tensors):
                if tensor is not None and tensor.numel() and int(tensor.min()) < 0:
                    raise ValueError(f"{spec.name}: expected non-negative entries, got min {int(tensor.min())}")
        for (name, size), largest in zip(bounded, values[minima:]):
            if largest >= size:
                raise _past_table(name, size, largest)
        self._check_seq_lens_sum(self.seq_lens_cpu if not summed else values[-1])

    def _check_seq_lens_sum(self, seq_lens: Any) -> None:
        """``seq_lens_sum`` against the sum of a host mirror (a tensor: a small one summed as Python
        ints, faster than a torch reduction) or a sum already read (an int)."""
        if isinstance(seq_lens, int):
            total = seq_lens
        else:
            total = sum(seq_lens.tolist()) if seq_lens.shape[0] <= HOST_SUM_ROWS else int(seq_lens.sum())
        if total != self.seq_lens_sum:
            raise ValueError(f"seq_lens_sum: expected seq_lens.sum()={total}, got {self.seq_lens_sum}")

    def _validate_extend(self, num_tokens: int) -> None:
        if self.extend_num_tokens != num_tokens:
            raise ValueError(
                f"extend_num_tokens: expected len(input_ids)={num_tokens}, got {self.extend_num_tokens!r}"
            )
        for name in ("extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
            mirror = getattr(self, name)
            if mirror is not None and len(mirror) != self.batch_size:
                raise ValueError(f"{name}: expected {self.batch_size} entries, got {len(mirror)}")
        if self.extend_seq_lens_cpu is not None and sum(self.extend_seq_lens_cpu) != num_tokens:
            raise ValueError(
                f"extend_seq_lens_cpu: expected entries summing to {num_tokens} tokens, "
                f"got {sum(self.extend_seq_lens_cpu)}"
            )


def _past_table(name: str, size: int, largest: int) -> ValueError:
    return ValueError(f"{name}: expected indices below {size} (the size of the table it indexes), got {largest}; "
                      "an index past a table inside a CUDA graph kills the CUDA context")


def _read(values: List[torch.Tensor]) -> List[int]:
    """0-d tensors as ints: one by one from host memory, in one copy (one sync) from a device."""
    if not values or values[0].device.type == "cpu":
        return [int(value) for value in values]
    return torch.stack([value.to(torch.int64) for value in values]).tolist()


def check_tensor(spec: FieldSpec, tensor: Any, rows: int, device: Optional[torch.device]) -> None:
    """Metadata-only check of one staged field: type, dtype, 1-D length, device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{spec.name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in spec.dtypes:
        expected = " or ".join(str(d) for d in spec.dtypes)
        raise TypeError(f"{spec.name}: expected dtype {expected}, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.shape[0] != rows:
        raise ValueError(f"{spec.name}: expected shape [{rows}], got {list(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{spec.name}: expected a tensor on {device}, got one on {tensor.device}")
