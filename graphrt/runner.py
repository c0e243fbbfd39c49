"""GraphRunner, the facade: wrap a model once, capture, then call it every step.

Each call validates the batch (metadata only on GPU), asks the dispatcher for a graph key,
and either replays that graph or runs the model eagerly, counting why. In lockstep the
ranks first agree on the step's padded size, then take the same path. Calls are serialized
by a lock: graphs share static buffers, so two threads replaying at once would overwrite
each other's inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from graphrt.backends import (
    DISABLE_ENV, graphs_disabled_by_env, make_backend, refuse_compiled_cudagraphs, resolve_backend_name, resolve_device,
    step_lock,
)
from graphrt.backends.compiled import describe_callable, is_compiled, opaque_to_dynamo
from graphrt.backends.state_journal import storage_key
from graphrt.backends.torchscript import refuse_torchscript
from graphrt.batch import EXTEND_FIELDS, ForwardBatch, ForwardMode, debug_enabled
from graphrt.batch_context import scratch_tensors, table_sizes
from graphrt.capture import CaptureReport, KeyCapture
from graphrt.check import CheckReport, check_runner
from graphrt.config import RunnerConfig
from graphrt.dispatch import DecodeStager, Dispatcher, ExtendStager, static_batch_for, with_context
from graphrt.entry import PIECEWISE_REQS, EagerReason, GraphEntry, GraphKey, KeyKind, replay_or_eager
from graphrt.forward_context import use_batch
from graphrt.guards import GuardFailure, GuardSpec, StateWatch
from graphrt.multistep import (
    MultiStepDecoder, NextTokens, add_multistep_keys, check_call, chosen_tokens, greedy, register_step_slots,
)
from graphrt.parallel.lockstep import SIZE_INDEPENDENT, Lockstep, StepAgreement, empty_batch, pad_forward_batch
from graphrt.piecewise import add_piecewise_keys
from graphrt.registry import GraphRegistry
from graphrt.sizes import SizeGrid, choose_capture_sizes, default_capture_sizes
from graphrt.staging import BufferSpec, InputBufferManager, RowAxis
from graphrt.stats import RuntimeStats, load_histogram, save_histogram
from graphrt.ubatch import UBatchConfig, UBatchWrapper

logger = logging.getLogger(__name__)


class GraphRunner:
    """Captures ``model(input_ids, positions, forward_batch)`` per padded size and replays it.

    Options are the fields of ``RunnerConfig`` (``max_batch_size``, ``capture_sizes``, ``modes``,
    ``backend``, ``batch_context``, ...), given as keywords or as one ``config``.
    """

    def __init__(self, model: Callable[..., Any], config: Optional[RunnerConfig] = None, **options: Any) -> None:
        if not callable(model):
            raise TypeError(f"model: expected a callable model(input_ids, positions, forward_batch), "
                            f"got {type(model).__name__}")
        if config is None:
            config = RunnerConfig(**options)
        elif not isinstance(config, RunnerConfig):
            raise TypeError(f"config: expected a RunnerConfig, got {type(config).__name__}")
        elif options:
            config = config.with_options(**options)
        refuse_compiled_cudagraphs(model, "model")
        refuse_torchscript(model, "model")
        requested = resolve_backend_name(config.backend, config.device)
        self.model = model
        self.config = config
        self.device = resolve_device(requested, config.device)
        self.backend_name = "eager" if graphs_disabled_by_env() else requested
        self.debug = debug_enabled() if config.debug is None else config.debug
        self.context: Mapping[str, Any] = config.batch_context  # read-only views of the checked options
        self.pad_values: Mapping[str, int] = config.pad_values
        self._limits = table_sizes(self.context)  # (field, table size) for the value checks
        self._stats = RuntimeStats()
        if config.histogram is not None:
            self._stats.merge_histogram(config.histogram)
        self.lockstep = Lockstep(config.process_group, config.cpu_group) if config.process_group is not None else None
        if self.lockstep is not None and self.backend_name == "cuda":
            self.lockstep.watch_replays(self.device)  # captured collectives are invisible to NCCL's watchdog
        self.capture_sizes = self._agreed(self._initial_sizes())
        self._graph_modes = self._modes_with_graphs()
        self.buffers = self._static_slots(
            any(mode.is_extend() for mode in self._graph_modes) or bool(config.piecewise_sizes))
        self.sampler: NextTokens = config.next_tokens if config.next_tokens is not None else greedy
        shared = self._shared_graphs(config.share_graphs_with)
        self.backend = make_backend(self.backend_name, self.device) if shared is None else shared.backend
        self.registry = GraphRegistry(config.copy_outputs, self.debug,
                                      None if shared is None else shared.registry.pool_replays)
        self.capturer = KeyCapture(self.backend, config.warmup_iters, config.verify, self._scratch_storages,
                                   is_compiled(model),
                                   agree=self.lockstep.agree_capture if self.lockstep is not None else None)
        self._stagers = {False: DecodeStager(self.buffers, self.context)}
        if "extend_start_loc" in self.buffers.slots:
            self._stagers[True] = ExtendStager(self.buffers, self.context)
        for mode in self._graph_modes:
            grid = config.extend_grid if mode.is_extend() else SizeGrid.for_decode(self.capture_sizes)
            self.registry.add_grid(mode, grid, self._make_entry)
        self._add_multistep_keys()
        self._ubatch = self._make_ubatch()
        self.piecewise = self._add_piecewise_keys()
        self._watch = StateWatch()
        self._guard_spec = GuardSpec(self._watch, fn=model)
        self._guard_entries()
        self._guard_warned: Set[str] = set()
        self.dispatcher = Dispatcher(self.registry, self.context, graphs_enabled=self.backend_name != "eager",
                                     piecewise=self.piecewise, watch=self._watch,
                                     on_guard_failure=self._guard_failed, debug=self.debug)
        self._decoder = MultiStepDecoder(self.dispatcher, self.registry, self._stats, config.decode_steps,
                                         self.sampler, self._multi_step_off, self._route)
        if self.lockstep is not None:
            self.lockstep.bind_keys(list(self.registry.entries))
        self._lock = threading.Lock()
        self._graph_state_ready = False

    # ---- construction helpers ---------------------------------------------------------------

    def _shared_graphs(self, other: Any) -> Optional["GraphRunner"]:
        """The runner whose graph pool this one shares (``share_graphs_with``), checked: same backend and
        device; None without one, or when graphs are off."""
        if other is None or self.backend_name == "eager":
            return None
        if not isinstance(other, GraphRunner):
            raise TypeError(f"share_graphs_with: expected a GraphRunner, got {type(other).__name__}")
        if (other.backend_name, other.device) != (self.backend_name, self.device):
            raise ValueError(f"share_graphs_with: expected a runner on backend {self.backend_name!r} and device "
                             f"{self.device}, got one on {other.backend_name!r} and {other.device}")
        return other

    def _initial_sizes(self) -> List[int]:
        sizes = self.config.capture_sizes
        if sizes != "auto":
            return list(sizes)
        max_graphs = self.config.max_graphs
        return self._sizes_from_traffic(len(default_capture_sizes(self.config.max_batch_size)) if max_graphs is None else max_graphs)

    def _sizes_from_traffic(self, max_graphs: int) -> List[int]:
        """Decode sizes that pad the recorded DECODE traffic least (the default list without history)."""
        traffic = self._stats.histogram.get(ForwardMode.DECODE, {})
        sizes = choose_capture_sizes(traffic, max_graphs, self.config.max_batch_size)
        logger.info("capture sizes from %d recorded steps: %s", sum(traffic.values()), sizes)
        return sizes

    def _agreed(self, sizes: List[int]) -> List[int]:
        """In lockstep, rank 0's capture sizes (every rank must shape the same graph keys, and run
        the same collectives while capturing them: warm-up calls and verification too)."""
        if self.lockstep is None:
            return sizes
        config = self.config
        shape = (config.max_batch_size, [mode.name for mode in config.modes], config.extend_grid,
                 config.warmup_iters, config.verify)
        return self.lockstep.agree_sizes(sizes, shape)

    def _modes_with_graphs(self) -> tuple:
        """Modes that get graphs: decode-style always; extend-style only if the backend says so."""
        backend_modes = getattr(self.context.get("attn_backend"), "graph_modes", None)
        modes = []
        for mode in self.config.modes:
            if mode.is_extend() and (backend_modes is None or mode not in backend_modes):
                logger.info("mode %s runs eagerly: the attention backend does not list it in graph_modes", mode.name)
                continue
            modes.append(mode)
        return tuple(modes)

    def _static_slots(self, extend: bool) -> InputBufferManager:
        """Every static input slot, allocated once: the decode fields with their pad values, a
        host mirror of seq_lens for the attention replay hook, and the extend fields if needed."""
        max_batch_size, extend_grid = self.config.max_batch_size, self.config.extend_grid
        max_tokens = max(max_batch_size, extend_grid.max_tokens if extend_grid else 0, *self.config.piecewise_sizes)
        buffers = InputBufferManager(self.config.slot_pool, max_batch_size=max_batch_size, max_seq_len=max_tokens,
                                     device=self.device)
        for name, value in self.pad_values.items():
            buffers.set_pad_value(name, value)
        buffers.register_slot("seq_lens_cpu", BufferSpec((max_batch_size,), torch.int32, torch.device("cpu")),
                              axis=RowAxis.REQUESTS, pad_value=self.pad_values["seq_lens"])
        if extend:
            for spec in EXTEND_FIELDS:
                buffers.register_field(spec)
        if self.config.decode_steps:
            register_step_slots(buffers, max(self.config.decode_steps), self.pad_values["out_cache_loc"])
        return buffers

    def _scratch_storages(self) -> Set[Tuple[torch.device, int]]:
        """Memory a capture writes only at rows no request owns (the static slots hold pad values):
        ``scratch_state`` and the tensors of the KV pool in ``batch_context``."""
        return {storage_key(tensor) for tensor in [*self.config.scratch_state, *scratch_tensors(self.context)]}

    def _make_entry(self, key: GraphKey) -> GraphEntry[ForwardBatch]:
        """A key's entry: the padded batch of static-slot views its graph reads, and the step on it."""
        static = static_batch_for(key, self.buffers, self.context, self.pad_values["seq_lens"])
        # Inside a full graph, current_batch() is the batch as captured, its Python values frozen
        # (a copy: replays restage ``static``), as a CUDA graph freezes the host values it read;
        # the emulated backend replays in the context variables of its capture.
        frozen = dataclasses.replace(static)

        def step() -> Any:
            with use_batch(frozen):
                return self.model(static.input_ids, static.positions, static)

        stager = self._stagers[key.mode.is_extend()]
        return GraphEntry(key, static, step, stager=stager, count=self._stats.record_graph)

    def _guard_entries(self) -> None:
        """Every key checks, per call, the state it was captured under (graphrt.guards)."""
        for entry in self.registry.entries.values():
            entry.guard_spec = self._guard_spec

    def _guard_failed(self, failure: GuardFailure) -> None:
        """Count a call a guard sent eagerly, and say once per difference what to do."""
        detail = f"{failure.reason}: {failure.detail}"
        self._stats.record_guard_failure(detail)
        if detail not in self._guard_warned:
            self._guard_warned.add(detail)
            logger.warning("steps run eagerly (%s): %s; graphs replay again once the state is as at capture, "
                           "or call runner.recapture() to capture them under the new one", failure.reason,
                           failure.detail)

    def _add_multistep_keys(self) -> None:
        """Multi-step keys (``decode_steps``) at every decode capture size, or why none can serve."""
        self._multi_step_off = add_multistep_keys(
            self.registry, self.model, self.config.decode_steps, self.capture_sizes, self.buffers, self.context,
            self._graph_modes, self._stats, self.sampler, self.pad_values["seq_lens"])

    def _add_piecewise_keys(self) -> bool:
        """Piecewise keys when splitting ops are set (in lockstep every rank takes the key of the agreed tokens)."""
        config = self.config
        if not config.splitting_ops or self.backend_name == "eager":
            return False
        add_piecewise_keys(self.registry, self.model, config.splitting_ops, config.piecewise_sizes, self.buffers,
                           self.context, self._stats)
        return True

    def _make_ubatch(self) -> Optional[UBatchWrapper]:
        """Split decode batches above the largest capture size into graph-hitting micro-batches."""
        config: Optional[UBatchConfig] = self.config.ubatch
        if config is None:
            return None
        return UBatchWrapper(self._step, dataclasses.replace(config, capture_sizes=self.capture_sizes))

    # ---- capture ------------------------------------------------------------------------------

    def capture(self) -> CaptureReport:
        """Capture every registered key, largest first (a failed key runs eagerly, others go on)."""
        if self.backend_name == "eager":
            logger.info("graphs are off (backend eager or %s=1): nothing to capture", DISABLE_ENV)
            return CaptureReport()
        with self._lock:
            report = self.capturer.capture_all(self.registry, self.prepare_capture(), progress=self.config.progress)
        logger.info("captured %d graphs in %.2fs (%d failed)", len(report.ok), report.seconds, len(report.failed))
        return report

    def prepare_capture(self) -> Callable[[GraphEntry], None]:
        """Allocate the attention backend's graph state (once), then return the hook that runs
        before each key's warm-up and capture (``graphrt.check`` records keys after it too): the
        static slots back to their pad values (slots no request owns), then, for a full graph, the
        attention backend's capture hook."""
        attn_backend = self.context.get("attn_backend")
        init_graph_state = getattr(attn_backend, "init_graph_state", None)
        if init_graph_state is not None and not self._graph_state_ready:
            # Once only: graphs captured earlier (a resumed capture, retune) read these buffers, which
            # are made outside inference mode so replays can refresh them under no_grad too.
            with torch.inference_mode(False):
                init_graph_state(self.config.max_batch_size, self.buffers.max_seq_len)
            self._graph_state_ready = True
        capture_hook = getattr(attn_backend, "init_forward_metadata_capture", None)

        def before_capture(entry: GraphEntry[ForwardBatch]) -> None:
            self.buffers.reset()
            if capture_hook is not None and entry.key.kind is KeyKind.FULL:
                capture_hook(entry.static_inputs)

        return before_capture

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
        modes = [mode for mode in self._graph_modes if not mode.is_extend()]
        if not modes:
            names = [mode.name for mode in self.config.modes]
            raise ValueError(f"retune: modes has no decode-style mode to retune, got {names}")
        with self._lock:
            self.capture_sizes = self._agreed(self._sizes_from_traffic(max_graphs))
            self._ubatch = self._make_ubatch()
            for mode in modes:
                self.registry.remove_mode(mode)
                self.registry.add_grid(mode, SizeGrid.for_decode(self.capture_sizes), self._make_entry)
            self._add_multistep_keys()
            self._guard_entries()
            if self.lockstep is not None:
                self.lockstep.bind_keys(list(self.registry.entries))
        return self.capture()

    def recapture(self, keys: Optional[Sequence[GraphKey]] = None) -> CaptureReport:
        """Capture every key (or only ``keys``, e.g. one a replay fault disabled) again, under the state
        of now: after weights were swapped by rebinding (``param.data = other``, ``m.weight =
        nn.Parameter(...)``), or to serve steps under another autocast or ``training`` state than the
        first capture's. The old graphs are dropped first (their memory is reused); static inputs stay."""
        with self._lock:
            self.registry.uncapture(keys)
        return self.capture()

    def save_histogram(self, path: Union[str, os.PathLike]) -> None:
        """Write the per-mode batch-size histogram seen so far as JSON (for ``capture_sizes="auto"``)."""
        save_histogram(self._stats.histogram, path)

    def load_histogram(self, path: Union[str, os.PathLike]) -> None:
        """Add the counts of a saved histogram to this runner's (``retune`` then uses them)."""
        self._stats.merge_histogram(load_histogram(path))

    # ---- per step -----------------------------------------------------------------------------

    @opaque_to_dynamo  # torch.compile around a step breaks its graph here: graphs replay
    def __call__(self, batch: ForwardBatch) -> Any:
        """Run one step: replay the graph that fits, else eager; returns only the real rows."""
        if self.lockstep is not None:
            return self._lockstep_call(batch)
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
        with step_lock(self._lock):  # no step while another thread captures, where torch needs it
            batch.validate(self.device, self.debug, self.config.check_values, self._limits)
            self._stats.record_size(batch.forward_mode, batch.batch_size)
            return self._route(batch)

    @opaque_to_dynamo
    def decode(self, batch: ForwardBatch, steps: int, next_tokens: Optional[NextTokens] = None) -> torch.Tensor:
        """``steps`` decode steps of ``batch``: the tokens chosen at each, ``[steps, batch_size]`` int64
        (an output like any other: valid until the next replay). ``out_cache_loc`` holds the slots of
        every step, step-major; step ``j`` runs at ``positions + j``, ``seq_lens + j`` on the tokens
        ``next_tokens(output, j - 1)`` chose (default: the runner's, ``RunnerConfig.next_tokens``,
        with which its multi-step keys were captured). One replay when a multi-step key serves, else
        the steps one by one (``stats()["multi_step_fallbacks"]`` says why); ``batch`` is not modified.
        See graphrt/multistep."""
        if self.lockstep is not None:
            return self._lockstep_call(batch, steps, next_tokens)
        check_call(batch, steps, next_tokens)
        with step_lock(self._lock):
            batch.validate(self.device, self.debug, self.config.check_values, self._limits, steps)
            self._stats.record_size(batch.forward_mode, batch.batch_size)
            return self._decoder.run(batch, steps, next_tokens)

    def _route(self, batch: ForwardBatch) -> Any:
        """A validated batch: micro-batches above the largest capture size (``ubatch``), else one step."""
        if self._ubatch is not None and batch.forward_mode is ForwardMode.DECODE and (
            batch.batch_size > self.capture_sizes[-1]
        ):
            return self._ubatch(batch)
        return self._step(batch)

    def idle_step(self, steps: Optional[int] = None) -> None:
        """Lockstep with no work on this rank: run an all-padding step of the agreed size, or with ``steps``
        take part in the peers' ``decode(batch, steps)`` launch (no-op alone)."""
        if self.lockstep is not None:
            self._lockstep_call(None, steps)

    def _lockstep_call(self, batch: Optional[ForwardBatch], steps: Optional[int] = None,
                       next_tokens: Optional[NextTokens] = None) -> Any:
        """Agree with the other ranks on this step's (``steps``: this ``decode()`` launch's) size and path,
        then run it (docs/DISTRIBUTED.md).

        ``None`` is an idle rank. A bad batch takes part as an idle step, so the other ranks do
        not hang, then raises.
        """
        error: Optional[Exception] = None
        launch = steps is not None
        with step_lock(self._lock):
            try:
                if launch and (type(steps) is not int or steps < 1):
                    steps, launch = 1, False  # take part as one step: peers launching several raise too
                    raise ValueError("steps: expected an int >= 1")
                if batch is not None:
                    self._check_lockstep_call(batch, steps if launch else None, next_tokens)
            except (TypeError, ValueError) as caught:
                error, batch = caught, None
            if batch is not None and batch.num_tokens == 0:
                batch = None
            result = self._lockstep_launch(batch, steps, next_tokens) if launch else self._lockstep_step(batch)
        if error is not None:
            raise error
        return result

    def _check_lockstep_call(self, batch: ForwardBatch, steps: Optional[int], next_tokens: Any) -> None:
        """The checks of ``runner(batch)`` (``steps`` None) or ``decode(batch, steps, next_tokens)``."""
        if steps is not None:
            check_call(batch, steps, next_tokens)
        elif not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
        batch.validate(self.device, self.debug, self.config.check_values, self._limits, steps or 1)
        if batch.forward_mode is ForwardMode.IDLE and batch.batch_size:
            raise ValueError(f"batch_size: expected 0 for an IDLE batch, got {batch.batch_size}")

    def _lockstep_step(self, batch: Optional[ForwardBatch], record: bool = True) -> Any:
        """One agreed step of a validated batch (None: idle); its real rows' outputs, None when idle.
        ``record``: the agreed size goes to the histogram (not for a launch's steps: the launch's went)."""
        local_reason = self.dispatcher.decide(batch).reason if batch is not None else None
        local_reason = local_reason if local_reason in SIZE_INDEPENDENT else None
        agreed = self.lockstep.agree_step(batch, local_reason is not None, self.registry.entries)
        if agreed.mode is None:
            return None
        if record:
            self._stats.record_size(agreed.mode, agreed.num_reqs)
        work = batch if batch is not None else empty_batch(agreed.mode, self.device)
        result = self._step(work, agreed, local_reason)
        return result if batch is not None else None

    def _lockstep_launch(self, batch: Optional[ForwardBatch], steps: int,
                         next_tokens: Optional[NextTokens]) -> Optional[torch.Tensor]:
        """A ``decode()`` launch in lockstep: every rank replays the multi-step key of the agreed size, or
        every rank runs the steps one by one, each step agreed again. Idle ranks (None) get None."""
        fn = self.sampler if next_tokens is None else next_tokens
        if steps == 1:  # a single step: the runner's own path, then next_tokens
            output = self._lockstep_step(batch)
            return None if batch is None else chosen_tokens(fn(output, 0), batch.batch_size).unsqueeze(0)
        local_reason = self._decoder.unavailable_for(steps, fn)
        if local_reason is None and batch is not None:
            reason = self.dispatcher.decide(batch, steps).reason
            local_reason = reason if reason in SIZE_INDEPENDENT else None
        agreed = self.lockstep.agree_step(batch, local_reason is not None, self.registry.entries, steps)
        if agreed.mode is None:
            return None
        self._stats.record_size(agreed.mode, agreed.num_reqs)
        decision = agreed.decide(lambda mode, tokens, reqs: self.dispatcher.lookup(mode, tokens, reqs, steps),
                                 local_reason)
        if decision.reason is not None and batch is None:
            for _ in range(steps):  # the peers' steps, one by one
                self._lockstep_step(None, record=False)
            return None
        work = batch if batch is not None else empty_batch(agreed.mode, self.device)
        if decision.reason is None:
            self._check_cut(decision.entry, work)
        def launch() -> torch.Tensor:
            return self._decoder.run_decided(work, steps, fn, decision,
                                             lambda step: self._lockstep_step(step, record=False))

        replayed = decision.reason is None  # one replay of the multi-step key, watched; else agreed steps
        tokens = self.lockstep.replayed(launch, f"the replay of {decision.entry.key}") if replayed else launch()
        return tokens if batch is not None else None

    def _step(
        self, batch: ForwardBatch, agreed: Optional[StepAgreement] = None, local_reason: Optional[EagerReason] = None
    ) -> Any:
        """One validated batch (a whole step, or one micro-batch of it): replay, else eager.
        ``current_batch()`` is ``batch`` throughout (the splitting ops of a piecewise key read it).

        In lockstep (``agreed``) every rank takes the same path at the agreed size: an eager step
        is padded to it, and a replay that raises is not redone eagerly (the peers replayed).
        """
        with use_batch(batch):
            if agreed is None:
                decision = self.dispatcher.decide(batch)
                run_eager = self._run_eager
            else:
                decision = agreed.decide(self.dispatcher.lookup, local_reason)
                run_eager = None
                if decision.reason is None:
                    self._check_cut(decision.entry, batch)
            entry = decision.entry
            if decision.reason is not None:
                return self._run_eager(decision.reason, batch, agreed, entry)
            num_reqs = batch.batch_size if entry.key.kind is KeyKind.FULL else PIECEWISE_REQS
            if agreed is None:
                return replay_or_eager(entry, batch, batch.num_tokens, num_reqs, run_eager, batch, agreed)
            return self.lockstep.replayed(lambda: replay_or_eager(entry, batch, batch.num_tokens, num_reqs, None),
                                          f"the replay of {entry.key}")

    def _check_cut(self, entry: GraphEntry, batch: ForwardBatch) -> None:
        """Lockstep replays at the agreed size: the real rows of this rank must be cuttable."""
        num_reqs = batch.batch_size if entry.key.kind is KeyKind.FULL else PIECEWISE_REQS
        reason = self.registry.prepare_cut(entry, batch.num_tokens, num_reqs)
        if reason is not None:
            raise ValueError(f"graph {entry.key}: its outputs cannot be cut to {batch.num_tokens} real rows "
                             f"({reason.value}); capture at least two sizes per mode")

    def _run_eager(self, reason: EagerReason, batch: ForwardBatch, agreed: Optional[StepAgreement] = None,
                   entry: Optional[GraphEntry] = None) -> Any:
        """The model on ``batch`` eagerly; in lockstep padded to the agreed size, then cut to the real rows."""
        self._stats.record_eager(reason, batch.num_tokens)
        if agreed is None:
            result = self._forward_eager(batch)
            if reason is EagerReason.AXIS_PROBE:
                num_reqs = batch.batch_size if entry.key.kind is KeyKind.FULL else PIECEWISE_REQS
                self.registry.observe_eager(entry.key, batch.num_tokens, num_reqs, result)
            return result
        padded = pad_forward_batch(batch, agreed.num_tokens, agreed.num_reqs, self.pad_values)
        key = GraphKey(agreed.mode, agreed.num_tokens, agreed.num_reqs)
        return self.registry.cut_eager(key, self._forward_eager(padded), batch.num_tokens, batch.batch_size)

    def _forward_eager(self, batch: ForwardBatch) -> Any:
        """The model on ``batch`` as given, with the runner's context objects filled in."""
        batch = with_context(batch, self.context)
        init_metadata = getattr(batch.attn_backend, "init_forward_metadata", None)
        if init_metadata is not None:
            init_metadata(batch)
        with torch.no_grad(), use_batch(batch):
            return self.model(batch.input_ids, batch.positions, batch)

    def stats(self) -> Dict[str, Any]:
        """Counters: graph_runs, eager_runs, eager_reasons, real_tokens, padded_tokens, and more."""
        result = self._stats.as_dict()
        result["wraps"] = describe_callable(self.model)
        result["backend"] = self.backend_name
        result["capture_sizes"] = list(self.capture_sizes)
        result.update(self.registry.summary())
        result["static_input_bytes"] = self.buffers.static_bytes()
        return result
