"""What a step ran: observed at capture, so its guards come from the execution, not from the wrapped object.

``observe(step)`` runs the step once under a profiler (``sys.setprofile``, this thread) and keeps
the modules whose code ran, however the step reached them (a ``functools.partial``, a lambda over
an engine object, a global, an attribute), the functions of the model's own code that ran,
with the globals their code reads, and the torch.compile'd callables it called. ``entry_roots(fn)`` names what the wrapped callable holds (a
bound method's object, a partial's callable and arguments, a callable object, closure cells): the
objects through which a later call reaches those modules, whose bindings the guard checks.
"""

from __future__ import annotations

import collections.abc
import contextvars
import dis
import functools
import logging
import os
import random
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from graphrt.backends.base import StepRefusal
from graphrt.backends.compiled import compile_wrapper_codes
from graphrt.backends.source_lines import is_model_file
from graphrt.guards.reads import attribute_names, computed_names, global_attributes
from graphrt.layout.rebind_guard import RebindError

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_ENVIRON_GETITEM = os._Environ.__getitem__.__code__  # type: ignore[attr-defined]
_ENVIRON_FILES = (os.__file__, collections.abc.Mapping.get.__code__.co_filename)  # between a read and its caller
# Installed libraries and the standard library: their module globals are frozen at capture, like
# torch's (a per-call check of every global transformers reads would cost more than it could catch).
_LIBRARY_DIRS = tuple(sorted({os.path.join(os.path.realpath(path), "") for name in ("stdlib", "platstdlib", "purelib",
                                                                                    "platlib")
                              if (path := sysconfig.get_paths().get(name))}))
_MISSING = object()
MAX_CHAIN = 4  # wrappers followed from the wrapped callable (partial of a bound method of ...)
logger = logging.getLogger(__name__)


class HostRandomError(StepRefusal):
    """The step draws from Python's ``random`` or numpy's generators: no graph can hold it."""
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
    # per module class, the methods that ran on a module of it (what they read through self: graphrt.guards.reads)
    self_codes: Dict[type, Set[types.CodeType]] = field(default_factory=dict)
    # per class of any other object, the methods of the model's own code that ran on one (a config's property)
    object_codes: Dict[type, Set[types.CodeType]] = field(default_factory=dict)
    # the lines that ran, per method and per function of user code (None: not traced, under a debugger's tracer)
    lines: Optional[Dict[types.CodeType, Set[int]]] = None
    # the context variables the model's own code read (ContextVar.get) and the environment variables read
    context_variables: List[contextvars.ContextVar] = field(default_factory=list)
    environment: Set[str] = field(default_factory=set)
    host_draws: List[str] = field(default_factory=list)  # draws from Python's or numpy's generators, with their line
    # the Python state the step wrote of its own (graphrt.guards.step_writes): (id(holder), attribute or None)
    written: Set[Tuple[int, Any]] = field(default_factory=set)

    def lines_of(self, code: types.CodeType) -> Optional[Set[int]]:
        """The lines of ``code`` that ran, or None when they were not traced (any may have)."""
        return None if self.lines is None else self.lines.get(code, set())

    def attribute_names(self) -> Set[str]:
        """The attribute names the code that ran loads (graphrt.guards.reads.attribute_names): on the lines
        that ran where they were traced, anywhere in the code otherwise."""
        traced = self.lines or {}
        return set().union(*(attribute_names(code, traced.get(code)) for code in self.ran_codes))

    def reads_computed_names(self) -> bool:
        """Whether the model's own code that ran reads an attribute by a name computed at run time, on a line
        that ran (graphrt.guards.reads.computed_names): every attribute of the objects it reads then counts. A
        library's reads are frozen, as its globals are."""
        return any(computed_names(code, self.lines_of(code)) for code in self.codes)

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
        there to data or a class (not a Python module), but for those the step binds itself before
        reading them (a forward context set by the step: its value before the call is not read)."""
        names: Dict[int, Tuple[Dict[str, Any], Set[str]]] = {}
        for code, scope in self.codes.items():
            loaded = {name for name in _global_loads(code) if name in scope and not isinstance(
                scope[name], types.ModuleType) and not self._bound_by_step(scope, name)}
            if loaded:
                names.setdefault(id(scope), (scope, set()))[1].update(loaded)
        return [(scope, tuple(sorted(loaded))) for scope, loaded in names.values()]

    def _bound_by_step(self, scope: Dict[str, Any], name: str) -> bool:
        """Whether the step stores ``name`` before reading it (seen by opcode; a use not traced counts as a read)."""
        key = (id(scope), name)
        return key in self.bound and self.global_uses[key][3]

    def refuse_host_draws(self) -> None:
        """A step that draws from Python's ``random`` or numpy's generators is refused (HostRandomError):
        a graph replays the draws of its recording, where eager draws anew on every call."""
        if self.host_draws:
            raise HostRandomError(
                f"the step draws from a host random generator ({', '.join(self.host_draws)}): a graph replays "
                "the values its recording drew, where eager draws anew on every call. Draw with torch "
                "(torch.rand, torch.bernoulli: each replay draws as eager would), or pass the draws as an argument")

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
    modules, codes, all_codes, self_codes = (observation.modules, observation.codes, observation.ran_codes,
                                             observation.self_codes)
    object_codes = observation.object_codes
    context_variables, environment = observation.context_variables, observation.environment
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
                if isinstance(module, torch.nn.Module):
                    self_codes.setdefault(type(module), set()).add(code)
                    if id(module) not in seen:
                        seen.add(id(module))
                        modules.append(module)
                elif code is _ENVIRON_GETITEM and _read_by_user_code(frame):  # os.environ[...], .get, os.getenv
                    environment.add(frame.f_locals.get("key"))
                elif code in codes:  # a method of the model's own code on another object (a config's property)
                    object_codes.setdefault(type(module), set()).add(code)
        elif event == "c_call":
            target = getattr(arg, "__self__", None)
            if type(target) is contextvars.ContextVar and arg.__name__ == "get" and is_user_file(
                    frame.f_code.co_filename):
                if not any(target is variable for variable in context_variables):
                    context_variables.append(target)
            elif isinstance(target, random.Random):
                draw = _host_draw(frame, target, arg.__name__)
                if draw is not None and draw not in observation.host_draws:
                    observation.host_draws.append(draw)
        if outer is not None:
            outer(frame, event, arg)

    tracer = None if sys.gettrace() is not None else GlobalUses(observation)  # a debugger's tracer stays alone
    numpy_before = _numpy_state()
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
    if not _same_numpy_state(numpy_before, _numpy_state()):  # numpy's draws call no function a profiler sees
        observation.host_draws.append("numpy.random (its global generator drew during the step)")
    _include_cached_functions(observation)
    return result, observation


def _numpy_state() -> Any:
    """numpy's global generator's state, if numpy is imported."""
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _same_numpy_state(before: Any, after: Any) -> bool:
    if before is None or after is None:
        return before is after
    return before[2:] == after[2:] and bool((before[1] == after[1]).all())


def _host_draw(frame: types.FrameType, generator: random.Random, function: str) -> Optional[str]:
    """``random.random (model.py:12)`` for a draw the model's code made from a Python generator, else None
    (torch's or graphrt's own)."""
    caller: Optional[types.FrameType] = frame
    while caller is not None and caller.f_code.co_filename == random.__file__:
        caller = caller.f_back
    if caller is None or not is_model_file(caller.f_code.co_filename):
        return None
    name = f"random.{function}" if generator is getattr(random, "_inst", None) else f"{type(generator).__name__}.{function}"
    return f"{name} ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"


def _read_by_user_code(frame: types.FrameType) -> bool:
    """Whether the model's own code made this read of ``os.environ`` (through ``get``, ``getenv``, ``in``):
    a library's reads are frozen like its globals."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename in _ENVIRON_FILES:
        caller = caller.f_back
    return caller is not None and is_user_file(caller.f_code.co_filename)


