"""What a step ran: observed at capture, so its guards come from the execution, not from the wrapped object.

``observe(step)`` runs the step once under a profiler (``sys.setprofile``, this thread) and keeps
the modules whose code ran, however the step reached them (a ``functools.partial``, a lambda over
an engine object, a global, an attribute), the functions of the model's own code that ran,
with the globals their code reads, and the torch.compile'd callables it called. ``entry_roots(fn)`` names what the wrapped callable holds (a
bound method's object, a partial's callable and arguments, a callable object, closure cells): the
objects through which a later call reaches those modules, whose bindings the guard checks.
"""

from __future__ import annotations

import dis
import functools
import logging
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import torch

from graphrt.backends.compiled import compile_wrapper_codes
from graphrt.backends.source_lines import is_model_file
from graphrt.layout.rebind_guard import RebindError

_CALL_IMPL = torch.nn.Module._call_impl.__code__
# Installed libraries and the standard library: their module globals are frozen at capture, like
# torch's (a per-call check of every global transformers reads would cost more than it could catch).
_LIBRARY_DIRS = tuple(sorted({os.path.join(os.path.realpath(path), "") for name in ("stdlib", "platstdlib", "purelib",
                                                                                    "platlib")
                              if (path := sysconfig.get_paths().get(name))}))
_MISSING = object()
MAX_CHAIN = 4  # wrappers followed from the wrapped callable (partial of a bound method of ...)
logger = logging.getLogger(__name__)
_warned_profiler = False


def is_user_file(filename: str) -> bool:
    """The model's own code outside installed libraries (a script, a notebook, the user's package)."""
    return is_model_file(filename) and not os.path.realpath(filename).startswith(_LIBRARY_DIRS)


@dataclass
class Observation:
    """What one run of a step ran."""

    modules: List[torch.nn.Module] = field(default_factory=list)  # in the order their code first ran
    codes: Dict[types.CodeType, Dict[str, Any]] = field(default_factory=dict)  # user code -> its globals
    ran_codes: Set[types.CodeType] = field(default_factory=set)  # every Python code object that ran
    # (id(globals), name) -> (globals, name, value before the step, whether the step's first use stored it)
    global_uses: Dict[Tuple[int, str], Tuple[Dict[str, Any], str, Any, bool]] = field(default_factory=dict)
    bound: Set[Tuple[int, str]] = field(default_factory=set)  # the globals the step rebound
    # torch.compile'd callables the step called, however reached: (OptimizeContext, the compiled callable)
    compiled_calls: List[Tuple[Any, Any]] = field(default_factory=list)

    def ran(self, code: types.CodeType) -> bool:
        return code in self.ran_codes

    def note_global_use(self, scope: Dict[str, Any], name: str, store: bool) -> None:
        """The step's user code is about to load (or store) the global ``name``: its first use keeps
        the value before the step and whether that use stores it."""
        key = (id(scope), name)
        if key not in self.global_uses:
            self.global_uses[key] = (scope, name, scope.get(name, _MISSING), store)

    def globals_read(self) -> List[Tuple[Dict[str, Any], Tuple[str, ...]]]:
        """Per globals dict of the user code that ran, the names its code loads that are bound
        there to data (not a Python module or a class: a rebound class leaves made objects alone),
        but for those the step binds itself before reading them (a forward context set by the step:
        its value before the call is not read)."""
        names: Dict[int, Tuple[Dict[str, Any], Set[str]]] = {}
        for code, scope in self.codes.items():
            loaded = {name for name in _global_loads(code) if name in scope and not isinstance(
                scope[name], (types.ModuleType, type)) and not self._bound_by_step(scope, name)}
            if loaded:
                names.setdefault(id(scope), (scope, set()))[1].update(loaded)
        return [(scope, tuple(sorted(loaded))) for scope, loaded in names.values()]

    def _bound_by_step(self, scope: Dict[str, Any], name: str) -> bool:
        """Whether the step stores ``name`` before reading it (seen by opcode; a use not traced counts as a read)."""
        key = (id(scope), name)
        return key in self.bound and self.global_uses[key][3]

    def refuse_assigned_globals(self) -> None:
        """A step that reads a global and then rebinds it (a counter ``COUNT += 1``) changes Python
        state a replay would not change: each such global is put back and RebindError raised."""
        assigned = [self.global_uses[key] for key in self.bound if not self.global_uses[key][3]]
        for scope, name, before, _ in assigned:
            if before is _MISSING:
                scope.pop(name, None)
            else:
                scope[name] = before
        if assigned:
            names = ", ".join(f"global {name}" for _, name, _, _ in assigned)
            raise RebindError(f"{names}: the step reads and then assigns it; a graph replays the step's tensor work, "
                              "never its Python, so replays would go on with the captured value. Keep such state in "
                              "a tensor written in place, or pass it as an argument")


