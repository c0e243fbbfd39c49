"""Containers a step reads in place, compared per call in one C-level pass each way, whatever they hold.

Python has no hook on a dict's or a list's writes (``model.sampling_cfg["temperature"] = 0.5``,
``tables["cos"] = new``, an entry of a global list; a class's ``__dict__`` is graphrt.guards.class_state's).
``Versioned`` compares the containers a step reads per call: a small one of values whose ``==`` means "the same"
(functions, classes, numbers, strings: a config dict, an object's attributes) against a copy, all of them in one
tuple compare; a dict of other values (tensors) by its version tag (PEP 509: every write gives the dict a new
one; torch.compile's ``DICT_VERSION`` guard reads it through ``torch._C._dynamo.guards.dict_version``), all of
them in one pass; a list or set of other values by the identity of its items; a buffer (a numpy array, an
``array.array``, a ``bytearray``: its items are numbers in memory, not Python objects) by its bytes, read once
per call. A container found changed is read again (``Watched.change``), and its copy or version renewed when
what the step reads of it is as at capture (a key the step skips written, a value assigned again).
"""

from __future__ import annotations

import array
import copy
import operator
from typing import AbstractSet, Any, Callable, Collection, List, Optional, Protocol, Sequence, Tuple

import torch

from graphrt.guards.python_state import frozen, is_reference, shown

try:
    import numpy
except ImportError:  # torch runs without numpy
    numpy = None

Change = Tuple[str, str]  # (reason, what changed in words)
# containers of numbers in memory, written in place by item or slice (``table[0] = 2.0``)
BUFFERS: Tuple[type, ...] = (array.array, bytearray, *((numpy.ndarray,) if numpy is not None else ()))
# a buffer up to this size is compared per call (a few microseconds at most); a larger one (a table of
# constants) is not read: comparing it would cost more than the step
MAX_BUFFER_BYTES = 1 << 16


def is_container(value: Any) -> bool:
    """A dict, list or set, a tuple holding one (``([1.0],)``), or a buffer of numbers small enough to compare
    per call: what is read in place."""
    if isinstance(value, tuple):
        return any(map(is_container, value))
    return isinstance(value, (dict, list, set)) or compared_buffer(value)


