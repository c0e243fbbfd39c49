"""The attention masks of a one-token decode step, computed on the device from its positions.

A model called without a prepared mask builds it inside the step from ``cache.get_mask_sizes()``,
and a ``SlidingRingLayer`` answers that with its first visible position, read from the device on
the host: a multi-step launch (several steps in one graph) cannot capture that read, and ran every
launch eagerly. ``generate()`` builds the mask outside the model call; a launch has no outside
between its steps, so ``DecodeMasks`` computes the masks from the step's position ids instead,
for what each cache layer returns for one new token:

* a full-attention layer (``StaticLayer``, ``CacheLongWindowLayer``): every cache slot, visible up
  to the position;
* a ``SlidingRingLayer`` of window ``w``: positions ``first .. first + w - 1`` with
  ``first = max(position - w + 1, 0)``, visible up to the position (the window's condition holds
  for every one); a chunked-attention layer (Llama 4) also hides positions before the chunk's start.

The masks are transformers': boolean for ``sdpa`` (True: attend), additive (0 or the dtype's
minimum) for ``eager``; other attention implementations build their own and are left to do so.
A model whose attention layers all return the same keys gets one 4-D mask, which every mask
builder passes through; a hybrid model gets a dict by layer type (``"full_attention"``,
``"sliding_attention"``, ``"chunked_attention"``), which transformers' hybrid models take as built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch

from graphrt.hf.window_layers import SlidingRingLayer

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")  # the attention implementations whose masks are built here


@dataclass(frozen=True)
class LayerMask:
    """What one attention layer returns for a one-token step: ``length`` keys, of kind full, sliding or chunked."""

    kind: str  # "full_attention", "sliding_attention" or "chunked_attention"
    length: int  # keys returned (the cache's length, or the window)

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """``[batch, length]``: which returned keys the token at ``positions`` (``[batch, 1]``) attends to."""
        offsets = torch.arange(self.length, device=positions.device)
        if self.kind == "full_attention":
            return offsets <= positions
        first = (positions - (self.length - 1)).clamp(min=0)  # the ring's first returned position
        keys = first + offsets
        visible = keys <= positions
        if self.kind == "chunked_attention":
            visible &= keys >= positions - positions.remainder(self.length)
        return visible


def layer_masks(layers: List[Any], layer_types: Optional[List[str]]) -> List[Optional[LayerMask]]:
    """The mask each attention layer needs (None: a layer without keys, as linear attention)."""
    masks: List[Optional[LayerMask]] = []
    for index, layer in enumerate(layers):
        declared = layer_types[index] if layer_types and index < len(layer_types) else None
        if type(layer) is SlidingRingLayer:
            kind = "chunked_attention" if declared == "chunked_attention" else "sliding_attention"
            masks.append(LayerMask(kind, layer.max_cache_len))
        elif isinstance(getattr(layer, "max_cache_len", None), int) and hasattr(layer, "keys"):
            masks.append(LayerMask("full_attention", layer.max_cache_len))
        else:
            masks.append(None)
    return masks


class DecodeMasks:
    """``masks(positions)``: a one-token step's attention mask for a graph-safe StaticCache, built on the device."""

    def __init__(self, by_type: Dict[str, LayerMask], single: bool, implementation: str, dtype: torch.dtype) -> None:
        self.by_type = by_type
        self.single = single  # one mask for every layer: a 4-D tensor rather than a dict
        self.implementation = implementation
        self.dtype = dtype

    @classmethod
    def for_cache(cls, cache: Any, config: Any, dtype: torch.dtype) -> Optional["DecodeMasks"]:
        """The masks of ``cache``'s steps, or None where the model's own mask needs no host read (no sliding ring)
        or cannot be built here (another attention implementation, layer kinds that disagree with the config)."""
        text_config = config.get_text_config(decoder=True)
        implementation = getattr(text_config, "_attn_implementation", None)
        layers = list(getattr(cache, "layers", ()))
        if not any(type(layer) is SlidingRingLayer for layer in layers) or implementation not in MASKED_IMPLEMENTATIONS:
            return None
        masks = [mask for mask in layer_masks(layers, getattr(text_config, "layer_types", None)) if mask is not None]
        by_type: Dict[str, LayerMask] = {}
        for mask in masks:
            if by_type.setdefault(mask.kind, mask) != mask:
                return None  # two lengths for one layer type: a dict by type cannot tell them apart
        return cls(by_type, len(set(masks)) == 1, implementation, dtype)

    def __call__(self, positions: torch.Tensor) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
        """The mask(s) for tokens at ``positions`` (``[batch, 1]``, on the device)."""
        built = {kind: self._form(mask.visible(positions)) for kind, mask in self.by_type.items()}
        return next(iter(built.values())) if self.single else built

    def _form(self, visible: torch.Tensor) -> torch.Tensor:
        """``[batch, 1, 1, keys]`` as the attention implementation takes it."""
        visible = visible[:, None, None, :]
        if self.implementation == "sdpa":
            return visible
        return torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(self.dtype).min)


__all__ = ["DecodeMasks", "LayerMask", "MASKED_IMPLEMENTATIONS", "layer_masks"]
