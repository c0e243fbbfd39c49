"""Findings from one recording: host reads, writes, rebindings, devices, randomness, aliasing.

Each function reads one ``Recording`` and returns findings of the catalog's kinds
(graphrt.check.hazards) with the op, the tensor's name and the model line. Writes into
memory the step did not allocate are not hazards but the step's state; ``state_table`` lists
them with the bytes written per step, unless they land in the step's own inputs.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from graphrt.backends.op_graph import RecordedOp
from graphrt.backends.state_journal import storage_key
from graphrt.check.dataflow import (
    Write,
    argument,
    draws_random,
    external_reads,
    op_name,
    state_writes,
)
from graphrt.check.names import ObjectGraph, Rebinding
from graphrt.check.recording import Recording, source_text, tensor_leaves
from graphrt.check.report import Finding, StateWrite

_NUMBERS = (bool, int, float)
_HOST_READ_NAMES = {"aten._local_scalar_dense": "a Python number from a tensor (.item(), int(), float(), bool(), `if t:`)"}


class Namer:
    """Names a recording's tensors: the step's inputs first (``forward_batch.input_ids``), then
    the object graph (``layers.0.self_attn.k_cache``), else the op that computed it."""

    def __init__(self, graph: ObjectGraph, recording: Recording) -> None:
        self.graph = graph
        self.inputs = {storage_key(tensor): name for name, tensor in recording.step.inputs.items() if tensor.numel()}
        self.producers = {id(result): op for op in recording.ops for result in tensor_leaves(op.output)}

    def input_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The input this tensor is (a view of), if any."""
        return self.inputs.get(storage_key(tensor)) if tensor.numel() else None

    def __call__(self, tensor: torch.Tensor) -> str:
        name = self.input_name(tensor) or self.graph.name_of(tensor)
        if name is not None:
            return name.removesuffix("[view]")
        producer = self.producers.get(id(tensor))
        shape = "x".join(map(str, tensor.shape)) or "scalar"
        made = f" computed by {op_name(producer)}" if producer is not None else ""
        return f"<{shape} {str(tensor.dtype).removeprefix('torch.')} tensor{made}>"

    def source(self, tensor: torch.Tensor) -> Optional[str]:
        """The model line that computed the tensor, if a recorded op did."""
        return _where(self.producers.get(id(tensor)))


def _where(op: Optional[RecordedOp]) -> Optional[str]:
    return source_text(op.source) if op is not None else None


def host_read_findings(recording: Recording, name: Namer, device: torch.device) -> List[Finding]:
    """Host reads of tensor values: a sync that fails a CUDA capture, or (a CPU tensor read by a
    CUDA step) a value the graph freezes at capture."""
    findings = []
    for read in recording.host_reads:
        tensor = name(read.tensor) if read.tensor is not None else None
        source = source_text(read.source)
        op = read.op.removesuffix(".default")
        what = _HOST_READ_NAMES.get(op, op)
        if read.torch_source is not None:
            what += f" (in {source_text(read.torch_source)})"
        if device.type == "cuda" and read.tensor is not None and read.tensor.device.type == "cpu":
            message = f"reads the values of a CPU tensor ({what}); a graph keeps the values it had at capture"
            findings.append(Finding("cpu_tensor", message, op, tensor, source))
        else:
            findings.append(Finding("host_sync", f"{what}: {read.why}", op, tensor, source))
    return findings


def state_table(recording: Recording, name: Namer) -> Tuple[List[StateWrite], List[Finding]]:
    """The step's in-place writes grouped per tensor; a write into an input is a finding instead."""
    groups: Dict[str, List[Write]] = {}
    for write in state_writes(recording.ops):
        groups.setdefault(name(write.target), []).append(write)
    table, findings = [], []
    for tensor_name, writes in groups.items():
        first = writes[0]
        if name.input_name(first.target) is not None:
            message = (f"writes its input {tensor_name} in place: a graph writes its static copy of the input, "
                       "the caller's tensor keeps its old values")
            findings.append(Finding("input_written", message, op_name(first.op), tensor_name, _where(first.op)))
            continue
        base = _largest_view(writes)
        table.append(StateWrite(
            tensor_name, list(base.shape), str(base.dtype).removeprefix("torch."), sum(w.bytes for w in writes),
            sorted({op_name(w.op) for w in writes}), sorted({source_text(w.op.source) for w in writes if w.op.source}),
        ))
    return table, findings


def _largest_view(writes: List[Write]) -> torch.Tensor:
    return max((write.target for write in writes), key=lambda target: target.numel())


def hazardous_rebindings(recording: Recording) -> List[Tuple[Rebinding, str]]:
    """(rebinding, finding kind): tensors the step read and then replaced by new ones
    (``rebound_tensor``), Python numbers it changed in an attribute (``python_state``)."""
    read = {storage_key(tensor) for tensor in external_reads(recording.ops) if tensor.numel()}
    found = []
    for change in recording.rebindings:
        before, after = change.before, change.after
        if isinstance(before, torch.Tensor) and before.numel() and storage_key(before) in read:
            if not (isinstance(after, torch.Tensor) and after.numel() and storage_key(after) == storage_key(before)):
                found.append((change, "rebound_tensor"))  # (a new view of the same memory reads the same addresses)
        elif change.is_attribute and type(before) in _NUMBERS and type(after) in _NUMBERS and before != after:
            found.append((change, "python_state"))
    return found