def plain_copy(value: Any) -> Any:
    """``value`` with the dicts, lists, sets and tuples it holds copied at every depth, and anything else as is
    (objects stay themselves, compared by identity): ``value == plain_copy(value)`` until a write anywhere
    inside it (``cfg["rope"]["factor"] = 4``, ``rows[0][0] = 2``), where a shallow copy would share the
    inner containers and see nothing."""
    if isinstance(value, dict):
        return {key: plain_copy(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(map(plain_copy, value))
    if isinstance(value, (list, tuple, set)):  # a set (hashable members), a subclass (a namedtuple): shallow
        return copy.copy(value)
    return value


def compared_buffer(value: Any) -> bool:
    """Whether ``value`` is a buffer of numbers small enough to compare per call (``MAX_BUFFER_BYTES``)."""
    if not isinstance(value, BUFFERS):
        return False
    size = len(value) if isinstance(value, bytearray) else (
        len(value) * value.itemsize if isinstance(value, array.array) else value.nbytes)
    return size <= MAX_BUFFER_BYTES


_guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
dict_version: Optional[Callable[[dict], int]] = getattr(_guards, "dict_version", None)
_is = operator.is_


class Watched(Protocol):
    """One container the step reads in place, and what it read of it."""

    mapping: Any  # a dict, a list or a set

    def change(self) -> Optional[Change]:
        """``(reason, words)`` when what the step read of ``mapping`` differs from capture, else None."""


class Contents:
    """A container the step reads (a dict, list or set): its items at capture, plain values by value and
    tensors and objects by identity (a tensor rebound in it is a binding changed, as a module's); a dict's
    ``skip`` keys (what the step itself writes: an object's counter) are left out."""

    __slots__ = ("mapping", "path", "captured", "_keep", "skip")

    def __init__(self, container: Collection[Any], path: str, skip: AbstractSet[Any] = frozenset()) -> None:
        self.mapping, self.path, self._keep, self.skip = container, path, [], skip
        self.captured = _items(container, self._keep, skip)

    def change(self) -> Optional[Change]:
        now = _items(self.mapping, [], self.skip)
        if now == self.captured:
            return None
        before, after = dict(self.captured), dict(now)
        for key in {**before, **after}:
            then, value = before.get(key, "<unset>"), after.get(key, "<unset>")
            if then != value:
                where = f"{self.path}[{key!r}]"
                if is_reference(then) or is_reference(value):
                    return "rebound_state", f"{where} is bound to another object than at capture"
                return "python_state", f"{where} {shown(then)} -> {shown(value)}"
        return "python_state", f"{self.path}: its items were reordered since capture"


def _items(container: Collection[Any], keep: List[Any],
           skip: AbstractSet[Any] = frozenset()) -> Tuple[Tuple[Any, Any], ...]:
    """``(key, frozen value)`` of a dict's items (but ``skip``'s), a list's positions, a set's members, a
    buffer's items (a numpy array's flat, after its shape and dtype)."""
    if isinstance(container, (array.array, bytearray)):
        return tuple(enumerate(container))
    if isinstance(container, BUFFERS):  # a numpy array
        return (("shape", container.shape), ("dtype", container.dtype.str), *enumerate(container.ravel().tolist()))
    if isinstance(container, dict):
        return tuple((key, frozen(value, keep)) for key, value in container.items() if key not in skip)
    if isinstance(container, (list, tuple)):
        return tuple(enumerate(frozen(value, keep) for value in container))
    return tuple((member, member) for member in frozen(container, keep)[1])


class Versioned:
    """The containers of ``entries``, compared per call (``check``), read again where one changed."""

    __slots__ = ("entries", "copied", "copied_dicts", "copies", "versioned", "versioned_dicts", "versions",
                 "by_identity", "members", "buffers", "snapshots")

    def __init__(self, entries: Sequence[Watched]) -> None:
        self.entries = list(entries)
        self.buffers = [entry for entry in self.entries if isinstance(entry.mapping, BUFFERS)]
        self.snapshots = [snapshot(entry.mapping) for entry in self.buffers]
        self.copied = [entry for entry in self.entries if entry not in self.buffers and _by_value(entry.mapping)]
        self.versioned = [entry for entry in self.entries if dict_version is not None and entry not in self.copied
                          and type(entry.mapping) is dict]
        self.by_identity = [entry for entry in self.entries
                            if entry not in self.copied and entry not in self.versioned and entry not in self.buffers]
        self.copied_dicts = [entry.mapping for entry in self.copied]
        self.copies = [plain_copy(mapping) for mapping in self.copied_dicts]  # renewed in place: check() holds it
        self.versioned_dicts = [entry.mapping for entry in self.versioned]
        self.versions: List[int] = list(map(dict_version, self.versioned_dicts)) if self.versioned else []
        self.members = [_members(entry.mapping) for entry in self.by_identity]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def equality(self) -> Optional[Tuple[Any, Any]]:
        """``(containers, copies)`` when the per-call check is ``containers == copies`` (none compared by
        version or identity): a guard compares it with its other such checks in one tuple compare. False
        may be a write that changed nothing the step reads: ``holds()`` tells, renewing the copies."""
        return None if self.versioned or self.by_identity or self.buffers else (self.copied_dicts, self.copies)

    def check(self) -> Callable[[], bool]:
        return self.holds

    def holds(self) -> bool:
        try:
            same = self.copied_dicts == self.copies
        except RuntimeError:  # a value's == raised (a tensor put where a plain value was)
            same = False
        if not same and not self._renew(self.copied):
            return False
        if self.versioned and list(map(dict_version, self.versioned_dicts)) != self.versions and (
                not self._renew(self.versioned)):
            return False
        if self.by_identity and list(map(_members, (entry.mapping for entry in self.by_identity))) != self.members and (
                not self._renew(self.by_identity)):
            return False
        if self.buffers and [snapshot(entry.mapping) for entry in self.buffers] != self.snapshots:
            return self._renew(self.buffers)
        return True

    def _renew(self, entries: Sequence[Watched]) -> bool:
        """Whether ``entries`` still read as at capture (a write that changed nothing): then their copies,
        versions and members are taken again."""
        if any(entry.change() is not None for entry in entries):
            return False
        self.copies[:] = [plain_copy(mapping) for mapping in self.copied_dicts]
        self.versions = list(map(dict_version, self.versioned_dicts)) if self.versioned else []
        self.members = [_members(entry.mapping) for entry in self.by_identity]
        self.snapshots = [snapshot(entry.mapping) for entry in self.buffers]
        return True

    def change(self) -> Change:
        """``(reason, words)`` of the first entry that differs from capture."""
        for entry in self.entries:
            change = entry.change()
            if change is not None:
                return change
        return "python_state", "a container the step reads changed"


class _Identity:
    """A member compared by identity (``==`` of two wrappers: ``is`` of what they hold)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    __hash__ = None  # type: ignore[assignment]


def _members(container: Collection[Any]) -> Tuple[Any, ...]:
    """What a container holds, comparable by identity: a dict's keys and values, a list's items."""
    values = container.values() if isinstance(container, dict) else container
    keys = tuple(container) if isinstance(container, dict) else ()
    return keys, tuple(map(_Identity, values))


def snapshot(buffer: Any) -> Any:
    """A buffer's contents as bytes (with a numpy array's dtype and shape, an array's typecode): equal exactly
    when every item is."""
    if isinstance(buffer, bytearray):
        return bytes(buffer)
    if isinstance(buffer, array.array):
        return buffer.typecode, buffer.tobytes()
    return buffer.dtype.str, buffer.shape, buffer.tobytes()


def put_back_buffer(buffer: Any, saved: Any) -> None:
    """Write ``saved`` (a copy of ``buffer`` taken before) back into ``buffer``, in place: whoever holds the
    buffer sees its items as they were."""
    if isinstance(buffer, (array.array, bytearray)):
        buffer[:] = saved
    else:
        if buffer.shape != saved.shape:
            buffer.shape = saved.shape
        buffer[...] = saved


MAX_COPIED = 32  # a container of more items is compared by version or identity


def _by_value(container: Collection[Any]) -> bool:
    """Whether comparing ``container`` with a copy is cheap and says "unchanged" exactly when it is: few
    items, each a value whose ``==`` is identity or plain equality."""
    values = container.values() if isinstance(container, dict) else container
    return len(container) <= MAX_COPIED and all(map(_plain, values))


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
