"""Bindings: the paths through which a recorded step reached its tensors and modules, checked per call.

A graph keeps the tensors (CUDA: the addresses) its step read and runs the modules it ran. A
model that later binds another object at one of those paths (``layer.keys =
keys.index_select(0, beams)``, ``m.weight = nn.Parameter(...)``, ``engine.model = other_model``,
``cache.layers[0] = ...``) is not seen by a replay, which would go on with the old one. At
capture, ``find_bindings`` walks the roots a step reads through (the modules it ran, object
arguments, what the wrapped callable holds) to the tensors it touched and the modules it ran,
and keeps every link of those paths.

Links held by a module (its tables and attributes) or by an object whose class graphrt watches
(graphrt.guards.epoch.watch_class) change only through ``__setattr__`` or torch's registration
APIs, which bump the state epoch naming the object and the attribute: after it moved, only the
links the changes name are read again (an object is watched for the names of its links only, so
its other attributes bump nothing). Links held by lists and dicts are compared on every call, one
C-level pass per container (graphrt.guards.live_checks).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from graphrt.backends.state_journal import backing_tensor
from graphrt.guards.attributes import attributes, entry_of, has_attributes
from graphrt.guards.epoch import Change, watch, watch_class
from graphrt.guards.live_checks import Same
from graphrt.guards.staged_tensors import TensorStaging

MAX_DEPTH = 4  # containers followed below an object argument, as RebindGuard
_MISSING = object()


class Link(NamedTuple):
    """One step of a path: ``container[key]`` held ``expected`` at capture."""

    container: Any  # a dict (an object's ``__dict__``, a module's ``_parameters``, ...) or a list
    key: Any
    expected: Any
    path: str
    owner: int = 0  # the id of the module or watched object whose assignments change the container


class Bindings:
    """The links a step's tensors and modules were reached through: ``rebound()`` after the epoch
    moved, ``live`` (one check per list or dict) on every call."""

    def __init__(self, gated: Sequence[Link], live: Sequence[Link], modules: Sequence[torch.nn.Module] = ()) -> None:
        self.gated = tuple(gated)
        self.modules = list(modules)  # the modules holding a link (their submodule tables change by the hooks' APIs)
        by_container: Dict[int, Tuple[Any, List[Link]]] = {}
        for link in live:
            by_container.setdefault(id(link.container), (link.container, []))[1].append(link)
        self.live = [Same.items(container, [link.key for link in links], [link.path for link in links])
                     for container, links in by_container.values()]
        links = (*self.gated, *live)
        self._tensors = [(link, _where(link.expected)) for link in links if isinstance(link.expected, torch.Tensor)]
        self._where = {id(link): where for link, where in self._tensors}
        self._by_owner: Dict[int, List[Link]] = {}
        for link in self.gated:
            self._by_owner.setdefault(link.owner, []).append(link)
        self._by_tensor: Dict[int, List[Tuple[Link, Tuple[int, torch.dtype, torch.device]]]] = {}
        for link, where in self._tensors:  # a tensor's memory swapped (.data = other) bumps naming the tensor
            watch(link.expected)
            self._by_tensor.setdefault(id(link.expected), []).append((link, where))

    def rebound(self, changes: Optional[Iterable[Change]] = None,
                staging: Optional[TensorStaging] = None) -> Optional[Tuple[str, str]]:
        """``(reason, words)`` for the first link held by a module or watched object that now holds
        another object, or a tensor moved (dtype, device, memory), else None: every link, or, given
        ``changes`` (``(id, aspect)``), those of the objects they name (by attribute name when the aspect
        is one). A tensor rebound to one ``staging`` accepts is staged, not a change."""
        if changes is None:
            return self._rebound(self.gated, self._tensors, staging)
        named: List[Link] = []
        swapped: List[Tuple[Link, Tuple[int, torch.dtype, torch.device]]] = []
        for owner, aspect in changes:
            links = self._by_owner.get(owner)
            if links:
                named += [link for link in links if link.key == aspect or not isinstance(aspect, str)
                          or aspect.startswith("__")]  # ALL, HOOKS, __class__: every link of the object
            swapped += self._by_tensor.get(owner, ())
        if not named and not swapped:
            return None
        where = self._where
        return self._rebound(named, [*((link, where[id(link)]) for link in named if id(link) in where), *swapped],
                             staging)

    @staticmethod
    def _rebound(gated: Sequence[Link], tensors: Sequence[Tuple[Link, Tuple[int, torch.dtype, torch.device]]],
                 staging: Optional[TensorStaging]) -> Optional[Tuple[str, str]]:
        for link in gated:
            bound = _bound(link)
            if bound is not link.expected and not (staging is not None and staging.accept(
                    (link.owner, link.key), link.expected, bound, functools.partial(_bound, link))):
                return rebound(link.path, link.expected, bound)
        for link, (address, dtype, device) in tensors:
            tensor = link.expected
            if tensor.dtype != dtype or tensor.device != device:
                return "module_moved", (f"{link.path} {_dtype(dtype)} on {device} -> {_dtype(tensor.dtype)} on "
                                        f"{tensor.device} (the graph reads the memory of before the move)")
            if _address(tensor) != address:
                return "module_moved", f"{link.path}: its memory was swapped (the graph reads the memory of before)"
        return None

    def swapped_storage(self) -> Optional[str]:
        """Debug mode, every call: the first tensor read through these paths whose memory is not
        the captured one (``param.data = other``: a graph goes on reading the captured memory)."""
        for link, (address, _, _) in self._tensors:
            if _address(link.expected) != address:
                return link.path
        return None

    @property
    def memory(self) -> Set[int]:
        """The addresses of the memory of the tensors these paths reach."""
        return {address for _, (address, _, _) in self._tensors}

    @property
    def tensors(self) -> List[torch.Tensor]:
        return [link.expected for link, _ in self._tensors]


def rebound(path: str, then: Any, now: Any) -> Tuple[str, str]:
    """``(reason, words)`` for ``path`` bound to ``now`` instead of ``then``: a tensor of another
    dtype or device (``module.to()`` rebinds buffers) is a move, anything else a rebinding."""
    if isinstance(then, torch.Tensor) and isinstance(now, torch.Tensor) and (
            then.dtype != now.dtype or then.device != now.device):
        return "module_moved", (f"{path} {_dtype(then.dtype)} on {then.device} -> {_dtype(now.dtype)} on "
                                f"{now.device} (the graph reads the memory of before the move)")
    return "rebound_state", f"{path} is bound to another object than at capture"


def _address(tensor: torch.Tensor) -> int:
    return backing_tensor(tensor).untyped_storage().data_ptr()


def _where(tensor: torch.Tensor) -> Tuple[int, torch.dtype, torch.device]:
    return _address(tensor), tensor.dtype, tensor.device


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bound(link: Link) -> Any:
    return entry_of(link.container, link.key, _MISSING)


def _opaque(value: Any) -> bool:
    """Objects not walked: functions, classes, Python modules, and graphrt's own runtime objects (a
    GraphedCallable an engine holds: its static slots are no state of the model's)."""
    if isinstance(value, (type, types.FunctionType, types.MethodType, types.ModuleType, functools.partial)):
        return True
    module = type(value).__module__
    return module.startswith("graphrt.") and not module.startswith(("graphrt.reference", "graphrt.hf"))


