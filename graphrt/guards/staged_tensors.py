"""Tensors rebound at a path the step reads, staged into the tensor the graph captured, like arguments.

A model that binds a new tensor at one of its attributes before each call and then only reads it
(Qwen2-VL's ``rope_deltas``, set at the start of every ``generate()``) would otherwise send a call per
rebinding eagerly and record its graphs again. A graph reads the memory of the tensor it captured, so a
key can serve the new binding by copying it there before each replay, as staging copies an argument
into its slot: when the new tensor has the captured one's shape, dtype, device, layout and strides, the
step never writes the captured one, and it is no parameter (a parameter replaced is new weights, whose
graphs are recorded again rather than copied into on every call). The captured tensor becomes the key's slot for that path (a
caller still holding it sees the copies). A captured tensor the step did not touch at all is no input
of the graph: its rebinding changes nothing a replay does. Anything else is a rebinding, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Set, Tuple

import torch

from graphrt.backends.state_journal import backing_tensor

Getter = Callable[[], Any]  # what the path holds now


class TensorStaging:
    """The paths of one key whose tensor was rebound to a stageable one, and the per-call copies."""

    __slots__ = ("touched", "written", "pairs")

    def __init__(self, touched: Set[int], written: Set[int]) -> None:
        self.touched = touched  # memory the step read or wrote (addresses)
        self.written = written  # of which, written
        self.pairs: Dict[Hashable, Tuple[torch.Tensor, Getter]] = {}

    def accept(self, path: Hashable, captured: Any, now: Any, current: Getter) -> bool:
        """Whether the key may serve calls with ``now`` bound at ``path`` where ``captured`` was: the same
        tensor, a tensor the step never touched, or one staged from now on (``current`` reads it per call)."""
        if now is captured:
            self.pairs.pop(path, None)
            return True
        if not isinstance(captured, torch.Tensor) or isinstance(captured, torch.nn.Parameter) or (
                type(now) is not type(captured) or not _same_kind(captured, now)):
            return False  # a parameter replaced is new weights: its graphs are recorded again, not copied into
        address = _address(captured)
        if address not in self.touched:
            return True
        if address in self.written:
            return False
        self.pairs[path] = (captured, current)
        return True

    def stage(self) -> None:
        """Copy every rebound tensor into the captured one (before a replay)."""
        for captured, current in self.pairs.values():
            captured.copy_(current())


def _same_kind(captured: torch.Tensor, now: torch.Tensor) -> bool:
    return (now.shape == captured.shape and now.dtype == captured.dtype and now.device == captured.device
            and now.layout == captured.layout == torch.strided and now.stride() == captured.stride())


def _address(tensor: torch.Tensor) -> int:
    return backing_tensor(tensor).untyped_storage().data_ptr()
