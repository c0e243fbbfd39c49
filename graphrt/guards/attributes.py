"""An object's attributes, wherever they live: its ``__dict__`` and the ``__slots__`` its classes declare.

A ``@dataclass(slots=True)`` config or a helper declaring ``__slots__`` has no ``__dict__`` (or one
beside its slots): ``vars()`` cannot read it, so the guards read its attributes through ``attributes()``,
a live mapping either way.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Tuple


@functools.lru_cache(maxsize=None)
def slot_names(cls: type) -> Tuple[str, ...]:
    """The attribute slots ``cls`` and its bases declare (``__dict__`` and ``__weakref__`` aside)."""
    names: Dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        declared = vars(klass).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name not in ("__dict__", "__weakref__"):
                names[name] = None
    return tuple(names)


def has_attributes(value: Any) -> bool:
    """Whether ``value`` holds attributes of its own: a ``__dict__``, or slots its classes declare."""
    return hasattr(value, "__dict__") or bool(slot_names(type(value)))


class SlotAttributes(Mapping):
    """A slotted object's attributes as a read-only mapping, read live: the slots that hold a value, then
    its ``__dict__``'s items if it has one too."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getitem__(self, name: str) -> Any:
        own = getattr(self.obj, "__dict__", None)
        if own is not None and name in own:
            return own[name]
        if name not in slot_names(type(self.obj)):
            raise KeyError(name)
        try:
            return object.__getattribute__(self.obj, name)
        except AttributeError:  # a slot never assigned
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        for name in slot_names(type(self.obj)):
            try:
                object.__getattribute__(self.obj, name)
            except AttributeError:
                continue
            yield name
        yield from getattr(self.obj, "__dict__", ())

    def __len__(self) -> int:
        return sum(1 for _ in self)


def attributes(value: Any) -> Mapping:
    """``value``'s attributes by name, live: ``vars(value)`` for an object without slots, else its
    ``SlotAttributes`` (an object with neither: an empty mapping)."""
    if slot_names(type(value)):
        return SlotAttributes(value)
    return getattr(value, "__dict__", {})


def entry_of(container: Any, key: Any, missing: Any) -> Any:
    """What ``container`` holds at ``key``: a list's item, a mapping's entry (a dict, an object's
    ``attributes``), else ``missing``."""
    if isinstance(container, list):
        return container[key] if key < len(container) else missing
    return container.get(key, missing)
