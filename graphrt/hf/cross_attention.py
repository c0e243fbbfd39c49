"""The step that fills an encoder-decoder cache's cross-attention keys and values, as a call layout of its own.

Hugging Face encoder-decoder models (T5, BART, Whisper) compute the cross-attention keys and
values on the first decoder step and store them in the cache's cross-attention StaticCache; a
Python dict, ``EncoderDecoderCache.is_updated``, records per layer that they are there, and later
steps branch on it to read them instead. A cache reused across ``generate()`` calls is reset
between them (``is_updated`` all False again), so its first step must take the filling branch,
while a graph recorded on a later step replays the reading one: the same call layout (the same
cache object, the same shapes) asking for two paths.

``CrossAttentionFills`` gives the filling step an object of its own: a view of the cache (the
same self- and cross-attention caches) whose ``is_updated`` says "not yet" for every layer and
drops the model's writes. The filling step is called with the view in place of the cache, a
layout of its own, recorded and replayed like any other; the caller then marks the real cache
updated, as the step would have, and hands the real cache back in the output.

Some models bind a new cross-attention cache on every ``generate()`` call (T5Gemma's
``_prepare_cache_for_generation``, to make it full-attention where the decoder config slides): the
view, and the graphs, keep the first one, which the pooled cache's ``reset()`` zeroed. The filling
step puts that one back on the cache, so the cache, the view and the graphs read the same tensors
(a new one would never be reset, and would not be the graphs').
"""

from __future__ import annotations

import copy
import weakref
from typing import Any


class PendingForEveryLayer(dict):
    """``is_updated`` of a filling view: every layer reads "not yet filled", and the model's writes are dropped
    (the caller records them on the real cache)."""

    def get(self, key: Any, default: Any = None) -> bool:
        return False

    def __getitem__(self, key: Any) -> bool:
        return False

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def needs_fill(cache: Any) -> bool:
    """Whether ``cache`` is an encoder-decoder cache whose cross-attention keys and values are still to compute."""
    updated = getattr(cache, "is_updated", None)
    return isinstance(updated, dict) and not all(updated.values())


def rebind_cross_attention(cache: Any, view: Any) -> None:
    """Put the view's cross-attention cache back on ``cache`` where the model bound a new, unused one of the same
    class in its place (T5Gemma, on every generate() call)."""
    first, bound = getattr(view, "cross_attention_cache", None), getattr(cache, "cross_attention_cache", None)
    if bound is first or type(bound) is not type(first):
        return
    if any(getattr(layer, "is_initialized", False) for layer in getattr(bound, "layers", ())):
        raise ValueError("cache.cross_attention_cache: a new cross-attention cache already holds keys and values; "
                         "graph_generate() replays the one of the cache's first call")
    cache.cross_attention_cache = first


class CrossAttentionFills:
    """One filling view per encoder-decoder cache (held as long as the cache lives)."""

    def __init__(self) -> None:
        self.views: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

    def view(self, cache: Any) -> Any:
        """The filling view of ``cache``: the same caches, ``is_updated`` always pending."""
        view = self.views.get(cache)
        if view is None:
            view = copy.copy(cache)  # shares the self- and cross-attention caches
            view.is_updated = PendingForEveryLayer()
            self.views[cache] = view
        else:
            rebind_cross_attention(cache, view)
        return view

    @staticmethod
    def filled(cache: Any) -> None:
        """Record on the real cache what the filling step did: every layer's cross-attention keys and values."""
        for layer in cache.is_updated:
            cache.is_updated[layer] = True


__all__ = ["CrossAttentionFills", "PendingForEveryLayer", "needs_fill", "rebind_cross_attention"]
