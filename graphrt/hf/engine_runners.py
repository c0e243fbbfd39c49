"""The GraphRunners of one engine, and which of them serves a step.

* A graphs runner per width and steps per launch: full decode graphs (multi-step keys for more
  than one step) at every batch size, their attention reading ``width`` table slots per request,
  the narrowest width of ``decode_widths`` that holds the step's longest request; so a decode
  step's attention work follows the requests it serves, not ``max_context``. The single-step
  runner of the narrowest width also holds the piecewise keys of prefill and mixed steps (split at
  the paged attention op, padded token counts up to the step budget): the runner every call uses.
* ``eager``: every step of ``graphs=False`` calls.

Each runner is built and captured once, under the engine's lock, with an attention backend of its own
over the shared KV pools: a runner captured later never reallocates state an earlier runner's graphs
read. Every runner a call may use is built before its first step (``prepare``: the prefill runner, then
the decode runners of every width, widest first), so no capture (and its collection, device sync and
cache emptying) lands between the steps of a request when it crosses a width. The graph runners share
one graph memory pool (``RunnerConfig.share_graphs_with``: the first graph runner's; on CUDA one capture
stream, so one cuBLAS workspace): the engine holds about one largest key's memory, not a pool per
runner; each step's logits are used (its tokens chosen on the device, in stream order) before the
next step replays. A key that a replay fault disabled
(the replay raised, the same step ran eagerly) is captured again once before the next step; a second
fault keeps it disabled.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from graphrt import CaptureReport
from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.config import RunnerConfig
from graphrt.entry import GraphKey, GraphStatus
from graphrt.hf.kv_layout import KVLayout
from graphrt.hf.paged_attention import PagedAttnBackend, splitting_ops
from graphrt.reference import CachePools, graph_runner_kwargs
from graphrt.runner import GraphRunner
from graphrt.sizes import default_capture_sizes, default_piecewise_sizes

logger = logging.getLogger(__name__)

MIN_WIDTH = 64  # the narrowest decode width (table slots per request) a decode runner reads
COUNTERS = ("graph_runs", "piecewise_runs", "eager_runs", "multi_step_runs", "real_tokens", "padded_tokens")
COUNTED = ("eager_reasons", "multi_step_fallbacks", "guard_failures")
DECODE_OPTIONS = frozenset({"capture_sizes", "decode_steps", "next_tokens", "max_graphs", "histogram", "ubatch"})
PREFILL_OPTIONS = frozenset({"splitting_ops", "piecewise_sizes", "extend_capture_sizes"})


def decode_widths(max_context: int) -> List[int]:
    """Powers of two from ``MIN_WIDTH`` below ``max_context``, then ``max_context``: a step's attention
    reads at most twice what its longest request holds, with one decode runner per doubling."""
    widths = []
    width = MIN_WIDTH
    while width < max_context:
        widths.append(width)
        width *= 2
    return widths + [max_context]


@dataclass(frozen=True)
class RunnerKey:
    """Which runner: eager (``width`` 0), or graphs of ``steps`` decode steps per launch reading ``width``
    table slots per request (the single-step runner of the narrowest width also prefills: ``prefill``)."""

    steps: int = 1
    width: int = 0
    prefill: bool = False

    @property
    def name(self) -> str:
        if not self.width:
            return "eager"
        return f"decode@{self.width}" + (f"x{self.steps}" if self.steps > 1 else "") + ("+prefill" if self.prefill else "")


class EngineRunners:
    """The engine's runners by ``RunnerKey``, built before a call's first step (``prepare``); the call
    statistics of those a call used."""

    def __init__(self, model: Callable[..., Any], pools: CachePools, layout: KVLayout, graph_backend: str,
                 device: Any, max_requests: int, max_step_tokens: int, options: Dict[str, Any],
                 lock: threading.RLock) -> None:
        self.model = model
        self.pools = pools
        self.layout = layout
        self.graph_backend = graph_backend
        self.device = device
        self.max_requests = max_requests
        self.max_step_tokens = max_step_tokens
        self.options = dict(options)
        self.widths = decode_widths(pools.req_to_token.max_context_len)
        self.used: Set[RunnerKey] = set()  # the runners of the current (or last) call
        self.widths_used: Set[int] = set()  # the widths its decode steps read
        self._lock = lock
        self._runners: Dict[RunnerKey, GraphRunner] = {}
        self._captures: Dict[RunnerKey, CaptureReport] = {}  # each graph runner's capture when it was built
        self._retried: Dict[RunnerKey, Set[GraphKey]] = {}
        self._faulted: Optional[Tuple[RunnerKey, GraphRunner]] = None

    def for_batch(self, graphs: bool, batch: ForwardBatch, steps_per_launch: int = 1,
                  steps: int = 1, longest: Optional[int] = None) -> Tuple[RunnerKey, GraphRunner]:
        """The runner that serves ``batch`` (``steps`` decode steps of it, on the runner of ``steps_per_launch``;
        ``longest``: its longest request, when the caller knows it on the host)."""
        if not graphs:
            key = RunnerKey()
        elif batch.forward_mode.is_decode_or_idle():
            if longest is None:
                longest = int(batch.seq_lens_cpu.max()) if batch.batch_size else 1
            width = self.width_for(longest + steps - 1)
            key = RunnerKey(steps_per_launch, width, steps_per_launch == 1 and width == self.widths[0])
            self.widths_used.add(width)
        else:
            key = RunnerKey(1, self.widths[0], True)
        return key, self.get(key)

    def width_for(self, tokens: int) -> int:
        """The narrowest decode width that holds ``tokens`` table slots per request."""
        index = bisect.bisect_left(self.widths, tokens)
        if index == len(self.widths):
            raise ValueError(f"seq_lens: a request of {tokens} tokens exceeds max_context={self.widths[-1]}")
        return self.widths[index]

    def prepare(self, graphs: bool, steps_per_launch: int) -> None:
        """Before a call's first step: every runner it may use built and captured, so none is captured
        between its steps. With graphs: the prefill runner (the narrowest width's single-step runner),
        then the decode runners of ``steps_per_launch`` steps at every width, widest first (narrower graphs
        reuse the pool blocks of wider ones). A call of another ``steps_per_launch`` builds its own here."""
        if not graphs:
            keys = [RunnerKey()]
        else:
            narrowest = self.widths[0]
            keys = [RunnerKey(1, narrowest, True)] + [
                RunnerKey(steps_per_launch, width, steps_per_launch == 1 and width == narrowest)
                for width in reversed(self.widths)]
        with self._lock:
            for key in dict.fromkeys(keys):
                self._runner(key)

    def get(self, key: RunnerKey) -> GraphRunner:
        """The runner of ``key`` (built and captured if ``prepare`` did not; once: under the engine's lock)."""
        with self._lock:
            if self._faulted is not None:
                self._retry(*self._faulted)
            runner = self._runner(key)
            self.used.add(key)
        return runner

    def _runner(self, key: RunnerKey) -> GraphRunner:
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._build(key)
        return runner

    def after_eager_step(self, key: RunnerKey, runner: GraphRunner) -> None:
        """A step of ``key``'s runner ran the model eagerly: if a replay fault disabled one of its keys, that
        key is captured again before the next step (once per key). Not in lockstep: a replay that raises
        there has raised on its rank alone, and a capture is collective."""
        if key.width and runner.lockstep is None and any(entry.status is GraphStatus.DISABLED for entry in runner.registry.entries.values()):
            self._faulted = (key, runner)

    def _retry(self, key: RunnerKey, runner: GraphRunner) -> None:
        self._faulted = None
        retried = self._retried.setdefault(key, set())
        faulted = [graph_key for graph_key, entry in runner.registry.entries.items()
                   if entry.status is GraphStatus.DISABLED and graph_key not in retried]
        if faulted:
            retried.update(faulted)
            logger.warning("engine runner %s: capturing %s again after a replay fault (once)", key.name,
                           ", ".join(map(str, faulted)))
            runner.recapture(faulted)

    def _build(self, key: RunnerKey) -> GraphRunner:
        """A runner of ``key``'s kind with its own attention backend, captured (eager: nothing to capture)."""
        backend = PagedAttnBackend(self.pools, self.layout, key.width or None)
        options: Dict[str, Any] = dict(max_batch_size=self.max_requests, device=self.device, progress=False,
                                       backend=self.graph_backend, **graph_runner_kwargs(backend, self.pools))
        if not key.width:
            options.update(modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED), backend="eager")
            dropped = DECODE_OPTIONS | PREFILL_OPTIONS
        elif key.prefill:
            options.update(modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED),
                           capture_sizes=default_capture_sizes(self.max_requests), splitting_ops=splitting_ops(self.layout),
                           piecewise_sizes=default_piecewise_sizes(self.max_step_tokens))
            dropped = frozenset({"decode_steps"})
        else:
            options.update(modes=(ForwardMode.DECODE,), capture_sizes=default_capture_sizes(self.max_requests),
                           decode_steps=(key.steps,) if key.steps > 1 else ())
            dropped = PREFILL_OPTIONS
        options.update({name: value for name, value in self.options.items() if name not in dropped})
        if key.prefill and "extend_capture_sizes" not in self.options:
            # No extend grid is captured (the backend graphs decode only): its one size bounds the static token slots.
            options["extend_capture_sizes"] = ([max(options["piecewise_sizes"])], [1])
        if key.width:  # one graph pool (and cuBLAS workspace) for the engine: the first graph runner's
            options["share_graphs_with"] = next((runner for built, runner in self._runners.items() if built.width),
                                                None)
        runner = GraphRunner(self.model, RunnerConfig(**options))
        report = runner.capture()
        if key.width:
            self._captures[key] = report
        logger.info("engine runner %s: %s", key.name, report)
        return runner

    def capture_summary(self) -> Dict[str, Any]:
        """What capturing the graph runners took: ``seconds``, ``pool_bytes`` (the pool's growth over every
        capture, each key's counted once), ``graphs`` (keys captured), ``runners`` and ``graph_pools`` (the
        distinct backends, so pools, the graph runners use: 1)."""
        with self._lock:
            reports = list(self._captures.values())
            backends = {id(runner.backend) for key, runner in self._runners.items() if key.width}
            return {"seconds": sum(report.seconds for report in reports),
                    "pool_bytes": sum(report.pool_bytes for report in reports),
                    "graphs": sum(len(report.ok) for report in reports), "runners": len(reports),
                    "graph_pools": len(backends)}

    def all(self) -> Dict[str, GraphRunner]:
        """Every runner built so far, by name."""
        with self._lock:
            return {key.name: runner for key, runner in self._runners.items()}

    def recapture(self) -> None:
        """Every runner's keys captured again under the state of now (eager runners have none)."""
        with self._lock:
            self._faulted = None
            self._retried.clear()
            for runner in self._runners.values():
                runner.recapture()

    def snapshot(self) -> Dict[RunnerKey, Dict[str, Any]]:
        """Every runner's counters now (``call_stats`` subtracts them), and a new call's set of used runners."""
        self.used, self.widths_used = set(), set()
        return {key: runner.stats() for key, runner in self._runners.items()}

    def call_stats(self, before: Dict[RunnerKey, Dict[str, Any]]) -> Dict[str, Any]:
        """The counters of the runners used since ``snapshot`` (what they did since, summed), their
        captured and failed keys (named ``runner:key``), the backend, the decode widths read."""
        merged: Dict[str, Any] = {name: 0 for name in COUNTERS}
        counted: Dict[str, Counter] = {name: Counter() for name in COUNTED}
        hits: Dict[str, int] = {}
        captured: List[str] = []
        failed: Dict[str, str] = {}
        backends: List[str] = []
        for key in sorted(self.used, key=lambda used: used.name):
            now, then = self._runners[key].stats(), before.get(key, {})
            for name in COUNTERS:
                merged[name] += now[name] - then.get(name, 0)
            for name in COUNTED:
                counted[name].update(Counter(now[name]) - Counter(then.get(name, {})))
            previous = then.get("key_hits", {})
            hits.update({f"{key.name}:{graph}": count - previous.get(graph, 0)
                         for graph, count in now["key_hits"].items() if count > previous.get(graph, 0)})
            captured += [f"{key.name}:{graph}" for graph in now["captured_keys"]]
            failed.update({f"{key.name}:{graph}": why for graph, why in now["failed_keys"].items()})
            backends.append(now["backend"])
        total = merged["real_tokens"] + merged["padded_tokens"]
        return {**merged, **{name: dict(value) for name, value in counted.items()}, "key_hits": hits,
                "captured_keys": captured, "failed_keys": failed,
                "padding_waste": merged["padded_tokens"] / total if total else 0.0,
                "backend": backends[0] if backends else self.graph_backend,
                "runners": [key.name for key in sorted(self.used, key=lambda used: used.name)],
                "decode_widths": sorted(self.widths_used), "capture": self.capture_summary()}


__all__ = ["EngineRunners", "MIN_WIDTH", "RunnerKey", "decode_widths"]
