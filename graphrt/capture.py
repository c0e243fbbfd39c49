"""Capture, in one place: warm up, record, undo every write, verify against eager, report.

``KeyCapture`` takes a registry's keys through the same sequence whatever the front (GraphRunner's
full and piecewise keys, each ``wrap()`` layout) and whatever the backend:

1. warm-up calls of the step on the key's static inputs (the backend's warm-up context);
2. the recording (``backend.capture``, or the entry's own recorder: piecewise keys record in pieces);
3. every write of 1 and 2 to tensors that existed before is undone (``StateJournal``), so capture
   leaves the model's state as it was (on CUDA the capture executes nothing; what runs during it,
   a piecewise key's piece replays and splitting ops, writes what the warm-ups wrote, undone alike);
4. verification: the step runs eagerly on the same inputs and state, the graph replays, and
   outputs and state writes are compared; both runs are undone.

A key whose capture or verification fails is marked so (its steps run eagerly, with the reason);
the other keys go on. With an ``agree`` hook (lockstep across ranks), every rank reports each
phase's outcome after it, and a key that failed on any rank is marked failed on every rank before
the next phase, whose collectives the failed rank would not run.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional: bare GPU images may lack tqdm
    tqdm = None

from graphrt.backends import CapturedGraph, GraphBackend, StateJournal
from graphrt.backends.base import StepRefusal
from graphrt.backends.compile_runs import compile_run, compiled_code
from graphrt.backends.compiled import eager_stance
from graphrt.batch import ForwardBatch
from graphrt.debug import GenerationCounter
from graphrt.entry import GraphEntry, GraphKey, GraphStatus, KeyKind
from graphrt.guards import observed_run, python_state_kept
from graphrt.layout.tensor_tree import flatten, is_plain_constant, leaf_paths, same_value
from graphrt.registry import GraphRegistry
from graphrt.verify import verify_graph

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
    output_bytes: int = 0  # the key's output tensors (memory the keys of one pool share)
    compiled: Optional[bool] = None  # the step's torch.compile'd code compiled at this key's shapes (None: it has none)
    compiled_graphs: int = 0  # graphs Dynamo compiled for this key (0: the key ran graphs compiled before)


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
        """The pool's growth over the capture: the keys share their output memory, so about the
        largest key's outputs and intermediates, not their sum."""
        return sum(report.pool_bytes or 0 for report in self.keys)

    @property
    def output_bytes(self) -> int:
        """The keys' output bytes added up: what the pool would hold if no key shared another's memory."""
        return sum(report.output_bytes for report in self.keys)

    @property
    def verify_seconds(self) -> float:
        return sum(report.verify_seconds for report in self.keys)

    @property
    def compiled_graphs(self) -> int:
        """Graphs Dynamo compiled for the keys (a dynamic graph serves many sizes: 1, and 1 more for size 1)."""
        return sum(report.compiled_graphs for report in self.keys)

    def __str__(self) -> str:
        lines = [f"{'key':<28} {'status':<8} {'seconds':>8} {'verify s':>8} {'out MiB':>8} {'pool MiB':>9} {'pieces':>6}"
                 f" {'compiled':>8}  reason"]
        for report in self.keys:
            pool = "-" if report.pool_bytes is None else f"{report.pool_bytes / 2**20:.2f}"
            status = "ok" if report.ok else "failed"
            pieces = "-" if report.pieces is None else str(report.pieces)
            compiled = {None: "-", True: "yes", False: "no"}[report.compiled] + (
                f"+{report.compiled_graphs}" if report.compiled_graphs else "")
            lines.append(f"{str(report.key):<28} {status:<8} {report.seconds:>8.3f} {report.verify_seconds:>8.3f} "
                         f"{report.output_bytes / 2**20:>8.2f} {pool:>9} {pieces:>6} {compiled:>8}  "
                         f"{report.reason or ''}")
        total_compiled = f"+{self.compiled_graphs}" if self.compiled_graphs else ""
        lines.append(f"{'pool total':<28} {'':<8} {self.seconds:>8.3f} {self.verify_seconds:>8.3f} "
                     f"{self.output_bytes / 2**20:>8.2f} {self.pool_bytes / 2**20:>9.2f} {'':>6} {total_compiled:>8}")
        return "\n".join(lines)


# Bytes a capture may copy to undo writes it cannot narrow to rows (opaque ops writing a whole tensor).
WHOLE_SAVE_BUDGET = 16 << 20


