"""Record one call of a step as a graph of aten ops, and build a replayable module from it.

Recording runs the step once under a ``TorchDispatchMode``: every aten op is executed and
kept with its arguments and the model source line that issued it. The recorder is invisible
to the model: no torch-function mode is active (``has_torch_function`` stays False, so code
with a fast path takes it as under a CUDA capture); host reads that never reach the
dispatcher on CPU (``tolist``, ``numpy``) are caught by patching those two tensor methods. Tensors no recorded op
produced (static inputs, parameters, KV caches) are *external*: the graph keeps an alias of
their memory as captured and reads its current contents on every replay, as a CUDA graph
keeps their addresses (a parameter whose ``.data`` is swapped later is not seen, on either). Python scalars and branches are frozen into the graph. Ops that need the
host to read device memory (``.item()``, ``nonzero``, boolean-mask indexing, ...) raise
``HostSyncError`` naming the op and the model line: a CUDA capture fails on them too.
"""

from __future__ import annotations

import contextvars
import keyword
import linecache
import operator
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphrt.backends.base import CollectiveError
from graphrt.backends.source_lines import SourceLine, model_source_line, torch_source_line
from graphrt.backends.state_journal import op_base_name, storage_key

# Tensor methods that read values on the host without an aten op on CPU (``np.asarray`` calls numpy).
_HOST_READ_METHODS = ("tolist", "numpy")
# Values FX code can hold as literals; any other non-tensor argument becomes a module attribute.
_FX_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """The captured step reads device memory on the host: a CUDA graph cannot capture it."""


@dataclass
class RecordedOp:
    """One executed aten op: what ran, on what, what it returned, and the model line that ran it."""

    func: Callable[..., Any]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    output: Any
    source: Optional[SourceLine]


# Ops that read tensor values on the host but carry no tag saying so.
_HOST_READING_OPS = {
    _aten._nested_tensor_from_mask.default: "a nested tensor's sizes are read from the mask's values",
    _aten._nested_tensor_from_mask_left_aligned.default: "it reads the mask's values to check its alignment",
    _aten.equal.default: "it returns a Python bool read from both tensors' values",
    _aten.is_nonzero.default: "it returns a Python bool read from the tensor's value",
}


# Compute capabilities on which torch's grouped_mm runs its fast path (bfloat16 only): aten/src/ATen/native/cuda/
# GroupedBlas.cpp ``_grouped_mm_cuda`` (``_scaled_mm_allowed_device(sm90_only, sm100_only)``), torch 2.9 to 2.11.
GROUPED_MM_FAST_MAJORS = (9, 10)


def _target_capability(tensor: torch.Tensor, cuda_target: bool) -> Optional[Tuple[int, int]]:
    """The compute capability of the GPU ``tensor``'s kernels run on: its own device's, or with
    ``cuda_target`` (a CPU tensor standing for a GPU one) the current GPU's; (0, 0) where unknown;
    None where none will."""
    if tensor.is_cuda:
        return torch.cuda.get_device_capability(tensor.device)
    if not cuda_target:
        return None
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def grouped_mm_fallback_reason(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                               cuda_target: bool = False) -> Optional[str]:
    """Why ``grouped_mm(mat_a, mat_b, offs=...)`` would take torch's fallback on a GPU, which copies the
    offsets to the host inside the kernel (``offs.cpu()``, ``.item()`` per group, below any dispatch mode),
    or None. The fast path takes bfloat16 operands and output on compute capability 9.x or 10.x only;
    transformers' default experts implementation (``grouped_mm``) calls it, so a float32 or float16
    Hugging Face MoE fails its capture on every GPU. ``cuda_target``: judge CPU tensors as the GPU's
    (graphrt.check); an unknown GPU is given the fast path for bfloat16."""
    capability = _target_capability(mat_a, cuda_target)
    if capability is None:
        return None
    dtypes = {mat_a.dtype, mat_b.dtype, out_dtype or mat_a.dtype}
    if dtypes != {torch.bfloat16}:
        names = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes))
        return (f"grouped_mm on {names} takes torch's fallback, which copies the offsets to the host (its fast "
                "path takes bfloat16 on compute capability 9.x/10.x only): use bfloat16 weights, or "
                "experts_implementation='batched_mm'")
    if capability != (0, 0) and capability[0] not in GROUPED_MM_FAST_MAJORS:
        return (f"grouped_mm on compute capability {capability[0]}.{capability[1]} takes torch's fallback, which "
                "copies the offsets to the host (its fast path runs on 9.x/10.x only): use "
                "experts_implementation='batched_mm'")
    return None


