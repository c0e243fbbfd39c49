"""wrap(pad_values=...): what the padding rows hold, by argument path, checked against the function's parameters."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch


def parameters_of(fn: Callable[..., Any]) -> List[inspect.Parameter]:
    """``fn``'s parameters (a module's ``forward``'s); none where it has no signature (a builtin)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return []


def positional_names(fn: Callable[..., Any]) -> List[str]:
    """The names of ``fn``'s positional parameters, to name arguments by."""
    return [p.name for p in parameters_of(fn) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def checked_pad_values(pad_values: Optional[Mapping[str, float]], fn: Callable[..., Any]) -> Dict[str, float]:
    """``wrap(pad_values=...)`` checked: argument paths (``args[1]``, a parameter's name, ``batch.slots``)
    to int or float pads (negative ones included: -1 for kernels that skip it)."""
    if pad_values is None:
        return {}
    if not isinstance(pad_values, Mapping):
        raise TypeError(f"pad_values: expected a mapping of argument paths to numbers, got {type(pad_values).__name__}")
    parameters = parameters_of(fn)
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | {"args"}
    any_name = not parameters or any(p.kind is p.VAR_KEYWORD for p in parameters)
    for path, value in pad_values.items():
        if not isinstance(path, str):
            raise TypeError(f"pad_values: expected argument paths as str keys, got {path!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"pad_values[{path!r}]: expected an int or float, got {value!r}")
        if not any_name and path.split(".")[0].split("[")[0] not in names:
            raise ValueError(f"pad_values: {path!r} names no parameter of the function (its parameters: "
                             f"{sorted(names - {'args'})}; or args[i])")
    return dict(pad_values)


__all__ = ["checked_pad_values", "parameters_of", "positional_names"]
