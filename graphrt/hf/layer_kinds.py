"""Which Hugging Face cache layers graphrt can replay, and the swap that makes a StaticCache graph-safe.

A replayed step runs no Python, so a cache layer replays only if its ``update()`` keeps all its
state in tensors written in place. The kinds graphrt knows, by exact class (a subclass may change
anything):

* ``StaticLayer``: the count and the keys/values are tensors written in place; replays as is.
* ``DummyLayer`` (transformers >= 5.23): holds nothing (shared-KV and attention-free layers).
* ``LinearAttentionLayer`` and ``LinearAttentionAndStaticFullAttentionLayer`` (state-space and
  linear-attention hybrids): fixed-size conv and recurrent states written in place
  (graphrt.hf.linear_attention), unless they record past states.
* ``StaticSlidingWindowLayer``: keeps a Python int it branches on; replaced by
  ``CacheLongWindowLayer`` or ``SlidingRingLayer`` (graphrt.hf.window_layers), as long as
  those replacements answer like transformers' layer on a scripted sequence in this process.

A graph-safe cache also reorders beams in place (graphrt.hf.beam_reorder): transformers' ``reorder_cache``
(beam search, between steps) rebinds every layer's tensors to new ones, which a graph recorded before
would never read again.

The classes are looked up by name in the installed transformers (feature detection: a release that
lacks one has no layer of that kind to graph).

Any other kind is named in graph_generate()'s warning. Its steps are recorded as they are (a
step that changes its Python state fails capture, naming the layer's class, and runs eagerly),
and its caches are not reused across ``generate()`` calls: Python state that ``reset()`` puts
back could send a reused cache's first steps down another path than the one recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from transformers import cache_utils
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from graphrt.hf.beam_reorder import InPlaceBeamReorder
from graphrt.hf.linear_attention import linear_attention_kinds, linear_attention_unsafe
from graphrt.hf.window_layers import CacheLongWindowLayer, SlidingRingLayer, cache_long_mismatch, ring_mismatch

LINEAR_ATTENTION = linear_attention_kinds()
DUMMY = tuple(getattr(cache_utils, name) for name in ("DummyLayer",) if hasattr(cache_utils, name))  # 5.23 on
GRAPH_SAFE = (StaticLayer, CacheLongWindowLayer, SlidingRingLayer, *DUMMY)
SUPPORTED_NAMES = ", ".join(kind.__name__ for kind in (StaticLayer, *DUMMY, *LINEAR_ATTENTION)) + \
    ", StaticSlidingWindowLayer (replaced by a graph-safe sliding-window layer)"


@dataclass
class LayerKinds:
    """The layer classes of one cache that graphrt cannot graph: which layers, and why."""

    unsupported: Dict[str, List[str]] = field(default_factory=dict)  # class name -> layers ("3", "cross 0")
    reasons: Dict[str, str] = field(default_factory=dict)  # class name -> why it cannot be graphed

    def describe(self) -> str:
        """Per unsupported kind: its class, its layers, why."""
        return "; ".join(f"{name} (layers {', '.join(layers)}): {self.reasons[name]}"
                         for name, layers in self.unsupported.items())


def cache_layers(cache: Any) -> List[Tuple[str, Any]]:
    """(name, layer) of every layer of a transformers cache: an encoder-decoder cache's self-attention
    layers by index, then its cross-attention layers as ``cross <index>``."""
    self_attention = getattr(cache, "self_attention_cache", cache)
    layers = [(str(index), layer) for index, layer in enumerate(getattr(self_attention, "layers", ()))]
    cross = getattr(cache, "cross_attention_cache", None)
    layers += [(f"cross {index}", layer) for index, layer in enumerate(getattr(cross, "layers", ()))]
    return layers


def window_mismatch() -> Optional[str]:
    """Why StaticSlidingWindowLayer is not replaced in this process: where a replacement answered otherwise
    than transformers' layer on the scripted sequence (both replacements are checked: the kind is
    supported or not as a whole)."""
    return ring_mismatch() or cache_long_mismatch()


def layer_kinds(cache: Any) -> LayerKinds:
    """The layers of ``cache`` that graphrt cannot graph (sliding-window layers count as supported
    while their replacements check out)."""
    kinds = LayerKinds()
    for name, layer in cache_layers(cache):
        kind = type(layer)
        reason = None
        if kind is StaticSlidingWindowLayer:
            mismatch = window_mismatch()
            if mismatch is not None:
                reason = f"its behaviour here differs from graphrt's graph-safe replacement ({mismatch})"
        elif kind in LINEAR_ATTENTION:
            reason = linear_attention_unsafe(layer)
        elif kind not in GRAPH_SAFE:
            reason = f"not a kind graphrt knows to replay (it knows {SUPPORTED_NAMES})"
        if reason is not None:
            kinds.unsupported.setdefault(kind.__name__, []).append(name)
            kinds.reasons[kind.__name__] = reason
    return kinds


def configured_windows(config: Any, layers: int) -> List[Optional[int]]:
    """The sliding window each layer is configured with (None: not sliding, or not known), from the model's config."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        _, per_layer = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        if isinstance(per_layer, dict):  # transformers 5.17 and 5.18: one dict of keywords for every layer
            per_layer = [per_layer] * layers
        windows = [kwargs.get("sliding_window") for kwargs in per_layer]
    except Exception:  # another transformers version, or no config: every window is taken to slide
        return [None] * layers
    return windows if len(windows) == layers else [None] * layers


def make_graph_safe(cache: Any, config: Any = None) -> Any:
    """Replace, in place, the StaticSlidingWindowLayers of ``cache`` (a transformers StaticCache, or the
    self-attention side of an EncoderDecoderCache) by graph-safe layers of the same window, and make its
    beam reordering in place; returns ``cache``.

    A window that cannot slide before the cache is full becomes a CacheLongWindowLayer: one as long as
    the cache's full-attention layers (they run out of room first), or, given the model's ``config``,
    one cut to the cache's length (its configured window is longer). Any other window slides: a
    SlidingRingLayer, which also slides past the cache's length as transformers' layer does.
    """
    if callable(getattr(cache, "reorder_cache", None)):
        cache.reorder_cache = InPlaceBeamReorder(cache, cache_layers)
    if window_mismatch() is not None:
        return cache  # graph_generate() warned; the layers stay transformers' (their capture fails, named)
    owner = getattr(cache, "self_attention_cache", cache)
    layers = list(getattr(owner, "layers", ()))
    full_lengths = {layer.max_cache_len for layer in layers if type(layer) is StaticLayer}
    windows = configured_windows(config, len(layers))
    for index, layer in enumerate(layers):
        if type(layer) is not StaticSlidingWindowLayer:
            continue
        window = windows[index]
        cut_to_cache = window is not None and layer.max_cache_len < window
        never_slides = layer.max_cache_len in full_lengths or cut_to_cache
        replacement = (CacheLongWindowLayer if never_slides else SlidingRingLayer)(max_cache_len=layer.max_cache_len)
        if layer.is_initialized:  # early-initialized (chunked prefill): allocate the same buffers now
            replacement.lazy_initialization(layer.keys[:, :, :0], layer.values[:, :, :0])
        owner.layers[index] = replacement
    return cache


__all__ = ["GRAPH_SAFE", "LINEAR_ATTENTION", "LayerKinds", "SUPPORTED_NAMES", "cache_layers", "configured_windows",
           "layer_kinds", "make_graph_safe"]
