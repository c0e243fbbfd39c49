"""Nested arguments and outputs as flat leaves plus a structure that compares cheaply.

Containers are tuples, lists, dicts, namedtuples, dataclass instances and every type registered
with torch's pytree (Hugging Face ``ModelOutput``, ``torch.return_types``, ``OrderedDict``, ...).
Everything else is a leaf: a tensor, or a value (a plain constant such as an int or None, or an
opaque object such as a cache or a module). A structure holds container types, keys and leaf
kinds but no leaf values, so two calls with the same layout have equal structures and comparing
them is a tuple comparison; the leaves are compared separately.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Iterator, List, Tuple

import torch
from torch.utils._pytree import SUPPORTED_NODES

TENSOR = "tensor"  # leaf kinds inside a structure
VALUE = "value"

PLAIN_CONSTANTS = (
    int, float, complex, bool, str, bytes, type(None), type(Ellipsis), slice, enum.Enum,
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size,
)

_SEQUENCE, _NAMEDTUPLE, _DICT, _DATACLASS, _PYTREE = range(5)  # container kinds


class _Rebuild:
    """What rebuilding a container needs beyond its type and keys (a dataclass template, a torch
    pytree context). Always equal, so it never makes two structures differ."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rebuild)

    def __hash__(self) -> int:
        return 0


def flatten(value: Any, leaves: List[Any]) -> Any:
    """Append ``value``'s leaves to ``leaves`` (depth first) and return its structure."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return TENSOR
    cls = type(value)
    if cls is tuple or cls is list:
        return (_SEQUENCE, cls, len(value), tuple([flatten(item, leaves) for item in value]), None)
    if cls is dict:
        return (_DICT, cls, tuple(value), tuple([flatten(item, leaves) for item in value.values()]), None)
    if isinstance(value, tuple) and hasattr(cls, "_fields"):
        return (_NAMEDTUPLE, cls, cls._fields, tuple([flatten(item, leaves) for item in value]), None)
    node = SUPPORTED_NODES.get(cls)
    if node is not None:
        children, context = node.flatten_fn(value)
        return (_PYTREE, cls, _freeze(context), tuple([flatten(item, leaves) for item in children]),
                _Rebuild(context))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(field.name for field in dataclasses.fields(value))
        children = tuple([flatten(getattr(value, name), leaves) for name in names])
        return (_DATACLASS, cls, names, children, _Rebuild(value))
    leaves.append(value)
    return VALUE


def unflatten(structure: Any, leaves: Iterator[Any]) -> Any:
    """Rebuild the value ``flatten`` took apart, taking leaves from the iterator in order."""
    if structure is TENSOR or structure is VALUE:
        return next(leaves)
    kind, cls, keys, children, rebuild = structure
    values = [unflatten(child, leaves) for child in children]
    if kind == _SEQUENCE:
        return cls(values)
    if kind == _DICT:
        return dict(zip(keys, values))
    if kind == _NAMEDTUPLE:
        return cls(*values)
    if kind == _PYTREE:
        return SUPPORTED_NODES[cls].unflatten_fn(values, rebuild.data)
    rebuilt = copy.copy(rebuild.data)  # a dataclass: keep the template's other attributes
    for name, item in zip(keys, values):
        object.__setattr__(rebuilt, name, item)
    return rebuilt


def leaf_paths(structure: Any, prefix: str) -> List[str]:
    """A readable path for every leaf, in flatten order: ``output[1][0]``, ``state.h``, ``mask['a']``."""
    if structure is TENSOR or structure is VALUE:
        return [prefix]
    kind, _, keys, children, _ = structure
    paths = []
    for index, child in enumerate(children):
        if kind in (_NAMEDTUPLE, _DATACLASS) or (kind == _PYTREE and _names_children(keys, children)):
            step = f".{keys[index]}"
        elif kind == _DICT:
            step = f"[{keys[index]!r}]"
        else:
            step = f"[{index}]"
        paths.extend(leaf_paths(child, prefix + step))
    return paths


def same_value(live: Any, captured: Any) -> bool:
    """Whether a non-tensor leaf equals the captured one: plain constants by value, objects by identity."""
    if live is captured:
        return True
    return type(live) is type(captured) and isinstance(live, PLAIN_CONSTANTS) and live == captured


def is_plain_constant(value: Any) -> bool:
    return isinstance(value, PLAIN_CONSTANTS)


def _names_children(keys: Any, children: Tuple[Any, ...]) -> bool:
    return isinstance(keys, tuple) and len(keys) == len(children) and all(isinstance(key, str) for key in keys)


def _freeze(context: Any) -> Any:
    """A hashable form of a torch pytree context (dict keys arrive as a list)."""
    if isinstance(context, (list, tuple)):
        return tuple(_freeze(item) for item in context)
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context
