"""The state epoch: one process-wide counter that every API able to change what a graph froze bumps.

A captured step froze more than tensors: which modules ran and their Python attributes, the hooks
that fired, the tensors bound where it read them, their dtypes and memory. Re-reading all of that
on every call would cost O(model depth); instead graphrt patches the APIs that change it to bump
``EPOCH`` (``Module.train``/``eval``, ``_apply`` (``to``, ``half``, ``double``, ``cuda``, ...),
``Module.__setattr__``/``__delattr__`` of any value, parameter, buffer and submodule registration,
forward hook registration and ``RemovableHandle.remove`` (module and global), the containers'
mutators (``ModuleList.insert``/``pop``/..., which write ``_modules`` directly), ``__setattr__``
of the plain classes whose objects a guard reads through (``watch_class``), and the setters of
torch's global settings (``torch.set_default_dtype``, ``set_float32_matmul_precision``, ...)), so a key re-reads its
state only after the epoch moved: one integer compare per call otherwise.

While an ``AssignmentJournal`` is active (a step being captured), the same patches report every
attribute assignment to it before it happens (graphrt.guards.assignments).

Code torch.compile traces bumps nothing: a global it reads would be guarded on, and bumping it
would recompile every call.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.hooks import RemovableHandle

# The epoch (a list: one cell, read by index on every call).
EPOCH = [0]
# ids of the modules and objects some guard reads: only their changes bump (building or changing
# another model, as torch.fx does for each recording, costs no guard a re-read).
WATCHED: Dict[int, Any] = {}


class _ActiveJournal(threading.local):
    """The journal of the step this thread is capturing, told of every assignment (graphrt.guards.assignments);
    per thread: another thread's assignments while one captures are not the step's."""

    active: Any = None


JOURNAL = _ActiveJournal()
_compiling = torch.compiler.is_compiling
_installed: List[Any] = []
# Container methods that change which modules or parameters a container holds; several write
# ``_modules`` directly (``ModuleList.insert``, ``ModuleDict.__delitem__``), past every hook.
CONTAINER_MUTATORS = ("__setitem__", "__delitem__", "__iadd__", "__imul__", "insert", "append", "extend", "pop",
                      "popitem", "clear", "update", "setdefault")
CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
              torch.nn.ParameterDict)
MODULE_METHODS = ("train", "_apply", "register_forward_hook", "register_forward_pre_hook")
GLOBAL_HOOK_FUNCTIONS = ("register_module_forward_hook", "register_module_forward_pre_hook")
# torch's global settings a step computes under (graphrt.guards.python_state.torch_settings): their setters bump.
SETTING_FUNCTIONS = ("set_default_dtype", "set_default_tensor_type", "set_default_device",
                     "set_float32_matmul_precision", "use_deterministic_algorithms")
_watched_classes: "weakref.WeakSet[type]" = weakref.WeakSet()


def watch(obj: Any) -> None:
    """Changes to ``obj`` (a module or an object of a watched class) bump the epoch from now on."""
    key = id(obj)
    if key in WATCHED:
        return
    try:
        WATCHED[key] = weakref.ref(obj, lambda _, key=key: WATCHED.pop(key, None))
    except TypeError:  # not weakly referenceable: kept by id (a reused id costs a re-read, never a miss)
        WATCHED[key] = None


def _bumping(original: Callable[..., Any], of_self: bool = True) -> Callable[..., Any]:
    """``original``, then a bump (after: a guard reading in between sees the change); ``of_self``:
    only when its first argument (``self``) is watched."""
    if getattr(original, "_graphrt_bumps", False):
        return original

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            if (not of_self or id(args[0]) in WATCHED) and not _compiling():
                EPOCH[0] += 1

    call._graphrt_bumps = True  # type: ignore[attr-defined]
    return call


def _object_setattr(self: Any, name: str, value: Any) -> None:
    """``object.__setattr__`` as Python code, for the patches below: Dynamo traces this literal call, but
    resolves the slot wrapper held in a closure as ``Tensor.__setattr__``, which calls the class's
    ``__setattr__`` (the patch) again, without end (a compiled forward setting a watched cache's attribute)."""
    object.__setattr__(self, name, value)


def _object_delattr(self: Any, name: str) -> None:
    """``object.__delattr__`` as Python code (``_object_setattr``)."""
    object.__delattr__(self, name)


def _journaled_setattr(original: Callable[..., None]) -> Callable[..., None]:
    """``__setattr__`` that tells the active journal first, then bumps."""
    if getattr(original, "_graphrt_bumps", False):
        return original
    if original is object.__setattr__:
        original = _object_setattr

    def __setattr__(self: Any, name: str, value: Any) -> None:
        journal = JOURNAL.active
        if journal is not None:
            journal.note(self, name)
        original(self, name, value)
        if id(self) in WATCHED and not _compiling():
            EPOCH[0] += 1

    __setattr__._graphrt_bumps = True  # type: ignore[attr-defined]
    __setattr__.__wrapped__ = original  # type: ignore[attr-defined]
    return __setattr__


def _journaled_delattr(original: Callable[..., None]) -> Callable[..., None]:
    if getattr(original, "_graphrt_bumps", False):
        return original
    if original is object.__delattr__:
        original = _object_delattr

    def __delattr__(self: Any, name: str) -> None:
        journal = JOURNAL.active
        if journal is not None:
            journal.note(self, name)
        original(self, name)
        if id(self) in WATCHED and not _compiling():
            EPOCH[0] += 1

    __delattr__._graphrt_bumps = True  # type: ignore[attr-defined]
    __delattr__.__wrapped__ = original  # type: ignore[attr-defined]
    return __delattr__


def install() -> None:
    """Patch torch's APIs to bump the epoch (idempotent)."""
    if _installed:
        return
    module = torch.nn.Module
    for name in MODULE_METHODS:
        setattr(module, name, _bumping(getattr(module, name)))
    module.__setattr__ = _journaled_setattr(module.__setattr__)  # type: ignore[method-assign]
    module.__delattr__ = _journaled_delattr(module.__delattr__)  # type: ignore[method-assign]
    for container in CONTAINERS:
        for name in CONTAINER_MUTATORS:
            if name in vars(container):
                setattr(container, name, _bumping(vars(container)[name]))
    hooks = torch.nn.modules.module
    for name in GLOBAL_HOOK_FUNCTIONS:
        setattr(hooks, name, _bumping(getattr(hooks, name), of_self=False))
    RemovableHandle.remove = _bumping(RemovableHandle.remove, of_self=False)  # type: ignore[method-assign]
    for name in SETTING_FUNCTIONS:
        setattr(torch, name, _bumping(getattr(torch, name), of_self=False))
    matmul = type(torch.backends.cuda.matmul)  # torch.backends.cuda.matmul.allow_tf32 = ...
    matmul.__setattr__ = _bumping(matmul.__setattr__, of_self=False)  # type: ignore[method-assign]

    def registered(module: torch.nn.Module, *_: Any) -> None:  # register_parameter/buffer/module write the tables
        if id(module) in WATCHED and not _compiling():
            EPOCH[0] += 1

    _installed.extend([hooks.register_module_parameter_registration_hook(registered),
                       hooks.register_module_buffer_registration_hook(registered),
                       hooks.register_module_module_registration_hook(registered)])


def watch_class(cls: type) -> bool:
    """Make assignments to attributes of ``cls``'s objects bump the epoch (and reach the journal);
    False when the class cannot be patched (a built-in or C type): its objects are compared per call."""
    if cls in _watched_classes or issubclass(cls, torch.nn.Module):
        return True
    if cls.__module__ == "builtins" or not cls.__flags__ & (1 << 9):  # Py_TPFLAGS_HEAPTYPE
        return False
    try:
        cls.__setattr__ = _journaled_setattr(cls.__setattr__)  # type: ignore[method-assign]
        cls.__delattr__ = _journaled_delattr(cls.__delattr__)  # type: ignore[method-assign]
    except TypeError:  # an immutable type
        return False
    _watched_classes.add(cls)
    return True


def bump_after(cls: type, name: str) -> Optional[Callable[..., Any]]:
    """Make ``cls.name`` (a method defined on ``cls``) bump the epoch after it returns on a watched
    object; the method."""
    function = vars(cls).get(name)
    if not callable(function) or isinstance(function, type) or getattr(function, "_graphrt_bumps", False):
        return None
    if isinstance(function, (staticmethod, classmethod)):
        return None
    setattr(cls, name, _bumping(function))
    return function
