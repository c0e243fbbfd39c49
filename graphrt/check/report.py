"""CheckReport: what ``graphrt.check`` found, as a table (``str``), JSON (``to_json``) and ``ok``.

Three sections. Hazards: findings of a kind from the catalog (graphrt.check.hazards), each
with the op, the tensor's name and the model line, merged when one line repeats (a loop over
layers). State: every pre-existing tensor the step writes in place and the bytes per step,
which capture undoes and every replay writes again. Arguments: how ``wrap()`` treats each
argument, hence which later calls will run eagerly and why.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from graphrt.check.hazards import HAZARDS, Severity


@dataclass
class Finding:
    """One hazard: its kind (a key of HAZARDS), what happened, and where."""

    kind: str
    message: str
    op: Optional[str] = None
    tensor: Optional[str] = None
    source: Optional[str] = None  # "file:line in function" of the model code that issued the op
    count: int = 1  # how many times the step hit it at this line

    @property
    def severity(self) -> Severity:
        return HAZARDS[self.kind].severity

    def key(self) -> tuple:
        """Findings with equal keys are one finding hit several times (merged, ``count`` summed)."""
        return self.kind, self.op, self.tensor, self.source, self.message

    def to_dict(self) -> Dict[str, Any]:
        hazard = HAZARDS[self.kind]
        return {
            **asdict(self), "severity": hazard.severity.value, "title": hazard.title, "graphrt": hazard.graphrt,
            "torch_compile": hazard.torch_compile, "fix": hazard.fix,
        }


@dataclass
class StateWrite:
    """A tensor that existed before the step and that the step writes in place."""

    tensor: str
    shape: List[int]
    dtype: str
    bytes_per_step: int
    ops: List[str]
    sources: List[str]


@dataclass
class ArgumentInfo:
    """How wrap() treats one argument: ``batched`` (padded), ``fixed`` (shape kept) or ``constant``."""

    name: str
    kind: str
    description: str  # shape and dtype, or the constant's value
    runs_eagerly_when: str  # which later calls miss the graph, and the eager reason they record


@dataclass
class CheckReport:
    """What a check found for one callable or runner; ``ok`` is False on any error or warning."""

    target: str
    device: str
    findings: List[Finding] = field(default_factory=list)
    state_writes: List[StateWrite] = field(default_factory=list)
    arguments: List[ArgumentInfo] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    splits: List[Any] = field(default_factory=list)  # SplitSite: where a piecewise step runs an op eagerly
    pieces: Optional[int] = None  # graph pieces of a piecewise step (runners with splitting_ops)
    recordings: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when nothing would make capture fail or a replay differ from eager."""
        return not any(finding.severity is not Severity.INFO for finding in self.findings)

    def of_kind(self, kind: str) -> List[Finding]:
        return [finding for finding in self.findings if finding.kind == kind]

    def add(self, finding: Finding) -> None:
        """Add ``finding``, or count it once more when the same one is already there."""
        for known in self.findings:
            if known.key() == finding.key():
                known.count += finding.count
                return
        self.findings.append(finding)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "target": self.target, "device": self.device, "ok": self.ok, "seconds": self.seconds,
            "recordings": self.recordings, "findings": [finding.to_dict() for finding in self.sorted_findings()],
            "state_writes": [asdict(write) for write in self.state_writes],
            "arguments": [asdict(argument) for argument in self.arguments], "notes": list(self.notes),
            "splits": [asdict(site) for site in self.splits], "pieces": self.pieces,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def sorted_findings(self) -> List[Finding]:
        order = list(Severity)
        return sorted(self.findings, key=lambda finding: order.index(finding.severity))

    def __str__(self) -> str:
        counts = {severity: sum(f.severity is severity for f in self.findings) for severity in Severity}
        verdict = "OK: safe to graph" if self.ok else (
            f"NOT SAFE TO GRAPH: {counts[Severity.ERROR]} errors, {counts[Severity.WARNING]} warnings"
        )
        header = f"graphrt check of {self.target} on {self.device}: {verdict} ({self.recordings} recordings, "
        lines = [header + f"{self.seconds:.2f}s)"]
        lines += _hazard_lines(self.sorted_findings())
        lines += _state_lines(self.state_writes)
        lines += _argument_lines(self.arguments)
        lines += _split_lines(self.splits, self.pieces)
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _hazard_lines(findings: List[Finding]) -> List[str]:
    if not findings:
        return ["hazards: none"]
    lines = ["hazards:"]
    for finding in findings:
        hazard = HAZARDS[finding.kind]
        times = f" (x{finding.count})" if finding.count > 1 else ""
        lines.append(f"  {finding.severity.value.upper():<7} {finding.kind}{times}: {finding.message}")
        for label, value in (("op", finding.op), ("tensor", finding.tensor), ("at", finding.source)):
            if value:
                lines.append(f"          {label}: {value}")
        compile_reason = f"; torch.compile: {hazard.torch_compile}" if hazard.torch_compile else ""
        lines.append(f"          graphrt: {hazard.graphrt}{compile_reason}")
        lines.append(f"          fix: {hazard.fix}")
    return lines


def _state_lines(writes: List[StateWrite]) -> List[str]:
    if not writes:
        return ["state written per step: none"]
    lines = ["state written per step (capture undoes it; every replay writes it again):",
             f"  {'tensor':<48} {'bytes/step':>11}  {'shape':<18} op @ line"]
    for write in writes:
        shape = "x".join(map(str, write.shape)) + f" {write.dtype}"
        lines.append(f"  {write.tensor:<48} {write.bytes_per_step:>11}  {shape:<18} "
                     f"{', '.join(write.ops)} @ {'; '.join(write.sources)}")
    return lines


def _argument_lines(arguments: List[ArgumentInfo]) -> List[str]:
    if not arguments:
        return []
    lines = ["arguments (as wrap() treats them):"]
    for argument in arguments:
        lines.append(f"  {argument.name:<24} {argument.kind:<12} {argument.description:<26} "
                     f"eager when: {argument.runs_eagerly_when}")
    return lines


def _split_lines(splits: List[Any], pieces: Optional[int]) -> List[str]:
    if pieces is None:
        return []
    if not splits:
        return ["splits: none (no splitting op is called: a piecewise step would be one piece)"]
    lines = [f"splits (a piecewise step runs these ops eagerly between {pieces} graph pieces):"]
    for site in splits:
        times = f" (x{site.count})" if site.count > 1 else ""
        lines.append(f"  {site.op}{times} @ {site.source or '<unknown line>'}")
    return lines
