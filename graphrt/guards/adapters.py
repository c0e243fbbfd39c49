"""PEFT adapters: the in-place changes PEFT's adapter API makes to its layers, told to the state epoch.

PEFT's layers keep their adapter state in containers they change in place, past ``__setattr__``:
``scale_layer()`` does ``self.scaling[adapter] *= scale``, ``merge()`` appends to
``merged_adapters`` (after adding the delta to the base weight, so a graph of the unmerged path
would add it twice), ``set_scale()`` and ``unmerge()`` likewise. When a step ran PEFT tuner layers
(``peft`` imported, a module a ``BaseTunerLayer``), every method their classes define in peft that
the step itself did not run (``merge``, ``unmerge``, ``scale_layer``, ``set_scale``, ...) bumps the
state epoch after it returns, so the layers' state is read again on the next call. Methods the step
runs (``forward``) are left alone: a replay runs none of them.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Callable, Sequence

import torch

from graphrt.guards.epoch import bump_after

_done: "weakref.WeakSet[type]" = weakref.WeakSet()


def is_adapter_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (``peft`` imported)."""
    base = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None)
    return base is not None and isinstance(module, base)


def watch_adapter_layers(modules: Sequence[torch.nn.Module], ran: Callable[[types.CodeType], bool]) -> None:
    """Make the adapter API of the PEFT layers among ``modules`` bump the epoch; ``ran(code)``:
    whether the step ran that code (such methods stay as they are)."""
    for cls in {type(module) for module in modules if is_adapter_layer(module)}:
        if cls in _done:
            continue
        _done.add(cls)
        for klass in cls.__mro__:
            if not klass.__module__.startswith("peft."):
                continue
            for name, function in list(vars(klass).items()):
                if isinstance(function, types.FunctionType) and not name.startswith("__") and not ran(
                        function.__code__):
                    bump_after(klass, name)
