"""GraphedCallable: graph capture/replay for any callable of tensors (what ``wrap()`` returns).

The first call fixes the signature: tensors whose first dimension is the batch are padded into
static buffers; every other tensor must keep its shape, dtype and device (it is copied into a
static buffer each call); non-tensor arguments must equal the first call's values. A call that
differs runs eagerly with reason ``shape_mismatch``.

Like torch.compile's CUDA-graph trees, graphs are captured on real calls and nothing runs
twice: the first ``warmup_iters`` calls of a padded size run ``fn`` eagerly as those calls'
real steps, the next one records on its own staged inputs (every write the recording makes
undone) and replays once to return its output, and later calls replay.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .backends import graphs_disabled_by_env, make_backend, resolve_backend_name, resolve_device
from .batch import ForwardMode, debug_enabled
from .buffers import BufferSpec, InputBufferManager, InputSlot, RowAxis, StagingPlan
from .dispatcher import EagerReason, GraphDispatcher
from .registry import CaptureReport, GraphEntry, GraphKey, GraphRegistry
from .sizes import SizeGrid, default_capture_sizes, normalize_capture_sizes
from .stats import RuntimeStats

MODE = ForwardMode.DECODE


class ArgKind(enum.Enum):
    """How one argument is treated: padded batch rows, a whole static tensor, or a constant."""

    BATCHED = "batched"
    FIXED = "fixed"
    CONSTANT = "constant"


@dataclass
class ArgSpec:
    """The captured form of one argument (positional index or keyword name)."""

    name: Union[int, str]
    kind: ArgKind
    slot: Optional[InputSlot] = None
    value: Any = None

    def matches(self, value: Any) -> bool:
        """Metadata-only check that ``value`` can be staged into this argument's slot."""
        if self.kind is ArgKind.CONSTANT:
            return not isinstance(value, torch.Tensor) and type(value) is type(self.value) and value == self.value
        static = self.slot.tensor
        if not isinstance(value, torch.Tensor) or value.dtype != static.dtype or value.device != static.device:
            return False
        if self.kind is ArgKind.FIXED:
            return value.shape == static.shape
        return value.dim() == static.dim() and value.shape[1:] == static.shape[1:]


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
    ) -> None:
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
        self.stats_counters = RuntimeStats()
        self.registry = GraphRegistry(make_backend(self.backend_name, resolve_device(requested, None)), warmup_iters)
        self.dispatcher = GraphDispatcher(
            self.registry, self.stats_counters, copy_outputs, debug_enabled() if debug is None else debug
        )
        self.buffers: Optional[InputBufferManager] = None
        self.positional: List[ArgSpec] = []
        self.keywords: Dict[str, ArgSpec] = {}
        self._batched: List[ArgSpec] = []
        self._staged: List[ArgSpec] = []
        self._plan = StagingPlan(())
        self._lock = threading.Lock()

    def capture(self, *args: Any, **kwargs: Any) -> CaptureReport:
        """Fix the signature from these example arguments and capture every size up front.

        Each size warms up and records on the example's rows (padded, or cut to the size);
        every write to the model's tensors is undone, so the model's state is as before.
        """
        with self._lock:
            if self.buffers is None:
                self._record_signature(args, kwargs)
            elif self._match(args, kwargs)[1] is not None:
                raise ValueError("args: expected the signature of the first call (same kinds, shapes and constants)")
            if self.backend_name == "eager":
                return CaptureReport()
            rows = self._batch_rows(args, kwargs)

            def stage_example(entry: GraphEntry) -> None:
                size = min(rows, entry.key.num_tokens)
                self._stage(args, kwargs, size, lambda value: value[:size])

            return self.registry.capture_all(self._make_callable, stage_example, progress=self.progress)

    def _record_signature(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        tensors = [value for value in list(args) + list(kwargs.values()) if isinstance(value, torch.Tensor) and value.dim()]
        if not tensors:
            raise ValueError("args: expected at least one tensor whose first dimension is the batch")
        batch_size = tensors[0].shape[0]
        self.buffers = InputBufferManager(max_batch_size=self.max_batch_size, register_defaults=False)
        self.positional = [self._arg_spec(index, value, batch_size) for index, value in enumerate(args)]
        self.keywords = {name: self._arg_spec(name, value, batch_size) for name, value in kwargs.items()}
        specs = self.positional + list(self.keywords.values())
        self._batched = [spec for spec in specs if spec.kind is ArgKind.BATCHED]
        self._staged = [spec for spec in specs if spec.slot is not None]
        self._plan = StagingPlan([spec.slot for spec in self._staged])
        if self.backend_name != "eager":
            self.registry.add_grid(MODE, SizeGrid.for_decode(self.capture_sizes), self._static_arguments)

    def _arg_spec(self, name: Union[int, str], value: Any, batch_size: int) -> ArgSpec:
        if not isinstance(value, torch.Tensor):
            return ArgSpec(name, ArgKind.CONSTANT, value=value)
        batched = value.dim() > 0 and value.shape[0] == batch_size
        shape = (self.max_batch_size, *value.shape[1:]) if batched else tuple(value.shape)
        slot = self.buffers.register_slot(
            f"arg_{name}", BufferSpec(shape, value.dtype, value.device),
            axis=RowAxis.TOKENS if batched else RowAxis.FIXED,
        )
        return ArgSpec(name, ArgKind.BATCHED if batched else ArgKind.FIXED, slot=slot)

    def _static_arguments(self, key: GraphKey) -> Tuple[list, dict]:
        def static(spec: ArgSpec) -> Any:
            return spec.value if spec.slot is None else spec.slot.view(key.num_tokens)

        return [static(spec) for spec in self.positional], {name: static(spec) for name, spec in self.keywords.items()}

    def _make_callable(self, entry: GraphEntry) -> Callable[[], Any]:
        args, kwargs = entry.inputs
        return lambda: self.fn(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the graph of the smallest captured size that fits, else run ``fn`` eagerly."""
        with self._lock:
            if self.buffers is None:
                self._record_signature(args, kwargs)
            batch_size, reason = self._match(args, kwargs)
            if batch_size:
                self.stats_counters.record_size(MODE, batch_size)
            if reason is None:
                decision = self.dispatcher.lookup(MODE, batch_size, batch_size)
                reason = decision.reason
                if reason is EagerReason.NOT_CAPTURED:
                    return self._warm_up_or_record(decision.entry, batch_size, args, kwargs)
            if reason is not None:
                return self._run_eager(reason, batch_size, args, kwargs)
            self._stage(args, kwargs, batch_size)
            return self.dispatcher.replay(decision.entry, batch_size, batch_size)

    def _warm_up_or_record(self, entry: GraphEntry, batch_size: int, args: tuple, kwargs: dict) -> Any:
        """A size's first calls are its warm-up, run eagerly as the real step; the next records
        on its staged inputs (the recording's writes undone) and replays once for its output."""
        warm_calls = self._warm_calls.get(entry.key, 0)
        if warm_calls < self.warmup_iters:
            self._warm_calls[entry.key] = warm_calls + 1
            with self.registry.backend.warmup_context():
                return self._run_eager(EagerReason.WARMUP, batch_size, args, kwargs)
        self._stage(args, kwargs, batch_size)
        with self.registry.backend.capture_session():
            captured = self.registry.capture_entry(entry, self._make_callable(entry), warmup_iters=0)
        if not captured:
            return self._run_eager(EagerReason.CAPTURE_FAILED, batch_size, args, kwargs)
        return self.dispatcher.replay(entry, batch_size, batch_size)

    def _run_eager(self, reason: EagerReason, batch_size: int, args: tuple, kwargs: dict) -> Any:
        self.stats_counters.record_eager(reason.value, batch_size)
        with torch.no_grad():
            return self.fn(*args, **kwargs)

    def _stage(self, args: tuple, kwargs: dict, rows: int, cut: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Copy the call's tensors into the static slots (batched ones padded above ``rows``)."""
        live = [args[spec.name] if isinstance(spec.name, int) else kwargs[spec.name] for spec in self._staged]
        if cut is not None:
            live = [cut(value) if spec.kind is ArgKind.BATCHED else value for spec, value in zip(self._staged, live)]
        self._plan.stage(live, rows, rows)

    def _batch_rows(self, args: tuple, kwargs: dict) -> int:
        spec = self._batched[0]
        return (args[spec.name] if isinstance(spec.name, int) else kwargs[spec.name]).shape[0]

    def _match(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, Optional[EagerReason]]:
        """The batch size, and SHAPE_MISMATCH when the call differs from the captured signature."""
        if len(args) != len(self.positional) or kwargs.keys() != self.keywords.keys():
            return 0, EagerReason.SHAPE_MISMATCH
        batch_size = None
        for spec in self._batched:
            value = args[spec.name] if isinstance(spec.name, int) else kwargs[spec.name]
            rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else None
            if rows is None or batch_size not in (None, rows):
                return 0, EagerReason.SHAPE_MISMATCH
            batch_size = rows
        if self.backend_name == "eager":
            return batch_size, EagerReason.GRAPHS_DISABLED
        if not all(spec.matches(value) for spec, value in zip(self.positional, args)):
            return batch_size, EagerReason.SHAPE_MISMATCH
        if not all(spec.matches(kwargs[name]) for name, spec in self.keywords.items()):
            return batch_size, EagerReason.SHAPE_MISMATCH
        return batch_size, None

    def stats(self) -> Dict[str, Any]:
        """Same counters as GraphRunner.stats()."""
        result = self.stats_counters.as_dict()
        result["backend"] = self.backend_name
        result.update(self.registry.summary())
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
