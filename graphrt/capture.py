"""Capture, in one place: warm up, record, undo every write, verify against eager, report.

``KeyCapture`` takes a registry's keys through the same sequence whatever the front (GraphRunner's
full and piecewise keys, each ``wrap()`` layout) and whatever the backend:

1. warm-up calls of the step on the key's static inputs (the backend's warm-up context);
2. the recording (``backend.capture``, or the entry's own recorder: piecewise keys record in pieces);
3. every write of 1 and 2 to tensors that existed before is undone (``StateJournal``), so capture
   leaves the model's state as it was (on CUDA the capture executes nothing and follows the undo);
4. verification: the step runs eagerly on the same inputs and state, the graph replays, and
   outputs and state writes are compared; both runs are undone.

A key whose capture or verification fails is marked so (its steps run eagerly, with the reason);
the other keys go on.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional: bare GPU images may lack tqdm
    tqdm = None

from graphrt.backends import CapturedGraph, GraphBackend, StateJournal
from graphrt.layout.tensor_tree import flatten, is_plain_constant, leaf_paths, same_value
from graphrt.registry import GraphEntry, GraphKey, GraphRegistry, GraphStatus, KeyKind

logger = logging.getLogger(__name__)


@dataclass
class KeyReport:
    """Capture outcome of one key."""

    key: GraphKey
    ok: bool
    seconds: float
    pool_bytes: Optional[int]
    reason: Optional[str] = None
    verify_seconds: float = 0.0  # part of ``seconds``: the eager run and replay that verified the graph
    pieces: Optional[int] = None  # piecewise keys: how many graph pieces the step was split into


@dataclass
class CaptureReport:
    """Per-key capture outcomes, largest key first."""

    keys: List[KeyReport] = field(default_factory=list)

    @property
    def ok(self) -> List[GraphKey]:
        return [report.key for report in self.keys if report.ok]

    @property
    def failed(self) -> Dict[GraphKey, str]:
        return {report.key: report.reason or "" for report in self.keys if not report.ok}

    @property
    def seconds(self) -> float:
        return sum(report.seconds for report in self.keys)

    @property
    def pool_bytes(self) -> int:
        return sum(report.pool_bytes or 0 for report in self.keys)

    @property
    def verify_seconds(self) -> float:
        return sum(report.verify_seconds for report in self.keys)

    def __str__(self) -> str:
        lines = [f"{'key':<28} {'status':<8} {'seconds':>8} {'verify s':>8} {'pool MiB':>9} {'pieces':>6}  reason"]
        for report in self.keys:
            pool = "-" if report.pool_bytes is None else f"{report.pool_bytes / 2**20:.2f}"
            status = "ok" if report.ok else "failed"
            pieces = "-" if report.pieces is None else str(report.pieces)
            lines.append(f"{str(report.key):<28} {status:<8} {report.seconds:>8.3f} {report.verify_seconds:>8.3f} "
                         f"{pool:>9} {pieces:>6}  {report.reason or ''}")
        return "\n".join(lines)


class KeyCapture:
    """Captures the keys of a registry through one backend (``warmup_iters`` warm-up calls each)."""

    def __init__(self, backend: GraphBackend, warmup_iters: int = 2, verify: bool = True) -> None:
        self.backend = backend
        self.warmup_iters = warmup_iters
        self.verify = verify

    def capture_all(self, registry: GraphRegistry, before_capture: Optional[Callable[[GraphEntry], None]] = None,
                    progress: bool = True) -> CaptureReport:
        """Capture every pending key of ``registry``, largest first; ``before_capture`` runs before
        each key's warm-up. A key whose capture raises is marked FAILED with the reason and the
        others go on. KeyboardInterrupt stops the loop, keeps the keys already captured and propagates."""
        report = CaptureReport()
        pending: Sequence[GraphEntry] = registry.pending()
        with self.backend.capture_session():
            if progress and tqdm is not None:
                pending = tqdm(pending, desc=f"capturing {self.backend.name} graphs")
            for entry in pending:
                start = time.perf_counter()
                try:
                    if before_capture is not None:
                        before_capture(entry)
                except Exception as error:  # a failed capture disables only this key
                    registry.mark_failed(entry, error)
                else:
                    self.capture_entry(registry, entry, self.warmup_iters)
                entry.seconds = time.perf_counter() - start
                report.keys.append(KeyReport(entry.key, entry.status is GraphStatus.READY, entry.seconds,
                                             entry.pool_bytes, entry.reason, entry.verify_seconds, _pieces(entry)))
        return report

    def capture_entry(self, registry: GraphRegistry, entry: GraphEntry, warmup_iters: int) -> bool:
        """Warm up, capture and (unless ``verify`` is off) verify one key against eager, every
        write to the model's tensors undone; a failure marks the key FAILED or VERIFY_FAILED with
        the reason (its steps run eagerly). True when READY."""
        step = recorded_step(entry)
        record = self.backend.capture if entry.record is None else (lambda fn: entry.record(self.backend, fn))
        try:
            graph = capture_graph(self.backend, step, warmup_iters, record)
        except Exception as error:  # a failed capture disables only this key
            registry.mark_failed(entry, error)
            return False
        if self.verify:
            start = time.perf_counter()
            try:
                verify_graph(graph, step, same_value)
            except Exception as error:  # a mismatch (VerifyError) or a replay that raised: this key only
                registry.mark_failed(entry, error, GraphStatus.VERIFY_FAILED)
                return False
            finally:
                entry.verify_seconds = time.perf_counter() - start
        registry.mark_ready(entry, graph)
        return True


def _pieces(entry: GraphEntry) -> Optional[int]:
    if entry.key.kind is not KeyKind.PIECEWISE or entry.graph is None:
        return None
    return entry.graph.piece_count


def recorded_step(entry: GraphEntry) -> Callable[[], List[Any]]:
    """``entry.step`` made to return its output leaves, which the backend keeps as the graph's
    outputs (so tensors inside dataclasses are refreshed too); the structure goes on the entry
    to rebuild results. A leaf that is neither a tensor, a plain constant nor a passed-through
    argument object fails the capture with a message naming it."""

    def run() -> List[Any]:
        leaves: List[Any] = []
        structure = flatten(entry.step(), leaves)
        for path, leaf in zip(leaf_paths(structure, "output"), leaves):
            if not isinstance(leaf, torch.Tensor) and not is_plain_constant(leaf) and id(leaf) not in entry.passthrough:
                kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
                raise TypeError(
                    f"{path} is a {kind}, not a tensor pytree: a graph can return only tensors (in tuples, lists, "
                    "dicts or dataclasses), plain constants, and objects passed in as arguments; return the "
                    f"tensors you need from the {type(leaf).__name__} instead"
                )
        entry.output_structure = structure
        return leaves

    return run


def capture_graph(backend: GraphBackend, fn: Callable[[], Any], warmup_iters: int,
                  record: Optional[Callable[[Callable[[], Any]], CapturedGraph]] = None) -> CapturedGraph:
    """``warmup_iters`` warm-up calls of ``fn``, then one recording (``record``, default
    ``backend.capture``); every in-place write undone."""
    record = backend.capture if record is None else record
    journal = StateJournal()
    graph = None
    with torch.no_grad():
        try:
            with journal:
                with backend.warmup_context():
                    for _ in range(warmup_iters):
                        fn()
                if backend.capture_executes:
                    graph = record(fn)
        finally:
            journal.restore()
        if graph is None:
            graph = record(fn)
    return graph


class VerifyError(RuntimeError):
    """A graph's first replay differs from eager on the same inputs: the key must not serve."""


