"""Dicts a step reads in place, compared per call in one C-level pass each way, whatever they hold.

Python has no hook on a dict's writes (a class's ``__dict__`` written by ``Cls.attr = value``, a
container changed with ``d[key] = value``). ``Versioned`` compares the dicts a step reads per call: a
small dict of values whose ``==`` means "the same" (functions, classes, numbers, strings: a model
class's own dict) against a copy, all of them in one tuple compare; any other by its version tag
(PEP 509: every write gives the dict a new one; torch.compile's ``DICT_VERSION`` guard reads it through
``torch._C._dynamo.guards.dict_version``), all of them in one pass. A dict found changed is read
again (``Watched.change``), and its copy or version renewed when what the step reads of it is as at
capture (a write elsewhere in a class's dict, a value assigned again).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

Change = Tuple[str, str]  # (reason, what changed in words)
_guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
dict_version: Optional[Callable[[dict], int]] = getattr(_guards, "dict_version", None)


class Watched(Protocol):
    """One dict the step reads in place, and what it read of it."""

    mapping: dict

    def change(self) -> Optional[Change]:
        """``(reason, words)`` when what the step read of ``mapping`` differs from capture, else None."""


class Versioned:
    """The dicts of ``entries``, compared per call (``check``), read again where one changed."""

    __slots__ = ("entries", "copied", "copied_dicts", "copies", "versioned", "versioned_dicts", "versions")

    def __init__(self, entries: Sequence[Watched]) -> None:
        self.entries = list(entries)
        self.copied = [entry for entry in self.entries if dict_version is None or _by_value(entry.mapping)]
        self.versioned = [entry for entry in self.entries if entry not in self.copied]
        self.copied_dicts = [entry.mapping for entry in self.copied]
        self.copies = [dict(mapping) for mapping in self.copied_dicts]  # renewed in place: check() holds it
        self.versioned_dicts = [entry.mapping for entry in self.versioned]
        self.versions: List[int] = list(map(dict_version, self.versioned_dicts)) if self.versioned else []

    def __bool__(self) -> bool:
        return bool(self.entries)

    def equality(self) -> Optional[Tuple[Any, Any]]:
        """``(dicts, copies)`` when the per-call check is ``dicts == copies`` (no dict versioned): a guard
        compares it with its other such checks in one tuple compare. False may be a write that changed
        nothing the step reads: ``holds()`` tells, renewing the copies."""
        return None if self.versioned else (self.copied_dicts, self.copies)

    def check(self) -> Callable[[], bool]:
        return self.holds

    def holds(self) -> bool:
        try:
            same = self.copied_dicts == self.copies
        except RuntimeError:  # a value's == raised (a tensor put where a plain value was)
            same = False
        if not same and not self._renew_copies():
            return False
        if self.versioned and list(map(dict_version, self.versioned_dicts)) != self.versions:
            return self._renew_versions()
        return True

    def _renew_copies(self) -> bool:
        if any(entry.change() is not None for entry in self.copied):
            return False
        self.copies[:] = [dict(mapping) for mapping in self.copied_dicts]
        return True

    def _renew_versions(self) -> bool:
        if any(entry.change() is not None for entry in self.versioned):
            return False
        self.versions = list(map(dict_version, self.versioned_dicts))
        return True

    def change(self) -> Change:
        """``(reason, words)`` of the first entry that differs from capture."""
        for entry in self.entries:
            change = entry.change()
            if change is not None:
                return change
        return "python_state", "a dict the step reads changed"


MAX_COPIED = 32  # a dict of more entries is compared by version


def _by_value(mapping: dict) -> bool:
    """Whether comparing ``mapping`` with a copy is cheap and says "unchanged" exactly when it is: few
    entries, each a value whose ``==`` is identity or plain equality."""
    return len(mapping) <= MAX_COPIED and all(map(_plain, mapping.values()))


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, (int, float, complex, str, bytes, type(None))) or type(value).__eq__ is object.__eq__:
        return True
    if isinstance(value, (tuple, list, frozenset)) and depth < 4:
        return all(_plain(item, depth + 1) for item in value)
    if isinstance(value, dict) and depth < 4:
        return all(_plain(item, depth + 1) for item in value.values())
    return False


def same_value(then: Any, now: Any) -> bool:
    """Identity, or equality for values whose ``==`` means the same (numbers, strings, None)."""
    return now is then or type(now) is type(then) and isinstance(now, (int, float, complex, str, bytes)) and now == then