def host_sync_reason(func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
                     cuda_target: bool = False) -> Optional[str]:
    """Why ``func`` on these arguments would read device memory on the host, or None. ``cuda_target``:
    CPU tensors stand for GPU ones (graphrt.check names what a GPU's kernels would sync on)."""
    if func is _aten._grouped_mm.default:
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
        return None if offs is None else grouped_mm_fallback_reason(args[0], args[1], out_dtype, cuda_target)
    if func is _aten.index.Tensor or func in (_aten.index_put_.default, _aten.index_put.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(index is not None and index.dtype in (torch.bool, torch.uint8) for index in indices):
            return "boolean-mask indexing (its output size depends on the mask's values)"
        return None
    if func is _aten.repeat_interleave.Tensor:
        return None if kwargs.get("output_size") is not None else "repeat_interleave without output_size"
    if func in _HOST_READING_OPS:
        return _HOST_READING_OPS[func]
    tags = func.tags
    if torch.Tag.data_dependent_output in tags:
        return "it returns a value read from device memory"
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on tensor values"
    return None


def _host_sync_message(op: str, why: str, source: Optional[SourceLine], torch_source: Optional[SourceLine]) -> str:
    where = f" at {source}" if source is not None else ""
    inside = f" (in {torch_source})" if torch_source is not None else ""
    return (
        f"host sync in the captured step: {op}{inside}{where}: {why}. A CUDA graph cannot capture it "
        "('operation not permitted when stream is capturing'); keep the step's values on the device"
    )


def _makes_nested(args: Sequence[Any], output: Any) -> bool:
    """A nested tensor made from dense ones: its sizes were read from tensor values."""
    return (isinstance(output, torch.Tensor) and output.is_nested
            and not any(isinstance(arg, torch.Tensor) and arg.is_nested for arg in args))


class OpRecorder(TorchDispatchMode):
    """Executes and records every aten op of the block; raises HostSyncError on host reads.

    Only dispatcher-level hooks are used (this mode, and ``tolist``/``numpy`` patched for the
    recording threads: ``_RecordingThreads``), so the model sees what it sees under a CUDA capture:
    no torch-function mode, ``torch.cuda.is_current_stream_capturing()`` True.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[RecordedOp] = []
        # The context variables the step ran with (taken at its first op): a replay that re-runs
        # Python (a custom op's) sees them as they were, as a CUDA graph keeps its capture's host values.
        self.context: Optional[contextvars.Context] = None
        self._host_reads_allowed = False
        self.cuda_target = False  # CPU tensors stand for GPU ones (graphrt.check): name the GPU's syncs too

    def __enter__(self) -> "OpRecorder":
        _RecordingThreads.enter(self)
        try:
            super().__enter__()
        except BaseException:
            _RecordingThreads.exit(self)
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            _RecordingThreads.exit(self)

    @contextmanager
    def host_reads_allowed(self) -> Iterator[None]:
        """A block whose host reads are no hazard: an op run eagerly outside any graph (a
        splitting op between graph pieces) may read host values."""
        self._host_reads_allowed = True
        try:
            yield
        finally:
            self._host_reads_allowed = False

    def _report_host_read(self, op: str, why: str, args: Sequence[Any]) -> None:
        if not self._host_reads_allowed:
            self.on_host_sync(op, why, args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if self.context is None:
            self.context = contextvars.copy_context()
        why = host_sync_reason(func, args, kwargs, self.cuda_target)
        if why is not None:
            self._report_host_read(str(func), why, args)
        output = func(*args, **kwargs)
        if _makes_nested(args, output):
            self._report_host_read(str(func), "a nested tensor's sizes are read from tensor values", args)
        self.ops.append(RecordedOp(func, args, kwargs, output, model_source_line()))
        return output

    def on_host_sync(self, op: str, why: str, args: Sequence[Any]) -> None:
        """A host read of device memory: raise HostSyncError, as a CUDA capture fails on it.
        ``graphrt.check`` overrides this to note every host read of a step and go on."""
        raise HostSyncError(_host_sync_message(op, why, model_source_line(), torch_source_line()))


class _RecordingThreads:
    """The process-wide patches every recorder needs (``Tensor.tolist``/``numpy``: host reads that
    reach no aten op on CPU; ``torch.cuda.is_current_stream_capturing``: True, as under a CUDA
    capture), installed while any thread records and acting for the recording threads only (the
    innermost recorder of each); removed, under a lock, when the last recording ends, whatever
    order recordings in several threads end in."""

    _lock = threading.Lock()
    _active = threading.local()  # .recorders: this thread's recorders, innermost last
    _count = 0  # recordings in progress, all threads
    _originals: Dict[Tuple[Any, str], Any] = {}

    @classmethod
    def enter(cls, recorder: "OpRecorder") -> None:
        with cls._lock:
            if cls._count == 0:
                cls._install()
            cls._count += 1
        stack = getattr(cls._active, "recorders", None)
        if stack is None:
            stack = cls._active.recorders = []
        stack.append(recorder)

    @classmethod
    def exit(cls, recorder: "OpRecorder") -> None:
        stack = cls._active.recorders
        stack.remove(recorder)
        with cls._lock:
            cls._count -= 1
            if cls._count == 0:
                for (owner, name), original in cls._originals.items():
                    setattr(owner, name, original)
                cls._originals.clear()

    @classmethod
    def current(cls) -> Optional["OpRecorder"]:
        """The innermost recorder of the calling thread, or None."""
        stack = getattr(cls._active, "recorders", None)
        return stack[-1] if stack else None

    @classmethod
    def _install(cls) -> None:
        for name in _HOST_READ_METHODS:
            cls._patch(torch.Tensor, name, cls._host_read(name, getattr(torch.Tensor, name)))
        original_capturing = torch.cuda.is_current_stream_capturing

        def capturing() -> bool:
            return True if cls.current() is not None else original_capturing()

        cls._patch(torch.cuda, "is_current_stream_capturing", capturing)

    @classmethod
    def _patch(cls, owner: Any, name: str, replacement: Any) -> None:
        cls._originals[owner, name] = getattr(owner, name)
        setattr(owner, name, replacement)

    @classmethod
    def _host_read(cls, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """``Tensor.<name>`` that reports a host read to the calling thread's recorder, if it records."""

        def guarded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            recorder = cls.current()
            if recorder is not None:
                recorder._report_host_read(f"Tensor.{name}", "it copies tensor values to the host", (tensor,))
            return method(tensor, *args, **kwargs)

        return guarded


@dataclass
class OpGraph:
    """A recorded step as an FX module: calling ``forward()`` re-runs every op on the external
    tensors' current contents and returns the fresh outputs that must be copied out. It holds
    no recorded op, so the recording's intermediates are freed once the graph is built."""

    module: torch.fx.GraphModule
    copy_targets: List[torch.Tensor]  # captured outputs in fresh memory, refreshed every replay


def build_op_graph(ops: List[RecordedOp], outputs: Any) -> OpGraph:
    """Turn recorded ops into straight-line FX code; ``outputs`` is what the step returned."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    nodes: Dict[int, torch.fx.Node] = {}
    externals: List[torch.Tensor] = []
    constants = 0

    def to_node_arg(value: Any) -> Any:
        nonlocal constants
        if isinstance(value, torch.Tensor):
            node = nodes.get(id(value))
            if node is None:  # not produced by a recorded op: read live at every replay
                name = f"external_{len(externals)}"
                externals.append(value)
                # An alias of the captured memory, as a CUDA graph keeps the captured address: a
                # tensor whose memory is swapped later (``param.data = other``) is not seen.
                with torch.inference_mode(False):
                    root.register_buffer(name, value.detach(), persistent=False)
                node = nodes[id(value)] = graph.get_attr(name)
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(to_node_arg(item) for item in value)
        if isinstance(value, _FX_LITERALS):
            return value
        name = f"constant_{constants}"  # e.g. a torch.Generator: kept as an attribute, not as code
        constants += 1
        setattr(root, name, value)
        return graph.get_attr(name)

    for op in ops:
        node = graph.call_function(_fx_target(op.func), tree_map(to_node_arg, op.args), tree_map(to_node_arg, op.kwargs))
        if any(_is_work(leaf) for leaf in tree_flatten(op.output)[0]):
            graph.call_function(wait_collectives, (node,))
        if isinstance(op.output, torch.Tensor):
            nodes[id(op.output)] = node
        elif isinstance(op.output, (list, tuple)):
            for index, item in enumerate(op.output):
                if isinstance(item, torch.Tensor):
                    nodes[id(item)] = graph.call_function(operator.getitem, (node, index))

    external_storages = {storage_key(tensor) for tensor in externals}
    copy_targets, returned = [], []
    for leaf in tree_flatten(outputs)[0]:
        if not isinstance(leaf, torch.Tensor) or id(leaf) not in nodes:
            continue  # external tensors and Python values are returned as captured
        if storage_key(leaf) in external_storages:
            continue  # a view of a static tensor: its memory is what the model wrote
        copy_targets.append(leaf)
        returned.append(nodes[id(leaf)])
    graph.output(returned)
    module = torch.fx.GraphModule(root, graph, class_name="RecordedStep")
    _forget_source_with(module)
    return OpGraph(module, copy_targets)


def _forget_source_with(module: torch.fx.GraphModule) -> None:
    """When ``module`` is freed, drop the generated source torch.fx keeps for it in a process-wide cache
    (and ``linecache``) forever: without this, every graph recorded and dropped (an engine built and
    dropped, a recapture) would keep its source."""
    loader = getattr(torch.fx.graph_module, "_loader", None)
    filename = getattr(getattr(type(module).forward, "__code__", None), "co_filename", None)
    if loader is not None and isinstance(getattr(loader, "eval_cache", None), dict) and filename:
        weakref.finalize(module, _forget_source, loader.eval_cache, filename)


def _forget_source(cache: Dict[str, str], filename: str) -> None:
    cache.pop(filename, None)
    linecache.cache.pop(filename, None)


_KEYWORD_OVERLOADS: Dict[Any, Callable[..., Any]] = {}


def _fx_target(func: Any) -> Callable[..., Any]:
    """What FX calls for ``func``: the op itself, unless its overload name is a Python keyword
    (``aten.random_.from``), which FX would write as invalid code; then a function calling it."""
    if not keyword.iskeyword(getattr(func, "_overloadname", "")):
        return func
    target = _KEYWORD_OVERLOADS.get(func)
    if target is None:
        def target(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        target.__name__ = f"{op_base_name(func)}_{func._overloadname}_overload"
        _KEYWORD_OVERLOADS[func] = target
    return target


def _is_work(value: Any) -> bool:
    """A c10d collective's handle (what ``dist.all_reduce`` waits on before it returns)."""
    if isinstance(value, torch.ScriptObject):
        return value._type().qualified_name().endswith("c10d.Work")
    return type(value).__name__ == "Work" and hasattr(value, "wait")


def wait_collectives(output: Any) -> None:
    """Wait for the collectives an op started: eager ``dist.all_reduce`` waits before returning. A wait
    that fails (a peer gone, or past the group's timeout) raises ``CollectiveError``."""
    for leaf in tree_flatten(output)[0]:
        if _is_work(leaf):
            try:
                leaf.wait()
            except RuntimeError as error:
                raise CollectiveError(f"a collective of the replay failed: {error}") from error

