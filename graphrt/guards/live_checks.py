"""Same: the few values a step read that no API can tell graphrt about, compared on every call.

A module-level ``MODEL = load(...)`` (a notebook cell run again), a closure variable changed with
``nonlocal``, an entry of a list or dict the step read a tensor or module through (a cache's
``layers`` list): Python has no hook for these, so each is compared on every call, one C-level
pass per dict, list or closure (``operator.itemgetter`` and identity), a few tens of nanoseconds
whatever the model's depth.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from graphrt.layout.tensor_tree import is_plain_constant

_is = operator.is_
_contents = operator.attrgetter("cell_contents")


def _cells(cells: Sequence[Any]) -> Tuple[Any, ...]:
    return tuple(map(_contents, cells))


def _by_equality(values: Sequence[Any]) -> bool:
    """Whether ``==`` on these values means "the same": plain values, and objects whose equality is
    identity (a tensor's ``==`` compares elements)."""
    return all(is_plain_constant(value) or type(value).__eq__ is object.__eq__ or isinstance(value, torch.nn.Module)
               for value in values)


class Same:
    """``get(source)`` still returns the values seen at capture: plain values by value, others by identity."""

    __slots__ = ("source", "get", "expected", "names", "what", "by_equality")

    def __init__(self, source: Any, get: Optional[Callable[[Any], Sequence[Any]]], names: Sequence[str],
                 what: str) -> None:
        self.source = source
        self.get = get  # None: the source itself, a list compared whole with a copy (no tuple built per call)
        self.names = tuple(names)
        self.what = what  # how a name reads in words: "global {}", "{}" (a path)
        self.expected = list(source) if get is None else get(source)
        self.by_equality = _by_equality(self.expected)

    @classmethod
    def items(cls, container: Any, keys: Sequence[Any], names: Sequence[str], what: str = "{}") -> "Same":
        """The entries ``container[key]`` (a dict or list) at ``keys``."""
        keys = tuple(keys)
        if isinstance(container, list) and keys == tuple(range(len(container))):
            return cls(container, None, names, what)  # the whole list, its length included
        if len(keys) == 1:  # itemgetter of one key returns the value itself: ask for it twice
            keys, names = keys * 2, tuple(names) * 2
        return cls(container, operator.itemgetter(*keys), names, what)

    @classmethod
    def cells(cls, function: Any) -> "Same":
        """The contents of a function's closure cells."""
        names = [f"{name} (closure of {function.__qualname__})" for name in function.__code__.co_freevars]
        return cls(function.__closure__, _cells, names, "{}")

    def equality(self) -> Optional[Tuple[Any, Any]]:
        """``(live, expected)`` when the check is ``live == expected`` (a whole list of plain values or
        modules), so that a guard compares all such checks in one tuple compare; else None."""
        return (self.source, self.expected) if self.get is None and self.by_equality else None

    def check(self) -> Callable[[], bool]:
        """A callable of no argument that says whether the check holds: for a whole list compared by
        equality, ``list == copy`` itself (no Python frame per call), else ``holds``."""
        if self.get is None and self.by_equality:
            return functools.partial(operator.eq, self.source, self.expected)
        return self.holds

    def holds(self) -> bool:
        get = self.get
        if get is None:
            now = self.source
        else:
            try:
                now = get(self.source)
            except (KeyError, IndexError, ValueError):  # an entry deleted, an emptied cell
                return False
        if self.by_equality:
            try:
                return now == self.expected
            except RuntimeError:  # a tensor put where a plain value was: its == raised
                return False
        return len(now) == len(self.expected) and all(map(_is, now, self.expected))

    def change(self) -> Tuple[str, str]:
        """``(reason, words)``: the first name whose value changed."""
        try:
            now: Optional[Sequence[Any]] = self.source if self.get is None else self.get(self.source)
        except (KeyError, IndexError, ValueError):
            now = None
        if now is None or len(now) != len(self.expected):
            return "rebound_state", f"{self.what.format(self.names[0] if self.names else '?')}: an entry was added " \
                                    "or removed since capture"
        for name, value, then in zip(self.names, now, self.expected):
            if value is then or self.by_equality and is_plain_constant(value) and value == then:
                continue
            words = self.what.format(name)
            if is_plain_constant(then) and is_plain_constant(value):
                return "python_state", f"{words} {then!r} -> {value!r}"
            return "rebound_state", f"{words} is bound to another object than at capture"
        return "rebound_state", f"{self.what.format(self.names[0])} changed"


def global_checks(scopes: Sequence[Tuple[dict, Tuple[str, ...]]]) -> List[Same]:
    """A check per globals dict of the names the step's own code reads there."""
    return [Same.items(scope, names, names, "global {}") for scope, names in scopes if names]
