"""The state epoch: one process-wide counter that every API able to change what a graph froze bumps.

A captured step froze more than tensors: which modules ran and their Python attributes, the hooks
that fired, the tensors bound where it read them, their dtypes and memory. Re-reading all of that
on every call would cost O(model depth); instead graphrt patches the APIs that change it to bump
``EPOCH`` (``Module.train``/``eval``, ``_apply`` (``to``, ``half``, ``double``, ``cuda``, ...),
``Module.__setattr__``/``__delattr__`` of any value, parameter, buffer and submodule registration,
forward hook registration and ``RemovableHandle.remove`` (module and global), the containers'
mutators (``ModuleList.insert``/``pop``/..., which write ``_modules`` directly), a watched tensor's
memory swapped (``.data = other``, ``set_``, ``torch.utils.swap_tensors``), ``__setattr__``
of the plain classes whose objects a guard reads through (``watch_class``), and the setters of
torch's global settings (graphrt.guards.torch_settings)), so a key re-reads its state only after the epoch moved:
one integer compare per call otherwise.

While an ``AssignmentJournal`` is active (a step being captured), the same patches report every
attribute assignment to it before it happens (graphrt.guards.assignments).

Code torch.compile traces bumps nothing: a global it reads would be guarded on, and bumping it
would recompile every call.

A bump says what changed: it appends ``(id of the object, aspect)`` to ``CHANGES`` (the aspect is an
attribute's name, or one of ``ALL``, ``TRAINING``, ``HOOKS``), so a key re-reads only the state of
what changed since it last looked (``changes_since``), not every module it ran. An object watched
for some attribute names only (``watch(obj, names)``: an engine whose ``model`` a guard reads) bumps
only when one of those is assigned: graphrt's own bookkeeping (an engine's timers and counters)
moves nothing. The rule that keeps the per-call check at one integer compare: nothing on graphrt's
own per-step path assigns to a watched object.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
import itertools
import threading
import weakref
from typing import Any, Callable, Dict, FrozenSet, Hashable, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from graphrt.guards.torch_settings import patch_setters

# The epoch (a list: one cell, read by index on every call): a new value from ``_tickets`` after every
# change, never one it held before (two threads bumping at once cannot bring an old value back).
EPOCH = [0]
_tickets = itertools.count(1)
# ids of the modules and objects some guard reads: only their changes bump (building or changing
# another model, as torch.fx does for each recording, costs no guard a re-read).
WATCHED: Dict[int, Any] = {}
# Objects watched for some attribute names only (id -> the names): another name assigned bumps nothing.
WATCHED_NAMES: Dict[int, Set[str]] = {}


class Aspect:
    """What changed of an object, when it is not one attribute (whose name is the aspect)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# What changed, in order: (id of the object, or of one of the keys below; the aspect). Appended before
# the epoch moves, so a key that sees the epoch move finds the change here.
Change = Tuple[int, Hashable]
CHANGES: List[Change] = []
ALL = Aspect("ALL")  # the whole object may have changed (``_apply``, a container mutator, an adapter's API)
HOOKS = Aspect("HOOKS")  # a forward hook registered or removed (the id: the module, or the hook dict it was in)
TRAINING = "training"  # ``train()``/``eval()``: the attribute it sets
SETTINGS = -2  # the id of torch's global settings (graphrt.guards.torch_settings)
GLOBAL_HOOKS = -3  # the id of the global forward hooks (register_module_forward_hook)
MAX_CHANGES = 4096  # past this, the older half is dropped; a key that had not read it reads everything
_changes_base = [0]  # how many changes were dropped from the front of CHANGES
_changes_lock = threading.Lock()


class _ActiveJournal(threading.local):
    """The journal of the step this thread is capturing, told of every assignment (graphrt.guards.assignments);
    per thread: another thread's assignments while one captures are not the step's."""

    active: Any = None


JOURNAL = _ActiveJournal()


