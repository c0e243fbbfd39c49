"""torch.compile'd code inside graphrt, and graphrt inside torch.compile'd code.

``mode="reduce-overhead"`` and ``"max-autotune"`` (inductor's ``triton.cudagraphs``) and the ``cudagraphs``
backend make the compiled code capture CUDA graphs of its own (cudagraph trees); recorded again
inside graphrt's graph they would nest, which CUDA refuses. They are refused by name wherever the
step reaches them: the callable handed to graphrt (``refuse_compiled_cudagraphs``), or compiled
code the step ran at capture, however reached (``refuse_nested_cudagraphs``: ``model.forward``
assigned back, a compiled submodule, a lambda over a compiled module). Fusion without graphs
(``mode="max-autotune-no-cudagraphs"``, or the default mode) pairs well: graphrt records the compiled
kernels on CUDA, and on CPU the recording runs the step's eager ops, which verification compares
with the compiled step's own numbers.

A compiled callable called while a dispatch mode is active (graphrt's state journal, recorder,
check) is skipped by Dynamo for good: its code is never compiled again. So every run graphrt
makes under its modes takes the eager path without Dynamo (``eager_stance``), and each key is
compiled by a run with no mode active before its recording (``graphrt.backends.compile_runs``).

graphrt's own entry points are opaque to Dynamo (``opaque_to_dynamo``): ``torch.compile`` around a
wrapped function breaks its graph there and calls graphrt, which replays its graphs, instead of
tracing graphrt's Python.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar

import torch

from graphrt.backends.base import StepRefusal

RECOMMENDED_MODE = "max-autotune-no-cudagraphs"
# What Dynamo says when it meets a graphrt entry point inside code it compiles (its graph-break log names it).
OPAQUE_REASON = ("graphrt replays its own CUDA graphs: its call runs outside torch.compile (a graph break here, "
                 "the code before and after it compiled)")
_Function = TypeVar("_Function", bound=Callable[..., Any])
_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl")  # a module compiled whole (its call, hooks included)


@dataclass(frozen=True)
class CompiledCallable:
    """A torch.compile'd callable met in a step: what it compiles, and with which backend."""

    name: str  # ``Linear.forward``, ``Llama`` (a compiled module), ``sampler``
    backend: str  # ``inductor``, ``eager``, ``aot_eager``, ``cudagraphs``, a custom backend's name
    cudagraphs: bool  # whether the compiled code captures CUDA graphs of its own

    def describe(self) -> str:
        return f"torch.compile({self.name}, backend={self.backend!r})"


def _context_of(fn: Any) -> Any:
    """The OptimizeContext ``fn`` was compiled with, or None when it is not a torch.compile'd callable."""
    context = getattr(fn, "dynamo_ctx", None)  # an OptimizedModule
    if context is None:  # a compiled function holds its OptimizeContext in its closure
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if type(contents).__name__ == "OptimizeContext":
                return contents
    return context if type(context).__name__ == "OptimizeContext" else None


