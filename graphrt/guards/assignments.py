"""AssignmentJournal: a step being captured must not change Python state a replay would not change.

A graph replays the step's tensor work, never its Python: a step that assigns an attribute of a
module or of an object it reads (``self.calls += 1`` used as an offset, ``self.state = new``)
would see it advance in eager and stay at the captured value in every replay. While a capture
runs the step, the patched ``__setattr__``/``__delattr__`` (graphrt.guards.epoch) tell the journal
of every assignment before it happens, with the model line that made it; after the run the
journal puts back every attribute that now holds another value, and refuses the capture
(``RebindError``) naming the attribute, the values and the line. Assigning an equal plain value
(``self.n = 4`` again), adding an attribute that was not there (lazy initialisation, as eager's
first call does) and a constructor filling a new object are not refused.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.backends.source_lines import model_source_line
from graphrt.guards import epoch
from graphrt.guards.observe import Observation, observe
from graphrt.guards.step_writes import StepWrites
from graphrt.layout.rebind_guard import RebindError, RebindGuard, advice, differs, owned_by
from graphrt.layout.tensor_tree import is_plain_constant

_MISSING = object()


class AssignmentJournal:
    """``with AssignmentJournal(): step()``: every attribute the step assigned is put back; one that
    changed value is refused (RebindError) when the block raised nothing else."""

    def __init__(self, paths: Optional[Dict[int, str]] = None) -> None:
        self._paths = paths or {}  # id of an object or of its __dict__ -> its path (args[1].layers[0])
        # (id(obj), name) -> (obj, name, value before the first assignment, the line that assigned)
        self._before: Dict[Tuple[int, str], Tuple[Any, str, Any, str]] = {}
        self._outer: Any = None

    def __enter__(self) -> "AssignmentJournal":
        epoch.install()
        self._outer = epoch.JOURNAL.active
        epoch.JOURNAL.active = self
        return self

    def note(self, obj: Any, name: str) -> None:
        """Called before ``obj.name`` is assigned or deleted: remember what it held (a module's
        attribute, or one of an object the capture names: an object argument and what it holds)."""
        key = (id(obj), name)
        if key in self._before or not isinstance(obj, torch.nn.Module) and id(obj) not in self._paths and (
                id(vars(obj)) not in self._paths if hasattr(obj, "__dict__") else True):
            return
        caller = sys._getframe(2)  # the patched __setattr__'s caller
        if caller.f_code.co_name == "__init__" and caller.f_locals.get("self") is obj:
            return  # a constructor filling an object the step made
        line = model_source_line()
        self._before[key] = (obj, name, _current(obj, name), "" if line is None else str(line))

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        epoch.JOURNAL.active = self._outer
        changed = self._changed()
        self._restore()
        if changed is not None and exc_type is None:
            raise RebindError(self._message(*changed))

    def _message(self, obj: Any, name: str, before: Any, now: Any, line: str) -> str:
        owner = type(obj)
        own = getattr(obj, "__dict__", None)
        path = f"{self._paths.get(id(obj)) or self._paths.get(id(own)) or owner.__qualname__}.{name}"
        at = f", at {line}" if line else ""
        if is_plain_constant(before) and is_plain_constant(now):
            return (f"{path}: the step assigns it ({before!r} -> {now!r}{at}){owned_by(owner)}; a graph replays the "
                    "step's tensor work, never its Python, so replays would go on with the captured value. Keep such "
                    f"state in a tensor written in place, or pass it as an argument. {advice(owner)}")
        return (f"{path}: the step rebinds it (now a {type(now).__name__}{at}) instead of writing in place"
                f"{owned_by(owner)}; a graph replays the step on the object as captured, so its state would stop "
                f"advancing. {advice(owner)}")

    def _changed(self) -> Optional[Tuple[Any, str, Any, Any, str]]:
        """The first attribute, in assignment order, whose value differs from before the step."""
        for obj, name, before, line in self._before.values():
            if before is _MISSING:
                continue  # an attribute the step added: as eager's first call would
            now = _current(obj, name)
            if differs(now, before):
                return obj, name, before, now, line
        return None

    def _restore(self) -> None:
        """Every attribute the step assigned back to its value before the step (newest first)."""
        restored: List[Tuple[Any, str, Any, str]] = list(self._before.values())
        for obj, name, before, _ in reversed(restored):
            if before is _MISSING or _current(obj, name) is before:
                continue
            setattr(obj, name, before)


@contextmanager
def python_state_kept(roots: Sequence[Tuple[str, Any]], fn: Any = None) -> Iterator[StepWrites]:
    """A run of a step for capture: the bindings of ``roots`` it changed (RebindGuard), every attribute
    it assigned (AssignmentJournal) and the class attributes, helper objects and containers of the model's
    own code it wrote (StepWrites; ``fn``: the wrapped callable, whose globals and closure count) are put
    back; the first two refused (RebindError), the last kept as eager's calls leave it (a replay runs no
    Python)."""
    with RebindGuard(roots) as rebinding, AssignmentJournal(rebinding.paths()), StepWrites(roots, fn) as writes:
        yield writes


def observed_run(step: Callable[[], Any], roots: Sequence[Tuple[str, Any]], fn: Any = None) -> Tuple[Any, Observation]:
    """``python_state_kept`` around one run of ``step``, observed (graphrt.guards.observe): a global
    it read and then rebound is put back and refused too, and a step drawing from a host generator."""
    with python_state_kept(roots, fn) as writes:
        result, observation = observe(step)
        writes.observation = observation  # a refused write is named with its line
        observation.refuse_host_draws()
        observation.refuse_assigned_globals()
    observation.written = writes.written  # the step's own state: left out of the key's per-call compare
    return result, observation


def _current(obj: Any, name: str) -> Any:
    """What ``obj.name`` holds (a module's parameter, buffer or submodule included), else _MISSING; a module
    still in its constructor may have no tables yet."""
    if isinstance(obj, torch.nn.Module):
        for table in (vars(obj).get(field, {}) for field in ("_parameters", "_buffers", "_modules")):
            if name in table:
                return table[name]
    return vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
