"""PythonState: the state of the modules a step ran, and of the objects it read, as a replay froze it.

A graph replays the step's tensor work as it ran at capture: which submodules a container held
(``model.layers.append(layer)`` adds one no replay runs), the hooks that fired (a hook added or
removed later changes nothing in a replay), the ``training`` flags and every Python attribute the
code could branch on or compute with (``m.scale = 4.0``, PEFT's active adapter), the parameters
and buffers and the memory, dtype and device they had (``model.double()`` moves them; a replay
reads the old memory). ``PythonState`` keeps all of that for the modules that ran (and the plain
attributes of the objects the step reads: an engine, an object argument) and says what differs,
in words; it is read again only after the state epoch moved (graphrt.guards.epoch), and then only
what the changes since name: one attribute of one module, its hooks, its ``training`` flag, or the
whole of the one module an API changed.
"""

from __future__ import annotations

import functools
from typing import AbstractSet, Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from graphrt.backends.state_journal import backing_tensor
from graphrt.guards.attributes import attributes
from graphrt.guards.epoch import GLOBAL_HOOKS, HOOKS, SETTINGS, TRAINING, Change as Changed, watch
from graphrt.guards.staged_tensors import TensorStaging
from graphrt.guards.torch_settings import torch_settings
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
GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                     "_global_forward_hooks_always_called")
_TABLES = ("_parameters", "_buffers", "_modules")


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
    keep.append(type(module))
    return type(module), module.training, plain, tensors, children, _module_hooks(module, keep)


def _module_hooks(module: torch.nn.Module, keep: List[Any]) -> Tuple[Any, ...]:
    attributes = vars(module)
    return tuple(frozen(tuple(attributes[name].items()), keep) for name in HOOK_DICTS if name in attributes)


def _module_entry(module: torch.nn.Module, name: str, keep: List[Any]) -> Hashable:
    """What ``module`` holds at attribute ``name``, frozen as ``module_state`` freezes it: ``(part, value)``."""
    for part, table in ((3, module._parameters), (3, module._buffers), (4, module._modules)):
        if name in table:
            value = table[name]
            return part, _tensor_state(value, keep) if part == 3 else frozen(value, keep)
    value = vars(module).get(name, _REF)
    if value is _REF:
        return None
    return (3, _tensor_state(value, keep)) if isinstance(value, torch.Tensor) else (2, frozen(value, keep))


def global_hooks(keep: List[Any]) -> Tuple[Any, ...]:
    """The forward hooks and pre-hooks registered for every module (``register_module_forward_hook``)."""
    return tuple(frozen(tuple(getattr(_mod, name).items()), keep) for name in GLOBAL_HOOK_DICTS)


def object_state(obj: Any, keep: List[Any], names: Optional[AbstractSet[str]] = None) -> Tuple[Any, ...]:
    """``(class, attributes)`` of a plain object the step reads (an engine, an object argument); ``names``:
    only those attributes (the names the step's code loads)."""
    keep.append(type(obj))
    return type(obj), tuple((name, frozen(value, keep)) for name, value in attributes(obj).items()
                            if names is None or name in names)


