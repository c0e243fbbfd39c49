"""Where each layer of an engine keeps its keys and values, sized by the layer's kind (as vLLM's per-layer KV
specs and transformers' per-type continuous-batching allocators size theirs).

* Full attention: one slot per token of the shared KV pool, found through the request table
  (``req_to_token``); the pool holds ``kv_slots`` slots (default: every request at full context).
* Sliding window ``W`` (when a window plus a step is shorter than the context): a ring of
  ``R = W - 1 + max_step_tokens`` slots per request row, position ``p`` of request row ``r`` in
  slot ``r * R + p % R``. A step writes its tokens before it attends, so the ring holds every key
  a step's queries see (at most ``max_step_tokens`` new ones beside the ``W - 1`` before them); row
  0 (the dummy request of padding rows) owns slots ``0 .. R - 1``, which no request reads.
* KV-shared (a layer handed the very key tensor an earlier layer was, as Gemma 3n's last layers are):
  no slots of its own; it reads its producer's.

Multi-head latent attention (DeepSeek) arrives at the attention function as per-head keys and values
(transformers decompresses the latent inside the attention module, before the attention function is
called), so it is stored that way: ``minimum_bytes`` says what the latent would take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence

import torch


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys and values: their shapes, the window its queries see, where they are stored."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    window: int = 0  # > 0: a query at position p sees the keys at p - window + 1 .. p
    ring: int = 0  # > 0: stored in a ring of that many slots per request row; 0: through the request table
    producer: int = -1  # the layer whose buffers it reads and writes (-1: its own)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's key and value take in this layer's storage."""
        return self.num_kv_heads * (self.k_dim + self.v_dim) * torch.empty((), dtype=self.dtype).element_size()


class KVLayout:
    """Every layer's ``LayerKV``; how many slots a ring takes and how many bytes the pool holds."""

    def __init__(self, layers: Sequence[LayerKV], num_request_rows: int, num_slots: int) -> None:
        self.layers = list(layers)
        self.num_request_rows = num_request_rows
        self.num_slots = num_slots

    def stores(self, index: int) -> bool:
        """Whether layer ``index`` writes buffers of its own (a KV-shared layer writes none)."""
        return self.layers[index].producer < 0

    def rows(self, index: int) -> int:
        """Slots of layer ``index``'s own buffers: a ring per request row, or the shared pool's slots."""
        layer = self.layers[index]
        return self.num_request_rows * layer.ring if layer.ring else self.num_slots

    def pool_bytes(self) -> int:
        """Bytes of every layer's own key and value buffers."""
        return sum(self.rows(index) * layer.bytes_per_token for index, layer in enumerate(self.layers)
                   if self.stores(index))

    def bytes_per_token_per_layer(self) -> float:
        """Bytes a cached token takes per layer, averaged over the layers (KV-shared layers take none)."""
        stored = sum(layer.bytes_per_token for index, layer in enumerate(self.layers) if self.stores(index))
        return stored / len(self.layers)

    def describe(self) -> str:
        """One line per kind of layer, for the log."""
        kinds = []
        for index, layer in enumerate(self.layers):
            if not self.stores(index):
                kinds.append(f"{index}: reads layer {layer.producer}'s")
            elif layer.ring:
                kinds.append(f"{index}: window {layer.window}, ring of {layer.ring} per request")
            else:
                kinds.append(f"{index}: {'window ' + str(layer.window) + ', ' if layer.window else ''}paged")
        return "; ".join(kinds)


def minimum_bytes_per_token_per_layer(config: Any, layout: KVLayout) -> float:
    """The least a cached token needs per layer: multi-head latent attention's compressed latent and
    rotary key (``kv_lora_rank + qk_rope_head_dim`` values), else the per-head keys and values
    (KV-shared layers none)."""
    text = config.get_text_config()
    latent = getattr(text, "kv_lora_rank", None)
    total = 0.0
    for index, layer in enumerate(layout.layers):
        if not layout.stores(index):
            continue
        if latent:
            size = torch.empty((), dtype=layer.dtype).element_size()
            total += (latent + getattr(text, "qk_rope_head_dim", 0)) * size
        else:
            total += layer.bytes_per_token
    return total / len(layout.layers)


class LayeredKVPool:
    """The engine's KV pool: ``num_slots`` slots for full-attention layers (through the request table; which
    are free is the engine's host bookkeeping, graphrt.hf.engine_slots) and buffers per layer as its
    ``LayerKV`` says: pool slots, a ring per request row, or the producer's own buffers (the same tensors)."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.num_slots = layout.num_slots
        self.device = torch.device(device)
        self.layout = layout
        self.k_buffers: List[torch.Tensor] = []
        self.v_buffers: List[torch.Tensor] = []
        for index, layer in enumerate(layout.layers):
            if not layout.stores(index):
                self.k_buffers.append(self.k_buffers[layer.producer])
                self.v_buffers.append(self.v_buffers[layer.producer])
                continue
            rows = layout.rows(index)
            self.k_buffers.append(torch.zeros((rows, layer.num_kv_heads, layer.k_dim), dtype=layer.dtype,
                                              device=self.device))
            self.v_buffers.append(torch.zeros((rows, layer.num_kv_heads, layer.v_dim), dtype=layer.dtype,
                                              device=self.device))


__all__ = ["KVLayout", "LayerKV", "LayeredKVPool", "minimum_bytes_per_token_per_layer"]