class CaptureChecks(Protocol):
    """A key's first warm-up and its verification run another way than the plain ones (wrap()'s padding
    check, graphrt.padding_rows.PaddingCheck: the warm-up is its padded-size run, the verification's eager run
    its real-size run), so a key's capture still runs the step three times."""

    def warm_up(self, step: Callable[[], Any]) -> None:
        """Run the first warm-up, ``step()`` (every write of it undone by the capture's journal too)."""

    def verify(self, graph: CapturedGraph, journal: StateJournal, verify_eagerly: Optional[Callable[[], None]]
               ) -> None:
        """After the recording: raise VerifyError where the graph must not serve; ``verify_eagerly``: the plain
        verification, for what the checks cannot tell otherwise (None: verification is off)."""


# Every rank calls it after each phase of a key's capture ("prepare", "capture", "verify") with its own
# error (None: the phase succeeded here); it returns the error to fail the key with because the phase
# failed on another rank, else None. GraphRunner passes Lockstep.agree_capture in lockstep.
PhaseAgreement = Callable[[GraphEntry, str, Optional[Exception]], Optional[Exception]]


class KeyCapture:
    """Captures the keys of a registry through one backend (``warmup_iters`` warm-up calls each).
    ``scratch``: the storages a capture writes only at rows no request owns (it stages pad values
    first), never copied to undo those writes. ``compiled``: the callable is torch.compile'd (its
    warm-ups take no capture path; at least one, so its compile run's writes are undone). Compiled
    code the step runs, however reached, compiles for each key before its recording
    (graphrt.backends.compile_runs). ``agree``: the ranks' agreement after each phase (lockstep),
    None for a single process."""

    def __init__(self, backend: GraphBackend, warmup_iters: int = 2, verify: bool = True,
                 scratch: Callable[[], Set[Tuple[torch.device, int]]] = frozenset, compiled: bool = False,
                 agree: Optional[PhaseAgreement] = None) -> None:
        self.backend = backend
        self.warmup_iters = warmup_iters
        self.verify = verify
        self.scratch = scratch
        self.compiled = compiled
        self.agree = agree
        self.pool_replays = GenerationCounter()  # replays of the graphs in this backend's pool (debug guard)

    def _agreed(self, entry: GraphEntry, phase: str, error: Optional[Exception]) -> Optional[Exception]:
        """This rank's error of ``phase``, else (with ``agree``) another rank's: every rank then
        marks the key alike and skips the next phase together."""
        if self.agree is None:
            return error
        peer_error = self.agree(entry, phase, error)
        return error if error is not None else peer_error

    def capture_all(self, registry: GraphRegistry,
                    before_capture: Optional[Callable[[GraphEntry], Optional[CaptureChecks]]] = None,
                    progress: bool = True) -> CaptureReport:
        """Capture every pending key of ``registry``, largest first; ``before_capture`` runs before
        each key's warm-up and may return how to run its first warm-up and verification (``CaptureChecks``). A
        key whose capture raises is marked FAILED with the reason and the others go on, unless the step was
        refused (``StepRefusal``: code no key can hold), which fails every later key with it. KeyboardInterrupt
        stops the loop, keeps the keys already captured and propagates."""
        report = CaptureReport()
        pending: Sequence[GraphEntry] = registry.pending()
        refusal: Optional[StepRefusal] = None
        with self.backend.capture_session():
            if progress and tqdm is not None:
                pending = tqdm(pending, desc=f"capturing {self.backend.name} graphs")
            for entry in pending:
                start = time.perf_counter()
                error: Optional[Exception] = refusal
                checks: Optional[CaptureChecks] = None
                try:
                    if before_capture is not None and error is None:
                        checks = before_capture(entry)
                except Exception as caught:  # a failed capture disables only this key
                    error = caught
                error = self._agreed(entry, "prepare", error)
                if error is not None:
                    registry.mark_failed(entry, error)
                else:
                    self.capture_entry(registry, entry, self.warmup_iters, checks=checks)
                    refusal = entry.refused
                entry.seconds = time.perf_counter() - start
                report.keys.append(KeyReport(entry.key, entry.status is GraphStatus.READY, entry.seconds,
                                             entry.pool_bytes, entry.reason, entry.verify_seconds, _pieces(entry),
                                             _output_bytes(entry),
                                             None if entry.compiled is None else entry.compiled.compiled,
                                             0 if entry.compiled is None else entry.compiled.graphs))
        return report

    def capture_entry(self, registry: GraphRegistry, entry: GraphEntry, warmup_iters: int, then: str = "",
                      watch: Optional[AbstractContextManager] = None, checks: Optional[CaptureChecks] = None) -> bool:
        """Warm up, capture and (unless ``verify`` is off) verify one key against eager, every
        write to the model's tensors undone; a failure marks the key FAILED or VERIFY_FAILED with
        the reason (its steps run eagerly, or, as ``then`` says, get another graph). True when READY.
        ``watch``: a context the first warm-up runs in, whose exit may refuse the key (raise); ``checks``: run
        the first warm-up (at least one then runs) and the verification (even with ``verify`` off: the plain
        verification is then not theirs to call)."""
        step = recorded_step(entry)
        record: Optional[Record] = None
        if entry.record is not None:
            record = lambda fn, generators: entry.record(self.backend, fn, generators)  # noqa: E731
        journal = StateJournal(self.scratch(), WHOLE_SAVE_BUDGET)
        error: Optional[Exception] = None
        entry.refused, entry.runs_compiled, entry.compiled = None, False, None  # this capture's findings
        try:
            runs = max(warmup_iters, 1) if self.compiled or checks is not None else warmup_iters
            graph = capture_graph(self.backend, step, runs, record, journal, watch, capture_path=not self.compiled,
                                  compile_step=lambda put_back: self._compile(entry, put_back),
                                  warm_up=None if checks is None else checks.warm_up)
            check_devices(entry, graph, self.backend.graph_device)
        except Exception as caught:  # a failed capture disables only this key
            error = caught
            if isinstance(caught, StepRefusal):
                entry.refused = caught
        error = self._agreed(entry, "capture", error)
        if error is not None:
            registry.mark_failed(entry, error, then=then)
            return False
        if self.verify or checks is not None:
            start = time.perf_counter()
            verify_eagerly = (lambda: verify_graph(graph, step, same_value, journal)) if self.verify else None
            try:
                if checks is None:
                    verify_eagerly()
                else:
                    checks.verify(graph, journal, verify_eagerly)
            except Exception as caught:  # a mismatch (VerifyError) or a replay that raised: this key only
                error = caught
            finally:
                entry.verify_seconds = time.perf_counter() - start
            error = self._agreed(entry, "verify", error)
            if error is not None:
                registry.mark_failed(entry, error, GraphStatus.VERIFY_FAILED, then)
                return False
        registry.mark_ready(entry, graph, journal.written, journal.reads_grad, journal.touched)
        return True

    def _compile(self, entry: GraphEntry, put_back: Callable[[], None]) -> None:
        """If the step ran torch.compile'd code (seen by its warm-ups), compile it at the key's shapes with
        no dispatch mode active, the key's rows marked dynamic (graphrt.backends.compile_runs). The step
        runs bare: compiling assigns attributes of the modules Dynamo and inductor make (inductor on CUDA
        rebinds its GraphModules' ``meta``), which the assignment journal would refuse; the step's own
        Python state was checked by the observed warm-up, and a cache hit under it assigns nothing."""
        if not entry.runs_compiled:
            return
        tensors: List[Any] = []
        flatten(entry.static_inputs, tensors)
        with self.backend.warmup_context():
            entry.compiled = compile_run(entry.step, [leaf for leaf in tensors if isinstance(leaf, torch.Tensor)],
                                         (entry.key.num_tokens, entry.key.num_reqs), put_back)
        if not entry.compiled.compiled:
            logger.warning("%s: the step's torch.compile'd code runs eagerly at this key's shapes: %s", entry.key,
                           entry.compiled.detail)