class _Module:
    """One module's state at capture, and whether an aspect of it (an attribute's name, its hooks, its
    ``training`` flag) still reads the same: the re-read after a bump that names it. A tensor rebound to
    one the key can stage (graphrt.guards.staged_tensors) reads the same."""

    __slots__ = ("module", "captured", "entries", "tensors")

    def __init__(self, module: torch.nn.Module, keep: List[Any]) -> None:
        self.module = module
        self.captured = module_state(module, keep)
        _, _, plain, tensors, children, _ = self.captured
        self.entries = {**{name: (2, value) for name, value in plain}, **{name: (3, value) for name, value in tensors},
                        **{name: (4, value) for name, value in children}}
        self.tensors = {name: _current(module, name) for name, _ in tensors}

    def same(self, aspect: Any, keep: List[Any], staging: Optional[TensorStaging] = None) -> bool:
        module = self.module
        if aspect == TRAINING:
            return module.training == self.captured[1]
        if aspect == HOOKS or aspect in HOOK_DICTS:
            return _module_hooks(module, keep) == self.captured[5]
        if not isinstance(aspect, str) or aspect.startswith("__") or aspect in _TABLES:  # ALL, __class__, __dict__
            return self.matches(module_state(module, keep), staging)
        if aspect in MODULE_INTERNALS:  # a table of torch's own the state does not compare
            return True
        if _module_entry(module, aspect, keep) == self.entries.get(aspect):
            if staging is not None and aspect in self.tensors:
                staging.accept((id(module), aspect), self.tensors[aspect], self.tensors[aspect], _no_getter)
            return True
        return self._staged(aspect, staging)

    def matches(self, now: Tuple[Any, ...], staging: Optional[TensorStaging]) -> bool:
        """Whether ``now`` (``module_state``) reads as at capture, tensors the key stages aside."""
        captured = self.captured
        if now == captured:
            return True
        if staging is None or now[:3] != captured[:3] or now[4:] != captured[4:]:
            return False
        before, after = dict(captured[3]), dict(now[3])
        return before.keys() == after.keys() and all(
            before[name] == after[name] or self._staged(name, staging) for name in before)

    def _staged(self, name: str, staging: Optional[TensorStaging]) -> bool:
        """Whether the tensor at ``name``, rebound since capture, is one the key stages."""
        captured, now = self.tensors.get(name), _current(self.module, name)
        return staging is not None and captured is not None and now is not captured and staging.accept(
            (id(self.module), name), captured, now, functools.partial(_current, self.module, name))


def _current(module: torch.nn.Module, name: str) -> Any:
    """What ``module`` holds at ``name``: a parameter, buffer or submodule, else its attribute."""
    for table in (module._parameters, module._buffers, module._modules):
        if name in table:
            return table[name]
    return vars(module).get(name)


def _no_getter() -> None:
    return None


class _Object:
    """One plain object's state at capture (``object_state``), re-read by attribute name after a bump;
    a tensor attribute rebound to one the key can stage reads the same."""

    __slots__ = ("name", "obj", "names", "captured", "entries", "tensors")

    def __init__(self, name: str, obj: Any, keep: List[Any], names: Optional[AbstractSet[str]] = None) -> None:
        self.name, self.obj, self.names = name, obj, names
        self.captured = object_state(obj, keep, names)
        self.entries = dict(self.captured[1])
        self.tensors = {key: value for key, value in attributes(obj).items() if isinstance(value, torch.Tensor)}

    def state(self, keep: List[Any]) -> Tuple[Any, ...]:
        return object_state(self.obj, keep, self.names)

    def same(self, aspect: Any, keep: List[Any], staging: Optional[TensorStaging] = None) -> bool:
        if not isinstance(aspect, str) or aspect.startswith("__"):
            return self.matches(self.state(keep), staging)
        if self.names is not None and aspect not in self.names:
            return True  # an attribute the step's code never loads by name
        value = attributes(self.obj).get(aspect, _REF)
        if value is _REF:
            return aspect not in self.entries
        if frozen(value, keep) == self.entries.get(aspect, _REF):
            if staging is not None and aspect in self.tensors:  # bound back: no copy from now on
                staging.accept((id(self.obj), aspect), value, value, _no_getter)
            return True
        return self._staged(aspect, staging)

    def matches(self, now: Tuple[Any, ...], staging: Optional[TensorStaging]) -> bool:
        """Whether ``now`` (``object_state``) reads as at capture, tensors the key stages aside."""
        if now == self.captured:
            return True
        after = dict(now[1])
        return now[0] is self.captured[0] and after.keys() == self.entries.keys() and all(
            after[name] == then or self._staged(name, staging) for name, then in self.entries.items())

    def _staged(self, name: str, staging: Optional[TensorStaging]) -> bool:
        captured, now = self.tensors.get(name), attributes(self.obj).get(name)
        return staging is not None and captured is not None and now is not captured and staging.accept(
            (id(self.obj), name), captured, now, functools.partial(_attribute, self.obj, name))


def _attribute(obj: Any, name: str) -> Any:
    return attributes(obj).get(name)


