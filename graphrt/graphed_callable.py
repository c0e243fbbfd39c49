"""GraphedCallable: graph capture/replay for any callable of tensors (what ``wrap()`` returns).

Arguments are pytrees: tensors nested in tuples, lists, dicts and dataclasses are staged into
static slots; the batch size of a call is dim 0 of its first tensor, and every other tensor is
padded along the dim that carries the batch, or kept whole (graphrt.layout.call_signature). Outputs
are cut to the real rows along the batch axis each one was seen to have (graphrt.layout.batch_axes).
Each call layout (argument structure, non-batch dims, dtypes, constants) gets graphs of its own
(graphrt.layout.layout_table): Hugging Face ``generate()`` calls ``forward`` with one layout for
the prefill and another for every decode step. At most ``max_signatures`` layouts hold graphs
(the least recently used is dropped); calls whose layout changes on every call run eagerly
(``shape_mismatch``, explained in ``stats()["layout_churn"]``).

Like torch.compile's CUDA-graph trees, graphs are captured on real calls and nothing runs
twice: the first ``warmup_iters`` calls of a padded size run ``fn`` eagerly as those calls'
real steps, the next one records on its own staged inputs (every write the recording makes
undone) and replays once to return its output, and later calls replay. A padded call before
any output was seen at another size runs eagerly once (``axis_probe``): its output shapes show
which dim of each output is the batch.

A padded size whose capture fails (the model's own state is sized to the real batch, such as a
StaticCache made for 3 rows) is recorded once more at the call's own size, a key of its own;
other sizes padded to that failed key get keys of their own too.

Graphs are for inference: with grad mode on and an input that requires grad, the call runs
eagerly (``autograd``) so gradients flow; replays never record autograd.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from graphrt.backends import (
    graphs_disabled_by_env, make_backend, refuse_compiled_cudagraphs, resolve_backend_name, resolve_device, step_lock,
)
from graphrt.backends.compiled import describe_callable, eager_stance, is_compiled, opaque_to_dynamo
from graphrt.outside_reads import OutsideReads, refuse_changed_reads
from graphrt.backends.state_journal import storage_key
from graphrt.backends.torchscript import refuse_torchscript
from graphrt.batch import ForwardMode, debug_enabled
from graphrt.capture import CaptureReport, KeyCapture
from graphrt.entry import EagerReason, GraphEntry, GraphKey, KeyKind, replay_or_eager
from graphrt.guards import RECURRING, GuardFailure, GuardSpec, StateWatch
from graphrt.layout.call_signature import CallSignature, StaticCall
from graphrt.layout.layout_table import Layout, LayoutTable
from graphrt.layout.signature_stager import SignatureStager
from graphrt.layout.wrapped_module import through_wrapper
from graphrt.pad_values import checked_pad_values, positional_names
from graphrt.padding_rows import PaddingCheck
from graphrt.registry import STATUS_REASONS, GraphRegistry, merged_summary
from graphrt.sizes import SizeGrid, default_capture_sizes, normalize_capture_sizes
from graphrt.stats import RuntimeStats

logger = logging.getLogger(__name__)

MODE = ForwardMode.DECODE
_OBSERVED_EAGER = (EagerReason.WARMUP, EagerReason.AXIS_PROBE)  # eager runs whose output shapes are evidence
MAX_SIGNATURES = 8  # layouts holding graphs, as torch.compile's recompile_limit
CHURN_LIMIT = 4  # layouts of one family opened in a row without a recording before it runs eagerly


@dataclass(eq=False)
class LayoutGraphs:
    """What one call layout holds: its keys' graphs, warm-up counts, and whether ``fn``'s eager
    outputs for it carry autograd history in grad mode (None: not seen yet)."""

    registry: GraphRegistry
    capture: Optional[KeyCapture]  # through the backend of the layout's device (None: graphs are off)
    warm_calls: Dict[GraphKey, int] = field(default_factory=dict)
    autograd: Optional[bool] = None
    off_reason: EagerReason = EagerReason.GRAPHS_DISABLED  # why calls run eagerly while ``capture`` is None
    exact_sizes: Optional[str] = None  # why every call size gets a key of its own (padding rows write state)
    outside_reads: Optional[List[Any]] = None  # what the last warm-up read outside its arguments (OutsideReads)


class GraphedCallable:
    """``fn(*args, **kwargs)`` replayed from graphs captured per call layout and padded batch size."""

    def __init__(
        self,
        fn: Callable[..., Any],
        max_batch_size: int,
        capture_sizes: Optional[Sequence[int]] = None,
        backend: str = "auto",
        warmup_iters: int = 1,
        copy_outputs: bool = False,
        progress: bool = False,
        debug: Optional[bool] = None,
        verify: bool = True,
        max_signatures: int = MAX_SIGNATURES,
        pad_values: Optional[Mapping[str, float]] = None,
        scratch_state: Sequence[torch.Tensor] = (),
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn: expected a callable (a function or module of tensors), got {type(fn).__name__}")
        refuse_compiled_cudagraphs(fn, "fn")
        refuse_torchscript(fn, "fn")
        self.fn = fn
        self.wraps = describe_callable(fn)  # what this front wraps, in words (stats()["wraps"])
        self.__wrapped__ = fn  # inspect.signature(self) is fn's: generate() passes forward the kwargs it accepts
        self.max_batch_size = max_batch_size
        self.capture_sizes = (
            default_capture_sizes(max_batch_size) if capture_sizes is None
            else normalize_capture_sizes(capture_sizes, max_batch_size)
        )
        resolve_backend_name(backend)  # an unknown name is refused here, before any call
        self.requested_backend = "eager" if graphs_disabled_by_env() else backend
        self.backend_name = resolve_backend_name(self.requested_backend)  # until a call shows its tensors' device
        self.progress = progress
        self.warmup_iters = warmup_iters
        self.copy_outputs = copy_outputs
        self.debug = debug_enabled() if debug is None else debug
        self._stats = RuntimeStats()
        self.verify = verify
        self._captures: Dict[Tuple[str, Optional[torch.device]], KeyCapture] = {}  # one backend (pool) per device
        if not isinstance(max_signatures, int) or isinstance(max_signatures, bool):
            raise TypeError(f"max_signatures: expected an int >= 1, got {max_signatures!r}")
        self.layouts: LayoutTable[LayoutGraphs] = LayoutTable(
            max_batch_size, max_signatures, CHURN_LIMIT, self._graphs_for, self._drop_graphs)
        self._grad_warned = False
        self._watch = StateWatch()
        self._variants = 0  # Python states seen (wrap() keeps layouts per state: StateWatch.variant)
        self._rebound_early: Set[int] = set()  # layouts whose last graphs were renewed after few replays
        self._positional_names = positional_names(fn)
        self.pad_values = checked_pad_values(pad_values, fn)
        if not all(isinstance(tensor, torch.Tensor) for tensor in scratch_state):
            raise TypeError("scratch_state: expected a sequence of tensors (state the padding rows may write)")
        self.scratch_storages = {storage_key(tensor) for tensor in scratch_state}  # padding rows may write these
        self._padding_warned: Set[str] = set()
        self._lock = threading.Lock()  # set last: from here on, unknown attributes are set on a wrapped module

    # ---- the wrapped object's attributes ------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """An attribute the wrapper lacks is ``fn``'s (``fast.compute_logits(...)`` of a wrapped
        module, a wrapped bound method's ``__self__``), as torch.compile's OptimizedModule passes
        attribute access to its module. Only called when normal lookup fails: no per-call cost."""
        try:
            fn = self.__dict__["fn"]
        except KeyError:  # during __init__, or an unpickled shell
            raise AttributeError(name) from None
        value = getattr(fn, name)
        if isinstance(fn, torch.nn.Module) and getattr(value, "__self__", None) is fn:
            # fast.cuda() is the wrapper, moved with its scratch state, not the bare module (the H200 session)
            return through_wrapper(self, fn, value, self.__dict__["scratch_storages"])
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        """Once built, setting an attribute the wrapper does not have sets it on a wrapped module
        (``fast.k_cache = ...`` as on the module itself), as OptimizedModule does."""
        if (isinstance(self.__dict__.get("fn"), torch.nn.Module) and "_lock" in self.__dict__
                and name not in self.__dict__ and not hasattr(type(self), name)):
            setattr(self.fn, name, value)
        else:
            object.__setattr__(self, name, value)

    # ---- layouts ----------------------------------------------------------------------------------

    @property
    def signature(self) -> Optional[CallSignature]:
        """The signature of the layout used last (None before the first call)."""
        current = self.layouts.current
        return None if current is None else current.signature

    def _graphs_for(self, signature: CallSignature) -> LayoutGraphs:
        """A new layout's registry (one key per capture size, pending), captured through the backend
        of the device its tensors live on."""
        signature.name_arguments(self._positional_names)
        if self.pad_values:
            signature.set_pad_values(self.pad_values)
        off_reason = signature.eager_reason
        capture = None if off_reason else self._capture_for(signature.leaves[signature.batch_leaf].device)
        registry = GraphRegistry(self.copy_outputs, self.debug, None if capture is None else capture.pool_replays)
        if capture is not None:
            stager = SignatureStager(signature)
            registry.add_grid(MODE, SizeGrid.for_decode(self.capture_sizes),
                              lambda key: self._make_entry(signature, stager, key), KeyKind.CALL)
        graphs = LayoutGraphs(registry, capture)
        if off_reason:
            graphs.off_reason = EagerReason(off_reason)
            logger.info("wrap(): calls of layout %s run eagerly (%s)", signature.layout(), off_reason)
        return graphs

    def _capture_for(self, device: torch.device) -> Optional[KeyCapture]:
        """The capture of layouts whose tensors live on ``device``: with ``backend="auto"`` CUDA
        graphs for CUDA tensors and the emulated backend for others (a CUDA graph of CPU tensors
        would replay nothing); None when graphs are off."""
        name = resolve_backend_name(self.requested_backend, device)
        if name == "eager":
            return None
        backend_device = resolve_device(name, device if name == "cuda" and device.type == "cuda" else None)
        key = (name, backend_device)
        capture = self._captures.get(key)
        if capture is None:
            capture = self._captures[key] = KeyCapture(make_backend(name, backend_device), self.warmup_iters,
                                                       self.verify, compiled=is_compiled(self.fn))
        return capture
    @staticmethod
    def _drop_graphs(graphs: LayoutGraphs) -> None:
        """Forget a layout's graphs (their memory returns once nothing holds their tensors)."""
        graphs.registry.clear()
        graphs.warm_calls.clear()

    def _make_entry(self, signature: CallSignature, stager: SignatureStager,
                    key: GraphKey) -> GraphEntry[Optional[StaticCall]]:
        """A key's entry: ``fn`` on the static-slot arguments its graph reads (set by
        ``_static_inputs`` before its first recording), guarded against rebinding the state of
        object arguments, which may be returned as they are."""
        objects = signature.objects

        def step() -> Any:
            static = entry.static_inputs
            return self.fn(*static.args, **static.kwargs)

        entry = GraphEntry(key, None, step, passthrough=frozenset(id(obj) for _, obj in objects), stager=stager,
                           count=self._stats.record_graph,
                           guard_spec=GuardSpec(self._watch, objects, self.fn))
        return entry

    @staticmethod
    def _static_inputs(signature: CallSignature, entry: GraphEntry[Optional[StaticCall]]) -> None:
        """Point ``entry`` at its views of the static slots (allocated by the first recording that
        needs them, so a layout that only warms up holds no static memory)."""
        if entry.static_inputs is None:
            entry.static_inputs = signature.static_arguments(entry.key.num_tokens)

    # ---- capture ----------------------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> CaptureReport:
        """Capture every size of these example arguments' layout up front.

        Each size warms up and records on the example's rows (padded, or cut to the size);
        every write to the model's tensors is undone, so the model's state is as before.
        """
        with self._lock:
            layout, leaves, rows = self.layouts.find(args, kwargs, self._watch.token())
            if layout is None:
                raise ValueError("args: no new layout is opened for calls like this example: "
                                 + "; ".join(self.layouts.churn.values()))
            if layout.graphs.capture is None:
                return CaptureReport()
            signature = layout.signature
            if signature.tentative and any(size != rows for size in self.capture_sizes):
                ambiguous = [path for path, axis in signature.layout().items() if axis.endswith("?")]
                raise ValueError(f"{ambiguous[0]}: the batch size {rows} is the size of several of its dims, so "
                                 "padding it would be a guess; capture with an example whose batch size differs "
                                 "from its other dims")

            def stage_example(entry: GraphEntry) -> Optional[PaddingCheck]:
                checks = self._padding_check(layout, entry, leaves, rows)
                if checks is None:
                    signature.stage(leaves, min(rows, entry.key.num_tokens), cut=True)
                self._static_inputs(signature, entry)
                return checks

            report = layout.graphs.capture.capture_all(layout.graphs.registry, stage_example, progress=self.progress)
            if report.ok:
                self.layouts.recorded(layout)
                self._learn_autograd(layout)
            return report

    # ---- per call ---------------------------------------------------------------------------------

    @opaque_to_dynamo  # torch.compile around a wrapped function breaks its graph here: graphs replay
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of the call's layout at the smallest captured size that fits, else run ``fn`` eagerly."""
        with step_lock(self._lock):  # no step while another thread captures, where torch needs it
            return self._call(args, kwargs, True)

    def _call(self, args: tuple, kwargs: dict, may_switch: bool) -> Any:
        """One call (the lock held); ``may_switch``: a guard failure of a Python state that may have
        been seen before switches to that state's layouts and dispatches the call once more."""
        state = self._watch.token()
        layout, leaves, batch_size = self.layouts.find(args, kwargs, state)
        if batch_size:
            self._stats.record_size(MODE, batch_size)
        autograd = torch.is_grad_enabled()
        if autograd and requires_grad(leaves):
            return self._run_eager(EagerReason.AUTOGRAD, layout, batch_size, args, kwargs)
        if layout is None:
            return self._run_eager(EagerReason.SHAPE_MISMATCH, layout, batch_size, args, kwargs)
        graphs = layout.graphs
        if graphs.capture is None:
            return self._run_eager(graphs.off_reason, layout, batch_size, args, kwargs)
        if autograd and graphs.autograd:  # eager outputs carry history (parameters that require grad)
            return self._run_eager(EagerReason.AUTOGRAD, layout, batch_size, args, kwargs)
        decision = graphs.registry.lookup(MODE, batch_size, batch_size, KeyKind.CALL)
        reason = decision.reason
        padded = None if decision.entry is None else decision.entry.key.num_tokens
        if layout.signature.tentative and padded is not None and batch_size != padded:
            reason = EagerReason.AMBIGUOUS_BATCH_AXIS
        elif reason is EagerReason.NOT_CAPTURED:
            return self._warm_up_or_record(layout, decision.entry, state, batch_size, leaves, args, kwargs)
        elif reason is EagerReason.CAPTURE_FAILED and batch_size != padded:
            # Another size padded to a key whose capture failed: a key of its own, warmed up first.
            entry = self._exact_size_entry(layout, batch_size)
            return self._warm_up_or_record(layout, entry, state, batch_size, leaves, args, kwargs)
        if reason is not None:
            return self._run_eager(reason, layout, batch_size, args, kwargs)
        if autograd and graphs.autograd is None:  # whether eager outputs carry history: see once
            return self._run_eager(EagerReason.AUTOGRAD, layout, batch_size, args, kwargs)
        return self._replay(decision.entry, state, layout, batch_size, leaves, args, kwargs, may_switch)

    def _replay(self, entry: GraphEntry, state: Any, layout: Layout[LayoutGraphs], batch_size: int,
                leaves: List[Any], args: tuple, kwargs: dict, may_switch: bool = False) -> Any:
        """Replay ``entry`` for this call if its guard holds (graphrt.guards), else run eagerly."""
        guard = entry.guard
        if guard is not None:
            failure = guard.failure(state, entry.stager.sources, leaves, self.debug)
            if failure is not None:
                return self._guard_failed(failure, layout, batch_size, args, kwargs, may_switch)
            if torch.is_grad_enabled() and guard.reads_grad():  # requires_grad set since capture
                return self._run_eager(EagerReason.AUTOGRAD, layout, batch_size, args, kwargs)
        if not self._grad_warned and torch.is_grad_enabled():
            self._warn_grad_mode()
        return replay_or_eager(entry, leaves, batch_size, batch_size, self._run_eager, layout, batch_size, args, kwargs)

    def _warm_up_or_record(self, layout: Layout[LayoutGraphs], entry: GraphEntry, state: Any, batch_size: int,
                           leaves: List[Any], args: tuple, kwargs: dict) -> Any:
        """A size's first calls are its warm-up, run eagerly as the real step; the next records
        on its staged inputs (the recording's writes undone) and replays once for its output."""
        graphs = layout.graphs
        warm_calls = graphs.warm_calls.get(entry.key, 0)
        if warm_calls < self.warmup_iters:  # a real call, on the caller's stream
            outputs = self._warm_up(layout, batch_size, leaves, args, kwargs)
            graphs.warm_calls[entry.key] = warm_calls + 1  # only once it returned: a raising step never records
            return outputs
        padded = entry.key.num_tokens
        if batch_size != padded and not graphs.registry.seen_other_size(entry.key):
            # Recording now could not tell which output dims to cut: learn them from this real step.
            return self._run_eager(EagerReason.AXIS_PROBE, layout, batch_size, args, kwargs)
        if torch.is_grad_enabled() and graphs.autograd is None:  # whether eager outputs carry history: see once
            return self._run_eager(EagerReason.AUTOGRAD, layout, batch_size, args, kwargs)
        captured = self._record(layout, entry, leaves, batch_size)
        if batch_size != padded and entry.refused is None and (not captured or graphs.exact_sizes is not None):
            # The padded key failed, or its padding was refused: the call's own size records now.
            entry = self._exact_size_entry(layout, batch_size)
            captured = self._record(layout, entry, leaves, batch_size)
        if entry.refused is not None:  # the step, not the size: no key of this layout can hold it
            graphs.capture, graphs.off_reason = None, EagerReason.CAPTURE_FAILED
        if not captured:  # capture_failed, or verify_failed
            return self._run_eager(STATUS_REASONS[entry.status], layout, batch_size, args, kwargs)
        self.layouts.recorded(layout)
        self._learn_autograd(layout)
        decision = graphs.registry.lookup(MODE, batch_size, batch_size, KeyKind.CALL)
        if decision.reason is not None:  # outputs that cannot be cut; the recording's writes were undone
            return self._run_eager(decision.reason, layout, batch_size, args, kwargs)
        return self._replay(entry, state, layout, batch_size, leaves, args, kwargs)

    def _warm_up(self, layout: Layout[LayoutGraphs], batch_size: int, leaves: List[Any], args: tuple,
                 kwargs: dict) -> Any:
        """A warm-up: ``fn`` on the call, eagerly, noting the tensors it reads from outside its
        arguments (graphrt.outside_reads), which the next recording compares with its own.
        A compiled ``fn`` runs without the note (it compiles here, with no dispatch mode active); a
        compiled part of ``fn`` runs its eager code under the note, which Dynamo would skip for good."""
        if is_compiled(self.fn):
            return self._run_eager(EagerReason.WARMUP, layout, batch_size, args, kwargs)
        reads = OutsideReads({storage_key(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.numel()})
        with eager_stance(), reads:
            outputs = self._run_eager(EagerReason.WARMUP, layout, batch_size, args, kwargs)
        layout.graphs.outside_reads = reads.reads
        return outputs

    def _guard_failed(self, failure: GuardFailure, layout: Layout[LayoutGraphs], batch_size: int, args: tuple,
                      kwargs: dict, may_switch: bool = False) -> Any:
        """A key's guard failed. A Python state that can come back (``training``, an attribute, the
        hooks: ``RECURRING``) switches the calls to that state's layouts, those of a state seen before
        whose guards hold now or new ones, and dispatches this call there. A rebound tensor or module,
        or a move, gives the layout fresh graphs, recorded on later calls on what is bound now (a one-off
        rebinding, whenever it happens: ``load_state_dict(assign=True)``, a replaced head), unless its
        graphs were renewed so twice in a row after fewer than ``CHURN_LIMIT`` replays each (the binding
        changes every few calls, as beam search's cache reorder does): then its calls run eagerly from
        now on. Other failures run this call eagerly with the failure's reason."""
        reason = EagerReason(failure.reason)
        self._stats.record_guard_failure(f"{failure.reason}: {failure.detail}")
        if failure.reason in RECURRING and may_switch:
            self._switch_state(layout)
            return self._call(args, kwargs, False)
        if reason in (EagerReason.REBOUND_STATE, EagerReason.MODULE_MOVED):
            graphs = layout.graphs
            replays = sum(entry.hits for entry in graphs.registry.entries.values())
            if replays >= CHURN_LIMIT or layout.number not in self._rebound_early:
                logger.info("wrap(): %s; layout %d records its graphs again", failure.detail, layout.number)
                if replays < CHURN_LIMIT:
                    self._rebound_early.add(layout.number)
                else:
                    self._rebound_early.discard(layout.number)
                self.layouts.renew(layout)
            else:
                logger.warning("wrap(): %s after %d replays: the binding changes every few calls (a Hugging Face "
                               "beam search reorders its cache by rebinding; graphrt.hf.graph_generate reorders in "
                               "place), so calls of layout %d run eagerly (rebound_state)", failure.detail, replays,
                               layout.number)
                graphs.capture, graphs.off_reason = None, reason
                graphs.registry.clear()
        return self._run_eager(reason, layout, batch_size, args, kwargs)

    def _switch_state(self, layout: Layout[LayoutGraphs]) -> None:
        """Calls go to the layouts of the Python state of now: a state seen before if a captured key
        of a layout like ``layout`` (same family) holds there, else a new one (its layouts are
        opened, warmed up and recorded on the next calls, bounded by ``max_signatures``)."""
        family = layout.signature.family()
        for other in reversed(self.layouts.layouts.values()):
            if other is layout or other.state is None or other.signature.family() != family:
                continue
            guards = [entry.guard for entry in other.graphs.registry.entries.values() if entry.guard is not None]
            if guards and guards[0].holds_now():
                logger.info("wrap(): the Python state is back to that of layout %d; its graphs replay", other.number)
                self._watch.set_variant(other.state[1])
                return
        self._variants += 1
        logger.info("wrap(): Python state %d: calls get graphs of their own", self._variants)
        self._watch.set_variant(self._variants)

    def recapture(self) -> None:
        """Drop every layout's graphs: each records them again on its next calls, on the tensors
        bound now (after weights were swapped by rebinding: ``param.data = other``)."""
        with self._lock:
            for layout in list(self.layouts.layouts.values()):
                self.layouts.renew(layout)

    @staticmethod
    def _learn_autograd(layout: Layout[LayoutGraphs]) -> None:
        """A captured step that read no tensor requiring grad cannot give eager outputs autograd
        history: grad-mode calls of this layout replay without an eager call to see it."""
        if layout.graphs.autograd is None and not any(
                entry.reads_grad for entry in layout.graphs.registry.entries.values() if entry.graph is not None):
            layout.graphs.autograd = False

    def _record(self, layout: Layout[LayoutGraphs], entry: GraphEntry, leaves: List[Any], batch_size: int) -> bool:
        """Stage the call's rows and record ``entry`` on them (writes undone); True when it replays.
        A padded key that fails is not final: the call's own size gets a graph (logged as INFO)."""
        checks = self._padding_check(layout, entry, leaves, batch_size)
        if checks is None:
            layout.signature.stage(leaves, batch_size)
        self._static_inputs(layout.signature, entry)
        padded = entry.key.num_tokens
        then = "" if batch_size == padded else f"calls of {batch_size} rows get a graph at their own size"
        capture = layout.graphs.capture
        expected = layout.graphs.outside_reads  # refuse a per-call tensor read from outside (a global context)
        watch = None if expected is None else refuse_changed_reads(set(layout.signature.slot_paths()), expected,
                                                                    entry.guard_spec.roots())
        with capture.backend.capture_session():  # one warm-up at the padded shape first, its writes undone
            return capture.capture_entry(layout.graphs.registry, entry, 1, then, watch, checks)

    def _padding_check(self, layout: Layout[LayoutGraphs], entry: GraphEntry, leaves: List[Any], rows: int
                       ) -> Optional[PaddingCheck]:
        """Before ``entry``'s key first records: if smaller calls will pad to it, stage the fewest rows it
        serves (this call's first rows, pad values above) and return the check of its padding rows, which
        runs as the key's first warm-up (all its rows) and its verification (those rows): graphrt.padding_rows.
        Padding rows that write state the real rows' step does not, or return other real rows (or a step that
        cannot run at both sizes) make the layout record every size exactly, said once; the key's graph
        still serves calls of its own size. None when no check is due (the call's rows staged by the caller)."""
        graphs = layout.graphs
        size = entry.key.num_tokens
        real = min(rows, graphs.registry.smallest_padded(MODE, size, KeyKind.CALL))
        if graphs.exact_sizes is not None or real >= size:
            return None
        signature = layout.signature
        signature.stage(leaves, real, cut=True)

        def refused(why: str, error: Optional[Exception]) -> None:
            if error is None and why not in self._padding_warned:
                self._padding_warned.add(why)
                logger.warning("wrap(): %s. Calls of layout %d are recorded at their exact sizes", why, layout.number)
            graphs.exact_sizes = why
            stager = SignatureStager(signature)
            graphs.registry.add_sizes(MODE, range(1, self.max_batch_size + 1),
                                      lambda key: self._make_entry(signature, stager, key), KeyKind.CALL)

        return PaddingCheck(self.fn, signature, real, size, self.scratch_storages, entry.guard_spec.rebind_roots(),
                            refused)

    def _exact_size_entry(self, layout: Layout[LayoutGraphs], batch_size: int) -> GraphEntry:
        """A key of the call's own size, for a size whose padded key's capture failed or whose padding was refused."""
        stager = SignatureStager(layout.signature)
        return layout.graphs.registry.add_size(MODE, batch_size, lambda key: self._make_entry(layout.signature, stager,
                                                                                               key), KeyKind.CALL)

    def _run_eager(self, reason: EagerReason, layout: Optional[Layout[LayoutGraphs]], batch_size: int,
                   args: tuple, kwargs: dict) -> Any:
        """``fn`` on the caller's arguments, counted under ``reason``. In grad mode it runs with
        autograd (eager outputs carry history where eager's would) and shows whether the layout's
        outputs carry history; warm-up and probe runs show output axes."""
        self._stats.record_eager(reason, batch_size)
        if reason is EagerReason.AUTOGRAD and layout is None:
            return self.fn(*args, **kwargs)
        if torch.is_grad_enabled():
            outputs = self.fn(*args, **kwargs)
            if layout is not None:
                layout.graphs.autograd = any(isinstance(leaf, torch.Tensor) and leaf.requires_grad
                                             for leaf in tree_leaves(outputs))
        else:
            outputs = self.fn(*args, **kwargs)
        if reason in _OBSERVED_EAGER:
            layout.graphs.registry.observe_eager(GraphKey(MODE, batch_size, batch_size, KeyKind.CALL), batch_size,
                                                 batch_size, outputs)
        return outputs

    def _warn_grad_mode(self) -> None:
        """Say once that grad mode costs nothing here: the replayed outputs carry no history, as eager's would not."""
        self._grad_warned = True
        logger.info("wrap(): called with grad mode on, nothing requiring grad: calls replay (their outputs carry "
                    "no autograd history, as eager's would not)")

    def stats(self) -> Dict[str, Any]:
        """Same counters as GraphRunner.stats(), plus the argument layouts wrap() inferred.

        Keys of the first layout are named as in GraphRunner (``decode/bs=4``); those of a later
        layout ``n`` are prefixed ``layout{n}:``. ``arg_layout`` is the layout used last.
        """
        result = self._stats.as_dict()
        result["wraps"] = self.wraps
        current = self.layouts.current
        result["backend"] = self.backend_name if current is None or current.graphs.capture is None else (
            current.graphs.capture.backend.name)
        held = self.layouts.layouts.values()
        result.update(merged_summary({f"layout{layout.number}:" if layout.number else "": layout.graphs.registry
                                      for layout in held}))
        layouts = {f"layout{layout.number}": {"arg_layout": layout.signature.layout(),
                                              "captured_keys": layout.graphs.registry.summary()["captured_keys"],
                                              "static_bytes": layout.signature.static_bytes} for layout in held}
        result["arg_layout"] = self.signature.layout() if self.signature is not None else {}
        result["layouts"] = layouts
        result["signature_changes"] = self.layouts.refined
        result["layouts_dropped"] = self.layouts.dropped
        result["layout_churn"] = dict(self.layouts.churn)
        result["exact_sizes"] = {f"layout{layout.number}": layout.graphs.exact_sizes for layout in held
                                 if layout.graphs.exact_sizes is not None}
        return result


def requires_grad(leaves: List[Any]) -> bool:
    """Whether a call's leaves hold a tensor that requires grad (a loop: about half the cost of
    ``any()`` over a generator, on every grad-mode call)."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return True
    return False


def wrap(
    fn: Callable[..., Any],
    max_batch_size: int,
    capture_sizes: Optional[Sequence[int]] = None,
    backend: str = "auto",
    **options: Any,
) -> GraphedCallable:
    """Graph ``fn`` for batch sizes up to ``max_batch_size``; captures lazily on the first call."""
    return GraphedCallable(fn, max_batch_size, capture_sizes, backend, **options)
