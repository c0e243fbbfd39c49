"""PythonState: the state of the modules a step ran, and of the objects it read, as a replay froze it.

A graph replays the step's tensor work as it ran at capture: which submodules a container held
(``model.layers.append(layer)`` adds one no replay runs), the hooks that fired (a hook added or
removed later changes nothing in a replay), the ``training`` flags and every Python attribute the
code could branch on or compute with (``m.scale = 4.0``, PEFT's active adapter), the parameters
and buffers and the memory, dtype and device they had (``model.double()`` moves them; a replay
reads the old memory). ``PythonState`` keeps all of that for the modules that ran (and the plain
attributes of the objects the step reads: an engine, an object argument) and says what differs,
in words; it is read again only after the state epoch moved (graphrt.guards.epoch).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from graphrt.backends.state_journal import backing_tensor
from graphrt.guards.epoch import watch
from graphrt.layout.tensor_tree import is_plain_constant

# A module's own bookkeeping (its tables and hook dicts), compared through ``module_state``'s
# other fields; ``training`` is compared as a flag.
MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")
MAX_PLAIN_ITEMS = 64  # a longer container is compared by identity
_REF = object()  # tags an object compared by identity in a frozen value
_mod = torch.nn.modules.module
Change = Tuple[str, str]  # (reason, what changed in words)


def frozen(value: Any, keep: List[Any], depth: int = 0) -> Hashable:
    """``value`` as a hashable that compares equal exactly when the value is the same: plain
    values (numbers, strings, None, dtypes) and small containers of them by value, anything else
    (kept alive in ``keep`` so its id stays its own) by identity."""
    if is_plain_constant(value):
        return value
    kind = type(value)
    if kind in (list, tuple, dict, set, frozenset) and depth < 3 and len(value) <= MAX_PLAIN_ITEMS:
        items = list(value.items()) if kind is dict else list(value)
        parts = []
        for item in items:
            part = frozen(item, keep, depth + 1) if kind is not dict else (
                item[0], frozen(item[1], keep, depth + 1))
            parts.append(part)
        if kind in (set, frozenset):
            return kind, frozenset(parts) if _hashable(parts) else tuple(map(id, items))
        return kind, tuple(parts)
    keep.append(value)
    return _REF, id(value)


def _hashable(parts: List[Any]) -> bool:
    try:
        frozenset(parts)
    except TypeError:
        return False
    return True


def _tensor_state(tensor: Optional[torch.Tensor], keep: List[Any]) -> Hashable:
    """A parameter's or buffer's identity, memory, dtype and device (a move changes the last three)."""
    if tensor is None:
        return None
    keep.append(tensor)
    try:
        address = backing_tensor(tensor).data_ptr()
    except RuntimeError:  # no storage (a meta or fake tensor)
        address = None
    return id(tensor), address, tensor.dtype, tensor.device


def module_state(module: torch.nn.Module, keep: List[Any]) -> Tuple[Any, ...]:
    """``(class, training, attributes, tensors, submodules, hooks)`` of one module, frozen."""
    attributes = vars(module)
    plain = tuple((name, frozen(value, keep)) for name, value in attributes.items()
                  if name not in MODULE_INTERNALS and not isinstance(value, torch.Tensor))
    tensors = tuple((name, _tensor_state(tensor, keep)) for table in (module._parameters, module._buffers)
                    for name, tensor in table.items())
    tensors += tuple((name, _tensor_state(value, keep)) for name, value in attributes.items()
                     if isinstance(value, torch.Tensor))
    children = tuple((name, frozen(child, keep)) for name, child in module._modules.items())
    hooks = tuple(frozen(tuple(attributes[name].items()), keep) for name in HOOK_DICTS if name in attributes)
    keep.append(type(module))
    return type(module), module.training, plain, tensors, children, hooks


def global_hooks(keep: List[Any]) -> Tuple[Any, ...]:
    """The forward hooks and pre-hooks registered for every module (``register_module_forward_hook``)."""
    return tuple(frozen(tuple(getattr(_mod, name).items()), keep) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
        "_global_forward_hooks_always_called"))


def object_state(obj: Any, keep: List[Any]) -> Tuple[Any, ...]:
    """``(class, attributes)`` of a plain object the step reads (an engine, an object argument)."""
    keep.append(type(obj))
    return type(obj), tuple((name, frozen(value, keep)) for name, value in vars(obj).items())


def torch_settings() -> Tuple[Tuple[str, Any], ...]:
    """torch's global settings a step computes under (torch.compile's global-state guard reads them too):
    the default dtype and device a factory call without them uses, the float32 matmul precision and TF32,
    deterministic algorithms. A graph keeps what they were at capture."""
    return (("default dtype", torch.get_default_dtype()), ("default device", str(torch.get_default_device())),
            ("float32 matmul precision", torch.get_float32_matmul_precision()),
            ("torch.backends.cuda.matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32),
            ("deterministic algorithms", (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled())))


class PythonState:
    """The frozen state of the modules a step ran and of the plain objects it read, checked again
    with ``change()`` (only after the state epoch moved: it costs a pass over every module)."""

    def __init__(self, modules: Sequence[torch.nn.Module], objects: Sequence[Tuple[str, Any]],
                 named: Sequence[Tuple[str, Any]]) -> None:
        for watched in (*modules, *(obj for _, obj in objects)):
            watch(watched)
        self._keep: List[Any] = []
        self.modules = [(module, module_state(module, self._keep)) for module in modules]
        self.objects = [(name, obj, object_state(obj, self._keep)) for name, obj in objects]
        self.global_hooks = global_hooks(self._keep)
        self.settings = torch_settings()
        self._named = named  # (name, object) roots, to name a module in words

    def change(self) -> Optional[Change]:
        """``(reason, words)`` for the first difference from capture, else None."""
        for (name, was), (_, now) in zip(self.settings, torch_settings()):
            if now != was:
                return "python_state", f"torch's {name} is {now} (it was {was} at capture)"
        scratch: List[Any] = []
        if global_hooks(scratch) != self.global_hooks:
            return "hooks", "a global forward hook (torch.nn.modules.module.register_module_forward_*) was added " \
                            "or removed since capture"
        for module, captured in self.modules:
            now = module_state(module, scratch)
            if now != captured:
                return self._describe(module, captured, now)
        for name, obj, captured in self.objects:
            now = object_state(obj, scratch)
            if now != captured:
                return _attributes_change(name, captured[1], now[1])
        return None

    def training(self) -> bool:
        """The ``training`` flag of the first module the step ran (True without modules)."""
        return self.modules[0][0].training if self.modules else True

    def _describe(self, module: torch.nn.Module, captured: Tuple[Any, ...], now: Tuple[Any, ...]) -> Change:
        path = self.path_of(module)
        kind, training, plain, tensors, children, hooks = now
        if kind is not captured[0]:
            return "rebound_state", f"{path} is now a {kind.__qualname__} (a {captured[0].__qualname__} at capture)"
        if children != captured[4]:
            return "rebound_state", f"{path}: its submodules changed ({_keys_change(captured[4], children)})"
        if tensors != captured[3]:
            return _tensors_change(path, dict(captured[3]), dict(tensors))
        if hooks != captured[5]:
            return "hooks", f"forward hooks on {path} were added or removed since capture"
        if training != captured[1]:
            changed = [self.path_of(other) for other, state in self.modules if other.training != state[1]]
            where = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            return "training", f"{'train' if training else 'eval'} mode ({where}; captured in the other mode)"
        return _attributes_change(path, captured[2], plain)

    def path_of(self, module: torch.nn.Module) -> str:
        """``Root.child.grandchild`` from the first root holding ``module``, else its class name."""
        for name, root in self._named:
            if isinstance(root, torch.nn.Module):
                for path, candidate in root.named_modules(prefix=name):
                    if candidate is module:
                        return path
        return type(module).__name__


def _attributes_change(path: str, captured: Tuple[Any, ...], now: Tuple[Any, ...]) -> Change:
    before, after = dict(captured), dict(now)
    for name in {**before, **after}:
        if before.get(name, _REF) != after.get(name, _REF):
            then, value = before.get(name, "<unset>"), after.get(name, "<unset>")
            if _is_ref(then) or _is_ref(value):
                return "python_state", f"{path}.{name} is bound to another object than at capture"
            return "python_state", f"{path}.{name} {_show(then)} -> {_show(value)}"
    return "python_state", f"{path}: its attributes changed"


def _tensors_change(path: str, captured: Dict[str, Any], now: Dict[str, Any]) -> Change:
    for name in {**captured, **now}:
        then, value = captured.get(name), now.get(name)
        if then == value:
            continue
        if then is not None and value is not None and (then[2] != value[2] or then[3] != value[3]):
            return "module_moved", (f"{path}.{name} {_dtype(then[2])} on {then[3]} -> {_dtype(value[2])} on "
                                    f"{value[3]} (the graph reads the memory of before the move)")
        if then is None or value is None or then[0] != value[0]:
            return "rebound_state", f"{path}.{name} is bound to another tensor than at capture"
        return "module_moved", f"{path}.{name}: its memory was swapped (the graph reads the memory of before)"
    return "rebound_state", f"{path}: its tensors changed"


def _keys_change(captured: Tuple[Any, ...], now: Tuple[Any, ...]) -> str:
    before, after = dict(captured), dict(now)
    added, removed = [name for name in after if name not in before], [name for name in before if name not in after]
    replaced = [name for name in after if name in before and before[name] != after[name]]
    words = [f"{label} {', '.join(names[:3])}" for label, names in (("added", added), ("removed", removed),
                                                                    ("replaced", replaced)) if names]
    return "; ".join(words) or "reordered"


def _is_ref(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] is _REF


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return repr(_thaw(value))
    return repr(value)


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] in (list, tuple, dict, set, frozenset):
        kind, parts = value
        if kind is dict:
            return {key: _thaw(part) for key, part in parts}
        return kind(_thaw(part) for part in parts)
    return value


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
