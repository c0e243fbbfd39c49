"""The plain objects and containers a step reads, found from what it ran.

A graph froze every value its step read, not only those of the modules it ran: a config object the
forward reads (``self.config.final_logit_softcapping``, ``config._attn_implementation`` set by
``set_attn_implementation``), a dict attribute (``self.sampling_cfg["temperature"]``), the containers and
objects of its closures, globals and ``functools.partial`` keywords (``tables["cos"]``), a forward hook
object's attributes, an object nested in an object argument, a submodule whose attribute it reads
without calling it (``F.dropout(h, self.dropout.p)``). ``step_reads`` names them from the observed run
(graphrt.guards.observe) and the step's bytecode on the lines that ran (graphrt.guards.reads): plain
objects are watched like modules (their class's ``__setattr__`` bumps the state epoch, naming the
attribute), containers are compared per call (graphrt.guards.in_place).
"""

from __future__ import annotations

import functools
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Set, Tuple

import torch

from graphrt.guards.adapters import is_adapter_layer
from graphrt.guards.attributes import attributes, has_attributes
from graphrt.guards.in_place import is_container
from graphrt.guards.observe import Observation
from graphrt.guards.python_state import MODULE_INTERNALS
from graphrt.guards.reads import global_attributes, only_appended, self_attributes, self_chains

MAX_DEPTH = 2  # objects followed below an object argument or a read object


@dataclass
class Reads:
    """What a step reads besides its modules' own state, each with its path in words."""

    objects: List[Tuple[str, Any]] = field(default_factory=list)  # plain objects
    containers: List[Tuple[str, Any]] = field(default_factory=list)  # dicts, lists, sets, buffers read in place
    submodules: List[torch.nn.Module] = field(default_factory=list)  # read without being called
    thread_locals: List[Tuple[str, threading.local]] = field(default_factory=list)  # read as this thread sees them
    computed: bool = False  # the step reads attributes by computed names: every attribute of what it reads counts
    _seen: Set[int] = field(default_factory=set)

    def mark(self, value: Any) -> bool:
        """Whether ``value`` is met for the first time (it is marked seen)."""
        if id(value) in self._seen:
            return False
        self._seen.add(id(value))
        return True

    def add(self, path: str, value: Any, depth: int = 0, containers: bool = True) -> None:
        """``value`` read at ``path``: a plain object (and what it holds, ``depth`` levels down), a container, or
        a ``functools.partial`` (its keywords and arguments); ``containers``: whether the object's own containers
        are read in place too."""
        if id(value) in self._seen or depth > MAX_DEPTH:
            return
        if is_container(value):
            self._seen.add(id(value))
            self.containers.append((path, value))
        elif isinstance(value, threading.local):
            self._seen.add(id(value))
            self.thread_locals.append((path, value))
        elif isinstance(value, functools.partial):  # what a call of it passes: its keywords and arguments
            self._seen.add(id(value))
            self.add(f"{path}.keywords", value.keywords, depth)
            for index, argument in enumerate(value.args):
                self.add(f"{path}.args[{index}]", argument, depth)
        elif is_plain_object(value):
            self._seen.add(id(value))
            self.objects.append((path, value))
            for name, held in attributes(value).items():
                if is_plain_object(held) or containers and is_container(held):
                    self.add(f"{path}.{name}", held, depth + 1, containers)


def is_plain_object(value: Any) -> bool:
    """An object whose attributes a step can read: not a module, tensor, function, class, Python module,
    partial or graphrt's own object (a GraphedCallable, an attention backend refreshing its metadata before
    each replay), a user's subclass of one included (it keeps graphrt's protocol: the runner writes its
    per-step metadata)."""
    if not has_attributes(value) or isinstance(value, (torch.nn.Module, torch.Tensor, type, types.FunctionType,
                                                       types.MethodType, types.ModuleType, functools.partial)):
        return False
    return not any(klass.__module__.split(".")[0] == "graphrt" for klass in type(value).__mro__)


