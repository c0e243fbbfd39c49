"""RebindGuard: a recorded step must not rebind the attributes of objects passed in as arguments.

An object argument (a cache, a module) is a constant of the graph: replays read the tensors it
held at capture, as they read the model's parameters. A step that rebinds the object's state
instead of writing it in place (a transformers ``DynamicCache`` grows by ``torch.cat`` and
reassignment; a counter attribute ``+= 1``) cannot be replayed: the graph would keep reading
the old tensors and the object would stop advancing. The guard snapshots the attributes reachable
from such objects before the recorded step; afterwards it puts back any that changed (the
state journal undoes tensor writes, not Python assignments) and fails the capture naming the
argument, the attribute and the class that owns it (with what to do for a Hugging Face cache).
"""

from __future__ import annotations

import types
from typing import Any, List, Optional, Sequence, Tuple

import torch

MAX_DEPTH = 4
MAX_CONTAINERS = 10_000
_OPAQUE = (torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
GENERIC_ADVICE = "Use an object updated in place, or pass its tensors as arguments"
HF_ADVICE = ("a Hugging Face cache class whose update keeps Python state: generate with "
             "graphrt.hf.graph_generate(model, ...), which hands generate() static caches with graph-safe layers "
             "and names the layer kinds it cannot graph; for a cache of your own, "
             "graphrt.hf.graph_safe_cache(StaticCache(...))")


class RebindError(TypeError):
    """The recorded step rebound the state of an object passed in as an argument."""


class RebindGuard:
    """``with RebindGuard([(path, obj), ...]): step()``: undo and refuse rebinding inside ``obj``."""

    def __init__(self, objects: Sequence[Tuple[str, Any]]) -> None:
        self.objects = objects
        # (path, container, shallow copy, child path format, the class of the object whose state it is)
        self._saved: List[Tuple[str, Any, Any, str, Optional[type]]] = []

    def __enter__(self) -> "RebindGuard":
        seen: set = set()
        for path, obj in self.objects:
            self._snapshot(path, obj, 0, seen, None)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        changed = self._changed()
        if changed is None:
            return
        self._restore()
        if exc_type is None:
            path, value, owner = changed
            raise RebindError(
                f"{path}: the step rebinds it (now a {type(value).__name__}) instead of writing in place"
                f"{owned_by(owner)}; a graph replays the step on the object as captured, so its state would stop "
                f"advancing. {advice(owner)}"
            )

    def _snapshot(self, path: str, obj: Any, depth: int, seen: set, owner: Optional[type]) -> None:
        """Save the containers reachable from ``obj``; ``owner``: the class of the nearest object holding them."""
        if depth > MAX_DEPTH or id(obj) in seen or len(self._saved) >= MAX_CONTAINERS or isinstance(obj, _OPAQUE):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, dict)):
            items = list(enumerate(obj)) if isinstance(obj, list) else list(obj.items())
            self._saved.append((path, obj, obj.copy(), "{}[{!r}]", owner))
            children = [(f"{path}[{key!r}]", value) for key, value in items]
        elif isinstance(obj, tuple):
            children = [(f"{path}[{index}]", value) for index, value in enumerate(obj)]
        elif hasattr(obj, "__dict__"):
            attributes = vars(obj)
            owner = type(obj)
            self._saved.append((path, attributes, dict(attributes), "{}.{}", owner))
            children = [(f"{path}.{name}", value) for name, value in attributes.items()]
        else:
            return
        for child_path, value in children:
            self._snapshot(child_path, value, depth + 1, seen, owner)

    def _changed(self) -> Optional[Tuple[str, Any, Optional[type]]]:
        """The first attribute (path, new value, owning class) whose object identity changed, if any."""
        for path, container, saved, child_path, owner in self._saved:
            if not entries_changed(container, saved):
                continue
            if isinstance(container, list) or container.keys() != saved.keys():
                return path, container, owner
            name = next(name for name, value in container.items() if value is not saved[name])
            return child_path.format(path, name), container[name], owner
        return None

    def _restore(self) -> None:
        for _, container, saved, _, _ in reversed(self._saved):
            restore_entries(container, saved)


def owned_by(owner: Optional[type]) -> str:
    """`` (state of a module.Class)``: the object the rebound attribute or entry belongs to, if any."""
    return "" if owner is None else f" (state of a {owner.__module__}.{owner.__qualname__})"


def advice(owner: Optional[type]) -> str:
    """What to do, for the class whose attribute the step rebinds: Hugging Face caches have a graph-safe way."""
    if owner is not None and owner.__module__.split(".")[0] == "transformers":
        return f"{owner.__name__} is {HF_ADVICE}"
    return GENERIC_ADVICE


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
