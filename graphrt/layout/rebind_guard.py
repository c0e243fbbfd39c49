"""RebindGuard: a recorded step must not rebind the attributes of its model or of objects passed in.

An object argument (a cache, a module) and the model's modules are constants of the graph:
replays read the tensors they held at capture. A step that rebinds such state instead of writing
it in place (a transformers ``DynamicCache`` grows by ``torch.cat`` and reassignment; a recurrent
module's ``self.state = self.state * 0.5 + x``; a counter attribute ``+= 1``) cannot be replayed:
the graph would keep reading the old tensors and the state would stop advancing. The guard
snapshots the attributes reachable from those objects (every submodule of a module) before the
recorded step; afterwards it puts back any that changed (the state journal undoes tensor writes,
not Python assignments) and fails the capture naming the path, the attribute and the class that
owns it (with what to do for a Hugging Face cache). Rebinding a plain value to an equal one
(``self.n = 4`` again) changes nothing a replay depends on and is not refused; in a module's
attributes only tensors count: its Python values (``self.calls += 1``) are frozen by a graph,
as on CUDA, and change during capture as they do there.
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from graphrt.layout.tensor_tree import is_plain_constant

MAX_DEPTH = 4
MAX_CONTAINERS = 10_000
_OPAQUE = (torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
GENERIC_ADVICE = "Use an object updated in place, or pass its tensors as arguments"
HF_ADVICE = ("a Hugging Face cache class whose update keeps Python state: generate with "
             "graphrt.hf.graph_generate(model, ...), which hands generate() static caches with graph-safe layers "
             "and names the layer kinds it cannot graph; in a decode loop of your own, pass "
             "cache = graphrt.hf.graph_safe_cache(StaticCache(config=model.config, max_cache_len=...), model.config) "
             "and, as the model builds a sliding-window mask inside the step otherwise, each step's "
             "attention_mask=graphrt.hf.decode_masks(model, cache)(position_ids)")


class RebindError(TypeError):
    """The recorded step rebound the state of an object passed in as an argument."""


class RebindGuard:
    """``with RebindGuard([(path, obj), ...]): step()``: undo and refuse rebinding inside ``obj``."""

    def __init__(self, objects: Sequence[Tuple[str, Any]]) -> None:
        self.objects = objects
        # (path, container, shallow copy, child path format, the class of the object whose state it is,
        # whether only tensor rebindings count: a module's attributes, whose Python values a graph freezes)
        self._saved: List[Tuple[str, Any, Any, str, Optional[type], bool]] = []

    def __enter__(self) -> "RebindGuard":
        seen: set = set()
        for path, obj in self.objects:
            self._snapshot(path, obj, 0, seen, None)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        changed = self._changed()
        if changed is None:  # Python values a module changed stay changed, as under a CUDA capture
            return
        self._restore()  # every binding as before the step
        if exc_type is None:
            path, value, owner = changed
            raise RebindError(
                f"{path}: the step rebinds it (now a {type(value).__name__}) instead of writing in place"
                f"{owned_by(owner)}; a graph replays the step on the object as captured, so its state would stop "
                f"advancing. {advice(owner)}"
            )

    def _snapshot(self, path: str, obj: Any, depth: int, seen: set, owner: Optional[type],
                  tensors_only: bool = False) -> None:
        """Save the containers reachable from ``obj``; ``owner``: the class of the nearest object holding
        them; ``tensors_only``: only tensors bound or unbound in them count (a module's plain state)."""
        if depth > MAX_DEPTH or id(obj) in seen or len(self._saved) >= MAX_CONTAINERS or isinstance(obj, _OPAQUE):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            self._snapshot_module(path, obj, seen)
            return
        if isinstance(obj, (list, dict)):
            items = list(enumerate(obj)) if isinstance(obj, list) else list(obj.items())
            self._saved.append((path, obj, obj.copy(), "{}[{!r}]", owner, tensors_only))
            children = [(f"{path}[{key!r}]", value) for key, value in items]
        elif isinstance(obj, tuple):
            children = [(f"{path}[{index}]", value) for index, value in enumerate(obj)]
        elif hasattr(obj, "__dict__"):
            attributes = vars(obj)
            owner = type(obj)
            self._saved.append((path, attributes, dict(attributes), "{}.{}", owner, tensors_only))
            children = [(f"{path}.{name}", value) for name, value in attributes.items()]
        else:
            return
        for child_path, value in children:
            self._snapshot(child_path, value, depth + 1, seen, owner, tensors_only)

    def _snapshot_module(self, path: str, module: torch.nn.Module, seen: set) -> None:
        """Save every submodule's attributes and its parameter, buffer and submodule tables; plain
        containers among its attributes are followed as an object's are."""
        for name, submodule in module.named_modules(prefix=path):
            seen.add(id(submodule))
            if isinstance(submodule, torch.jit.ScriptModule):
                continue  # TorchScript's tables are not dicts; a step that runs it is refused (backends.torchscript)
            owner = type(submodule)
            attributes = vars(submodule)
            self._saved.append((name, attributes, dict(attributes), "{}.{}", owner, True))
            for table in (submodule._parameters, submodule._buffers, submodule._modules):
                self._saved.append((name, table, dict(table), "{}.{}", owner, False))
            for key, value in attributes.items():
                if isinstance(value, (list, dict)) and not key.startswith("_"):
                    self._snapshot(f"{name}.{key}", value, 1, seen, owner, tensors_only=True)

    def paths(self) -> Dict[int, str]:
        """The path of each object and attribute dict saved (``id`` -> ``args[1].layers[0]``)."""
        paths = {id(obj): path for path, obj in self.objects}
        paths.update((id(container), path) for path, container, *_ in self._saved)
        return paths

    def _changed(self) -> Optional[Tuple[str, Any, Optional[type]]]:
        """The first attribute (path, new value, owning class) whose object identity changed, if any
        (in a module's attributes, only a tensor bound or unbound: its Python values are frozen by
        a graph, as on CUDA, and change during capture as they do there)."""
        for path, container, saved, child_path, owner, tensors_only in self._saved:
            if not entries_changed(container, saved):
                continue
            if tensors_only:
                key = tensor_rebound(container, saved)
                if key is not _NONE:
                    return child_path.format(path, key), entry_of(container, key), owner
                continue
            if isinstance(container, list) or container.keys() != saved.keys():
                return path, container, owner
            name = next(name for name, value in container.items() if differs(value, saved[name]))
            return child_path.format(path, name), container[name], owner
        return None

    def _restore(self) -> None:
        for _, container, saved, _, _, _ in reversed(self._saved):
            restore_entries(container, saved)


def owned_by(owner: Optional[type]) -> str:
    """`` (state of a module.Class)``: the object the rebound attribute or entry belongs to, if any."""
    return "" if owner is None else f" (state of a {owner.__module__}.{owner.__qualname__})"


def advice(owner: Optional[type]) -> str:
    """What to do, for the class whose attribute the step rebinds: Hugging Face caches have a graph-safe way."""
    if owner is not None and owner.__module__.split(".")[0] == "transformers":
        return f"{owner.__name__} is {HF_ADVICE}"
    return GENERIC_ADVICE


def differs(now: Any, then: Any) -> bool:
    """Whether an entry holds another object than it did: by identity, plain values by equality."""
    if now is then:
        return False
    return not (type(now) is type(then) and is_plain_constant(now) and now == then)


_NONE = object()


def entry_of(container: Any, key: Any) -> Any:
    """``container[key]``, or None where a dict lacks the key or a list is shorter."""
    if isinstance(container, dict):
        return container.get(key)
    return container[key] if key < len(container) else None


def tensor_rebound(container: Any, saved: Any) -> Any:
    """The first key whose entry is, or was, a tensor and now holds another object, else ``_NONE``."""
    keys = range(max(len(container), len(saved))) if isinstance(container, list) else {*container, *saved}
    for key in keys:
        now, then = entry_of(container, key), entry_of(saved, key)
        if now is not then and (isinstance(now, torch.Tensor) or isinstance(then, torch.Tensor)):
            return key
    return _NONE


def entries_changed(container: Any, saved: Any) -> bool:
    """Whether a dict or list holds other objects (plain values: other values), or other keys, than
    its shallow copy ``saved``."""
    if len(container) != len(saved):
        return True
    if isinstance(container, dict):
        return any(key not in container or differs(container[key], value) for key, value in saved.items())
    return any(differs(now, then) for now, then in zip(container, saved))


def restore_entries(container: Any, saved: Any) -> None:
    """Put a dict's or list's entries back as in its shallow copy ``saved`` (untouched when unchanged)."""
    if not entries_changed(container, saved):
        return
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    else:
        container[:] = saved
