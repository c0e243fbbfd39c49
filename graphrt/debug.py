"""Debug-mode guard against stale outputs: a view read after a later replay may have overwritten it raises.

Graph outputs are views of memory the graphs of one pool share: the next replay of any key in
the pool may overwrite them (the keys' outputs reuse the same blocks, so graph memory stays near
one largest key). With ``GraphRunner(..., debug=True)`` or ``GRAPHRT_DEBUG=1`` each replay bumps
the pool's generation and hands out views tagged with it; any torch operation on a view whose
generation is out of date raises ``StaleOutputError`` (torch.compile's CUDA-graph trees give
the same guarantee). Off by default: it costs a subclass per output.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map


class StaleOutputError(RuntimeError):
    """An output view was read after a later replay of its graph overwrote it."""


class GenerationCounter:
    """How many replays the graphs of one memory pool have run, and which key ran the last one
    (shared by the views every key of the pool handed out: a replay of any of them may overwrite
    another's outputs, which share the pool's memory)."""

    __slots__ = ("generation", "last_key")

    def __init__(self) -> None:
        self.generation = 0
        self.last_key = ""


class GuardedOutput(torch.Tensor):
    """A view of a static output that checks, on every torch operation, that it is still current."""

    _graphrt_counter: GenerationCounter
    _graphrt_generation: int
    _graphrt_key: str

    @staticmethod
    def guard(view: torch.Tensor, counter: GenerationCounter, key: str) -> "GuardedOutput":
        guarded = torch.Tensor._make_subclass(GuardedOutput, view, view.requires_grad)
        guarded._graphrt_counter = counter
        guarded._graphrt_generation = counter.generation
        guarded._graphrt_key = key
        return guarded

    def check_current(self) -> None:
        counter = self._graphrt_counter
        if counter.generation != self._graphrt_generation:
            raise StaleOutputError(
                f"graphrt: this output of graph {self._graphrt_key} (replay #{self._graphrt_generation} of its "
                f"memory pool) may have been overwritten: the pool has replayed since, last graph "
                f"{counter.last_key} (replay #{counter.generation}); an output is valid until the next replay of "
                f"any graph in its pool: clone() outputs you keep across steps, or use copy_outputs=True"
            )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, GuardedOutput):
                value.check_current()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def guard_outputs(outputs: Any, counter: GenerationCounter, key: str) -> Any:
    """Count one replay of ``key`` in the pool and tag every output tensor with it."""
    counter.generation += 1
    counter.last_key = key
    return tree_map(lambda value: GuardedOutput.guard(value, counter, key) if isinstance(value, torch.Tensor)
                    else value, outputs)
