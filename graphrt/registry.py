"""GraphKey, GraphEntry, GraphRegistry: capture every key, look keys up, disable failed ones."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional: bare GPU images may lack tqdm
    tqdm = None

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.backends.capture import capture_graph
from graphrt.batch import ForwardMode
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
    DISABLED = "disabled"


@dataclass
class GraphEntry:
    """One key's graph and what the runner needs to replay it."""

    key: GraphKey
    inputs: Any = None
    graph: Optional[CapturedGraph] = None
    status: GraphStatus = GraphStatus.PENDING
    reason: Optional[str] = None
    seconds: float = 0.0
    pool_bytes: Optional[int] = None
    hits: int = 0
    result_cache: Dict[Any, Any] = field(default_factory=dict, repr=False)
    output_structure: Any = field(default=None, repr=False)  # how graph.outputs (leaves) rebuild the result
    outputs_observed: bool = False  # its output shapes are in the dispatcher's batch-axis evidence


@dataclass
class KeyReport:
    """Capture outcome of one key."""

    key: GraphKey
    ok: bool
    seconds: float
    pool_bytes: Optional[int]
    reason: Optional[str] = None


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

    def __str__(self) -> str:
        lines = [f"{'key':<28} {'status':<8} {'seconds':>8} {'pool MiB':>9}  reason"]
        for report in self.keys:
            pool = "-" if report.pool_bytes is None else f"{report.pool_bytes / 2**20:.2f}"
            status = "ok" if report.ok else "failed"
            lines.append(f"{str(report.key):<28} {status:<8} {report.seconds:>8.3f} {pool:>9}  {report.reason or ''}")
        return "\n".join(lines)


class GraphRegistry:
    """Holds one GraphEntry per key; captures them through a backend, largest first."""

    def __init__(self, backend: Optional[GraphBackend], warmup_iters: int = 2) -> None:
        self.backend = backend
        self.warmup_iters = warmup_iters
        self.entries: Dict[GraphKey, GraphEntry] = {}
        self.grids: Dict[ForwardMode, Tuple[SizeGrid, List[Optional[int]], List[Optional[int]]]] = {}
        self._by_rows: Dict[ForwardMode, List[Optional[GraphEntry]]] = {}

    def add_grid(self, mode: ForwardMode, grid: SizeGrid, make_inputs: Callable[[GraphKey], Any]) -> None:
        """Register every key of ``grid`` for ``mode`` and precompute its padded-size tables."""
        self.grids[mode] = (grid, build_pad_table(grid.token_sizes), build_pad_table(grid.req_sizes))
        for num_tokens, num_reqs in grid.pairs():
            key = GraphKey(mode, num_tokens, num_reqs)
            self.add(key, make_inputs(key))
        if grid.diagonal:
            padded = build_pad_table(grid.token_sizes)
            self._by_rows[mode] = [self.entries[GraphKey(mode, size, size)] for size in padded]

    def lookup(self, mode: ForwardMode, num_tokens: int, num_reqs: int) -> Tuple[Optional[GraphEntry], str]:
        """The entry whose key pads (num_tokens, num_reqs) least, in O(1), or None and why not."""
        by_rows = self._by_rows.get(mode)
        if by_rows is not None:  # diagonal grid: one list index
            return (by_rows[num_tokens], "") if num_tokens < len(by_rows) else (None, "batch_too_large")
        grid_tables = self.grids.get(mode)
        if grid_tables is None:
            return None, "mode_not_captured"
        grid, token_table, req_table = grid_tables
        if num_tokens >= len(token_table) or num_reqs >= len(req_table):
            return None, "batch_too_large"
        entry = self.entries.get(GraphKey(mode, token_table[num_tokens], req_table[num_reqs]))
        return (entry, "") if entry is not None else (None, "batch_too_large")

    def add(self, key: GraphKey, inputs: Any = None) -> GraphEntry:
        """Register ``key`` (pending capture) with the static inputs its graph will read."""
        entry = self.entries[key] = GraphEntry(key, inputs)
        return entry

    def get(self, key: GraphKey) -> Optional[GraphEntry]:
        return self.entries.get(key)

    def capture_all(
        self,
        make_callable: Callable[[GraphEntry], Callable[[], Any]],
        before_capture: Optional[Callable[[GraphEntry], None]] = None,
        progress: bool = True,
    ) -> CaptureReport:
        """Capture every pending key, largest first; a key whose capture raises is marked
        FAILED with the reason and the others go on. KeyboardInterrupt stops the loop,
        keeps the keys already captured and propagates."""
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
                report.keys.append(self._capture_one(entry, make_callable, before_capture))
        return report

    def _capture_one(
        self,
        entry: GraphEntry,
        make_callable: Callable[[GraphEntry], Callable[[], Any]],
        before_capture: Optional[Callable[[GraphEntry], None]],
    ) -> KeyReport:
        start = time.perf_counter()
        try:
            if before_capture is not None:
                before_capture(entry)
            fn = make_callable(entry)
        except Exception as error:  # a failed capture disables only this key
            self._mark_failed(entry, error)
        else:
            self.capture_entry(entry, fn, self.warmup_iters)
        entry.seconds = time.perf_counter() - start
        return KeyReport(entry.key, entry.status is GraphStatus.READY, entry.seconds, entry.pool_bytes, entry.reason)

    def capture_entry(self, entry: GraphEntry, fn: Callable[[], Any], warmup_iters: int) -> bool:
        """Warm up and capture one key, every write to the model's tensors undone; a failure
        marks the key FAILED with the reason (its steps run eagerly). True when READY."""
        try:
            entry.graph = capture_graph(self.backend, fn, warmup_iters)
        except Exception as error:  # a failed capture disables only this key
            self._mark_failed(entry, error)
            return False
        entry.status, entry.pool_bytes = GraphStatus.READY, entry.graph.pool_bytes
        return True

    def _mark_failed(self, entry: GraphEntry, error: Exception) -> None:
        entry.status, entry.reason = GraphStatus.FAILED, f"{type(error).__name__}: {error}"
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

    def ready_keys(self) -> Iterable[GraphKey]:
        return [key for key, entry in self.entries.items() if entry.status is GraphStatus.READY]

    def clear(self) -> None:
        """Forget every entry and graph (their pool memory returns when the graphs are freed)."""
        self.entries.clear()
        self.grids.clear()
        self._by_rows.clear()
