"""Beam reordering in place, for caches whose tensors graphs read.

transformers' ``reorder_cache`` (beam search, between steps) rebinds each layer's state to new,
reordered tensors: keys and values, and a linear-attention or state-space layer's conv and
recurrent states (dicts of tensors by state index). A graph recorded before reads the old tensors
and would never see the new order. ``InPlaceBeamReorder`` runs the layer's own ``reorder_cache``
(so it reorders exactly what transformers reorders) and then copies every rebound tensor back into
the tensor it replaced, rebinding the old one: the order is transformers', the storage the graphs'.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

Slot = Tuple[str, Optional[Hashable]]  # (attribute, key in a dict attribute or None)


def held_tensors(layer: Any) -> Dict[Slot, torch.Tensor]:
    """Every tensor ``layer`` holds as an attribute, or as a value of a dict attribute (states by index)."""
    held: Dict[Slot, torch.Tensor] = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            held[(name, None)] = value
        elif isinstance(value, dict):
            held.update({(name, key): item for key, item in value.items() if isinstance(item, torch.Tensor)})
    return held


def _bound(layer: Any, slot: Slot) -> Any:
    name, key = slot
    value = getattr(layer, name, None)
    return value if key is None else (value or {}).get(key)


def _bind(layer: Any, slot: Slot, tensor: torch.Tensor) -> None:
    name, key = slot
    if key is None:
        setattr(layer, name, tensor)
    else:
        getattr(layer, name)[key] = tensor


def reorder_layer_in_place(layer: Any, beam_idx: torch.Tensor) -> None:
    """``layer.reorder_cache(beam_idx)``, with every tensor it rebinds copied back into the one it replaced."""
    before = held_tensors(layer)
    layer.reorder_cache(beam_idx)
    for slot, old in before.items():
        new = _bound(layer, slot)
        if new is old or not isinstance(new, torch.Tensor):
            continue
        if new.shape != old.shape:
            raise RuntimeError(f"{type(layer).__name__}.reorder_cache: {slot[0]} changed shape "
                               f"{tuple(old.shape)} -> {tuple(new.shape)}; it cannot be reordered in place")
        old.copy_(new)
        _bind(layer, slot, old)


class InPlaceBeamReorder:
    """``cache.reorder_cache`` of a graph-safe cache: each layer reordered along the batch in place (holds the
    cache weakly: no reference cycle)."""

    def __init__(self, cache: Any, layers: Callable[[Any], Any]) -> None:
        self.cache = weakref.ref(cache)
        self.layers = layers  # cache -> [(name, layer)]

    def __call__(self, beam_idx: torch.Tensor) -> None:
        for _, layer in self.layers(self.cache()):
            if callable(getattr(layer, "reorder_cache", None)):
                reorder_layer_in_place(layer, beam_idx)


__all__ = ["InPlaceBeamReorder", "held_tensors", "reorder_layer_in_place"]
