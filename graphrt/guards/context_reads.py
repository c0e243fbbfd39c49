"""Per-call context a step reads: context variables, thread-local attributes, environment variables.

None of them is a module's or an argument's state, and each can differ from one call to the next (another
request's context, another thread, ``os.environ`` set by a launcher), so a replay would silently keep what
the recording read. The observed run (graphrt.guards.observe) sees the ``ContextVar.get`` calls and the
reads of ``os.environ`` of the model's own code (a library's are frozen like its globals); the step's bytecode names the ``threading.local``
objects it reads (graphrt.guards.read_objects). Each is compared per call, in the caller's context and
thread: a context variable with ``get``, a thread-local's attributes as this thread sees them, the
environment by its dict's version (one C call while nothing was set), then by the variables read.
"""

from __future__ import annotations

import contextvars
import os
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from graphrt.guards.in_place import Change, same_value
from graphrt.guards.python_state import frozen, shown

_MISSING = object()


class ContextVariables:
    """The context variables the step's code read with ``get()``: their values in the caller's context."""

    __slots__ = ("variables", "expected")

    def __init__(self, variables: Sequence[contextvars.ContextVar]) -> None:
        self.variables = tuple(variables)
        self.expected = [variable.get(_MISSING) for variable in self.variables]

    def __bool__(self) -> bool:
        return bool(self.variables)

    def equality(self) -> None:
        return None

    def check(self) -> Callable[[], bool]:
        return self.holds

    def holds(self) -> bool:
        return all(same_value(then, variable.get(_MISSING)) for variable, then in zip(self.variables, self.expected))

    def change(self) -> Change:
        for variable, then in zip(self.variables, self.expected):
            now = variable.get(_MISSING)
            if not same_value(then, now):
                return "python_state", (f"context variable {variable.name} {_words(then)} -> {_words(now)} "
                                        "(pass per-call values as arguments)")
        return "python_state", "a context variable the step reads changed"


class ThreadLocal:
    """A ``threading.local`` the step reads: its attributes as the calling thread sees them."""

    __slots__ = ("local", "path", "captured", "_keep")

    def __init__(self, local: threading.local, path: str) -> None:
        self.local, self.path, self._keep = local, path, []
        self.captured = self._now(self._keep)

    def _now(self, keep: List[Any]) -> Any:
        return frozen(dict(vars(self.local)), keep)

    def equality(self) -> None:
        return None

    def check(self) -> Callable[[], bool]:
        return self.holds

    def holds(self) -> bool:
        return self._now([]) == self.captured

    def change(self) -> Change:
        before, after = dict(self.captured[1]), dict(self._now([])[1])
        for name in {**before, **after}:
            then, now = before.get(name, "<unset>"), after.get(name, "<unset>")
            if then != now:
                return "python_state", (f"{self.path}.{name} {shown(then)} -> {shown(now)} in this thread "
                                        "(a thread-local the step reads)")
        return "python_state", f"{self.path}: a thread-local the step reads changed"


class Environment:
    """The environment variables the step read (a ``Watched`` container of graphrt.guards.in_place: the
    dict behind ``os.environ``, compared by version, then by the variables read)."""

    __slots__ = ("mapping", "expected")

    def __init__(self, names: Sequence[str]) -> None:
        self.mapping = os.environ._data  # type: ignore[attr-defined]  # what os.environ reads and writes
        self.expected: List[Tuple[str, Optional[str]]] = [(name, os.environ.get(name)) for name in sorted(names)]

    def change(self) -> Optional[Change]:
        for name, then in self.expected:
            now = os.environ.get(name)
            if now != then:
                return "python_state", f"os.environ[{name!r}] {then!r} -> {now!r}"
        return None


def _words(value: Any) -> str:
    return "<unset>" if value is _MISSING else repr(value)
