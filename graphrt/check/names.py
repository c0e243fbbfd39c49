"""Name every tensor a step can reach, and snapshot / restore the Python state that holds them.

A report that says ``aten.index_put_ writes 4 KiB into a tensor`` is useless; one that says
``model.layers.0.self_attn.k_cache`` is not. Parameters and buffers have names, but KV caches
often live in plain Python lists inside a cache object that is an argument, a closure
variable or an attribute of an attention backend. ``ObjectGraph`` walks all of that breadth
first (shortest name wins) from named roots: the step's arguments, the callable's module,
``__self__``, closure cells and the globals its code names.

The same walk lists every mutable container (object ``__dict__``, dicts, lists) it passed
through. ``snapshot()`` keeps a shallow copy of each, so the check can see what a step rebinds
(``self.state = new_tensor``, ``self.step += 1``) and put every binding back afterwards.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.backends.state_journal import storage_key
from graphrt.layout.rebind_guard import entries_changed, restore_entries

MAX_DEPTH = 8
MAX_ITEMS = 4096  # containers larger than this are not entered (token lists, vocabularies)
MAX_FUNCTION_DEPTH = 2  # functions deeper than this (hooks, registries) are not entered
PLAIN = (int, float, bool, str, bytes, type(None), complex)
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
_NOT_WALKED = (type, types.ModuleType, types.BuiltinFunctionType, torch.dtype, torch.device, torch.Generator)

Container = Any  # a dict or a list whose entries the walk followed


def callable_roots(fn: Any) -> List[Tuple[str, Any]]:
    """The named objects a callable can reach: itself if it is a module (no prefix), the module
    behind a bound method, a partial's function and arguments, closure cells and named globals."""
    if isinstance(fn, torch.nn.Module):
        return [("", fn)]
    if inspect.ismethod(fn):
        owner = fn.__self__
        return [("", owner)] if isinstance(owner, torch.nn.Module) else [("self", owner)]
    partial_func = getattr(fn, "func", None)
    if partial_func is not None and hasattr(fn, "args") and hasattr(fn, "keywords"):
        return callable_roots(partial_func) + [(f"partial.{i}", v) for i, v in enumerate(fn.args)] + [
            (f"partial.{k}", v) for k, v in fn.keywords.items()
        ]
    if isinstance(fn, types.FunctionType):
        return list(_function_children(fn))
    return [("", fn)]


def _function_children(fn: types.FunctionType) -> Iterator[Tuple[str, Any]]:
    """Closure variables by name, then the globals the function's code refers to."""
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell (the variable is assigned later)
            continue
    for name in code.co_names:
        if name in fn.__globals__:
            yield name, fn.__globals__[name]


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _children(obj: Any, depth: int) -> Iterator[Tuple[Any, Optional[Container], Any, bool]]:
    """(child, container, key, is_attribute) for every entry of ``obj`` the walk follows."""
    if isinstance(obj, torch.nn.Module):
        for dict_name in _MODULE_DICTS:
            entries = obj.__dict__.get(dict_name, {})
            for key, child in entries.items():
                yield child, entries, key, True
        for key, child in vars(obj).items():
            if key not in _MODULE_DICTS:
                yield child, obj.__dict__, key, True
    elif isinstance(obj, dict):
        if len(obj) <= MAX_ITEMS:
            for key, child in obj.items():
                if isinstance(key, (str, int)):
                    yield child, obj, key, False
    elif isinstance(obj, (list, tuple)):
        if len(obj) <= MAX_ITEMS:
            for index, child in enumerate(obj):
                yield child, obj if isinstance(obj, list) else None, index, False
    elif isinstance(obj, types.FunctionType):
        if depth <= MAX_FUNCTION_DEPTH:  # a helper the step calls, not every function a model stores
            for key, child in _function_children(obj):
                yield child, None, key, False
    elif hasattr(obj, "__dict__") and not isinstance(obj, _NOT_WALKED) and not _from_stdlib(obj):
        for key, child in vars(obj).items():
            yield child, obj.__dict__, key, True


