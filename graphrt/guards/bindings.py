"""Bindings: the attribute paths through which a recorded step read its tensors, checked per call.

A graph keeps the tensors (CUDA: the addresses) its step read. A model that later binds another
tensor at one of those paths (``layer.keys = keys.index_select(0, beams)``, ``m.weight =
nn.Parameter(...)``) is not seen by a replay, which would go on reading the old tensor. At
capture, ``find_bindings`` walks the roots a step reads through (the model's modules, object
arguments) to the tensors it touched, and keeps every link of those paths; per call,
``Bindings.rebound`` says which path now holds another object.

Links inside modules' ``_parameters``, ``_buffers`` and ``_modules`` change only through
``Module.__setattr__``/``register_*``, which run torch's global registration hooks: they are read
again only after such a hook ran (one integer compare per call otherwise). Plain attributes and
containers (a cache's ``layers`` list, a layer's ``keys``) are compared on every call.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

# Registrations of parameters, buffers and submodules into the modules some graph reads through
# (``WATCHED``), made in this process since graphrt started counting.
REGISTRATIONS = [0]
WATCHED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
MAX_DEPTH = 4  # containers followed below an object argument, as RebindGuard
_MISSING = object()
_installed: List[Any] = []


def count_registrations() -> None:
    """Bump ``REGISTRATIONS`` on every parameter, buffer and submodule (re)bound into a watched
    module (idempotent). Modules a forward builds and fills (a ``ModuleList`` slice) are not
    watched, so they cost one set lookup; code torch.compile traces counts nothing (a global it
    reads would be guarded on, and bumping it would recompile every call)."""
    if _installed:
        return

    def bump(module: torch.nn.Module, *_: Any) -> None:
        if not torch.compiler.is_compiling() and module in WATCHED:
            REGISTRATIONS[0] += 1

    hooks = torch.nn.modules.module
    _installed.extend([hooks.register_module_parameter_registration_hook(bump),
                       hooks.register_module_buffer_registration_hook(bump),
                       hooks.register_module_module_registration_hook(bump)])


class Link(NamedTuple):
    """One step of a path: ``container[key]`` held ``expected`` at capture."""

    container: Any  # a dict (an object's ``__dict__``, a module's ``_parameters``, ...) or a list
    key: Any
    expected: Any
    path: str


class Bindings:
    """The links a step's tensors were reached through; ``rebound()`` per call."""

    def __init__(self, plain: Sequence[Link], registered: Sequence[Link]) -> None:
        self.plain = tuple(plain)
        self.registered = tuple(registered)
        self._seen_registrations = REGISTRATIONS[0]
        self._storages = [(link, link.expected.untyped_storage().data_ptr())
                          for link in (*self.registered, *self.plain) if isinstance(link.expected, torch.Tensor)]

    def rebound(self) -> Optional[str]:
        """The first path whose link now holds another object than at capture, else None."""
        for link in self.plain:
            if _bound(link) is not link.expected:
                return link.path
        if REGISTRATIONS[0] != self._seen_registrations:
            for link in self.registered:
                if _bound(link) is not link.expected:
                    return link.path
            self._seen_registrations = REGISTRATIONS[0]
        return None

    def swapped_storage(self) -> Optional[str]:
        """Debug mode: the first tensor read through these paths whose memory is not the captured
        one (``param.data = other``: a graph goes on reading the captured memory), else None."""
        for link, pointer in self._storages:
            if link.expected.untyped_storage().data_ptr() != pointer:
                return link.path
        return None

    @property
    def memory(self) -> Set[int]:
        """The addresses of the memory of the tensors these paths reach."""
        return {pointer for _, pointer in self._storages}


def _bound(link: Link) -> Any:
    container = link.container
    if isinstance(container, dict):
        return container.get(link.key, _MISSING)
    return container[link.key] if link.key < len(container) else _MISSING


StorageOf = Callable[[torch.Tensor], Any]


def find_bindings(roots: Sequence[Tuple[str, Any]], touched: Set[Any], storage_of: StorageOf) -> Bindings:
    """The links from ``roots`` (``(name, object)``: modules or object arguments) to the tensors
    whose storage (``storage_of``) is in ``touched``; a link is kept only on a path that reaches one."""
    plain: List[Link] = []
    registered: List[Link] = []
    seen: Set[int] = set()
    finder = _Finder(touched, storage_of, plain, registered, seen)
    for name, root in roots:
        finder.visit(root, name, 0)
    return Bindings(plain, registered)


class _Finder:
    """A depth-first walk that appends the links of every path reaching a touched tensor."""

    def __init__(self, touched: Set[Any], storage_of: StorageOf, plain: List[Link], registered: List[Link],
                 seen: Set[int]) -> None:
        self.touched, self.storage_of = touched, storage_of
        self.plain, self.registered, self.seen = plain, registered, seen

    def visit(self, value: Any, path: str, depth: int) -> bool:
        """Whether ``value`` is, or leads to, a touched tensor (its links appended)."""
        if isinstance(value, torch.Tensor):
            return self.storage_of(value) in self.touched
        if id(value) in self.seen or depth > MAX_DEPTH:
            return False
        if isinstance(value, torch.nn.Module):
            self.seen.add(id(value))
            return self._module(value, path)
        if isinstance(value, (list, tuple, dict)) or hasattr(value, "__dict__") and not callable(value):
            self.seen.add(id(value))
            return self._container(value, path, depth)
        return False

    def _module(self, module: torch.nn.Module, path: str) -> bool:
        found = False
        for table in (module._parameters, module._buffers, module._modules):
            for name, child in table.items():
                if child is not None and self.visit(child, f"{path}.{name}", 0):
                    self.registered.append(Link(table, name, child, f"{path}.{name}"))
                    WATCHED.add(module)
                    found = True
        for name, child in vars(module).items():  # plain attributes: tensors and containers of them
            if not name.startswith("_") and isinstance(child, (torch.Tensor, list, tuple, dict)) and (
                    self.visit(child, f"{path}.{name}", 1)):
                self.plain.append(Link(vars(module), name, child, f"{path}.{name}"))
                found = True
        return found

    def _container(self, value: Any, path: str, depth: int) -> bool:
        if isinstance(value, tuple):  # immutable: reached through the link that holds it
            return any([self.visit(child, f"{path}[{index}]", depth + 1) for index, child in enumerate(value)])
        if isinstance(value, list):
            items, container, form = list(enumerate(value)), value, "{}[{}]"
        elif isinstance(value, dict):
            items, container, form = list(value.items()), value, "{}[{!r}]"
        else:
            items, container, form = list(vars(value).items()), vars(value), "{}.{}"
        found = False
        for key, child in items:
            child_path = form.format(path, key)
            if self.visit(child, child_path, depth + 1):
                self.plain.append(Link(container, key, child, child_path))
                found = True
        return found
