"""A wrapped module's own methods called through its ``wrap()`` wrapper: one that returns the module
(``.cuda()``, ``.to()``, ``.eval()``) returns the wrapper, not the bare module, and the scratch state
declared to ``wrap()`` follows the tensors such a method replaced (``Module.to`` makes new ones)."""

from __future__ import annotations

import functools
from itertools import chain
from typing import Any, Callable, Dict, Set, Tuple

import torch

from graphrt.backends.state_journal import storage_key


def _named_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return dict(chain(module.named_parameters(), module.named_buffers()))


def through_wrapper(wrapper: Any, module: torch.nn.Module, method: Callable[..., Any],
                    scratch: Set[Tuple[torch.device, int]]) -> Callable[..., Any]:
    """``method`` (bound to ``module``) as the wrapper's: its result is the wrapper where it was the module,
    and each of the module's tensors in ``scratch`` (storage keys, updated in place) is its new tensor after."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        before = {name: storage_key(tensor) for name, tensor in _named_tensors(module).items()
                  if storage_key(tensor) in scratch}
        result = method(*args, **kwargs)
        if before:
            after = _named_tensors(module)
            scratch.difference_update(before.values())
            scratch.update(storage_key(after[name]) for name in before if name in after)
        return wrapper if result is module else result
    return call