def step_reads(observation: Observation, objects: Sequence[Tuple[str, Any]], entry: Sequence[Tuple[str, Any]],
               fn: Any, functions: Sequence[types.FunctionType]) -> Reads:
    """What the step read: from the modules that ran, at the names their methods load through ``self`` on
    the lines that ran (and ``self.name.attribute`` into a read object's containers); the closure cells of
    ``functions`` (the model's own functions that ran) and the globals its code read, with the containers of
    the objects it reads attributes of; ``fn``'s partial keywords; the forward hook objects of the modules
    that ran; the object arguments ``objects`` and what they hold. ``entry``: what the wrapped callable
    holds: its containers and the objects in its closure cells are read, but the bookkeeping of an object it is
    bound to or is (an engine's timers) is not the step's."""
    reads = Reads()
    holders = {id(value) for _, value in entry}
    for path, obj in objects:  # their attributes are the step's (graphrt.guards.python_state): what they hold too
        reads.mark(obj)
        for name, held in attributes(obj).items():
            reads.add(f"{path}.{name}", held, 1)
    ran = {id(module) for module in observation.modules}
    for module in observation.modules:
        _module_reads(module, observation, reads, ran)
    for function in functions:
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if only_appended(function.__code__, name):
                continue  # a log the step appends to (a hook's ``logged.append(...)``): never read
            # an object in a closure cell, the wrapped function's own included, is read like a global one:
            # its attributes the step's code loads (a table of tensors, a setting) are the step's state
            reads.add(f"{name} (closure of {function.__qualname__})", value, containers=False)
    for scope, names in observation.globals_read():
        for name in names:
            if _global_log(observation, scope, name):
                continue  # a global log the step appends to (a custom op's ``SEEN.append(...)``): never read
            if id(scope[name]) not in holders or is_container(scope[name]):
                reads.add(f"global {name}", scope[name], containers=False)
    for code, scope in observation.codes.items():  # GLOBAL.name: a container of a global object, read in place
        for owner, name in global_attributes(code, observation.lines_of(code)):
            value = scope.get(owner)
            held = attributes(value).get(name) if is_plain_object(value) and id(value) not in holders else None
            if is_container(held):
                reads.add(f"global {owner}.{name}", held)
    for partial in _partials(fn):
        reads.add(_name(partial), partial)
    for path, obj in list(reads.objects):  # a container an object's own methods index (``self.values[0]``)
        _object_reads(path, obj, observation, reads)
    reads.computed = observation.reads_computed_names()
    if reads.computed:  # getattr(obj, "table_" + kind)[0]: any container of what it reads may be the one
        for module in observation.modules:
            if is_adapter_layer(module):  # PEFT's containers change through its API, which bumps the epoch
                continue
            for name, value in vars(module).items():
                if name not in MODULE_INTERNALS and is_container(value):
                    reads.add(f"{type(module).__name__}.{name}", value)
        for path, obj in list(reads.objects):
            for name, held in attributes(obj).items():
                if is_container(held):
                    reads.add(f"{path}.{name}", held)
    for module in observation.modules:
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for hook in table.values():
                owner = getattr(hook, "__self__", hook)
                if is_plain_object(owner):
                    reads.add(f"a forward hook of {type(module).__name__}", owner, containers=False)
    return reads


def _module_reads(module: torch.nn.Module, observation: Observation, reads: Reads, ran: Set[int]) -> None:
    """What ``module``'s methods that ran read through ``self`` (on the lines that ran)."""
    codes = observation.self_codes.get(type(module), ())
    names: Set[str] = set()
    chains: Set[Tuple[str, str]] = set()
    for code in codes:
        lines = observation.lines_of(code)
        names |= self_attributes(code, lines)
        chains |= self_chains(code, lines)
    own, children = vars(module), module._modules
    owner = type(module).__name__
    adapter = is_adapter_layer(module)  # PEFT's containers change through its API, which bumps the epoch
    for name in names - MODULE_INTERNALS:
        child = children.get(name)
        if child is not None and id(child) not in ran and reads.mark(child):
            reads.submodules.append(child)  # read, never called: its attributes are read (self.dropout.p)
        value = own.get(name)
        if value is not None and not name.startswith("__") and not (adapter and is_container(value)):
            reads.add(f"{owner}.{name}", value, containers=False)
    for name, attribute in chains:  # self.config.rope_scaling: a container of a read object, read in place
        obj = own.get(name)
        held = attributes(obj).get(attribute) if is_plain_object(obj) else None
        if is_container(held):
            reads.add(f"{owner}.{name}.{attribute}", held)


def _object_reads(path: str, obj: Any, observation: Observation, reads: Reads) -> None:
    """The containers ``obj`` holds that its class's methods of the model's own code loaded through ``self``
    on the lines that ran (a property returning ``self.values[0]``): read in place."""
    held = attributes(obj)
    for code in observation.object_codes.get(type(obj), ()):
        for name in self_attributes(code, observation.lines_of(code)):
            if is_container(held.get(name)):
                reads.add(f"{path}.{name}", held[name])


def _global_log(observation: Observation, scope: Dict[str, Any], name: str) -> bool:
    """Whether every code that ran in ``scope`` naming ``name`` only appends to the global (a log)."""
    codes = [code for code, globals_ in observation.codes.items() if globals_ is scope and name in code.co_names]
    return bool(codes) and all(only_appended(code, name) for code in codes)


def _partials(fn: Any) -> List[functools.partial]:
    """The partials the wrapped callable is, or wraps (a few levels)."""
    found: List[functools.partial] = []
    for _ in range(4):
        if isinstance(fn, functools.partial):
            found.append(fn)
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            break
    return found


def _name(partial: functools.partial) -> str:
    return f"partial({getattr(partial.func, '__qualname__', type(partial.func).__name__)})"
