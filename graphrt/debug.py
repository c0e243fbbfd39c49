"""Debug-mode guard against stale outputs: a view read after a later replay overwrote it raises.

Graph outputs are views of static tensors that the next replay of the same key
overwrites. With ``GraphRunner(..., debug=True)`` or ``GRAPHRT_DEBUG=1`` each replay
bumps its key's generation and hands out views tagged with it; any torch operation on a
view whose generation is out of date raises ``StaleOutputError`` (torch.compile's
CUDA-graph trees give the same guarantee). Off by default: it costs a subclass per output.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map


class StaleOutputError(RuntimeError):
    """An output view was read after a later replay of its graph overwrote it."""


class GenerationCounter:
    """How many times one graph key has been replayed (shared by the views it handed out)."""

    __slots__ = ("name", "generation")

    def __init__(self, name: str) -> None:
        self.name = name
        self.generation = 0


class GuardedOutput(torch.Tensor):
    """A view of a static output that checks, on every torch operation, that it is still current."""

    _graphrt_counter: GenerationCounter
    _graphrt_generation: int

    @staticmethod
    def guard(view: torch.Tensor, counter: GenerationCounter) -> "GuardedOutput":
        guarded = torch.Tensor._make_subclass(GuardedOutput, view, view.requires_grad)
        guarded._graphrt_counter = counter
        guarded._graphrt_generation = counter.generation
        return guarded

    def check_current(self) -> None:
        counter = self._graphrt_counter
        if counter.generation != self._graphrt_generation:
            raise StaleOutputError(
                f"graphrt: this output of graph {counter.name} (replay #{self._graphrt_generation}) was "
                f"overwritten by replay #{counter.generation}; clone() outputs you keep across steps, "
                f"or use GraphRunner(copy_outputs=True)"
            )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, GuardedOutput):
                value.check_current()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def guard_outputs(outputs: Any, counter: GenerationCounter) -> Any:
    """Bump the key's generation and tag every output tensor with it."""
    counter.generation += 1
    return tree_map(lambda value: GuardedOutput.guard(value, counter) if isinstance(value, torch.Tensor) else value,
                    outputs)