def observe(step: Callable[[], Any]) -> Tuple[Any, Observation]:
    """Run ``step`` once, seeing what it runs; its result and the observation. A Python profiler
    already set (a debugger's) keeps getting its events; under a C profiler (``cProfile``), which
    cannot be chained, the modules are seen through a global forward pre-hook instead, and the
    functions and globals not at all (logged once)."""
    outer = sys.getprofile()
    if outer is not None and not callable(outer):
        return _observe_modules(step)
    observation = Observation()
    seen: Set[int] = set()
    modules, codes, all_codes = observation.modules, observation.codes, observation.ran_codes
    compile_wrappers, compiled_calls = compile_wrapper_codes(), observation.compiled_calls

    def profile(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            code = frame.f_code
            if code in compile_wrappers:  # torch.compile's wrapper: its context and the callable it compiles
                names = frame.f_locals
                call = (names.get("self"), names.get("fn"))
                if not any(call[0] is context and call[1] is fn for context, fn in compiled_calls):
                    compiled_calls.append(call)
            if code not in all_codes:
                all_codes.add(code)
                if is_user_file(code.co_filename):
                    codes[code] = frame.f_globals
            if code is _CALL_IMPL or code.co_argcount and code.co_varnames[0] == "self":
                module = frame.f_locals.get("self")
                if isinstance(module, torch.nn.Module) and id(module) not in seen:
                    seen.add(id(module))
                    modules.append(module)
        if outer is not None:
            outer(frame, event, arg)

    tracer = None if sys.gettrace() is not None else GlobalUses(observation)  # a debugger's tracer stays alone
    sys.setprofile(profile)
    if tracer is not None:
        sys.settrace(tracer.trace)
    try:
        result = step()
    finally:
        if tracer is not None:
            sys.settrace(None)
        sys.setprofile(outer)
    observation.bound = {key for key, (scope, name, before, _) in observation.global_uses.items()
                         if scope.get(name, _MISSING) is not before}
    return result, observation


class GlobalUses:
    """A tracer of the user code's global loads and stores, opcode by opcode, in the order they run:
    a global the step stores before it reads it (a forward context the step sets) is no input of
    the step; one it reads and then rebinds (a counter) is Python state a replay would not change.
    Only frames of user code are traced opcode by opcode, and only during the observed run."""

    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        self._uses: Dict[types.CodeType, Dict[int, Tuple[str, bool]]] = {}

    def trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "call" or not is_user_file(frame.f_code.co_filename):
            return None
        code = frame.f_code
        uses = self._uses.get(code)
        if uses is None:
            uses = self._uses[code] = _global_uses(code)
        if not uses:
            return None
        frame.f_trace_opcodes = True
        return self._opcode

    def _opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            use = self._uses[frame.f_code].get(frame.f_lasti)
            if use is not None:
                self.observation.note_global_use(frame.f_globals, *use)
        return self._opcode


def _observe_modules(step: Callable[[], Any]) -> Tuple[Any, Observation]:
    """``observe`` under a C profiler: the modules called, through a global forward pre-hook."""
    global _warned_profiler
    if not _warned_profiler:
        _warned_profiler = True
        logger.info("a C profiler (cProfile) is active: graphrt sees the modules a captured step runs through a "
                    "forward pre-hook, and does not guard the globals and closure variables its code reads")
    observation = Observation()
    seen: Set[int] = set()

    def called(module: torch.nn.Module, args: Any) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            observation.modules.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(called)
    try:
        result = step()
    finally:
        handle.remove()
    return result, observation


def _global_uses(code: types.CodeType) -> Dict[int, Tuple[str, bool]]:
    """By instruction offset, the global names ``code`` loads or stores: ``(name, is a store)``."""
    return {instruction.offset: (instruction.argval, instruction.opname != "LOAD_GLOBAL")
            for instruction in dis.get_instructions(code)
            if instruction.opname in ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL") and isinstance(
                instruction.argval, str)}