def check_devices(entry: GraphEntry, graph: CapturedGraph, device: Optional[torch.device]) -> None:
    """Refuse a graph whose static inputs or outputs live off its backend's device: a CUDA graph
    neither stages nor refreshes a CPU tensor (it would replay the capture's outputs forever). A
    ForwardBatch's ``seq_lens_cpu`` is a host mirror by contract, read on the host (a piecewise key's
    splitting ops read the live batch's), never by the graph."""
    if device is None:
        return
    inputs: List[Any] = []
    named = [(path, leaf) for path, leaf in zip(leaf_paths(flatten(entry.static_inputs, inputs), "input"), inputs)]
    named += list(zip(leaf_paths(entry.output_structure, "output"), graph.outputs))
    mirror = getattr(entry.static_inputs, "seq_lens_cpu", None) if isinstance(entry.static_inputs, ForwardBatch) else None
    for path, leaf in named:
        if isinstance(leaf, torch.Tensor) and leaf.device != device and leaf is not mirror:
            raise ValueError(f"{path} is on {leaf.device}: a graph captured on {device} can neither stage nor "
                             "refresh it; keep the step's tensors on one device (wrap() picks the backend from "
                             "the call's tensors with backend='auto')")


def _output_bytes(entry: GraphEntry) -> int:
    """Bytes of a captured key's output tensors (each memory counted once)."""
    if entry.graph is None:
        return 0
    tensors = {leaf.data_ptr(): leaf.numel() * leaf.element_size() for leaf in entry.graph.outputs
               if isinstance(leaf, torch.Tensor)}
    return sum(tensors.values())


