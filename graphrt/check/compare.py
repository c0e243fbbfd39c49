"""Compare two recordings of a step: where its op graph depends on values, where padding leaks.

A graph replays the ops recorded at capture for every later input. Recording the step at two
inputs of the same shape and comparing op by op (the function, the non-tensor arguments that
Python baked in, and where each tensor argument comes from) finds the first op a graph would
get wrong for one of them. Recording it unpadded and padded, and comparing the real rows of
every op's output, finds the first op where padding rows leak into real ones.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from graphrt.backends.op_graph import RecordedOp
from graphrt.backends.state_journal import op_base_name
from graphrt.check.dataflow import op_name
from graphrt.check.names import ObjectGraph
from graphrt.check.recording import Recording, source_text, tensor_leaves
from graphrt.check.report import Finding
from graphrt.padding_rows import real_part

_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
_TOLERANCE = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}  # (rtol, atol); float32/64: 1e-4, 1e-5


class _Signatures:
    """Per op, what a graph bakes in: the function, Python values, and each tensor's origin."""

    def __init__(self, recording: Recording, graph: ObjectGraph) -> None:
        self._graph = graph
        self._inputs = {id(tensor): label for label, tensor in recording.step.inputs.items()}
        self._producers: Dict[int, str] = {}
        self.items: List[tuple] = []
        for index, op in enumerate(recording.ops):
            self.items.append((op.func, self._token([op.args, op.kwargs])))
            for position, result in enumerate(tensor_leaves(op.output)):
                self._producers[id(result)] = f"op{index}.{position}"

    def _token(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            origin = self._producers.get(id(value)) or self._inputs.get(id(value)) or self._graph.name_of(value)
            shape = "nested" if value.is_nested else tuple(value.shape)  # a nested tensor has no single shape
            return "tensor", value.dtype, shape, origin
        if isinstance(value, (list, tuple)):
            return tuple(self._token(item) for item in value)
        if isinstance(value, dict):
            return tuple((key, self._token(item)) for key, item in value.items())
        if isinstance(value, float):
            return repr(value)  # nan == nan
        if isinstance(value, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return value
        return type(value).__name__


def _first_difference(a: Any, b: Any) -> str:
    """The first argument token that differs, as ``X vs Y`` (a tensor shown by dtype and shape)."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and not _is_tensor_token(a):
        return next(_first_difference(x, y) for x, y in zip(a, b) if x != y)
    return f"{_show(a)} vs {_show(b)}"


def _is_tensor_token(token: Any) -> bool:
    return isinstance(token, tuple) and len(token) == 4 and token[0] == "tensor"


def _show(token: Any) -> str:
    if _is_tensor_token(token):
        origin = f" from {token[3]}" if token[3] and not token[3].startswith("op") else ""
        return f"a {str(token[1]).removeprefix('torch.')} tensor of shape {list(token[2])}{origin}"
    return repr(token)


def _describe(op: Optional[RecordedOp]) -> str:
    if op is None:
        return "the end of the step"
    return f"{op_name(op)} at {source_text(op.source)}" if op.source is not None else op_name(op)


def divergence(first: Recording, second: Recording, graph: ObjectGraph) -> Optional[Finding]:
    """The first op where two recordings of the same step differ, as a finding; None if none."""
    a, b = _Signatures(first, graph).items, _Signatures(second, graph).items
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if index is None:
        if len(a) == len(b):
            return None
        index = min(len(a), len(b))
    op_a = first.ops[index] if index < len(first.ops) else None
    op_b = second.ops[index] if index < len(second.ops) else None
    if op_a is not None and op_b is not None and op_a.func is op_b.func:
        what = f"{_describe(op_a)} gets {_first_difference(a[index][1], b[index][1])}"
    else:
        what = f"{_describe(op_a)} vs {_describe(op_b)}"
    message = (f"recorded at the {first.step.label} and at the {second.step.label}, the step runs different ops "
               f"from op {index}: {what}; a graph replays the first for every input")
    reads = [read for read in first.host_reads if read.position <= index]
    if reads:
        message += f" (after the host read {reads[-1].op.removesuffix('.default')} at {source_text(reads[-1].source)})"
    where = op_a if op_a is not None else op_b
    return Finding("value_dependent_branch", message, op_name(where) if where else None, None,
                   source_text(where.source) if where is not None else None)


def _close(real: torch.Tensor, padded: torch.Tensor) -> bool:
    if real.dtype != padded.dtype:
        return False
    if not (real.is_floating_point() or real.is_complex()):
        return torch.equal(real, padded)
    rtol, atol = _TOLERANCE.get(real.dtype, (1e-4, 1e-5))
    return bool(torch.isclose(real, padded, rtol=rtol, atol=atol, equal_nan=True).all())


def padding_leak(real: Recording, padded: Recording, rows: Dict[int, int]) -> List[Finding]:
    """Padded outputs that graphs cannot cut (padded calls run eagerly), or else the first op whose
    real rows differ between the unpadded and the padded run. ``rows`` maps padded to real sizes."""
    outputs = list(zip(tensor_leaves(real.output), tensor_leaves(padded.output)))
    uncut = [index for index, (want, got) in enumerate(outputs) if real_part(want, got, rows) is None]
    if uncut:
        message = (f"output {uncut[0]} has no dimension that grows with the batch (shapes "
                   f"{list(outputs[uncut[0]][0].shape)} unpadded, {list(outputs[uncut[0]][1].shape)} padded), so "
                   "padded calls run eagerly; only calls at a captured size replay")
        return [Finding("unsliceable_output", message, None, None, _producer_line(padded, outputs[uncut[0]][1]))]
    if all(_close(want, real_part(want, got, rows)) for want, got in outputs):
        return []
    op = _first_leaking_op(real.ops, padded.ops, rows)
    message = ("padding the batch changes the outputs of the real rows"
               + (f"; the first op whose real rows differ is {_describe(op)}" if op is not None else ""))
    return [Finding("rows_interact", message, op_name(op) if op else None, None,
                    source_text(op.source) if op is not None else None)]


def _producer_line(recording: Recording, tensor: torch.Tensor) -> Optional[str]:
    producer = next((op for op in reversed(recording.ops) if any(r is tensor for r in tensor_leaves(op.output))), None)
    return source_text(producer.source) if producer is not None else None


def _first_leaking_op(real: Sequence[RecordedOp], padded: Sequence[RecordedOp], rows: Dict[int, int]) -> Optional[RecordedOp]:
    for want_op, got_op in zip(real, padded):
        if want_op.func is not got_op.func:
            return None  # the ops differ from here on: no row-by-row comparison
        if op_base_name(want_op.func) in _UNINITIALIZED:
            continue
        for want, got in zip(tensor_leaves(want_op.output), tensor_leaves(got_op.output)):
            part = got if want.shape == got.shape else real_part(want, got, rows)
            if part is not None and not _close(want, part):
                return got_op
    return None
