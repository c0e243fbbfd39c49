"""CheckSession: records steps and turns recordings into one CheckReport.

Both entry points (a callable with example arguments, a GraphRunner with its reference
batches) build a session over the objects the step can reach, record the step at a few
inputs, and hand each recording or pair of recordings to the analyses. The session owns the
naming of tensors, the merging of repeated findings and the recording count.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

import torch

from graphrt.check.compare import divergence, padding_leak
from graphrt.check.dataflow import draws_random
from graphrt.check.findings import (
    Namer,
    hazardous_rebindings,
    rebinding_findings,
    recording_findings,
    state_table,
)
from graphrt.check.line_trace import rebinding_lines
from graphrt.check.names import ObjectGraph
from graphrt.backends.state_journal import storage_key
from graphrt.check.recording import Recording, ScanRecorder, Step, record, source_text
from graphrt.check.report import CheckReport, Finding
from graphrt.padding_rows import find_padding_write, fix_for

logger = logging.getLogger(__name__)


class CheckSession:
    """Records steps over one object graph and collects what they show in ``report``."""

    def __init__(self, target: str, roots: Sequence[Tuple[str, Any]], device: torch.device) -> None:
        self.started = time.perf_counter()
        self.graph = ObjectGraph(roots)
        self.device = device
        self.report = CheckReport(target, str(device))

    def record(self, step: Step, recorder: Optional[ScanRecorder] = None) -> Recording:
        recording = record(step, self.graph, recorder)
        self.report.recordings += 1
        logger.debug("recorded %s: %d ops, %d host reads", step.label, len(recording.ops), len(recording.host_reads))
        return recording

    def analyze(self, recording: Recording, with_state: bool = True) -> bool:
        """Add what one recording shows; ``with_state`` fills the state table from it (once per
        report). False when the step raised (nothing else to learn from it)."""
        if recording.error is not None:
            self.add_error(recording.step.label, recording.error, recording.error_source)
            return False
        name = Namer(self.graph, recording)
        hazardous = hazardous_rebindings(recording)
        lines = rebinding_lines(recording.step, self.graph, [change for change, _ in hazardous]) if hazardous else {}
        for finding in recording_findings(recording, name, self.device) + rebinding_findings(hazardous, lines):
            self.report.add(finding)
        table, findings = state_table(recording, name)
        for finding in findings:
            self.report.add(finding)
        if with_state and not self.report.state_writes:
            self.report.state_writes = table
        return True

    def add_error(self, label: str, error: BaseException, source: Optional[str]) -> None:
        message = f"the {label} raised {type(error).__name__}: {error}"
        self.report.add(Finding("step_raised", message, None, None, source))

    def compare(self, first: Recording, second: Recording) -> None:
        """Add the first op where two recordings of the same step differ; a variant that raised
        is noted, not reported (the variant may be invalid for the model, the example is not)."""
        if second.error is not None:
            self.report.notes.append(f"the {second.step.label} raised {type(second.error).__name__}: "
                                     f"{second.error}; it was left out of the comparison")
            return
        finding = divergence(first, second, self.graph)
        if finding is not None:
            self.report.add(finding)

    def compare_padding(self, real: Recording, padded: Recording, rows: Dict[int, int]) -> None:
        """Add a finding when padding rows leak into real rows (or the padded step raised)."""
        if padded.error is not None:
            message = (f"padded from {min(rows.values())} to {max(rows)} rows, the step raised "
                       f"{type(padded.error).__name__}: {padded.error}; sizes that need padding will not capture")
            self.report.add(Finding("batch_not_padded", message, None, None, padded.error_source))
            return
        if any(recording.host_reads for recording in (real, padded)) or any(map(draws_random, real.ops)):
            self.report.notes.append("padding was not compared: the step reads values on the host or draws "
                                     "random numbers, so its padded run is not comparable row by row")
            return
        for finding in padding_leak(real, padded, rows):
            self.report.add(finding)

    def compare_padding_writes(self, real: Step, padded: Step, rows: int, size: int,
                               scratch: Set[Tuple[torch.device, int]]) -> None:
        """Add a finding when the padding rows write state the real rows' step does not (wrap() would
        record exact sizes; graphrt.padding_rows): the op, the line, the tensor and the fix."""
        inputs = {storage_key(tensor): name for step in (real, padded) for name, tensor in step.inputs.items()
                  if tensor.numel()}

        def restoring(fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                snapshot = self.graph.snapshot()  # Python bindings the step changes, put back after each run
                try:
                    return fn()
                finally:
                    snapshot.restore()
            return run

        try:
            write = find_padding_write(restoring(real.fn), restoring(padded.fn), rows, size, set(inputs) | scratch,
                                       inputs)
        except Exception as error:  # the padded step's failure is reported by compare_padding
            self.report.notes.append(f"padding rows' writes were not compared: {type(error).__name__}: {error}")
            return
        if write is not None:
            name = self.graph.name_of(write.written) if write.written is not None else None
            self.report.add(Finding("padding_writes_state", f"{write.describe()}; {fix_for(write)}", write.op,
                                    name, source_text(write.source)))

    def finish(self) -> CheckReport:
        self.report.seconds = time.perf_counter() - self.started
        logger.info("checked %s in %.2fs: %s", self.report.target, self.report.seconds,
                    "ok" if self.report.ok else f"{len(self.report.findings)} findings")
        return self.report