def _global_loads(code: types.CodeType) -> Set[str]:
    """The global names ``code`` loads (and those of the code objects nested in it: comprehensions)."""
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    return {name for name in names if isinstance(name, str)}


def entry_roots(fn: Any) -> List[Tuple[str, Any]]:
    """``(name, object)`` for what a wrapped callable holds and a call reaches its model through:
    a bound method's object, a partial's callable and arguments, a callable object itself, the
    contents of closure cells; followed through a few wrappers."""
    roots: List[Tuple[str, Any]] = []
    seen: Set[int] = set()

    def add(name: str, value: Any, depth: int) -> None:
        if id(value) in seen or depth > MAX_CHAIN or value is None:
            return
        seen.add(id(value))
        if isinstance(value, functools.partial):
            add(name, value.func, depth + 1)
            for index, argument in enumerate(value.args):
                add(f"{name}.args[{index}]", argument, depth + 1)
            for key, argument in value.keywords.items():
                add(f"{name}.keywords[{key!r}]", argument, depth + 1)
            return
        if isinstance(value, types.MethodType):
            add(type(value.__self__).__name__, value.__self__, depth + 1)
            return
        if isinstance(value, types.FunctionType):
            for cell_name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
                try:
                    add(cell_name, cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    continue
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                add(name, wrapped, depth + 1)
            return
        if isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)) or _is_constant(value):
            return
        roots.append((name, value))
        wrapped = getattr(value, "__wrapped__", None)  # a wrapper object (GraphedCallable, a decorator class)
        if wrapped is not None and not isinstance(value, torch.nn.Module):
            add(name, wrapped, depth + 1)

    add(_name_of(fn), fn, 0)
    return roots


def entry_functions(fn: Any) -> List[types.FunctionType]:
    """The Python functions a wrapped callable holds (itself, through partials and bound methods,
    and functions in its closure cells), whose closure cells a later call reads again."""
    found: List[types.FunctionType] = []
    seen: Set[int] = set()

    def add(value: Any, depth: int) -> None:
        if id(value) in seen or depth > MAX_CHAIN:
            return
        seen.add(id(value))
        if isinstance(value, functools.partial):
            add(value.func, depth + 1)
        elif isinstance(value, types.MethodType):
            add(value.__func__, depth + 1)
        elif isinstance(value, types.FunctionType):
            found.append(value)
            for cell in value.__closure__ or ():
                try:
                    add(cell.cell_contents, depth + 1)
                except ValueError:
                    continue
            add(getattr(value, "__wrapped__", None), depth + 1)
        elif callable(value) and not isinstance(value, (type, torch.nn.Module)):
            add(getattr(type(value), "__call__", None), depth + 1)

    add(fn, 0)
    return found


def _name_of(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _is_constant(value: Any) -> bool:
    return isinstance(value, (int, float, complex, bool, str, bytes, torch.dtype, torch.device))


def functions_that_ran(functions: Sequence[Any], observation: Observation) -> List[types.FunctionType]:
    """Those of ``functions`` whose code ran in the observed step, holds closure cells and is the
    model's own (a library's closures, its decorators' ``func``, are frozen like its globals)."""
    return [function for function in functions if isinstance(function, types.FunctionType)
            and function.__closure__ and observation.ran(function.__code__)
            and is_user_file(function.__code__.co_filename)]
