"""GraphedCallable: graph capture/replay for any callable of tensors (what ``wrap()`` returns).

Arguments are pytrees: tensors nested in tuples, lists, dicts and dataclasses are staged into
static slots; the batch size of a call is dim 0 of its first tensor, and every other tensor is
padded along the dim that carries the batch, or kept whole (graphrt.layout.call_signature). Outputs
are cut to the real rows along the batch axis each one was seen to have (graphrt.layout.batch_axes).
A call that differs from the captured signature runs eagerly with reason ``shape_mismatch``.

Like torch.compile's CUDA-graph trees, graphs are captured on real calls and nothing runs
twice: the first ``warmup_iters`` calls of a padded size run ``fn`` eagerly as those calls'
real steps, the next one records on its own staged inputs (every write the recording makes
undone) and replays once to return its output, and later calls replay. A padded call before
any output was seen at another size runs eagerly once (``axis_probe``): its output shapes show
which dim of each output is the batch.

Graphs are for inference: with grad mode on and an input that requires grad, the call runs
eagerly (``autograd``) so gradients flow; replays never record autograd.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graphrt.backends import graphs_disabled_by_env, make_backend, resolve_backend_name, resolve_device
from graphrt.backends.compiled import refuse_compiled_cudagraphs
from graphrt.batch import ForwardMode, debug_enabled
from graphrt.dispatch import OutputCutter
from graphrt.layout.call_signature import CallSignature, StaticCall
from graphrt.layout.rebind_guard import RebindGuard
from graphrt.registry import STATUS_REASONS, CaptureReport, EagerReason, GraphEntry, GraphKey, GraphRegistry
from graphrt.sizes import SizeGrid, default_capture_sizes, normalize_capture_sizes
from graphrt.stats import RuntimeStats

logger = logging.getLogger(__name__)

MODE = ForwardMode.DECODE
_OBSERVED_EAGER = (EagerReason.WARMUP, EagerReason.AXIS_PROBE)  # eager runs whose output shapes are evidence


class GraphedCallable:
    """``fn(*args, **kwargs)`` replayed from graphs captured per padded batch size."""

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
    ) -> None:
        refuse_compiled_cudagraphs(fn, "fn")
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.capture_sizes = (
            default_capture_sizes(max_batch_size) if capture_sizes is None
            else normalize_capture_sizes(capture_sizes, max_batch_size)
        )
        requested = resolve_backend_name(backend)
        self.backend_name = "eager" if graphs_disabled_by_env() else requested
        self.progress = progress
        self.warmup_iters = warmup_iters
        self._warm_calls: Dict[GraphKey, int] = {}
        self._stats = RuntimeStats()
        self.registry = GraphRegistry(make_backend(self.backend_name, resolve_device(requested, None)), warmup_iters, verify)
        self.outputs = OutputCutter(self.registry, copy_outputs, debug_enabled() if debug is None else debug)
        self.signature: Optional[CallSignature] = None
        self.signature_changes = 0
        self._mismatch_logged = False
        self._grad_warned = False
        self._lock = threading.Lock()

    # ---- signature ------------------------------------------------------------------------------

    def _adopt(self, signature: CallSignature) -> CallSignature:
        """Use ``signature`` from now on: graphs of an earlier one are dropped and captured again."""
        if self.signature is not None:
            self.signature_changes += 1
            logger.info("wrap(): argument layout is now %s; graphs are captured again", signature.layout())
        self.signature = signature
        self._mismatch_logged = False
        self.registry.clear()
        self._warm_calls.clear()
        if self.backend_name != "eager":
            self.registry.add_grid(MODE, SizeGrid.for_decode(self.capture_sizes), self._make_entry)
        return signature

    def _make_entry(self, key: GraphKey) -> GraphEntry[StaticCall]:
        """A key's entry: the static-slot arguments its graph reads, and ``fn`` on them (guarded
        against rebinding the state of object arguments, which may be returned as they are)."""
        static = self.signature.static_arguments(key.num_tokens)
        objects = self.signature.objects

        def step() -> Any:
            if not objects:
                return self.fn(*static.args, **static.kwargs)
            with RebindGuard(objects):
                return self.fn(*static.args, **static.kwargs)

        return GraphEntry(key, static, step, passthrough=frozenset(id(obj) for _, obj in objects))

    def _call_layout(self, args: tuple, kwargs: dict) -> Tuple[CallSignature, List[Any], int, bool]:
        """The signature for this call (a refined one if the call decides a batch axis), the call's
        leaves, its batch size, and whether it matches."""
        signature = self.signature or self._adopt(CallSignature.first_call(args, kwargs, self.max_batch_size))
        leaves, structure = signature.flatten(args, kwargs)
        batch_size, matched = signature.match(leaves, structure)
        if matched:
            if signature.tentative:
                signature.confirm(leaves, structure)
            return signature, leaves, batch_size, True
        refined = signature.refine(leaves, structure)
        if refined is None:
            if not self._mismatch_logged:  # once per signature: why calls like this one run eagerly
                self._mismatch_logged = True
                why = signature.describe_mismatch(leaves, structure)
                logger.info("wrap(): call runs eagerly (shape_mismatch): %s", why)
            return signature, leaves, batch_size, False
        signature = self._adopt(refined)
        batch_size, matched = signature.match(leaves, structure)
        return signature, leaves, batch_size, matched

    # ---- capture ----------------------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> CaptureReport:
        """Fix the signature from these example arguments and capture every size up front.

        Each size warms up and records on the example's rows (padded, or cut to the size);
        every write to the model's tensors is undone, so the model's state is as before.
        """
        with self._lock:
            signature, leaves, rows, matched = self._call_layout(args, kwargs)
            if not matched:
                raise ValueError(signature.describe_mismatch(*signature.flatten(args, kwargs)))
            if self.backend_name == "eager":
                return CaptureReport()
            if signature.tentative and any(size != rows for size in self.capture_sizes):
                ambiguous = [path for path, axis in signature.layout().items() if axis.endswith("?")]
                raise ValueError(f"{ambiguous[0]}: the batch size {rows} is the size of several of its dims, so "
                                 "padding it would be a guess; capture with an example whose batch size differs "
                                 "from its other dims")

            def stage_example(entry: GraphEntry) -> None:
                signature.stage(leaves, min(rows, entry.key.num_tokens), cut=True)

            return self.registry.capture_all(stage_example, progress=self.progress)

    # ---- per call ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of the smallest captured size that fits, else run ``fn`` eagerly."""
        with self._lock:
            signature, leaves, batch_size, matched = self._call_layout(args, kwargs)
            if batch_size:
                self._stats.record_size(MODE, batch_size)
            if torch.is_grad_enabled():
                if any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves):
                    return self._run_eager(EagerReason.AUTOGRAD, batch_size, args, kwargs)
                self._warn_grad_mode()
            if not matched:
                return self._run_eager(EagerReason.SHAPE_MISMATCH, batch_size, args, kwargs)
            if self.backend_name == "eager":
                return self._run_eager(EagerReason.GRAPHS_DISABLED, batch_size, args, kwargs)
            decision = self.outputs.lookup(MODE, batch_size, batch_size)
            reason = decision.reason
            if signature.tentative and decision.entry is not None and batch_size != decision.entry.key.num_tokens:
                reason = EagerReason.AMBIGUOUS_BATCH_AXIS
            elif reason is EagerReason.NOT_CAPTURED:
                return self._warm_up_or_record(decision.entry, batch_size, leaves, args, kwargs)
            if reason is not None:
                return self._run_eager(reason, batch_size, args, kwargs)
            return self._replay(decision.entry, leaves, batch_size)

    def _replay(self, entry: GraphEntry[StaticCall], leaves: List[Any], batch_size: int) -> Any:
        """Stage the call's tensors into the static slots, replay, cut the real rows, count."""
        self.signature.stage(leaves, batch_size)
        entry.graph.replay()
        outputs = self.outputs.cut(entry, batch_size, batch_size)
        entry.hits += 1
        self._stats.record_graph(batch_size, entry.key.num_tokens)
        return outputs

    def _warm_up_or_record(
        self, entry: GraphEntry, batch_size: int, leaves: List[Any], args: tuple, kwargs: dict
    ) -> Any:
        """A size's first calls are its warm-up, run eagerly as the real step; the next records
        on its staged inputs (the recording's writes undone) and replays once for its output."""
        warm_calls = self._warm_calls.get(entry.key, 0)
        if warm_calls < self.warmup_iters:
            self._warm_calls[entry.key] = warm_calls + 1
            with self.registry.backend.warmup_context():
                return self._run_eager(EagerReason.WARMUP, batch_size, args, kwargs)
        padded = entry.key.num_tokens
        if batch_size != padded and not self.outputs.axes.seen_other_size(MODE, padded, padded):
            # Recording now could not tell which output dims to cut: learn them from this real step.
            return self._run_eager(EagerReason.AXIS_PROBE, batch_size, args, kwargs)
        self.signature.stage(leaves, batch_size)
        with self.registry.backend.capture_session():
            captured = self.registry.capture_entry(entry, warmup_iters=0)
        if not captured:  # capture_failed, or verify_failed
            return self._run_eager(STATUS_REASONS[entry.status], batch_size, args, kwargs)
        decision = self.outputs.lookup(MODE, batch_size, batch_size)
        if decision.reason is not None:  # outputs that cannot be cut; the recording's writes were undone
            return self._run_eager(decision.reason, batch_size, args, kwargs)
        return self._replay(entry, leaves, batch_size)

    def _run_eager(self, reason: EagerReason, batch_size: int, args: tuple, kwargs: dict) -> Any:
        self._stats.record_eager(reason, batch_size)
        if reason is EagerReason.AUTOGRAD:
            return self.fn(*args, **kwargs)
        with torch.no_grad():
            outputs = self.fn(*args, **kwargs)
        if reason in _OBSERVED_EAGER:
            self.outputs.observe_eager(MODE, batch_size, batch_size, outputs)
        return outputs

    def _warn_grad_mode(self) -> None:
        if not self._grad_warned:
            self._grad_warned = True
            logger.info("wrap(): called with grad mode on: outputs of graph replays carry no autograd history "
                           "(graphs are for inference); call it under torch.inference_mode() or torch.no_grad()")

    def stats(self) -> Dict[str, Any]:
        """Same counters as GraphRunner.stats(), plus the argument layout wrap() inferred."""
        result = self._stats.as_dict()
        result["backend"] = self.backend_name
        result.update(self.registry.summary())
        result["uncut_outputs"] = dict(self.outputs.uncut_outputs)
        result["arg_layout"] = self.signature.layout() if self.signature is not None else {}
        result["signature_changes"] = self.signature_changes
        return result


def wrap(
    fn: Callable[..., Any],
    max_batch_size: int,
    capture_sizes: Optional[Sequence[int]] = None,
    backend: str = "auto",
    **options: Any,
) -> GraphedCallable:
    """Graph ``fn`` for batch sizes up to ``max_batch_size``; captures lazily on the first call."""
    return GraphedCallable(fn, max_batch_size, capture_sizes, backend, **options)
