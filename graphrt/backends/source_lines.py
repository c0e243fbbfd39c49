"""Where an op came from: the model line that issued it, and torch's own line when torch did."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHRT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODEL_DIRS = (os.path.join(_GRAPHRT_DIR, "reference") + os.sep,)  # graphrt code that is "the model"
# Frames of torch's dispatch and decorator machinery: never the line that issued an op.
_DISPATCH_FILES = tuple(os.path.join(_TORCH_DIR, *name.split("/")) for name in (
    "_ops.py", "_dynamo/", "_compile.py", "utils/_python_dispatch.py", "utils/_contextlib.py"))


@dataclass(frozen=True)
class SourceLine:
    """Where in the model's code an op was issued."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


def is_model_file(filename: str) -> bool:
    """True for the model's code: not torch, not graphrt's runtime, not ``<string>`` and the like."""
    inside_runtime = filename.startswith(_TORCH_DIR) or (
        filename.startswith(_GRAPHRT_DIR) and not filename.startswith(_MODEL_DIRS)
    )
    return not inside_runtime and not filename.startswith("<")


def model_source_line() -> Optional[SourceLine]:
    """The innermost frame outside torch and graphrt's runtime: the model line being executed."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_model_file(frame.f_code.co_filename):
            return SourceLine(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def torch_source_line() -> Optional[SourceLine]:
    """The innermost torch frame outside its dispatch machinery (``nn/modules/transformer.py``,
    say) when torch's own code issued the op, else None: with the model line it says who asked."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_model_file(filename):
            return None
        if filename.startswith(_TORCH_DIR) and not filename.startswith(_DISPATCH_FILES):
            return SourceLine(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None
