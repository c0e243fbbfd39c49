"""GraphKey, GraphEntry, GraphRegistry: one entry per padded size, looked up in O(1), captured largest first.

``GraphRegistry.lookup`` answers every step with a ``Decision``: the entry to replay, or the
``EagerReason`` the step runs eagerly. A key whose capture fails, or whose replay raises, is
taken out of use alone; the other keys go on.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Generic, List, NamedTuple, Optional, Tuple, TypeVar

import torch

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional: bare GPU images may lack tqdm
    tqdm = None

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.backends.capture import capture_graph, verify_graph
from graphrt.batch import ForwardMode
from graphrt.layout.tensor_tree import flatten, is_plain_constant, leaf_paths, same_value
from graphrt.sizes import SizeGrid, build_pad_table

logger = logging.getLogger(__name__)


class GraphKey(NamedTuple):
    """What a graph was captured for: mode and padded row counts (tokens, requests)."""

    mode: ForwardMode
    num_tokens: int
    num_reqs: int

    def __str__(self) -> str:
        if self.num_tokens == self.num_reqs:
            return f"{self.mode.name.lower()}/bs={self.num_reqs}"
        return f"{self.mode.name.lower()}/tokens={self.num_tokens},reqs={self.num_reqs}"


class GraphStatus(enum.Enum):
    """Where a key stands: waiting for capture, replayable, or out of use (with a reason)."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    VERIFY_FAILED = "verify_failed"  # captured, but its first replay differed from eager
    DISABLED = "disabled"


class EagerReason(str, enum.Enum):
    """Why a step ran eagerly instead of replaying a graph (a fixed set, each counted)."""

    GRAPHS_DISABLED = "graphs_disabled"  # backend="eager" or GRAPHRT_DISABLE=1
    WARMUP = "warmup"  # wrap(): a size's first call is its warm-up, run eagerly as the real step
    NOT_CAPTURED = "not_captured"  # capture() has not run (or was interrupted) for this key
    MODE_NOT_CAPTURED = "mode_not_captured"
    BATCH_TOO_LARGE = "batch_too_large"
    SHAPE_MISMATCH = "shape_mismatch"  # wrap(): the call fits no layout with graphs, and its kind changes every call
    CAPTURE_FAILED = "capture_failed"
    VERIFY_FAILED = "verify_failed"  # the key's first replay differed from eager at capture
    DISABLED = "disabled"  # an earlier replay of this key raised
    UNSUPPORTED_FIELD = "unsupported_field"  # logprobs or multimodal fields: graphs are captured without them
    CONTEXT_MISMATCH = "context_mismatch"  # attn_backend or a pool other than the captured one
    REPLAY_FAILED = "replay_failed"  # the replay raised; the step re-ran eagerly
    PEER_EAGER = "peer_eager"  # lockstep: another rank must run this step eagerly, so every rank does
    AXIS_PROBE = "axis_probe"  # padded, and the outputs' batch axes are not known yet: this run's shapes show them
    UNSLICEABLE_OUTPUT = "unsliceable_output"  # padded, and an output has no batch axis to cut the padding off
    AUTOGRAD = "autograd"  # wrap(): grad mode on and an input requires grad; eager so gradients flow
    AMBIGUOUS_BATCH_AXIS = "ambiguous_batch_axis"  # wrap(): padded, and an argument has the batch size in two dims


StaticInputs = TypeVar("StaticInputs")


@dataclass(eq=False)
class GraphEntry(Generic[StaticInputs]):
    """One key's graph: the padded inputs it reads, the step capture records, and its state."""

    key: GraphKey
    static_inputs: StaticInputs  # views of the static slots at the key's size (a ForwardBatch, or wrap()'s call)
    step: Callable[[], Any]  # the model on static_inputs: what capture records
    passthrough: FrozenSet[int] = frozenset()  # ids of argument objects the step may return as they are
    graph: Optional[CapturedGraph] = None
    status: GraphStatus = GraphStatus.PENDING
    reason: Optional[str] = None
    seconds: float = 0.0
    verify_seconds: float = 0.0
    pool_bytes: Optional[int] = None
    hits: int = 0
    result_cache: Dict[Tuple[int, int], Any] = field(default_factory=dict, repr=False)  # real size -> cut outputs
    output_structure: Any = field(default=None, repr=False)  # how graph.outputs (leaves) rebuild the result
    outputs_observed: bool = False  # its output shapes are in the batch-axis evidence


