"""RebindGuard: a recorded step must not rebind the attributes of objects passed in as arguments.

An object argument (a cache, a module) is a constant of the graph: replays read the tensors it
held at capture, as they read the model's parameters. A step that rebinds the object's state
instead of writing it in place (a transformers ``DynamicCache`` grows by ``torch.cat`` and
reassignment; a counter attribute ``+= 1``) cannot be replayed: the graph would keep reading
the old tensors and the object would stop advancing. The guard snapshots the attributes reachable
from such objects before the recorded step; afterwards it puts back any that changed (the
state journal undoes tensor writes, not Python assignments) and fails the capture naming the
argument and the attribute.
"""

from __future__ import annotations

import types
from typing import Any, List, Optional, Sequence, Tuple

import torch

MAX_DEPTH = 4
MAX_CONTAINERS = 10_000
_OPAQUE = (torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class RebindError(TypeError):
    """The recorded step rebound the state of an object passed in as an argument."""


class RebindGuard:
    """``with RebindGuard([(path, obj), ...]): step()``: undo and refuse rebinding inside ``obj``."""

    def __init__(self, objects: Sequence[Tuple[str, Any]]) -> None:
        self.objects = objects
        self._saved: List[Tuple[str, Any, Any, str]] = []  # (path, container, shallow copy, child path format)

    def __enter__(self) -> "RebindGuard":
        seen: set = set()
        for path, obj in self.objects:
            self._snapshot(path, obj, 0, seen)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        changed = self._changed()
        if changed is None:
            return
        self._restore()
        if exc_type is None:
            path, value = changed
            raise RebindError(
                f"{path}: the step rebinds it (now a {type(value).__name__}) instead of writing in place; "
                "a graph replays the step on the object as captured, so its state would stop advancing. "
                "Use an object updated in place (e.g. transformers' StaticCache), or pass its tensors as arguments"
            )

    def _snapshot(self, path: str, obj: Any, depth: int, seen: set) -> None:
        if depth > MAX_DEPTH or id(obj) in seen or len(self._saved) >= MAX_CONTAINERS or isinstance(obj, _OPAQUE):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, dict)):
            items = list(enumerate(obj)) if isinstance(obj, list) else list(obj.items())
            self._saved.append((path, obj, obj.copy(), "{}[{!r}]"))
            children = [(f"{path}[{key!r}]", value) for key, value in items]
        elif isinstance(obj, tuple):
            children = [(f"{path}[{index}]", value) for index, value in enumerate(obj)]
        elif hasattr(obj, "__dict__"):
            attributes = vars(obj)
            self._saved.append((path, attributes, dict(attributes), "{}.{}"))
            children = [(f"{path}.{name}", value) for name, value in attributes.items()]
        else:
            return
        for child_path, value in children:
            self._snapshot(child_path, value, depth + 1, seen)

    def _changed(self) -> Optional[Tuple[str, Any]]:
        """The first attribute (path, new value) whose object identity changed, if any."""
        for path, container, saved, child_path in self._saved:
            if not entries_changed(container, saved):
                continue
            if isinstance(container, list) or container.keys() != saved.keys():
                return path, container
            name = next(name for name, value in container.items() if value is not saved[name])
            return child_path.format(path, name), container[name]
        return None

    def _restore(self) -> None:
        for _, container, saved, _ in reversed(self._saved):
            restore_entries(container, saved)


def entries_changed(container: Any, saved: Any) -> bool:
    """Whether a dict or list holds other objects (by identity), or other keys, than its shallow copy ``saved``."""
    if len(container) != len(saved):
        return True
    if isinstance(container, dict):
        return any(key not in container or container[key] is not value for key, value in saved.items())
    return any(now is not then for now, then in zip(container, saved))


def restore_entries(container: Any, saved: Any) -> None:
    """Put a dict's or list's entries back as in its shallow copy ``saved`` (untouched when unchanged)."""
    if not entries_changed(container, saved):
        return
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    else:
        container[:] = saved
