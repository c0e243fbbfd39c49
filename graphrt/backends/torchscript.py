"""TorchScript in a step (``torch.jit.script``, ``torch.jit.trace``): refused by name.

A TorchScript module runs its code in TorchScript's interpreter: graphrt sees none of the modules it
calls, their ``training`` flags, attributes and Python state, which a key's guards must check (a
graph replays only under the state it was captured for), and its parameter tables are not the dicts
a Python module holds. So the callable handed to ``wrap()``/``GraphRunner()`` is refused when it is
TorchScript (``refuse_torchscript``), and a key whose step runs a TorchScript module (``nested_torchscript``)
fails with the same advice: hand graphrt the eager module. TorchScript is deprecated in favor of
torch.compile, whose fused kernels graphrt records (``mode="max-autotune-no-cudagraphs"``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from graphrt.backends.base import StepRefusal
from graphrt.backends.compiled import RECOMMENDED_MODE

ADVICE = ("hand graphrt the eager module or function instead (TorchScript is deprecated in favor of torch.compile; "
          f"for fused kernels, torch.compile(model, mode='{RECOMMENDED_MODE}'), whose kernels graphrt records)")


class TorchScriptError(StepRefusal, TypeError):
    """The callable, or a module its step runs, is TorchScript: graphrt cannot guard what it runs."""


def _script_kinds() -> tuple:
    kinds = [torch.jit.ScriptModule, torch.jit.ScriptFunction]
    method = getattr(torch._C, "ScriptMethod", None)
    if method is not None:
        kinds.append(method)
    return tuple(kinds)


def _described(obj: Any) -> Optional[str]:
    """``a TorchScript module MLP`` when ``obj`` (or the object a bound method is of) is TorchScript, else None."""
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, torch.jit.ScriptModule) and not isinstance(obj, torch.jit.ScriptModule):
        obj = owner
    if not isinstance(obj, _script_kinds()):
        return None
    if isinstance(obj, torch.jit.ScriptModule):
        return f"a TorchScript module {getattr(obj, 'original_name', type(obj).__name__)}"
    name = getattr(obj, "name", None) or getattr(obj, "__name__", type(obj).__name__)
    owner = getattr(obj, "owner", None)  # a scripted module's method: its owner is the C++ module
    if owner is not None:
        try:
            return f"a TorchScript method {owner._type().name()}.{name}"
        except (AttributeError, RuntimeError):
            return f"a TorchScript method {name}"
    return f"a TorchScript function {name}"


def _message(subject: str, described: str) -> str:
    return (f"{subject}{described} (torch.jit.script or torch.jit.trace): its code runs in TorchScript's interpreter, "
            "where graphrt cannot see the modules, attributes and Python state a graph must be guarded on; "
            f"{ADVICE}")


def refuse_torchscript(fn: Any, field: str) -> None:
    """Raise TorchScriptError when ``fn`` is a TorchScript module, function or method."""
    described = _described(fn)
    if described is not None:
        raise TorchScriptError(_message(f"{field}: ", described))


def nested_torchscript(modules: Sequence[torch.nn.Module]) -> Optional[TorchScriptError]:
    """The error for the first TorchScript module among those a step ran, else None."""
    for module in modules:
        described = _described(module)
        if described is not None:
            return TorchScriptError(_message("the step runs ", described))
    return None
