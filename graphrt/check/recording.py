"""Record one call of a step for the check: every aten op, every host read, every rebinding.

Capture's ``OpRecorder`` stops at the first host read, as a CUDA capture does. A report should
list them all, so ``ScanRecorder`` notes each one (op, model line, the tensor read) and lets the
op run, which it can on the CPU. Every recording runs under ``preserved_state``: a StateJournal
undoes the step's in-place writes and an ObjectGraph snapshot puts back the Python bindings it
changed, so recording a step leaves the model exactly as it was.
"""

from __future__ import annotations

import os
import random
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten

from graphrt.backends.op_graph import OpRecorder, RecordedOp
from graphrt.backends.source_lines import SourceLine, is_model_file, model_source_line, torch_source_line
from graphrt.backends.state_journal import StateJournal
from graphrt.check.names import ObjectGraph, Rebinding, Snapshot


def tensor_leaves(value: Any) -> List[torch.Tensor]:
    """The tensors in a pytree (tuples, lists, dicts, namedtuples), in order."""
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


@dataclass
class HostRead:
    """A host read of tensor values inside the step (a device sync on a GPU)."""

    op: str
    why: str
    source: Optional[SourceLine]
    tensor: Optional[torch.Tensor]
    position: int  # how many ops ran before it
    torch_source: Optional[SourceLine] = None  # torch's own line, when torch's code issued the read


class ScanRecorder(OpRecorder):
    """An OpRecorder that notes host reads and goes on, so one run finds all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reads: List[HostRead] = []
        self.cuda_target = True  # a step checked on the CPU is judged as on a GPU (grouped_mm's fallback)

    def on_host_sync(self, op: str, why: str, args: Sequence[Any]) -> None:
        tensors = tensor_leaves(list(args))
        masks = [tensor for tensor in tensors if tensor.dtype in (torch.bool, torch.uint8)]
        read = (masks or tensors or [None])[0]
        self.host_reads.append(HostRead(op, why, model_source_line(), read, len(self.ops), torch_source_line()))


@dataclass
class Step:
    """One call to record: ``prepare()`` (not recorded, e.g. attention metadata) then ``fn()``.
    ``inputs`` names the tensors handed to the step (arguments, ForwardBatch fields)."""

    label: str
    fn: Callable[[], Any]
    inputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    prepare: Optional[Callable[[], None]] = None


@dataclass
class Recording:
    """What one recorded call did; ``error`` is set when the step raised."""

    step: Step
    ops: List[RecordedOp]
    output: Any
    host_reads: List[HostRead]
    rebindings: List[Rebinding]
    error: Optional[BaseException] = None
    error_source: Optional[str] = None


@contextmanager
def preserved_state(graph: ObjectGraph) -> Iterator[Snapshot]:
    """Run the block, then undo its in-place writes and put back the bindings it changed."""
    snapshot = graph.snapshot()
    journal = StateJournal()
    try:
        with torch.no_grad(), journal:
            yield snapshot
    finally:
        journal.restore()
        snapshot.restore()


@contextmanager
def preserved_random_state() -> Iterator[None]:
    """Leave torch's (CPU and CUDA) and Python's random generators as they were."""
    python_state = random.getstate()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)


def record(step: Step, graph: ObjectGraph, recorder: Optional[ScanRecorder] = None) -> Recording:
    """Run ``step`` once under ``recorder`` (a fresh ScanRecorder by default); every effect on the
    model is undone on return."""
    recorder = ScanRecorder() if recorder is None else recorder
    output, error, error_source = None, None, None
    with preserved_state(graph) as before:
        try:
            if step.prepare is not None:
                step.prepare()
            with recorder:
                output = step.fn()
        except Exception as caught:  # the report says where the step raised
            error, error_source = caught, raising_line(caught)
        rebindings = graph.rebindings(before)
    return Recording(step, recorder.ops, output, recorder.host_reads, rebindings, error, error_source)


def source_text(source: Optional[SourceLine]) -> Optional[str]:
    """``file:line in function``, the file relative to the working directory when it is below it."""
    if source is None:
        return None
    filename = os.path.relpath(source.filename)
    return str(SourceLine(source.filename if filename.startswith("..") else filename, source.lineno, source.function))


def raising_line(error: BaseException) -> Optional[str]:
    """The innermost model line of the error's traceback, as ``file:line in function``."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if is_model_file(frame.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return source_text(SourceLine(frame.filename, frame.lineno or 0, frame.name))