def _from_stdlib(obj: Any) -> bool:
    """Loggers, locks, executors: the standard library's objects hold no model state, and
    putting their attributes back (a logger registry) could break them."""
    return type(obj).__module__.split(".")[0] in sys.stdlib_module_names


@dataclass
class Snapshot:
    """Shallow copies of the walked containers, taken before a step runs."""

    saved: List[Tuple[Container, Any]]

    def restore(self) -> None:
        """Put back every entry a step rebound, added or removed (tensor contents are the journal's job)."""
        for container, copy in self.saved:
            restore_entries(container, copy)


@dataclass(frozen=True)
class Rebinding:
    """One attribute, dict entry or list item that a step bound to another object."""

    name: str
    before: Any
    after: Any
    is_attribute: bool  # an object's attribute (not an entry of a dict or list)
    container: Container
    key: Any

    def changed(self) -> bool:
        """True while the entry holds another object than before the step."""
        return entry(self.container, self.key) is not self.before


class ObjectGraph:
    """Names of the tensors reachable from named roots; the containers that hold them."""

    def __init__(self, roots: Sequence[Tuple[str, Any]], max_depth: int = MAX_DEPTH) -> None:
        self._names: Dict[int, str] = {}
        self._by_storage: Dict[Tuple[torch.device, int], List[Tuple[str, torch.Tensor]]] = {}
        self._tensors: List[torch.Tensor] = []  # keeps ids stable while the graph lives
        self._containers: List[Tuple[Container, str, bool]] = []  # (container, its name, holds attributes)
        self._walk(roots, max_depth)

    def _walk(self, roots: Sequence[Tuple[str, Any]], max_depth: int) -> None:
        seen: set = set()
        queue: Deque[Tuple[str, Any, int]] = deque((name, obj, 0) for name, obj in roots)
        while queue:
            name, obj, depth = queue.popleft()
            if isinstance(obj, torch.Tensor):
                self._add_tensor(name, obj)
                continue
            if isinstance(obj, PLAIN) or id(obj) in seen or depth > max_depth:
                continue
            seen.add(id(obj))
            entered: set = set()
            for child, container, key, is_attribute in _children(obj, depth):
                if container is not None and id(container) not in entered:
                    entered.add(id(container))
                    self._containers.append((container, name, is_attribute))
                queue.append((_join(name, key), child, depth + 1))

    def _add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if id(tensor) in self._names:
            return
        self._names[id(tensor)] = name
        self._tensors.append(tensor)
        if tensor.numel():
            self._by_storage.setdefault(storage_key(tensor), []).append((name, tensor))

    def name_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The tensor's name, or the name of a reachable tensor it is a view of (``name[view]``)."""
        name = self._names.get(id(tensor))
        if name is not None or not tensor.numel():
            return name
        owners = self._by_storage.get(storage_key(tensor))
        if not owners:
            return None
        for owner_name, owner in owners:
            if owner.shape == tensor.shape and owner.stride() == tensor.stride() and (
                owner.storage_offset() == tensor.storage_offset()
            ):
                return owner_name
        owner_name, _ = max(owners, key=lambda item: item[1].numel())
        return f"{owner_name}[view]"

    def snapshot(self) -> Snapshot:
        """Shallow copies of every container the walk passed through."""
        return Snapshot([(c, dict(c) if isinstance(c, dict) else list(c)) for c, _, _ in self._containers])

    def rebindings(self, before: Snapshot) -> List[Rebinding]:
        """Entries whose object changed since ``before`` (new entries and removals included)."""
        found = []
        for (container, name, attributes), (_, copy) in zip(self._containers, before.saved):
            if not entries_changed(container, copy):
                continue
            keys = container.keys() | copy.keys() if isinstance(container, dict) else range(max(len(container), len(copy)))
            for key in keys:
                old, new = entry(copy, key), entry(container, key)
                if old is not new:
                    found.append(Rebinding(_join(name, key), old, new, attributes, container, key))
        return found


def entry(container: Container, key: Any) -> Any:
    """``container[key]``, or None when the key is not there (any more)."""
    if isinstance(container, dict):
        return container.get(key)
    return container[key] if key < len(container) else None
