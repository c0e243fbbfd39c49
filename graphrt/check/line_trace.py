"""Find the model line that rebinds an attribute: ``self.calls += 1`` runs no aten op to record.

Only when a recording shows rebindings, the step runs once more under a ``sys.settrace``
tracer that follows model files only; after every line it checks the rebound entries, and the
first line after which an entry holds another object is the line to report (a change made in
torch or library code is charged to the model line that called it).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, Dict, List, Optional

from graphrt.backends.source_lines import SourceLine, is_model_file
from graphrt.check.names import ObjectGraph, Rebinding
from graphrt.check.recording import Step, preserved_state, source_text


def rebinding_lines(step: Step, graph: ObjectGraph, rebindings: List[Rebinding]) -> Dict[str, str]:
    """``{rebinding name: "file:line in function"}`` for the rebindings the traced rerun located."""
    pending = list(rebindings)
    found: Dict[str, str] = {}
    last_line: Dict[FrameType, int] = {}

    def check(frame: FrameType, line: int) -> None:
        for rebinding in list(pending):
            if rebinding.changed():
                pending.remove(rebinding)
                found[rebinding.name] = source_text(SourceLine(frame.f_code.co_filename, line, frame.f_code.co_name))

    def local(frame: FrameType, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        if event == "line" and frame in last_line:
            check(frame, last_line[frame])
        elif event == "return":
            check(frame, frame.f_lineno)
            last_line.pop(frame, None)
        if event == "line":
            last_line[frame] = frame.f_lineno
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        return local if event == "call" and pending and is_model_file(frame.f_code.co_filename) else None

    with preserved_state(graph):
        if step.prepare is not None:
            step.prepare()
        previous = sys.gettrace()
        sys.settrace(calls)
        try:
            step.fn()
        except Exception:  # the recording already reported how the step fails
            pass
        finally:
            sys.settrace(previous)
    return found