StorageOf = Callable[[torch.Tensor], Any]


def find_bindings(roots: Sequence[Tuple[str, Any]], touched: Set[Any], storage_of: StorageOf,
                  modules: Sequence[torch.nn.Module] = (), holders: Sequence[Tuple[str, Any]] = ()) -> Bindings:
    """The links from ``roots`` (``(name, object)``: modules, object arguments) to the tensors whose
    storage (``storage_of``) is in ``touched`` and to ``modules`` (those the step ran), and from
    ``holders`` (what a wrapped callable holds: an engine, closure cells, globals) to those modules
    and the tensors inside them (an engine's attention backend refreshes its own metadata every
    step: its plain state is not the step's); a link is kept only on a path that reaches one."""
    finder = _Finder(touched, storage_of, {id(module) for module in modules})
    for name, root in roots:
        finder.visit(root, name, 0)
    finder.plain_tensors = False
    for name, root in holders:
        finder.visit(root, name, 0)
    return Bindings(finder.gated, finder.live, finder.modules)


class _Finder:
    """A depth-first walk that appends the links of every path reaching a touched tensor or a module that ran."""

    def __init__(self, touched: Set[Any], storage_of: StorageOf, targets: Set[int]) -> None:
        self.touched, self.storage_of, self.targets = touched, storage_of, targets
        self.gated: List[Link] = []
        self.live: List[Link] = []
        self.modules: List[torch.nn.Module] = []  # the modules holding a link, in the order found
        self.plain_tensors = True  # tensors reached outside modules count (object arguments: yes; holders: no)
        self.seen: Set[int] = set()

    def visit(self, value: Any, path: str, depth: int, inside_module: bool = False) -> bool:
        """Whether ``value`` is, or leads to, a touched tensor or a module that ran (its links appended);
        ``inside_module``: reached through a module's tables or attributes."""
        if isinstance(value, torch.Tensor):
            return self.storage_of(value) in self.touched and (self.plain_tensors or inside_module)
        if id(value) in self.seen or depth > MAX_DEPTH:
            return id(value) in self.targets
        if isinstance(value, torch.nn.Module):
            self.seen.add(id(value))
            return self._module(value, path) or id(value) in self.targets
        if isinstance(value, (list, tuple, dict)) or has_attributes(value) and not _opaque(value):
            self.seen.add(id(value))
            return self._container(value, path, depth, inside_module)
        return False

    def _module(self, module: torch.nn.Module, path: str) -> bool:
        found = False
        for table in (module._parameters, module._buffers, module._modules):
            for name, child in table.items():
                if child is not None and self.visit(child, f"{path}.{name}", 0, True):
                    self.gated.append(Link(table, name, child, f"{path}.{name}", id(module)))
                    found = True
        attributes = vars(module)
        for name, child in attributes.items():  # plain attributes: tensors and containers of them
            if not name.startswith("_") and isinstance(child, (torch.Tensor, list, tuple, dict)) and (
                    self.visit(child, f"{path}.{name}", 1, True)):
                self.gated.append(Link(attributes, name, child, f"{path}.{name}", id(module)))
                found = True
        if found:
            watch(module)
            self.modules.append(module)
        return found

    def _container(self, value: Any, path: str, depth: int, inside_module: bool) -> bool:
        if isinstance(value, tuple):  # immutable: reached through the link that holds it
            return any([self.visit(child, f"{path}[{index}]", depth + 1, inside_module)
                        for index, child in enumerate(value)])
        if isinstance(value, list):
            items, container, form = list(enumerate(value)), value, "{}[{}]"
        elif isinstance(value, dict):
            items, container, form = list(value.items()), value, "{}[{!r}]"
        else:
            container, form = attributes(value), "{}.{}"
            items = list(container.items())
        found = [Link(container, key, child, form.format(path, key), id(value)) for key, child in items
                 if self.visit(child, form.format(path, key), depth + 1, inside_module and container is value)]
        if found:  # an object's attributes: read again after an assignment bumped the epoch, if its class allows
            watched = container is not value and watch_class(type(value))
            (self.gated if watched else self.live).extend(found)
            if watched:  # its links' names only: the object's own bookkeeping (an engine's timers) bumps nothing
                watch(value, frozenset(link.key for link in found))
        return bool(found)