def verify_graph(graph: CapturedGraph, fn: Callable[[], Sequence[Any]], same_leaf: Callable[[Any, Any], bool]) -> None:
    """Run ``fn`` eagerly, then replay ``graph``, on the same inputs and state; raise VerifyError
    naming the first output or state region that differs beyond ``torch.testing.assert_close``'s
    per-dtype tolerance. Every write of both runs is undone. ``fn`` returns the output leaves;
    ``same_leaf(replayed, eager)`` compares its non-tensor leaves (the caller's rule for constants).

    This catches what no recording sees: kernels outside the dispatcher, random ops (eager and
    replay draw other numbers), a model whose path differs under capture."""
    journal = StateJournal()
    with torch.no_grad(), _random_state_kept():
        try:
            with journal:
                expected = [_owned(leaf) for leaf in fn()]
            regions = list(journal.regions)  # what eager wrote; the replay must write the same
            expected_state = [region.current() for region in regions]
            journal.put_back()
            with journal:  # the emulated replay's writes are journaled; a CUDA replay writes the regions above
                graph.replay()
            _compare(expected, list(graph.outputs), [f"output leaf {i}" for i in range(len(expected))], same_leaf)
            _compare(expected_state, [region.current() for region in regions],
                     [f"state written by {region.op} at {region.source} ({_describe(region.target)})"
                      for region in regions], same_leaf)
        finally:
            journal.restore()


def _random_state_kept() -> AbstractContextManager:
    """Leave torch's random generators as they were: verifying draws numbers no step would."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _owned(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _describe(tensor: torch.Tensor) -> str:
    return f"tensor {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _compare(expected: Sequence[Any], actual: Sequence[Any], names: Sequence[str],
             same_leaf: Callable[[Any, Any], bool]) -> None:
    """Raise VerifyError at the first pair that differs (tensors within tolerance, others by ``same_leaf``)."""
    for name, want, got in zip(names, expected, actual):
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            try:
                torch.testing.assert_close(got, want, equal_nan=True)
            except AssertionError as error:
                detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
                raise VerifyError(f"{name} differs from eager: {detail}") from None
        elif not same_leaf(got, want):
            raise VerifyError(f"{name} differs from eager: {got!r} != {want!r}")