class _Quiet(threading.local):
    """How deep this thread is in ``unbumped`` blocks."""

    depth = 0


_QUIET = _Quiet()


@contextmanager
def unbumped() -> Iterator[None]:
    """Assignments this thread makes inside bump nothing: for graphrt's own set-and-restore of a watched
    object's attribute around a call it makes (an engine switching the model config's attention
    implementation for each step and back), which leaves the object as it was for the next check."""
    _QUIET.depth += 1
    try:
        yield
    finally:
        _QUIET.depth -= 1
_compiling = torch.compiler.is_compiling
_installed: List[Any] = []
# Container methods that change which modules or parameters a container holds; several write
# ``_modules`` directly (``ModuleList.insert``, ``ModuleDict.__delitem__``), past every hook.
CONTAINER_MUTATORS = ("__setitem__", "__delitem__", "__iadd__", "__imul__", "insert", "append", "extend", "pop",
                      "popitem", "clear", "update", "setdefault")
CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
              torch.nn.ParameterDict)
# Module methods that bump, and the aspect of the module they change.
MODULE_METHODS = {"train": TRAINING, "_apply": ALL, "register_forward_hook": HOOKS, "register_forward_pre_hook": HOOKS}
GLOBAL_HOOK_FUNCTIONS = ("register_module_forward_hook", "register_module_forward_pre_hook")
_watched_classes: "weakref.WeakSet[type]" = weakref.WeakSet()


def watch(obj: Any, names: Optional[FrozenSet[str]] = None) -> None:
    """Changes to ``obj`` (a module or an object of a watched class) bump the epoch from now on;
    ``names``: only assignments of those attributes (and changes through the APIs), else any."""
    key = id(obj)
    if key in WATCHED:
        if key in WATCHED_NAMES:
            if names is None:
                del WATCHED_NAMES[key]
            else:
                WATCHED_NAMES[key] |= names
        return
    if names is not None:
        WATCHED_NAMES[key] = set(names)
    try:
        WATCHED[key] = weakref.ref(obj, functools.partial(_forget, key))
    except TypeError:  # not weakly referenceable: kept by id (a reused id costs a re-read, never a miss)
        WATCHED[key] = None


def _forget(key: int, _: Any) -> None:
    WATCHED.pop(key, None)
    WATCHED_NAMES.pop(key, None)


def bump(key: int, aspect: Hashable) -> None:
    """Tell every key that ``aspect`` of the object ``key`` (an id, or ``SETTINGS``, ...) changed."""
    CHANGES.append((key, aspect))
    EPOCH[0] = next(_tickets)
    if len(CHANGES) > MAX_CHANGES:
        with _changes_lock:
            dropped = len(CHANGES) // 2
            del CHANGES[:dropped]
            _changes_base[0] += dropped


def position() -> int:
    """Where the next change will be logged (a key reads ``changes_since`` it later)."""
    with _changes_lock:
        return _changes_base[0] + len(CHANGES)


def changes_since(start: int) -> Tuple[int, Optional[Set[Change]]]:
    """The changes logged from ``start`` on, and where the next will be; None when some were dropped
    (everything must be read again)."""
    with _changes_lock:
        base = _changes_base[0]
        recent = CHANGES[start - base:] if start >= base else None
        end = base + len(CHANGES)
    return end, None if recent is None else set(recent)


def _bumping(original: Callable[..., Any], aspect: Hashable = ALL, key: Optional[int] = None) -> Callable[..., Any]:
    """``original``, then a bump (after: a guard reading in between sees the change) of ``aspect`` of
    its first argument (``self``) when that is watched; with ``key``, of that key whatever the arguments."""
    if getattr(original, "_graphrt_bumps", False):
        return original

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            changed = key if key is not None else id(args[0])
            if (key is not None or changed in WATCHED) and not _compiling():
                bump(changed, aspect)

    call._graphrt_bumps = True  # type: ignore[attr-defined]
    return call


