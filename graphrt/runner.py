"""GraphRunner, the facade: wrap a model once, capture, then call it every step.

Each call validates the batch (metadata only on GPU), asks the dispatcher for a graph
key, and either stages + replays that graph or runs the model eagerly, counting why.
Calls are serialized by a lock: graphs share static buffers, so two threads replaying at
once would overwrite each other's inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from graphrt.backends import DISABLE_ENV, graphs_disabled_by_env, make_backend, resolve_backend_name, resolve_device
from graphrt.batch import ForwardBatch, ForwardMode, debug_enabled
from graphrt.check.report import CheckReport
from graphrt.check.runner_check import check_runner
from graphrt.dispatch import CONTEXT_FIELDS, EagerReason, ReplayDispatcher, output_leaves_step, static_batch_for
from graphrt.parallel.lockstep import SIZE_INDEPENDENT, Lockstep, StepAgreement, empty_batch, pad_forward_batch
from graphrt.registry import CaptureReport, GraphEntry, GraphKey, GraphRegistry
from graphrt.sizes import SizeGrid, choose_capture_sizes, default_capture_sizes, normalize_capture_sizes
from graphrt.staging import BufferSpec, InputBufferManager, RowAxis
from graphrt.stats import RuntimeStats, histogram_from, load_histogram, save_histogram
from graphrt.ubatch import UBatchConfig, UBatchWrapper

logger = logging.getLogger(__name__)

DEFAULT_PAD_VALUES = {"input_ids": 0, "positions": 0, "seq_lens": 1, "out_cache_loc": 0, "req_pool_indices": 0}
EXTEND_SLOTS = ("extend_seq_lens", "extend_prefix_lens", "extend_start_loc")


class GraphRunner:
    """Captures ``model(input_ids, positions, forward_batch)`` per padded size and replays it.

    ``capture_sizes``: decode batch sizes to capture (default: 1, 2, 4, 8, then multiples of 8
    up to ``max_batch_size``), or ``"auto"``: at most ``max_graphs`` (default: as many as the
    default list) chosen from the traffic histogram (``histogram``: a ``{size: count}`` mapping or
    a file from ``save_histogram``, merged into the runner's own; see docs/CAPTURE_SIZES.md).
    ``process_group``: run every step in lockstep with the other ranks (docs/DISTRIBUTED.md).
    ``extend_capture_sizes``: ``(token_sizes, request_sizes)`` for
    EXTEND/MIXED modes, captured only when the attention backend lists the mode in ``graph_modes``.
    ``ubatch``: a ``UBatchConfig`` to split DECODE batches above the largest capture size into
    micro-batches that replay captured graphs (merged in order) instead of running eagerly.
    ``batch_context``: the objects every batch shares (``attn_backend``, ``req_to_token_pool``,
    ``token_to_kv_pool``); the graphs are bound to them.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        max_batch_size: int = 64,
        capture_sizes: Optional[Union[Sequence[int], str]] = None,
        modes: Iterable[ForwardMode] = (ForwardMode.DECODE,),
        backend: str = "auto",
        device: Optional[Union[str, torch.device]] = None,
        warmup_iters: int = 2,
        pad_values: Optional[Mapping[str, int]] = None,
        copy_outputs: bool = False,
        batch_context: Optional[Mapping[str, Any]] = None,
        extend_capture_sizes: Optional[tuple] = None,
        debug: Optional[bool] = None,
        progress: bool = True,
        histogram: Optional[Union[Mapping[Any, Any], str, os.PathLike]] = None,
        max_graphs: Optional[int] = None,
        process_group: Optional[Any] = None,
        ubatch: Optional[UBatchConfig] = None,
    ) -> None:
        for name, value, least in (("max_batch_size", max_batch_size, 1), ("warmup_iters", warmup_iters, 0)):
            if type(value) is not int or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
        requested = resolve_backend_name(backend)
        self.device = resolve_device(requested, device)
        self.backend_name = "eager" if graphs_disabled_by_env() else requested
        self.model = model
        self.max_batch_size = max_batch_size
        self.modes = tuple(ForwardMode(mode) for mode in modes)
        self.debug = debug_enabled() if debug is None else debug
        self.progress = progress
        self.context: Dict[str, Any] = self._check_context(batch_context or {})
        self.stats_counters = RuntimeStats()
        if histogram is not None:
            self.stats_counters.merge_histogram(histogram_from(histogram))
        self.capture_sizes = self._resolve_sizes(capture_sizes, max_graphs)
        self.extend_grid = self._extend_grid(extend_capture_sizes)
        self.lockstep = Lockstep(process_group, self.device) if process_group is not None else None
        if self.lockstep is not None:
            self.capture_sizes = self.lockstep.agree_sizes(self.capture_sizes, self._shape_config())
        max_tokens = max(self.max_batch_size, self.extend_grid.max_tokens if self.extend_grid else 0)
        self.buffers = InputBufferManager(max_batch_size=max_batch_size, max_seq_len=max_tokens, device=self.device)
        self._apply_pad_values(pad_values or {})
        self.pad_values = {name: int(self.buffers.get_slot(name).pad_value) for name in DEFAULT_PAD_VALUES}
        self.registry = GraphRegistry(make_backend(self.backend_name, self.device), warmup_iters)
        self.dispatcher = ReplayDispatcher(
            self.registry, self.buffers, self.stats_counters, self.context, copy_outputs,
            graphs_enabled=self.backend_name != "eager", debug=self.debug,
        )
        self.dispatcher.enable_seq_lens_cpu(self.buffers.register_slot(
            "seq_lens_cpu", BufferSpec((max_batch_size,), torch.int32, torch.device("cpu")),
            axis=RowAxis.REQUESTS, pad_value=self.buffers.get_slot("seq_lens").pad_value,
        ))
        self._lock = threading.Lock()
        self._graph_state_ready = False
        self._register_keys()
        self._ubatch = self._make_ubatch(ubatch)
        if self.lockstep is not None:
            self.lockstep.bind_keys(list(self.registry.entries))

    # ---- construction helpers ---------------------------------------------------------------

    @staticmethod
    def _check_context(context: Mapping[str, Any]) -> Dict[str, Any]:
        unknown = set(context) - set(CONTEXT_FIELDS)
        if unknown:
            raise ValueError(f"batch_context: expected keys among {CONTEXT_FIELDS}, got {sorted(unknown)}")
        return dict(context)

    def _resolve_sizes(self, capture_sizes: Optional[Union[Sequence[int], str]], max_graphs: Optional[int]) -> list:
        if isinstance(capture_sizes, str) and capture_sizes == "auto":
            return self._sizes_from_traffic(len(default_capture_sizes(self.max_batch_size)) if max_graphs is None
                                            else max_graphs)
        if max_graphs is not None:
            raise ValueError(f"max_graphs: only used with capture_sizes='auto', got capture_sizes={capture_sizes!r}")
        if capture_sizes is None:
            return default_capture_sizes(self.max_batch_size)
        if isinstance(capture_sizes, str):
            raise ValueError(f"capture_sizes: expected None, 'auto' or a list of ints, got {capture_sizes!r}")
        return normalize_capture_sizes(capture_sizes, self.max_batch_size)

    def _sizes_from_traffic(self, max_graphs: int) -> list:
        """Decode sizes that pad the recorded DECODE traffic least (the default list without history)."""
        traffic = self.stats_counters.histogram.get(ForwardMode.DECODE, {})
        sizes = choose_capture_sizes(traffic, max_graphs, self.max_batch_size)
        logger.info("capture sizes from %d recorded steps: %s", sum(traffic.values()), sizes)
        return sizes

    def _shape_config(self) -> tuple:
        """What must be equal on every rank besides the capture sizes for the graph keys to match."""
        return self.max_batch_size, [mode.name for mode in self.modes], self.extend_grid

    def _extend_grid(self, extend_capture_sizes: Optional[tuple]) -> Optional[SizeGrid]:
        if not any(mode.is_extend() for mode in self.modes):
            return None
        if extend_capture_sizes is None:
            token_sizes = [64, 128, 256, 512]
            req_sizes = default_capture_sizes(self.max_batch_size)
        else:
            token_sizes, req_sizes = extend_capture_sizes
        token_sizes = normalize_capture_sizes(token_sizes, 1 << 20, "extend_capture_sizes[0]")
        req_sizes = normalize_capture_sizes(req_sizes, self.max_batch_size, "extend_capture_sizes[1]")
        return SizeGrid.for_extend(token_sizes, req_sizes)

    def _apply_pad_values(self, pad_values: Mapping[str, int]) -> None:
        for name, value in pad_values.items():
            if name not in DEFAULT_PAD_VALUES:
                raise ValueError(f"pad_values: expected keys among {sorted(DEFAULT_PAD_VALUES)}, got {name!r}")
            if type(value) is not int or (name == "seq_lens" and value < 1) or value < 0:
                raise ValueError(f"pad_values[{name!r}]: expected a non-negative int (seq_lens >= 1), got {value!r}")
            self.buffers.set_pad_value(name, value)

    def _graph_modes(self) -> tuple:
        """Modes that get graphs: decode-style always; extend-style only if the backend says so."""
        backend_modes = getattr(self.context.get("attn_backend"), "graph_modes", None)
        modes = []
        for mode in self.modes:
            if mode.is_extend() and (backend_modes is None or mode not in backend_modes):
                logger.info("mode %s runs eagerly: the attention backend does not list it in graph_modes", mode.name)
                continue
            modes.append(mode)
        return tuple(modes)

    def _register_keys(self) -> None:
        graph_modes = self._graph_modes()
        if any(mode.is_extend() for mode in graph_modes):
            for name in EXTEND_SLOTS:
                spec = BufferSpec((self.max_batch_size,), torch.int32, self.device)
                self.buffers.register_slot(name, spec, axis=RowAxis.REQUESTS, pad_value=0)
            self.dispatcher.enable_extend_slots()
        for mode in graph_modes:
            grid = self.extend_grid if mode.is_extend() else SizeGrid.for_decode(self.capture_sizes)
            self.registry.add_grid(mode, grid, self._static_batch)

    def _static_batch(self, key: GraphKey) -> ForwardBatch:
        """The padded batch a key's graph reads: views of the static input slots."""
        return static_batch_for(key, self.buffers, self.context, self.pad_values["seq_lens"])

    # ---- capture ------------------------------------------------------------------------------

    def capture(self) -> CaptureReport:
        """Capture every registered key, largest first (a failed key runs eagerly, others go on)."""
        if self.backend_name == "eager":
            logger.info("graphs are off (backend eager or %s=1): nothing to capture", DISABLE_ENV)
            return CaptureReport()
        before_capture, make_callable = self._capture_steps()
        with self._lock:
            report = self.registry.capture_all(make_callable, before_capture, progress=self.progress)
        logger.info("captured %d graphs in %.2fs (%d failed)", len(report.ok), report.seconds, len(report.failed))
        return report

    def _capture_steps(self) -> Tuple[Callable[[GraphEntry], None], Callable[[GraphEntry], Callable[[], Any]]]:
        """The attention backend's graph state (allocated once), then per key: the hook that runs
        before its warm-up and capture, and the step that capture records (check() records it too)."""
        attn_backend = self.context.get("attn_backend")
        init_graph_state = getattr(attn_backend, "init_graph_state", None)
        if init_graph_state is not None and not self._graph_state_ready:
            # Once only: graphs captured earlier (a resumed capture, retune) read these buffers.
            init_graph_state(self.max_batch_size, self.buffers.max_seq_len)
            self._graph_state_ready = True
        capture_hook = getattr(attn_backend, "init_forward_metadata_capture", None)

        def before_capture(entry: GraphEntry) -> None:
            if capture_hook is not None:
                capture_hook(entry.inputs)

        def make_callable(entry: GraphEntry) -> Callable[[], Any]:
            static_batch = entry.inputs

            def step() -> Any:
                return self.model(static_batch.input_ids, static_batch.positions, static_batch)

            return output_leaves_step(entry, step)

        return before_capture, make_callable

    def check(self, *examples: ForwardBatch, keys: Optional[Sequence[GraphKey]] = None) -> CheckReport:
        """What would make capture fail or replays differ from eager, found without capturing
        (``graphrt.check``, docs/CHECK.md). Records the step on the padded batches capture uses
        (``keys``, default: the smallest and largest key of each mode) and on ``examples``
        (real batches: padded as staging pads them, and compared with their unpadded run).
        The model's state is left exactly as it was."""
        with self._lock:
            return check_runner(self, examples, keys)

    def retune(self, max_graphs: int) -> CaptureReport:
        """Recapture the decode keys at <= ``max_graphs`` sizes chosen from the traffic seen so far.

        The old decode graphs are dropped before the new ones are captured, so their memory is
        reused; static inputs stay (same data_ptrs). With a process group every rank must call it
        (rank 0's sizes win). Extend keys are kept.
        """
        modes = [mode for mode in self._graph_modes() if not mode.is_extend()]
        if not modes:
            raise ValueError(f"retune: modes has no decode-style mode to retune, got {[m.name for m in self.modes]}")
        with self._lock:
            sizes = self._sizes_from_traffic(max_graphs)
            if self.lockstep is not None:
                sizes = self.lockstep.agree_sizes(sizes, self._shape_config())
            self.capture_sizes = sizes
            if self._ubatch is not None:
                self._ubatch = self._make_ubatch(self._ubatch.config)
            for mode in modes:
                self.registry.remove_mode(mode)
                self.registry.add_grid(mode, SizeGrid.for_decode(sizes), self._static_batch)
            if self.lockstep is not None:
                self.lockstep.bind_keys(list(self.registry.entries))
        return self.capture()

    def save_histogram(self, path: Union[str, os.PathLike]) -> None:
        """Write the per-mode batch-size histogram seen so far as JSON (for ``capture_sizes="auto"``)."""
        save_histogram(self.stats_counters.histogram, path)

    def load_histogram(self, path: Union[str, os.PathLike]) -> None:
        """Add the counts of a saved histogram to this runner's (``retune`` then uses them)."""
        self.stats_counters.merge_histogram(load_histogram(path))

    # ---- per step -----------------------------------------------------------------------------

    def __call__(self, batch: ForwardBatch) -> Any:
        """Run one step: replay the graph that fits, else eager; returns only the real rows."""
        if self.lockstep is not None:
            return self._lockstep_call(batch)
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
        with self._lock:
            batch.validate(self.device, self.debug)
            self.stats_counters.record_size(batch.forward_mode, batch.batch_size)
            if self._ubatch is not None and batch.forward_mode is ForwardMode.DECODE and (
                batch.batch_size > self.capture_sizes[-1]
            ):
                return self._ubatch(batch)
            return self._run_one(batch)

    def _run_one(self, batch: ForwardBatch) -> Any:
        """Graph or eager for one validated batch (a whole step, or one micro-batch of it)."""
        decision = self.dispatcher.decide(batch)
        if decision.reason is not None:
            return self._run_eager(batch, decision.reason)
        try:
            return self.dispatcher.run_graph(decision.entry, batch)
        except Exception as error:  # a replay that raises: disable the key, redo the step eagerly
            self.dispatcher.disable(decision.entry.key, f"replay raised {type(error).__name__}: {error}")
            return self._run_eager(batch, EagerReason.REPLAY_FAILED)

    def _make_ubatch(self, config: Optional[UBatchConfig]) -> Optional[UBatchWrapper]:
        """Split decode batches above the largest capture size into graph-hitting micro-batches."""
        if config is None:
            return None
        if not isinstance(config, UBatchConfig):
            raise TypeError(f"ubatch: expected a UBatchConfig, got {type(config).__name__}")
        if config.threaded:
            raise ValueError("ubatch.threaded: expected False: one runner's graphs share static buffers, "
                             "so its micro-batches must replay one after another")
        return UBatchWrapper(self._run_one, dataclasses.replace(config, capture_sizes=self.capture_sizes))

    def idle_step(self) -> None:
        """Lockstep with no work on this rank: run an all-padding step of the agreed size (no-op alone)."""
        if self.lockstep is not None:
            self._lockstep_call(None)

    def _lockstep_call(self, batch: Optional[ForwardBatch]) -> Any:
        """One step at the size every rank agreed on (docs/DISTRIBUTED.md); None for an idle rank.

        A bad batch takes part as an idle step, so the other ranks do not hang, then raises.
        """
        error: Optional[Exception] = None
        with self._lock:
            try:
                if batch is not None:
                    if not isinstance(batch, ForwardBatch):
                        raise TypeError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
                    batch.validate(self.device, self.debug)
                    if batch.forward_mode is ForwardMode.IDLE and batch.batch_size:
                        raise ValueError(f"batch_size: expected 0 for an IDLE batch, got {batch.batch_size}")
            except (TypeError, ValueError) as caught:
                error, batch = caught, None
            if batch is not None and batch.num_tokens == 0:
                batch = None
            local_reason = self.dispatcher.decide(batch).reason if batch is not None else None
            local_reason = local_reason if local_reason in SIZE_INDEPENDENT else None
            agreed = self.lockstep.agree_step(batch, local_reason is not None, self.registry.entries)
            result = None if agreed.mode is None else self._agreed_step(agreed, batch, local_reason)
        if error is not None:
            raise error
        return result if batch is not None else None

    def _agreed_step(
        self, agreed: StepAgreement, batch: Optional[ForwardBatch], local_reason: Optional[EagerReason]
    ) -> Any:
        """Replay the agreed key or run eagerly padded to the agreed size; this rank's real rows."""
        self.stats_counters.record_size(agreed.mode, agreed.num_reqs)
        work = batch if batch is not None else empty_batch(agreed.mode, self.device)
        decision = agreed.decide(self.dispatcher, local_reason)
        if decision.reason is None:
            try:
                return self.dispatcher.run_graph(decision.entry, work)
            except Exception as error:  # cannot redo the step alone: peers already replayed
                self.dispatcher.disable(decision.entry.key, f"replay raised {type(error).__name__}: {error}")
                raise
        self.stats_counters.record_eager(decision.reason.value, work.num_tokens)
        padded = pad_forward_batch(work, agreed.num_tokens, agreed.num_reqs, self.pad_values)
        key = GraphKey(agreed.mode, agreed.num_tokens, agreed.num_reqs)
        return self.dispatcher.cut_eager(key, self._forward_eager(padded), work.num_tokens, work.batch_size)

    def _run_eager(self, batch: ForwardBatch, reason: EagerReason) -> Any:
        num_tokens = batch.input_ids.shape[0]
        self.stats_counters.record_eager(reason.value, num_tokens)
        outputs = self._forward_eager(batch)
        if reason is EagerReason.AXIS_PROBE:
            self.dispatcher.observe_eager(batch.forward_mode, num_tokens, batch.batch_size, outputs)
        return outputs

    def _forward_eager(self, batch: ForwardBatch) -> Any:
        """The model on ``batch`` as given, with the runner's context objects filled in."""
        missing = {name: self.context[name] for name in self.context if getattr(batch, name) is None}
        if missing:
            batch = dataclasses.replace(batch, **missing)
        init_metadata = getattr(batch.attn_backend, "init_forward_metadata", None)
        if init_metadata is not None:
            init_metadata(batch)
        with torch.no_grad():
            return self.model(batch.input_ids, batch.positions, batch)

    def stats(self) -> Dict[str, Any]:
        """Counters: graph_runs, eager_runs, eager_reasons, real_tokens, padded_tokens, and more."""
        result = self.stats_counters.as_dict()
        result["backend"] = self.backend_name
        result["capture_sizes"] = list(self.capture_sizes)
        result.update(self.registry.summary())
        result["uncut_outputs"] = dict(self.dispatcher.uncut_outputs)
        result["static_input_bytes"] = self.buffers.static_bytes()
        return result