def _pieces(entry: GraphEntry) -> Optional[int]:
    if entry.key.kind is not KeyKind.PIECEWISE or entry.graph is None:
        return None
    return entry.graph.piece_count


def recorded_step(entry: GraphEntry) -> Callable[[], List[Any]]:
    """``entry.step`` made to return its output leaves, which the backend keeps as the graph's
    outputs (so tensors inside dataclasses are refreshed too); the structure goes on the entry
    to rebuild results. A leaf that is neither a tensor, a plain constant nor a passed-through
    argument object fails the capture with a message naming it. A step that rebinds the state of
    its guard's roots (object arguments, what the wrapped callable holds) or assigns an attribute
    of any module or watched object fails it too (``RebindError``), each binding put back. The
    first run is observed (graphrt.guards.observe): what it ran is what the key's guard checks, and
    the compiled code it ran (``compiled_code``) is compiled for the key before its recording."""
    roots = entry.guard_spec.rebind_roots() if entry.guard_spec is not None else ()
    fn = entry.guard_spec.fn if entry.guard_spec is not None else None
    entry.observation = None

    def run() -> List[Any]:
        leaves: List[Any] = []
        if entry.observation is None:
            outputs, entry.observation = observed_run(entry.step, roots, fn)
            entry.runs_compiled = compiled_code(entry.observation.modules, entry.observation.compiled_calls)
        else:
            with python_state_kept(roots, fn):
                outputs = entry.step()
        structure = flatten(outputs, leaves)
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


Record = Callable[[Callable[[], Any], Sequence[torch.Generator]], CapturedGraph]


def capture_graph(backend: GraphBackend, fn: Callable[[], Any], warmup_iters: int, record: Optional[Record] = None,
                  journal: Optional[StateJournal] = None, watch: Optional[AbstractContextManager] = None,
                  capture_path: bool = False,
                  compile_step: Optional[Callable[[Callable[[], None]], None]] = None,
                  warm_up: Optional[Callable[[Callable[[], Any]], None]] = None) -> CapturedGraph:
    """``warmup_iters`` warm-up calls of ``fn``, then one recording (``record(fn, generators)``,
    default ``backend.capture``), each on the state as it was before (a warm-up's writes are put
    back before the next run); every in-place write and every random draw undone. The
    generators the warm-ups were handed go to the recording (CUDA registers them with the graph).
    ``journal``: the StateJournal to use, for a caller that reads what the step wrote; ``watch``:
    a context the first warm-up's run of ``fn`` also runs in (whose exit may raise, refusing the key). ``capture_path``:
    the warm-ups take the step's capture path (``GraphBackend.warmup_context``; not for a torch.compile'd
    step, whose compiled code must not see a patched flag). ``compile_step(put_back)``: run between the
    warm-ups and the recording with no dispatch mode active (a torch.compile'd step compiles there, not
    under a mode nor inside a CUDA capture); it writes the regions the warm-ups wrote, put back after
    it (and by ``put_back()`` between its runs). ``warm_up(fn)``: runs the first warm-up in place of ``fn()``."""
    record = backend.capture if record is None else record
    journal = StateJournal() if journal is None else journal
    with torch.no_grad():
        try:
            def watched() -> Any:  # the first warm-up's run of the step, in ``watch``
                with watch if watch is not None else nullcontext():
                    return fn()

            with journal, eager_stance():
                with backend.warmup_context(capture_path):
                    for run in range(warmup_iters):
                        if run > 0:
                            fn()
                        elif warm_up is not None:
                            warm_up(watched)
                        else:
                            watched()
                        journal.put_back()  # each run starts from the state as it was (a cache's length)
                generators = journal.generators.explicit()
            if compile_step is not None:
                compile_step(journal.put_back)
                journal.put_back()
            if backend.capture_executes:
                with journal, eager_stance():
                    return record(fn, generators)
            # A CUDA capture executes nothing, outside the journal (its saves would be captured);
            # what does run during it (piecewise: each piece's replay, the splitting ops) writes
            # the regions the warm-ups wrote, so the journal, kept until now, undoes it too.
            return record(fn, generators)
        finally:
            journal.restore()