def _include_cached_functions(observation: Observation) -> None:
    """The model's own ``functools.lru_cache``'d functions the step's code calls, as code whose globals it
    reads: a cache hit runs none of their Python, so the observed run may not have seen them (torch.compile
    traces through the cache wrapper likewise); a global they read changed (after ``cache_clear()``) is a
    change of the step's."""
    pending = list(observation.codes.items())
    while pending:
        code, scope = pending.pop()
        names = {*_global_loads(code), *(f"{owner}.{name}" for owner, name in global_attributes(code))}
        for name in names:
            owner, _, attribute = name.partition(".")
            value = scope.get(owner, _MISSING)
            if attribute:
                value = getattr(value, attribute, _MISSING) if isinstance(value, types.ModuleType) else _MISSING
            wrapped = getattr(value, "__wrapped__", None) if hasattr(value, "cache_clear") else None
            if isinstance(wrapped, types.FunctionType) and is_user_file(wrapped.__code__.co_filename) and (
                    wrapped.__code__ not in observation.codes):
                observation.codes[wrapped.__code__] = wrapped.__globals__
                pending.append((wrapped.__code__, wrapped.__globals__))


class GlobalUses:
    """A tracer of the user code's global loads and stores, opcode by opcode, in the order they run:
    a global the step stores before it reads it (a forward context the step sets) is no input of
    the step; one it reads and then rebinds (a counter) is Python state a replay would not change.
    Only frames of user code are traced opcode by opcode, and only during the observed run. It notes
    the lines that ran of user code and of every method (what a replay froze is what those lines read:
    graphrt.guards.reads)."""

    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        observation.lines = self._lines = {}
        self._uses: Dict[types.CodeType, Dict[int, Tuple[str, bool]]] = {}

    def trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        code = frame.f_code
        if not is_user_file(code.co_filename):
            return self._line if code.co_argcount and code.co_varnames[0] == "self" else None
        uses = self._uses.get(code)
        if uses is None:
            uses = self._uses[code] = _global_uses(code)
        if not uses:
            return self._line
        frame.f_trace_opcodes = True
        return self._opcode

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._lines.setdefault(frame.f_code, set()).add(frame.f_lineno)
        return self._line

    def _opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            use = self._uses[frame.f_code].get(frame.f_lasti)
            if use is not None:
                self.observation.note_global_use(frame.f_globals, *use)
        elif event == "line":
            self._lines.setdefault(frame.f_code, set()).add(frame.f_lineno)
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