def rebinding_findings(hazardous: List[Tuple[Rebinding, str]], lines: Dict[str, str]) -> List[Finding]:
    """Findings for ``hazardous_rebindings``; ``lines`` has the line that rebinds each, where known."""
    findings = []
    for change, kind in hazardous:
        if kind == "rebound_tensor":
            message = (f"reads {change.name} and then binds it to a new tensor; a graph keeps reading the tensor "
                       "it captured, so every replay sees the state from before capture")
        else:
            message = (f"changes {change.name} from {change.before!r} to {change.after!r}; a replay runs no Python, "
                       "so it stays at its value after capture and every op that used it keeps the captured value")
        findings.append(Finding(kind, message, None, change.name, lines.get(change.name)))
    return findings


def device_findings(recording: Recording, name: Namer, device: torch.device) -> List[Finding]:
    """For a CUDA step: tensors on the CPU or on another device than the step's."""
    if device.type != "cuda":
        return []
    findings = []
    for op in recording.ops:
        for tensor in tensor_leaves([op.args, op.kwargs, op.output]):
            if tensor.device.type == "cpu":
                message = (f"{op_name(op)} uses a CPU tensor in a CUDA step: the CPU work runs once at capture "
                           "and its values are frozen, and copies from pageable host memory fail capture")
                findings.append(Finding("cpu_tensor", message, op_name(op), name(tensor), _where(op)))
            elif tensor.device != device and tensor.device.type != "meta":
                message = f"{op_name(op)} uses a tensor on {tensor.device}, the step runs on {device}"
                findings.append(Finding("multiple_devices", message, op_name(op), name(tensor), _where(op)))
    return findings


def random_findings(recording: Recording) -> List[Finding]:
    """Random ops, as information: each replay draws what eager would draw at that point of the
    generator's sequence (an explicit generator is registered with the CUDA graph)."""
    findings = []
    for op in recording.ops:
        if not draws_random(op):
            continue
        if argument(op, "generator") is not None:
            message = (f"{op_name(op)} draws from the step's own generator; graphrt registers it with the graph, so "
                       "each replay advances it as the eager call would")
            findings.append(Finding("random_generator", message, op_name(op), None, _where(op)))
        else:
            message = (f"{op_name(op)} draws from the default generator; each replay draws what the eager call "
                       "would draw at that point of the generator's sequence")
            findings.append(Finding("random_op", message, op_name(op), None, _where(op)))
    return findings


def alias_findings(recording: Recording, name: Namer) -> List[Finding]:
    """Outputs that are views of an input, and outputs that share memory with each other."""
    findings = []
    owners: Dict[Tuple[torch.device, int], int] = {}
    for index, output in enumerate(tensor_leaves(recording.output)):
        if not output.numel():
            continue
        input_name = name.input_name(output)
        if input_name is not None:
            message = (f"output {index} is a view of the input {input_name}; a graph returns a view of its static "
                       "copy of the input instead, which the next call overwrites")
            findings.append(Finding("output_aliases_input", message, None, input_name, name.source(output)))
        key = storage_key(output)
        if key in owners:
            message = f"outputs {owners[key]} and {index} share memory"
            findings.append(Finding("outputs_alias", message, None, name(output), name.source(output)))
        owners.setdefault(key, index)
    return findings


_LIFTS = ("aten.lift_fresh", "aten.lift_fresh_copy")  # a tensor the step's Python built from host values


def outside_findings(recording: Recording, name: Namer) -> List[Finding]:
    """Tensors the step reads that are neither its inputs nor reachable from the model, the arguments
    or the callable's globals (a global forward context): a graph reads the captured one forever.
    Only for a step a graph records (``Step.graphed``)."""
    if not recording.step.graphed:
        return []
    known = {id(arg) for op in recording.ops if op_name(op) in _LIFTS for arg in tensor_leaves(op.args)}
    known |= {id(change.before) for change in recording.rebindings}  # bound when the step read it (rebound_tensor)
    readers = {}
    for op in recording.ops:
        for tensor in tensor_leaves([op.args, op.kwargs]):
            readers.setdefault(id(tensor), op)
    findings = []
    for tensor in external_reads(recording.ops):
        if (id(tensor) in known or not tensor.numel() or name.input_name(tensor) is not None
                or name.graph.name_of(tensor) is not None):
            continue
        op = readers[id(tensor)]
        message = (f"{op_name(op)} reads a {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor that "
                   "is neither an argument nor reachable from the model, the arguments or the step's globals; a graph "
                   "reads this same tensor on every replay, so if the step gets another one on the next call (a "
                   "global forward context, as nano-vllm's get_context()), every replay computes with the captured one")
        findings.append(Finding("outside_tensor", message, op_name(op), name(tensor), _where(op)))
    return findings


def recording_findings(recording: Recording, name: Namer, device: torch.device) -> List[Finding]:
    """Every finding one recording shows by itself, rebindings aside (their lines need a rerun;
    divergence and padding need a second recording)."""
    return (host_read_findings(recording, name, device) + device_findings(recording, name, device)
            + random_findings(recording) + alias_findings(recording, name) + outside_findings(recording, name))
