"""Class-level state a step reads: what a lookup through a class found at capture.

``self.softmax_scale`` found on ``MyAttention``, ``self.forward`` found on ``RMSNorm`` (a kernel library
patches the class after capture), ``self.activation`` a staticmethod, ``Settings.temperature`` of a class
the step reads as a global: the lookup walks the class's MRO, so a change is an assignment on the class
that defines the name or on one before it (shadowing). ``class_reads`` names, per class dict on those
walks, the ``(class, name)`` lookups it takes part in. ``ClassLookups`` checks them per call: one identity
compare per name in the dict that defines it, one ``not in`` per dict before it (where an assignment would
shadow it), all in one generated function. Names torch's own classes define (``nn.Module._call_impl``,
``nn.Linear.forward``) and dunder names are torch's and Python's machinery, frozen like torch's globals.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from graphrt.guards.in_place import Change, same_value
from graphrt.guards.observe import Observation
from graphrt.guards.reads import global_attributes, self_attributes

_MISSING = object()
Lookup = Tuple[type, str]


def resolve(cls: type, name: str) -> Tuple[Optional[type], Any]:
    """Where a lookup of ``name`` through ``cls`` finds it, and the raw value there (a staticmethod as
    itself, not the function it wraps): ``(None, _MISSING)`` when no class defines it."""
    for klass in cls.__mro__:
        value = vars(klass).get(name, _MISSING)
        if value is not _MISSING:
            return klass, value
    return None, _MISSING


def class_dict(cls: type) -> dict:
    """The dict behind ``cls.__dict__`` (a read-only proxy): the one ``Cls.attr = value`` writes."""
    return gc.get_referents(vars(cls))[0]


class ClassDict:
    """A class's dict, and the lookups through it the step made (``change``: what they find now, in words)."""

    __slots__ = ("mapping", "lookups")

    def __init__(self, mapping: dict) -> None:
        self.mapping = mapping
        self.lookups: List[Tuple[type, str, Optional[type], Any]] = []  # (class, name, definer, raw value)

    def change(self) -> Optional[Change]:
        for cls, name, definer, value in self.lookups:
            now_definer, now = resolve(cls, name)
            if now_definer is not definer or not same_value(value, now):
                where = f"{cls.__qualname__}.{name}"
                if now is _MISSING:
                    return "python_state", f"{where}: deleted from its class since capture"
                if now_definer is not definer:
                    return "python_state", f"{where} is now {now_definer.__qualname__}'s (it was " \
                                           f"{definer.__qualname__}'s at capture)"
                if isinstance(value, (int, float, str, bool)) and isinstance(now, (int, float, str, bool)):
                    return "python_state", f"{where} {value!r} -> {now!r} (a class attribute)"
                return "python_state", f"{where} is another object than at capture (a class attribute)"
        return None


class ClassLookups:
    """The class dicts of a step's lookups through classes, checked per call by one function generated
    for them (``check()``): a lookup's value must still be the object it found (identity), and its name
    absent from the dicts before the definer's. Python tells of no write to a class's dict, and comparing
    the dicts whole costs a compare per entry (a transformers Llama: 35 entries for 9 lookups); a generated
    function is how ``dataclasses`` builds ``__init__`` and how Dynamo built its guards. A value assigned
    again (an equal float) renews what is compared (``holds``)."""

    __slots__ = ("dicts", "_terms", "_scope", "_check")

    def __init__(self, dicts: List[ClassDict]) -> None:
        self.dicts = dicts
        terms: Dict[Tuple[int, str], Tuple[dict, str, bool]] = {}
        for entry in dicts:
            for _, name, definer, _ in entry.lookups:
                terms[id(entry.mapping), name] = (entry.mapping, name, class_dict(definer) is entry.mapping)
        self._terms = list(terms.values())
        self._scope: Dict[str, Any] = {}  # the generated function's globals: the dicts, the values compared
        self._check = _generated(self._terms, self._scope)
        self._renew_values()

    def __bool__(self) -> bool:
        return bool(self._terms)

    def equality(self) -> None:
        """Never a plain ``==`` (graphrt.guards.key_guard groups those): ``check()`` is its own function."""
        return None

    def check(self) -> Callable[[], bool]:
        """The generated per-call check: true while every lookup finds what it found when last seen the same."""
        return self._check

    def holds(self) -> bool:
        if self._check():
            return True
        if self.change() is not None:
            return False
        self._renew_values()  # written with what it held (an equal value assigned again)
        return True

    def change(self) -> Optional[Change]:
        """``(reason, words)`` of the first lookup that finds another value than at capture, else None."""
        return next((change for change in map(ClassDict.change, self.dicts) if change is not None), None)

    def _renew_values(self) -> None:
        """The values the generated function compares with: what the defining dicts hold now."""
        self._scope.update((f"value_{index}", mapping[name])
                           for index, (mapping, name, defines) in enumerate(self._terms) if defines)


def _generated(terms: List[Tuple[dict, str, bool]], scope: Dict[str, Any]) -> Callable[[], bool]:
    """A function of no argument testing every term in one expression, its names in ``scope``: ``dict_i[name]
    is value_i`` where ``dict_i`` defines ``name``, ``name not in dict_i`` where it must not; False when an
    entry was deleted."""
    tests = []
    for index, (mapping, name, defines) in enumerate(terms):
        scope[f"dict_{index}"] = mapping
        tests.append(f"dict_{index}[{name!r}] is value_{index}" if defines else f"{name!r} not in dict_{index}")
    source = (f"def class_lookups_hold():\n    try:\n        return {' and '.join(tests) or 'True'}\n"
              "    except KeyError:\n        return False\n")
    exec(compile(source, "<graphrt class lookups>", "exec"), scope)
    return scope["class_lookups_hold"]


def class_reads(lookups: Iterable[Lookup]) -> List[ClassDict]:
    """A ``ClassDict`` per class dict the ``(class, name)`` lookups walk through, up to the class that
    defines the name; names no class defines, dunder names and those torch's classes define are left out."""
    by_dict: Dict[int, ClassDict] = {}
    for cls, name in dict.fromkeys(lookups):
        if name.startswith("__"):
            continue
        definer, value = resolve(cls, name)
        if definer is None or definer is object or definer.__module__.split(".")[0] == "torch":
            continue
        for klass in cls.__mro__[:cls.__mro__.index(definer) + 1]:
            mapping = class_dict(klass)
            entry = by_dict.setdefault(id(mapping), ClassDict(mapping))
            entry.lookups.append((cls, name, definer, value))
    return list(by_dict.values())


def step_lookups(observation: Observation) -> List[Lookup]:
    """The lookups through classes a step's code made, on the lines that ran: ``(class, name)`` for each
    name the methods that ran on a module of that class load through it (``self.name``, ``type(self).name``),
    and for each attribute the user code that ran loads from a class it reads as a global."""
    lookups = [(cls, name) for cls, ran in observation.self_codes.items() for code in ran
               for name in self_attributes(code, observation.lines_of(code))]
    for code, scope in observation.codes.items():
        lookups += [(scope[owner], name) for owner, name in global_attributes(code, observation.lines_of(code))
                    if isinstance(scope.get(owner), type)]
    return lookups
