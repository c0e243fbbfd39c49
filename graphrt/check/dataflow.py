"""What a recorded step reads and writes: the tensors it did not create, and its in-place writes.

A graph keeps the addresses of the tensors a step read but did not create (parameters, caches,
inputs): ``external_reads``. It writes in place into the ones the step writes: ``state_writes``,
with the bytes each write touches (the indexed rows of an ``index_put_``, not the whole cache),
which is also what a capture has to undo. Memory the step allocated itself is not state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Set, Tuple

import torch

from graphrt.backends.op_graph import RecordedOp
from graphrt.backends.state_journal import (
    INDEX_DIM_WRITERS,
    INDEX_PUT_WRITERS,
    SCATTER_WRITERS,
    allocated_storages,
    op_base_name,
    storage_key,
    written_tensors,
)
from graphrt.check.recording import tensor_leaves

_aten = torch.ops.aten


def op_name(op: RecordedOp) -> str:
    """``aten.index_put_`` rather than the overload's full name."""
    return "aten." + op_base_name(op.func)


def argument(op: RecordedOp, name: str) -> Any:
    """The value the op got for the schema argument ``name`` (its default when not passed)."""
    for position, schema_argument in enumerate(op.func._schema.arguments):
        if schema_argument.name == name:
            if position < len(op.args):
                return op.args[position]
            return op.kwargs.get(name, schema_argument.default_value if schema_argument.has_default_value() else None)
    return None


def draws_random(op: RecordedOp) -> bool:
    """True when the op consumes random numbers: a seeded op, unless its dropout is off
    (``dropout_p=0``, as attention kernels get in eval mode, or ``train=False``)."""
    if torch.Tag.nondeterministic_seeded not in op.func.tags:
        return False
    return argument(op, "dropout_p") != 0 and argument(op, "train") is not False and (
        argument(op, "training") is not False
    )


@dataclass
class Write:
    """One in-place write of a recorded op into memory that existed before the step."""

    index: int
    op: RecordedOp
    target: torch.Tensor
    bytes: int


def fresh_storages(ops: Sequence[RecordedOp]) -> Set[Tuple[torch.device, int]]:
    """Storages the step allocated (outputs of ops that do not return a view of an input)."""
    return {key for op in ops for key in allocated_storages(op.func, op.args, op.kwargs, op.output)}


def external_reads(ops: Sequence[RecordedOp]) -> List[torch.Tensor]:
    """Tensors the ops read that no recorded op produced, in first-read order (no repeats)."""
    produced: Set[int] = set()
    seen: Set[int] = set()
    externals = []
    for op in ops:
        for arg in tensor_leaves([op.args, op.kwargs]):
            if id(arg) not in produced and id(arg) not in seen:
                seen.add(id(arg))
                externals.append(arg)
        produced.update(id(result) for result in tensor_leaves(op.output))
    return externals


def state_writes(ops: Sequence[RecordedOp]) -> List[Write]:
    """Every in-place write into memory the step did not allocate, in execution order."""
    fresh = fresh_storages(ops)
    writes = []
    for index, op in enumerate(ops):
        for position, target in written_tensors(op.func, op.args, op.kwargs):
            if storage_key(target) not in fresh:
                writes.append(Write(index, op, target, _written_elements(op, position, target) * target.element_size()))
    return writes


def _written_elements(op: RecordedOp, position: int, target: torch.Tensor) -> int:
    """Elements of ``target`` the op writes: indexed rows for indexed writers, else all of it."""
    name = op_base_name(op.func)
    args = op.args
    if position != 0:
        return target.numel()
    if name in INDEX_PUT_WRITERS:
        return _indexed_numel(target, args[1])
    if name in INDEX_DIM_WRITERS:
        dim = args[1] % max(target.dim(), 1)
        return args[2].numel() * (target.numel() // max(target.shape[dim] if target.dim() else 1, 1))
    if name in SCATTER_WRITERS:
        return args[2].numel()
    return target.numel()


def _indexed_numel(target: torch.Tensor, indices: Sequence[Any]) -> int:
    """Size of ``target[indices]``, worked out on the meta device (no data is read)."""
    meta_indices = [None if index is None else torch.empty(index.shape, dtype=index.dtype, device="meta")
                    for index in indices]
    try:
        return _aten.index.Tensor(torch.empty(target.shape, dtype=target.dtype, device="meta"), meta_indices).numel()
    except Exception:  # boolean masks have no size without their values: count the whole tensor
        return target.numel()