class PythonState:
    """The frozen state of the modules a step ran and of the plain objects it read, checked again
    with ``change()`` after the state epoch moved: all of it, or only what the changes since name."""

    def __init__(self, modules: Sequence[torch.nn.Module], objects: Sequence[Tuple[str, Any]],
                 named: Sequence[Tuple[str, Any]], names: Optional[Dict[int, AbstractSet[str]]] = None) -> None:
        for watched in (*modules, *(obj for _, obj in objects)):
            watch(watched)
        self._keep: List[Any] = []
        self.modules = [_Module(module, self._keep) for module in modules]
        self.objects = [_Object(name, obj, self._keep, (names or {}).get(id(obj))) for name, obj in objects]
        self.global_hooks = global_hooks(self._keep)
        self.settings = torch_settings()
        self._named = named  # (name, object) roots, to name a module in words
        # id of what a bump names -> what to read again, and the aspect when the id is a module's hook dict
        self._by_id: Dict[int, Tuple[Any, Optional[str]]] = {id(state.obj): (state, None) for state in self.objects}
        for state in self.modules:
            self._by_id[id(state.module)] = (state, None)
            attributes = vars(state.module)
            self._by_id.update((id(attributes[name]), (state, HOOKS)) for name in HOOK_DICTS if name in attributes)
        self._global_hook_ids = {GLOBAL_HOOKS, *(id(getattr(_mod, name)) for name in GLOBAL_HOOK_DICTS)}

    def change(self, changes: Optional[Iterable[Changed]] = None,
               staging: Optional[TensorStaging] = None) -> Optional[Change]:
        """``(reason, words)`` for the first difference from capture, else None: of everything, or,
        given ``changes`` (``(id, aspect)`` since the state was last seen the same), of what they name.
        A module's tensor rebound to one ``staging`` accepts is staged, not a change."""
        if changes is None:
            return self._change(True, True, self.modules, self.objects, staging)
        scratch: List[Any] = []
        settings = hooks = False
        modules: List[_Module] = []
        objects: List[_Object] = []
        for key, aspect in changes:
            if key == SETTINGS:
                settings = True
            elif key in self._global_hook_ids:
                hooks = True
            elif key in self._by_id:
                state, hook_dict = self._by_id[key]
                if isinstance(state, _Module) and not state.same(hook_dict or aspect, scratch, staging):
                    modules.append(state)
                elif isinstance(state, _Object) and not state.same(aspect, scratch, staging):
                    objects.append(state)
        return self._change(settings, hooks, modules, objects, staging)

    def _change(self, settings: bool, hooks: bool, modules: Sequence["_Module"], objects: Sequence["_Object"],
                staging: Optional[TensorStaging]) -> Optional[Change]:
        if settings:
            for (name, was), (_, now) in zip(self.settings, torch_settings()):
                if now != was:
                    return "python_state", f"torch's {name} is {now} (it was {was} at capture)"
        scratch: List[Any] = []
        if hooks and global_hooks(scratch) != self.global_hooks:
            return "hooks", "a global forward hook (torch.nn.modules.module.register_module_forward_*) was added " \
                            "or removed since capture"
        for state in modules:
            now = module_state(state.module, scratch)
            if not state.matches(now, staging):
                return self._describe(state.module, state.captured, now)
        for state in objects:
            now = state.state(scratch)
            if not state.matches(now, staging):
                staged = {name for owner, name in staging.pairs if owner == id(state.obj)} if staging else set()
                return _attributes_change(state.name, state.captured[1], now[1], staged)
        return None

    def training(self) -> bool:
        """The ``training`` flag of the first module the step ran (True without modules)."""
        return self.modules[0].module.training if self.modules else True

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
            changed = [self.path_of(state.module) for state in self.modules
                       if state.module.training != state.captured[1]]
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


def _attributes_change(path: str, captured: Tuple[Any, ...], now: Tuple[Any, ...],
                       staged: AbstractSet[str] = frozenset()) -> Change:
    """The first attribute that reads otherwise than at capture, the ``staged`` tensors aside."""
    before, after = dict(captured), dict(now)
    for name in {**before, **after}:
        if before.get(name, _REF) != after.get(name, _REF) and name not in staged:
            then, value = before.get(name, "<unset>"), after.get(name, "<unset>")
            if is_reference(then) or is_reference(value):
                return "python_state", f"{path}.{name} is bound to another object than at capture"
            return "python_state", f"{path}.{name} {shown(then)} -> {shown(value)}"
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


def is_reference(value: Any) -> bool:
    """Whether a frozen value is an object compared by identity (not a plain value)."""
    return isinstance(value, tuple) and len(value) == 2 and value[0] is _REF


def shown(value: Any) -> str:
    """A frozen plain value in words."""
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