def _backend_of(context: Any) -> Any:
    """The backend object a context compiles with (Dynamo's wrappers unwrapped)."""
    backend = getattr(context, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    return backend


def _uses_cudagraphs(backend: Any) -> bool:
    """Whether code compiled by ``backend`` captures CUDA graphs: Dynamo's ``cudagraphs`` backend, or
    inductor with ``triton.cudagraphs`` (the modes' options, else inductor's global config)."""
    name = getattr(backend, "compiler_name", None)
    if name == "cudagraphs":
        return True
    if name != "inductor":
        return False
    options = getattr(backend, "config", None) or {}
    if "triton.cudagraphs" in options:
        return bool(options["triton.cudagraphs"])
    inductor = sys.modules.get("torch._inductor.config")
    return bool(inductor is not None and inductor.triton.cudagraphs)


def _name_of(fn: Any) -> str:
    """A compiled callable's original, by name: ``Linear`` for a module, ``Linear.forward`` for a method."""
    original = getattr(fn, "_orig_mod", None)
    if original is not None:
        return type(original).__name__
    target = getattr(fn, "_torchdynamo_orig_callable", fn)
    target = getattr(target, "__wrapped__", target)  # Dynamo's wrap_inline around a module's call
    if isinstance(target, torch.nn.Module):
        return type(target).__name__
    owner = getattr(target, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        method = getattr(target, "__name__", "forward")
        return type(owner).__name__ if method in _CALLS else f"{type(owner).__name__}.{method}"
    return getattr(target, "__qualname__", None) or type(target).__name__


def compiled_callable(fn: Any, context: Any = None) -> Optional[CompiledCallable]:
    """What ``fn`` is when torch.compile'd (``context``: its OptimizeContext, when known), else None."""
    context = _context_of(fn) if context is None else context
    if context is None:
        return None
    backend = _backend_of(context)
    return CompiledCallable(_name_of(fn), _backend_name(backend), _uses_cudagraphs(backend))


def _backend_name(backend: Any) -> str:
    """``inductor``, ``eager``, a custom backend function's name, a backend object's class."""
    name = getattr(backend, "compiler_name", None)
    if isinstance(name, str) and not name.startswith("<"):
        return name
    compiler = getattr(backend, "compiler_fn", backend)
    return getattr(compiler, "__name__", None) or type(compiler).__name__


def describe_callable(fn: Any) -> str:
    """What a front wraps, in words: ``torch.compile(LlamaForCausalLM.forward, backend='inductor')``,
    ``LlamaForCausalLM.forward``, ``Stepper`` (a module), ``step`` (a function)."""
    found = compiled_callable(fn)
    return found.describe() if found is not None else _name_of(fn)


def is_compiled(fn: Any) -> bool:
    """Whether ``fn`` is a torch.compile'd callable (an OptimizedModule or a compiled function)."""
    return _context_of(fn) is not None


def _graphs_message(subject: str, found: CompiledCallable) -> str:
    return (f"{subject}{found.describe()} captures CUDA graphs of its own (mode='reduce-overhead' or 'max-autotune', "
            "or the 'cudagraphs' backend); graphrt's graphs cannot hold them. Compile it with "
            f"mode='{RECOMMENDED_MODE}' (fused kernels, no graphs) and let graphrt capture")


def refuse_compiled_cudagraphs(fn: Any, field: str) -> None:
    """Raise ValueError when ``fn`` was compiled to capture CUDA graphs itself (they would nest)."""
    found = compiled_callable(fn)
    if found is not None and found.cudagraphs:
        raise ValueError(_graphs_message(f"{field}: ", found))


class NestedGraphsError(StepRefusal, ValueError):
    """The step runs torch.compile'd code that captures CUDA graphs of its own: no key can hold it."""


def compiled_parts(calls: Iterable[Tuple[Any, Any]], modules: Sequence[torch.nn.Module]) -> List[CompiledCallable]:
    """The compiled callables a step ran: ``calls``, the (OptimizeContext, callable) pairs the step's
    run passed through (graphrt.guards.observe), and those the modules that ran hold (a compiled
    module, a compiled ``forward`` assigned back, ``Module.compile()``), seen even where the run's
    frames were not (under a C profiler). Each once."""
    found: List[CompiledCallable] = []
    seen = set()

    def add(fn: Any, context: Any = None) -> None:
        described = compiled_callable(fn, context)
        if described is not None and (id(fn), id(context)) not in seen:
            seen.add((id(fn), id(context)))
            if described not in found:
                found.append(described)

    for context, fn in calls:
        add(fn, context)
    for module in modules:
        for held in (module, module.__dict__.get("forward"), module.__dict__.get("_compiled_call_impl")):
            if held is not None and _context_of(held) is not None:
                add(held)
    return found


def refuse_nested_cudagraphs(parts: Sequence[CompiledCallable]) -> None:
    """Raise NestedGraphsError naming the first compiled callable the step ran that captures CUDA graphs."""
    for found in parts:
        if found.cudagraphs:
            raise NestedGraphsError(_graphs_message("the step runs ", found))


def compile_wrapper_codes() -> Tuple[Any, ...]:
    """The code objects of torch.compile's wrapper function (``compile_wrapper``, whose frame holds the
    OptimizeContext as ``self`` and the compiled callable as ``fn``); none while Dynamo is not imported
    (then no compiled code can run)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    context = getattr(eval_frame, "_TorchDynamoContext", None)
    call = getattr(getattr(context, "__call__", None), "__code__", None)
    if call is None:
        return ()
    return tuple(constant for constant in call.co_consts
                 if hasattr(constant, "co_name") and constant.co_name == "compile_wrapper")


def original_module(model: Any) -> Any:
    """The module a compiled module (``torch.compile(model)``, an OptimizedModule) compiles, else ``model``."""
    return getattr(model, "_orig_mod", model) if _context_of(model) is not None else model


def compiled_like(model: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled as ``model`` (an OptimizedModule) is: same backend, mode, options and dynamic."""
    return model.dynamo_ctx(fn)


def eager_stance() -> AbstractContextManager:
    """Compiled callables run their eager code, without Dynamo, inside the block: what graphrt
    wraps around every run under its dispatch modes (``torch.compiler.set_stance("force_eager")``,
    torch >= 2.6; on an older torch nothing changes, and a compiled model called under a mode
    stays uncompiled)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


def opaque_to_dynamo(function: _Function) -> _Function:
    """Mark a graphrt entry point so that Dynamo never traces it: code it compiles breaks its graph at
    the call (the reason, ``OPAQUE_REASON``, in Dynamo's graph-break log) and calls graphrt eagerly,
    and neither the entry point's frame nor any it calls is compiled by the enclosing torch.compile
    (torch.compiler.disable's semantics). Unlike torch.compiler.disable it wraps nothing, so a call
    outside torch.compile costs nothing more; the function is returned as it is."""
    function._torchdynamo_disable = True  # type: ignore[attr-defined]
    function._torchdynamo_disable_msg = OPAQUE_REASON  # type: ignore[attr-defined]
    function._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    action = getattr(eval_frame, "_FrameAction", None)
    strategy = getattr(eval_frame, "_FrameExecStrategy", None)
    if set_strategy is not None and action is not None and strategy is not None:
        set_strategy(function.__code__, strategy(action.SKIP, action.SKIP))  # this frame and those it calls
    return function
