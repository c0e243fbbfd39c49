"""StepWrites: Python state outside the modules' own attributes that a run of the step for capture writes.

Capture runs the step several times besides the call it serves (warm-up, recording, verification: wrap()'s
padding check runs within them); a replay runs none of its Python (the graph contract: Python state the step
writes is frozen). A step that writes a class attribute (``type(self).calls += 1``), a helper object a module holds
(``self.stats.calls += 1``) or a container (a dict it counts into, at module level, in a closure, a module's
dict attribute; a numpy array or ``array.array`` it writes items of) would leave that state advanced by
capture's runs. ``with StepWrites(roots, fn): step()`` saves that state before the run (the classes, helper
objects and containers of the model's own code, reached from the step's roots, the modules' defining files and
the wrapped callable's globals and closure) and puts back what the run changed, logging the first write and its
line once per key; what it added (a memo's key, a log's new items) is kept. ``written`` names what the step
wrote: the step's own state, which the key's per-call compare of what the step reads leaves out
(graphrt.guards.key_guard). Installed libraries' and torch's classes and globals are left out, as the guards
leave them (frozen at capture).
"""

from __future__ import annotations

import copy
import dis
import logging
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from graphrt.guards.attributes import attributes, entry_of, has_attributes
from graphrt.guards.class_state import class_dict
from graphrt.guards.in_place import compared_buffer, put_back_buffer, snapshot
from graphrt.guards.observe import Observation, entry_functions, is_user_file
from graphrt.layout.rebind_guard import differs, entries_changed

logger = logging.getLogger(__name__)

_MISSING = object()
_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.CodeType)
MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "add", "discard",
                      "remove", "clear", "__setitem__"})
MAX_SAVED = 10_000


def _user_module(name: str) -> bool:
    """Whether the Python module ``name`` is the model's own code (not torch, an installed library, graphrt)."""
    module = sys.modules.get(name)
    filename = getattr(module, "__file__", None)
    return module is not None and (filename is None or is_user_file(filename))


def _writable(value: Any) -> bool:
    """A container the step can write in place: a dict, list or set, or a buffer of numbers (small enough to save)."""
    return isinstance(value, (dict, list, set)) or compared_buffer(value)


def _plain_object(value: Any) -> bool:
    return has_attributes(value) and not isinstance(value, _OPAQUE) and type(value).__module__ != "builtins"