class Decision(NamedTuple):
    """Replay ``entry``, or run eagerly for ``reason`` (``entry`` then names the key that did not serve)."""

    entry: Optional[GraphEntry]
    reason: Optional[EagerReason]


STATUS_REASONS = {
    GraphStatus.PENDING: EagerReason.NOT_CAPTURED,
    GraphStatus.FAILED: EagerReason.CAPTURE_FAILED,
    GraphStatus.VERIFY_FAILED: EagerReason.VERIFY_FAILED,
    GraphStatus.DISABLED: EagerReason.DISABLED,
}
TOO_LARGE = Decision(None, EagerReason.BATCH_TOO_LARGE)
NO_MODE = Decision(None, EagerReason.MODE_NOT_CAPTURED)


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


class GraphRegistry:
    """Holds one GraphEntry per key; captures them through a backend, largest first."""

    def __init__(self, backend: Optional[GraphBackend], warmup_iters: int = 2, verify: bool = True) -> None:
        self.backend = backend
        self.warmup_iters = warmup_iters
        self.verify = verify
        self.entries: Dict[GraphKey, GraphEntry] = {}
        self.grids: Dict[ForwardMode, Tuple[SizeGrid, List[Optional[int]], List[Optional[int]]]] = {}
        self._by_rows: Dict[ForwardMode, List[Optional[GraphEntry]]] = {}

    def add_grid(self, mode: ForwardMode, grid: SizeGrid, make_entry: Callable[[GraphKey], GraphEntry]) -> None:
        """Register every key of ``grid`` for ``mode`` (pending capture) and precompute its padded-size tables."""
        self.grids[mode] = (grid, build_pad_table(grid.token_sizes), build_pad_table(grid.req_sizes))
        for num_tokens, num_reqs in grid.pairs():
            key = GraphKey(mode, num_tokens, num_reqs)
            self.entries[key] = make_entry(key)
        if grid.diagonal:
            padded = build_pad_table(grid.token_sizes)
            self._by_rows[mode] = [self.entries[GraphKey(mode, size, size)] for size in padded]

    def add_size(self, mode: ForwardMode, size: int, make_entry: Callable[[GraphKey], GraphEntry]) -> GraphEntry:
        """Register the diagonal key (size, size) beside ``mode``'s grid, keeping its other keys and
        graphs: calls of exactly ``size`` rows use it from now on (a size padding cannot serve)."""
        grid = self.grids[mode][0]
        sizes = sorted({*grid.token_sizes, size})
        key = GraphKey(mode, size, size)
        entry = self.entries[key] = make_entry(key)
        table = build_pad_table(sizes)
        self.grids[mode] = (SizeGrid.for_decode(sizes), table, table)
        self._by_rows[mode] = [self.entries[GraphKey(mode, padded, padded)] for padded in table]
        return entry

    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Decision:
        """The entry whose key pads (num_tokens, num_reqs) least, in O(1), if it is ready; else why not."""
        by_rows = self._by_rows.get(mode)
        if by_rows is not None:  # diagonal grid: one list index
            if num_tokens >= len(by_rows):
                return TOO_LARGE
            entry = by_rows[num_tokens]
        else:
            grid_tables = self.grids.get(mode)
            if grid_tables is None:
                return NO_MODE
            _, token_table, req_table = grid_tables
            if num_tokens >= len(token_table) or num_reqs >= len(req_table):
                return TOO_LARGE
            entry = self.entries.get(GraphKey(mode, token_table[num_tokens], req_table[num_reqs]))
            if entry is None:
                return TOO_LARGE
        if entry.status is GraphStatus.READY:
            return Decision(entry, None)
        return Decision(entry, STATUS_REASONS[entry.status])

    def capture_all(
        self, before_capture: Optional[Callable[[GraphEntry], None]] = None, progress: bool = True
    ) -> CaptureReport:
        """Capture every pending key, largest first; ``before_capture`` runs before each key's
        warm-up. A key whose capture raises is marked FAILED with the reason and the others go on.
        KeyboardInterrupt stops the loop, keeps the keys already captured and propagates."""
        report = CaptureReport()
        pending = sorted(
            (entry for entry in self.entries.values() if entry.status is GraphStatus.PENDING),
            key=lambda entry: (entry.key.num_tokens, entry.key.num_reqs, entry.key.mode),
            reverse=True,
        )
        with self.backend.capture_session():
            if progress and tqdm is not None:
                pending = tqdm(pending, desc=f"capturing {self.backend.name} graphs")
            for entry in pending:
                start = time.perf_counter()
                try:
                    if before_capture is not None:
                        before_capture(entry)
                except Exception as error:  # a failed capture disables only this key
                    self._mark_failed(entry, error)
                else:
                    self.capture_entry(entry, self.warmup_iters)
                entry.seconds = time.perf_counter() - start
                report.keys.append(KeyReport(entry.key, entry.status is GraphStatus.READY, entry.seconds,
                                             entry.pool_bytes, entry.reason, entry.verify_seconds))
        return report

    def capture_entry(self, entry: GraphEntry, warmup_iters: int) -> bool:
        """Warm up, capture and (unless ``verify`` is off) verify one key against eager, every
        write to the model's tensors undone; a failure marks the key FAILED or VERIFY_FAILED with
        the reason (its steps run eagerly). True when READY."""
        step = recorded_step(entry)
        try:
            graph = capture_graph(self.backend, step, warmup_iters)
        except Exception as error:  # a failed capture disables only this key
            self._mark_failed(entry, error)
            return False
        if self.verify:
            start = time.perf_counter()
            try:
                verify_graph(graph, step, same_value)
            except Exception as error:  # a mismatch (VerifyError) or a replay that raised: this key only
                self._mark_failed(entry, error, GraphStatus.VERIFY_FAILED)
                return False
            finally:
                entry.verify_seconds = time.perf_counter() - start
        entry.graph, entry.status, entry.pool_bytes = graph, GraphStatus.READY, graph.pool_bytes
        return True

    def _mark_failed(self, entry: GraphEntry, error: Exception, status: GraphStatus = GraphStatus.FAILED) -> None:
        entry.status, entry.reason = status, f"{type(error).__name__}: {error}"
        logger.warning("capture of %s failed, it will run eagerly: %s", entry.key, entry.reason)

    def disable(self, key: GraphKey, reason: str) -> None:
        """Take ``key`` out of use (its steps run eagerly) and drop its graph."""
        entry = self.entries[key]
        entry.status, entry.reason, entry.graph = GraphStatus.DISABLED, reason, None
        entry.result_cache.clear()
        logger.warning("graph %s disabled: %s", key, reason)

    def remove_mode(self, mode: ForwardMode) -> None:
        """Forget every key of ``mode`` and its lookup tables; dropped graphs free their memory."""
        for key in [key for key in self.entries if key.mode is mode]:
            del self.entries[key]
        self.grids.pop(mode, None)
        self._by_rows.pop(mode, None)

    def summary(self) -> Dict[str, Any]:
        """Per-key counters for ``stats()``: replays per key, captured keys, and why keys are out of use."""
        return {
            "key_hits": {str(key): entry.hits for key, entry in self.entries.items() if entry.hits},
            "captured_keys": [str(key) for key in self.ready_keys()],
            "failed_keys": {str(key): entry.reason for key, entry in self.entries.items() if entry.reason is not None},
        }

    def ready_keys(self) -> List[GraphKey]:
        """Keys whose graph replays."""
        return [key for key, entry in self.entries.items() if entry.status is GraphStatus.READY]

    def clear(self) -> None:
        """Forget every entry and graph (their pool memory returns when the graphs are freed)."""
        self.entries.clear()
        self.grids.clear()
        self._by_rows.clear()
