"""RunnerConfig: every GraphRunner option in one frozen dataclass, checked once at construction.

``GraphRunner(model, **options)`` builds one from its keyword options; a bad option raises
ValueError/TypeError naming it before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from graphrt.backends import resolve_backend_name
from graphrt.batch import CONTEXT_FIELDS, DECODE_SPECS, ForwardMode
from graphrt.piecewise import SplittingOpSpec, resolve_splitting_ops
from graphrt.sizes import SizeGrid, default_capture_sizes, default_piecewise_sizes, normalize_capture_sizes
from graphrt.staging import SlotPool
from graphrt.stats import histogram_from
from graphrt.ubatch import UBatchConfig

DEFAULT_PAD_VALUES = {spec.name: spec.pad_value for spec in DECODE_SPECS}
DERIVED_FROM_MAX_BATCH_SIZE = ("capture_sizes", "extend_capture_sizes", "piecewise_sizes")
DEFAULT_EXTEND_TOKENS = (64, 128, 256, 512)


@dataclass(frozen=True)
class RunnerConfig:
    """How a GraphRunner captures and replays ``model(input_ids, positions, forward_batch)``.

    ``capture_sizes``: decode batch sizes to capture (default: 1, 2, 4, 8, then multiples of 8
    up to ``max_batch_size``), or ``"auto"``: at most ``max_graphs`` (default: as many as the
    default list) chosen from the traffic histogram (``histogram``: a ``{size: count}`` mapping or
    a file from ``save_histogram``, merged into the runner's own; see docs/CAPTURE_SIZES.md).
    ``extend_capture_sizes``: ``(token_sizes, request_sizes)`` for EXTEND/MIXED modes, captured
    only when the attention backend lists the mode in ``graph_modes``.
    ``batch_context``: the objects every batch shares (``attn_backend``, ``req_to_token_pool``,
    ``token_to_kv_pool``); the graphs are bound to them.
    ``pad_values``: the fill of padding rows per staged field (seq_lens >= 1; ``out_cache_loc`` -1 for a
    KV store that skips it, as vLLM's ``reshape_and_cache`` and nano-vllm's store kernel do).
    ``process_group``: run every step in lockstep with the other ranks (docs/DISTRIBUTED.md).
    ``cpu_group``: the gloo group of the same ranks the lockstep agreements run on (default: the
    process group if it is gloo, else one created at construction).
    ``ubatch``: split DECODE batches above the largest capture size into micro-batches that
    replay captured graphs (merged in order) instead of running eagerly.
    ``debug``: check values and guard outputs against staleness (default: ``GRAPHRT_DEBUG``).
    ``check_values``: read index values of each batch (non-negative, ``seq_lens_sum``) before it is
    staged; default (None): for host tensors always, for device tensors only in debug mode (reading
    them synchronizes). False checks metadata only, as on a GPU.
    ``splitting_ops``: ops run eagerly between graph pieces (``OpOverload``, ``OpOverloadPacket``,
    a ``torch.library.custom_op`` function or ``"namespace::name"``; typically a custom op wrapping
    varlen attention).
    With them, steps no full graph serves replay piecewise graphs keyed by padded token count
    (``piecewise_sizes``; default: powers of two from 1 up to the larger of ``max_batch_size`` and
    the largest extend token size, 512 by default, that size included). See docs/ARCHITECTURE.md.
    ``warmup_iters``: eager runs of each key's step before its recording (default 1, observed: what the
    step read is what its guard checks); with the recording and the verification, a key's capture runs
    the step three times. At least 1 on CUDA.
    ``verify``: compare each key's first replay with eager on the same inputs at capture (one
    extra eager step and replay per key); a difference keeps the key eager (``verify_failed``).
    ``decode_steps``: step counts (ints >= 2) of the multi-step keys captured for every decode
    capture size, e.g. ``(4, 8)``: ``GraphRunner.decode(batch, steps)`` then runs that many decode
    steps in one replay, the next tokens chosen inside the graph by ``next_tokens(output, step)``
    (a device-only function of the model's output; default ``output.argmax(-1)``). In lockstep every rank
    calls ``decode(batch, steps)`` (or ``idle_step(steps)``) together.
    ``scratch_state``: tensors the model writes only at rows the staged indices address (a KV cache
    written at ``out_cache_loc``): capture stages pad values first, so their writes land in rows no
    request owns and are not copied to be undone. Tensors held by ``batch_context``'s
    ``token_to_kv_pool`` count as scratch state too.
    ``slot_pool``: where the static input slots are allocated (a ``graphrt.pools`` BufferPool, e.g.
    a ``HierarchicalBufferPool`` that puts host slots in pinned memory); default: allocated directly.
    ``share_graphs_with``: another ``GraphRunner`` (same backend and device) whose graph memory pool this
    runner's graphs share (on CUDA also its capture stream, so one cuBLAS workspace): several runners of
    one engine then hold about one largest key's memory, not one pool each. An output of either runner's
    graphs is valid until the next replay of any graph in the pool.
    """

    max_batch_size: int = 64
    capture_sizes: Optional[Union[Sequence[int], str]] = None
    modes: Iterable[ForwardMode] = (ForwardMode.DECODE,)
    backend: str = "auto"
    device: Optional[Union[str, torch.device]] = None
    warmup_iters: int = 1
    pad_values: Mapping[str, int] = field(default_factory=dict)
    copy_outputs: bool = False
    batch_context: Mapping[str, Any] = field(default_factory=dict)
    extend_capture_sizes: Optional[Tuple[Sequence[int], Sequence[int]]] = None
    debug: Optional[bool] = None
    check_values: Optional[bool] = None
    verify: bool = True
    progress: bool = True
    histogram: Optional[Union[Mapping[Any, Any], str, os.PathLike]] = None
    max_graphs: Optional[int] = None
    process_group: Optional[Any] = None
    cpu_group: Optional[Any] = None
    ubatch: Optional[UBatchConfig] = None
    splitting_ops: Sequence[SplittingOpSpec] = ()
    piecewise_sizes: Optional[Sequence[int]] = None
    decode_steps: Sequence[int] = ()
    next_tokens: Optional[Callable[[Any, int], torch.Tensor]] = field(default=None, compare=False)
    scratch_state: Sequence[torch.Tensor] = field(default=(), compare=False)
    slot_pool: Optional[SlotPool] = field(default=None, compare=False)
    share_graphs_with: Optional[Any] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        unset = [name for name in DERIVED_FROM_MAX_BATCH_SIZE if getattr(self, name) is None]
        for name, least in (("max_batch_size", 1), ("warmup_iters", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
        if resolve_backend_name(self.backend, self.device) == "cuda" and self.warmup_iters < 1:
            # The first run of a step initializes what must not run inside a capture (NCCL
            # communicators, Triton's JIT, cuBLAS handles): on CUDA it must be a warm-up.
            raise ValueError(f"warmup_iters: expected an int >= 1 on the cuda backend (the first run of a step "
                             f"sets up NCCL, Triton and cuBLAS, which a capture cannot), got {self.warmup_iters}")
        if self.cpu_group is not None and self.process_group is None:
            raise ValueError("cpu_group: expected None without process_group (it carries the lockstep agreements)")
        self._set("modes", tuple(ForwardMode(mode) for mode in self.modes))
        self._set("capture_sizes", self._checked_capture_sizes())
        self._set("extend_capture_sizes", self._checked_extend_sizes())
        self._set("pad_values", MappingProxyType({**DEFAULT_PAD_VALUES, **self._checked_pad_values()}))
        unknown = set(self.batch_context) - set(CONTEXT_FIELDS)
        if unknown:
            raise ValueError(f"batch_context: expected keys among {CONTEXT_FIELDS}, got {sorted(unknown)}")
        self._set("batch_context", MappingProxyType(dict(self.batch_context)))
        if self.histogram is not None:
            self._set("histogram", histogram_from(self.histogram))
        if self.slot_pool is not None and not all(callable(getattr(self.slot_pool, name, None))
                                                  for name in ("allocate", "release")):
            raise TypeError(f"slot_pool: expected a buffer pool with allocate(spec) and release(tensor), "
                            f"got {type(self.slot_pool).__name__}")
        self._set("scratch_state", tuple(self.scratch_state))
        if not all(isinstance(tensor, torch.Tensor) for tensor in self.scratch_state):
            raise TypeError("scratch_state: expected a sequence of tensors")
        self._set("splitting_ops", resolve_splitting_ops(self.splitting_ops))
        self._set("piecewise_sizes", self._checked_piecewise_sizes())
        self._set("decode_steps", self._checked_decode_steps())
        if self.ubatch is not None:
            if not isinstance(self.ubatch, UBatchConfig):
                raise TypeError(f"ubatch: expected a UBatchConfig, got {type(self.ubatch).__name__}")
            if self.ubatch.threaded:
                raise ValueError("ubatch.threaded: expected False: one runner's graphs share static buffers, "
                                 "so its micro-batches must replay one after another")
        # Sizes left unset and filled in from max_batch_size (with_options must not keep them stale).
        self._set("_derived", tuple(name for name in unset if getattr(self, name)))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def with_options(self, **options: Any) -> "RunnerConfig":
        """This config with ``options`` replacing its values (``GraphRunner(model, config, **options)``).
        A different ``max_batch_size`` is refused while sizes this config derived from its own
        ``max_batch_size`` are not given too: they would no longer fit, and an error about them
        would name options the user never set."""
        size = options.get("max_batch_size", self.max_batch_size)
        stale = [name for name in self._derived if name not in options]
        if size != self.max_batch_size and stale:
            raise ValueError(
                f"max_batch_size: {size!r} given beside a RunnerConfig with max_batch_size={self.max_batch_size}, "
                f"whose default sizes were derived from {self.max_batch_size}; give max_batch_size in one place "
                f"(build the RunnerConfig with max_batch_size={size!r})")
        return dataclasses.replace(self, **options)

    def _checked_capture_sizes(self) -> Union[Tuple[int, ...], str]:
        sizes = self.capture_sizes
        if isinstance(sizes, str) and sizes == "auto":
            return sizes
        if self.max_graphs is not None:
            raise ValueError(f"max_graphs: only used with capture_sizes='auto', got capture_sizes={sizes!r}")
        if sizes is None:
            return tuple(default_capture_sizes(self.max_batch_size))
        if isinstance(sizes, str):
            raise ValueError(f"capture_sizes: expected None, 'auto' or a list of ints, got {sizes!r}")
        return tuple(normalize_capture_sizes(sizes, self.max_batch_size))

    def _checked_extend_sizes(self) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        if not any(mode.is_extend() for mode in self.modes):
            return None
        if self.extend_capture_sizes is None:
            token_sizes, req_sizes = DEFAULT_EXTEND_TOKENS, default_capture_sizes(self.max_batch_size)
        else:
            token_sizes, req_sizes = self.extend_capture_sizes
        return (tuple(normalize_capture_sizes(token_sizes, 1 << 20, "extend_capture_sizes[0]")),
                tuple(normalize_capture_sizes(req_sizes, self.max_batch_size, "extend_capture_sizes[1]")))

    def _checked_piecewise_sizes(self) -> Tuple[int, ...]:
        """The padded token counts of piecewise keys: none without splitting ops."""
        if not self.splitting_ops:
            if self.piecewise_sizes:
                raise ValueError("piecewise_sizes: expected None without splitting_ops (nothing splits the step), "
                                 f"got {self.piecewise_sizes!r}")
            return ()
        if self.piecewise_sizes is not None:
            return tuple(normalize_capture_sizes(self.piecewise_sizes, 1 << 20, "piecewise_sizes"))
        token_sizes = self.extend_capture_sizes[0] if self.extend_capture_sizes else DEFAULT_EXTEND_TOKENS
        return tuple(default_piecewise_sizes(max(self.max_batch_size, max(token_sizes))))

    def _checked_decode_steps(self) -> Tuple[int, ...]:
        """The step counts of multi-step keys, sorted and unique; each at least 2 (one step is a plain key)."""
        steps = self.decode_steps
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise ValueError(f"decode_steps: expected a sequence of ints >= 2, got {steps!r}")
        steps = tuple(steps)
        if not all(type(count) is int and count >= 2 for count in steps):
            raise ValueError(f"decode_steps: expected a sequence of ints >= 2, got {steps!r}")
        if self.next_tokens is not None and not callable(self.next_tokens):
            raise TypeError(f"next_tokens: expected a callable next_tokens(output, step), got "
                            f"{type(self.next_tokens).__name__}")
        return tuple(sorted(set(steps)))

    def _checked_pad_values(self) -> Mapping[str, int]:
        for name, value in self.pad_values.items():
            if name not in DEFAULT_PAD_VALUES:
                raise ValueError(f"pad_values: expected keys among {sorted(DEFAULT_PAD_VALUES)}, got {name!r}")
            if type(value) is not int or (name == "seq_lens" and value < 1):
                raise ValueError(f"pad_values[{name!r}]: expected an int (seq_lens >= 1; a negative slot or request "
                                 f"index for kernels that skip it), got {value!r}")
        return self.pad_values

    @property
    def extend_grid(self) -> Optional[SizeGrid]:
        """The (tokens, requests) keys of extend-style modes, or None when no such mode is asked for."""
        if self.extend_capture_sizes is None:
            return None
        return SizeGrid.for_extend(*self.extend_capture_sizes)