class StepWrites:
    """Saves, before one run of the step, the Python state of the model's own code it could write that no
    replay writes; after it, puts back what changed (additions kept) and notes what was written."""

    def __init__(self, roots: Sequence[Tuple[str, Any]], fn: Any = None) -> None:
        self.observation: Optional[Observation] = None  # the run's observation, for the line of a write
        self.written: Set[Tuple[int, Any]] = set()  # (id(holder), attribute name, or None: a container)
        # (path, kind, holder, shallow copy): kind "class" (holder: the class), "object" (its vars) or "container"
        self._saved: List[Tuple[str, str, Any, Any]] = []
        self._seen: Set[int] = set()
        modules: List[Tuple[str, torch.nn.Module]] = []
        for path, root in roots:
            if isinstance(root, torch.nn.Module):
                modules += [(f"{path}.{name}" if name else path, module) for name, module in root.named_modules()]
        classes: Dict[type, None] = {}
        scopes: Dict[int, Dict[str, Any]] = {}
        for path, module in modules:
            classes.update(dict.fromkeys(type(module).__mro__))
            for name, value in vars(module).items():
                if not name.startswith("_"):
                    self._held(f"{path}.{name}", value, classes)
        for function in entry_functions(fn) if fn is not None else ():
            if is_user_file(function.__code__.co_filename):
                scopes[id(function.__globals__)] = function.__globals__
            for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
                try:
                    self._held(name, cell.cell_contents, classes)
                except ValueError:  # an empty cell
                    continue
        for cls in classes:
            if cls is not object and _user_module(cls.__module__):
                self._save(cls.__qualname__, "class", cls, dict(class_dict(cls)))
                scopes.setdefault(id(vars(sys.modules[cls.__module__])), vars(sys.modules[cls.__module__]))
        for scope in scopes.values():
            for name, value in list(scope.items()):
                if _writable(value) and not name.startswith("__"):
                    self._held(name, value, classes)

    def _held(self, path: str, value: Any, classes: Dict[type, None]) -> None:
        """A value a module, a closure or a global holds: a container, or a helper object (and its containers)."""
        if id(value) in self._seen:
            return
        if compared_buffer(value):
            self._save(path, "buffer", value, copy.copy(value))
        elif _writable(value):
            self._save(path, "container", value, value.copy())
        elif _plain_object(value) and _user_module(type(value).__module__):
            self._save(path, "object", value, dict(attributes(value)))
            classes.update(dict.fromkeys(type(value).__mro__))
            for name, held in attributes(value).items():
                if _writable(held) and id(held) not in self._seen:
                    self._held(f"{path}.{name}", held, classes)

    def _save(self, path: str, kind: str, holder: Any, copy: Any) -> None:
        if len(self._saved) < MAX_SAVED:
            self._seen.add(id(holder))
            self._saved.append((path, kind, holder, copy))

    def __enter__(self) -> "StepWrites":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        changes = self._changes()
        if changes and self.observation is not None:  # once per key: its observed run
            path, name, before, now = changes[0]
            line = self._line(name)
            logger.info("%s: the step writes it (%s -> %s%s): put back after each capture run; replays run no "
                        "Python, so this state stays as the eager calls leave it", path, _shown(before), _shown(now),
                        f", at {line}" if line else "")
        self._restore()

    def _changes(self) -> List[Tuple[str, Any, Any, Any]]:
        """``(path, name, before, now)`` of each entry the run changed or removed; what it wrote, additions
        included, goes into ``written`` (the step's own state: the per-call compare leaves it out)."""
        changes: List[Tuple[str, Any, Any, Any]] = []
        for path, kind, holder, saved in self._saved:
            if kind == "buffer":
                if snapshot(holder) != snapshot(saved):
                    self.written.add((id(holder), None))
                    changes.append((path, path.rsplit(".", 1)[-1], saved, holder))
                continue
            current = self._current(kind, holder)
            if kind == "container":
                if isinstance(holder, set):
                    if holder != saved:
                        self.written.add((id(holder), None))
                    if not saved <= holder:
                        changes.append((path, path.rsplit(".", 1)[-1], sorted(saved, key=repr),
                                        sorted(holder, key=repr)))
                    continue
                if not entries_changed(current, saved):
                    continue
                self.written.add((id(holder), None))
            keys = range(len(saved)) if isinstance(current, list) else saved
            for key in keys:
                then, now = entry_of(saved, key, _MISSING), entry_of(current, key, _MISSING)
                if differs(now, then):
                    where = f"{path}[{key!r}]" if kind == "container" else f"{path}.{key}"
                    changes.append((where, path.rsplit(".", 1)[-1] if kind == "container" else key, then, now))
                    if kind != "container":
                        self.written.add((id(holder), key))
            if kind != "container":
                self.written.update((id(holder), name) for name in current if name not in saved)
        return changes

    @staticmethod
    def _current(kind: str, holder: Any) -> Any:
        return class_dict(holder) if kind == "class" else attributes(holder) if kind == "object" else holder

    def _restore(self) -> None:
        """What the run changed or removed, as it was. An entry it added where none was (a key, a set's
        member, a list's new items, an attribute) is kept: lazy initialisation, as eager's first call at that
        size makes it (a per-shape memo), or a log the step appends to."""
        for _, kind, holder, saved in reversed(self._saved):
            if kind == "buffer":
                if snapshot(holder) != snapshot(saved):
                    put_back_buffer(holder, saved)
                continue
            if kind == "container":
                if isinstance(holder, set):
                    holder.update(saved)
                elif isinstance(holder, list):
                    if entries_changed(holder[:len(saved)], saved):
                        holder[:] = saved
                else:
                    for key, value in saved.items():
                        if holder.get(key, _MISSING) is not value:
                            holder[key] = value
                continue
            current = self._current(kind, holder)
            for name, value in saved.items():
                if current.get(name, _MISSING) is not value:
                    setattr(holder, name, value)  # through setattr: a class's attribute cache is renewed

    def _line(self, name: Any) -> str:
        """``file:line in function`` of the first line that ran storing attribute ``name``, or storing into
        (or calling a mutating method of) what it loads by ``name``; "" when the run was not observed."""
        if self.observation is None or not isinstance(name, str):
            return ""
        for code in self.observation.codes:
            lines = self.observation.lines_of(code)
            by_line: Dict[int, List[dis.Instruction]] = {}
            line = None
            for instruction in dis.get_instructions(code):
                line = instruction.positions.lineno if instruction.positions else line
                if line is not None and (lines is None or line in lines):
                    by_line.setdefault(line, []).append(instruction)
            for number, instructions in sorted(by_line.items()):
                if any(_writes(instruction, name) for instruction in instructions) or (
                        any(instruction.argval == name and instruction.opname.startswith("LOAD") for instruction
                            in instructions) and any(_mutates(instruction) for instruction in instructions)):
                    return f"{code.co_filename}:{number} in {code.co_name}"
        return ""


def _writes(instruction: dis.Instruction, name: str) -> bool:
    return instruction.opname in ("STORE_ATTR", "DELETE_ATTR") and instruction.argval == name


def _mutates(instruction: dis.Instruction) -> bool:
    return instruction.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") or (
        instruction.opname in ("LOAD_METHOD", "LOAD_ATTR") and instruction.argval in MUTATORS)


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "<unset>"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"