def _removing(original: Callable[..., None]) -> Callable[..., None]:
    """``RemovableHandle.remove``, then a bump of the hook dicts it removed from (a module's or the global ones)."""
    if getattr(original, "_graphrt_bumps", False):
        return original

    @functools.wraps(original)
    def remove(handle: RemovableHandle) -> None:
        dicts = [handle.hooks_dict_ref(), *(ref() for ref in getattr(handle, "extra_dict_ref", ()))]
        try:
            original(handle)
        finally:
            if not _compiling():
                for hooks in dicts:
                    if hooks is not None:
                        bump(id(hooks), HOOKS)

    remove._graphrt_bumps = True  # type: ignore[attr-defined]
    return remove


def _assigned(obj: Any, name: str) -> None:
    """An attribute of ``obj`` was assigned or deleted: a bump when some key reads it."""
    key = id(obj)
    if key in WATCHED and not _compiling() and not _QUIET.depth:
        names = WATCHED_NAMES.get(key)
        if names is None or name in names:
            bump(key, name)


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
        _assigned(self, name)

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
        _assigned(self, name)

    __delattr__._graphrt_bumps = True  # type: ignore[attr-defined]
    __delattr__.__wrapped__ = original  # type: ignore[attr-defined]
    return __delattr__


def install() -> None:
    """Patch torch's APIs to bump the epoch (idempotent)."""
    if _installed:
        return
    module = torch.nn.Module
    for name, aspect in MODULE_METHODS.items():
        setattr(module, name, _bumping(getattr(module, name), aspect))
    module.__setattr__ = _journaled_setattr(module.__setattr__)  # type: ignore[method-assign]
    module.__delattr__ = _journaled_delattr(module.__delattr__)  # type: ignore[method-assign]
    for container in CONTAINERS:
        for name in CONTAINER_MUTATORS:
            if name in vars(container):
                setattr(container, name, _bumping(vars(container)[name]))
    hooks = torch.nn.modules.module
    for name in GLOBAL_HOOK_FUNCTIONS:
        setattr(hooks, name, _bumping(getattr(hooks, name), HOOKS, GLOBAL_HOOKS))
    RemovableHandle.remove = _removing(RemovableHandle.remove)  # type: ignore[method-assign]
    patch_setters(lambda setter: _bumping(setter, ALL, SETTINGS))
    _patch_storage_swaps()

    def registered(module: torch.nn.Module, name: str, *_: Any) -> None:  # register_parameter/buffer/module
        _assigned(module, name)

    _installed.extend([hooks.register_module_parameter_registration_hook(registered),
                       hooks.register_module_buffer_registration_hook(registered),
                       hooks.register_module_module_registration_hook(registered)])


def _patch_storage_swaps() -> None:
    """``tensor.data = other``, ``tensor.set_(...)`` and ``torch.utils.swap_tensors`` give a tensor other
    memory without an assignment to its holder (a graph goes on reading the old; cudagraph trees'
    ``test_unstable_ptr``): a watched tensor's swap bumps, naming it (aspect ``data``). The ``data``
    property reads as torch's own, through its getter."""
    data = torch._C.TensorBase.data

    def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
        data.__set__(tensor, value)
        _swapped(tensor)

    torch.Tensor.data = property(data.__get__, set_data, doc=data.__doc__)  # type: ignore[assignment]
    set_ = torch._C.TensorBase.set_

    @functools.wraps(set_)
    def set_storage(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = set_(tensor, *args, **kwargs)
        _swapped(tensor)
        return result

    torch.Tensor.set_ = set_storage  # type: ignore[method-assign]
    swap = torch.utils.swap_tensors

    @functools.wraps(swap)
    def swap_tensors(first: torch.Tensor, second: torch.Tensor) -> None:
        swap(first, second)
        _swapped(first)
        _swapped(second)

    torch.utils.swap_tensors = swap_tensors


def _swapped(tensor: torch.Tensor) -> None:
    if not _compiling() and id(tensor) in WATCHED:
        bump(id(tensor), "data")


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
