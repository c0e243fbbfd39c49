"""graph_generate(): Hugging Face ``model.generate()`` replaying its decode steps, in one line.

``graphrt.wrap(model.forward)`` alone already replays every decode step of a
``generate(..., cache_implementation="static")`` call after that call's warm-up and recording
steps. But transformers (5.x) builds a new StaticCache on every ``generate()`` call, and the cache
object is a constant of the call layout (compared by identity), so each call opens new layouts
and records its graphs again. ``graph_generate`` wraps ``forward`` and hands ``generate()`` the
same StaticCache again (reset in place) for the same batch size and cache length, so later calls
replay from their first decode step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

from graphrt.graphed_callable import GraphedCallable, wrap

logger = logging.getLogger(__name__)

MAX_POOLED_CACHES = 4  # StaticCaches kept for reuse; the least recently used is let go past it


class StaticCachePool:
    """Stands in for ``model._prepare_static_cache``: the cache made before for the same batch size
    and length, reset in place, else a new one (kept for next time, up to ``max_caches``). A cache
    that an earlier ``generate()`` returned (``return_dict_in_generate``) is reset by the next call
    of the same shape. Encoder-decoder caches (sized to the encoder output too) are not pooled."""

    def __init__(self, prepare: Callable[..., Any], max_caches: int = MAX_POOLED_CACHES) -> None:
        self.prepare = prepare
        self.max_caches = max_caches
        self.caches: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.reused = 0

    def __call__(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                 prefill_chunk_size: Optional[int], model_kwargs: dict) -> Any:
        key = (cache_implementation, batch_size, max_cache_len, prefill_chunk_size)
        pooled = model_kwargs.get("encoder_outputs") is None
        cache = self.caches.get(key) if pooled else None
        if cache is not None:
            self.caches.move_to_end(key)
            cache.reset()  # zeroes keys, values and the length counter in place: the graphs' tensors stay
            self.reused += 1
            return cache
        cache = self.prepare(cache_implementation=cache_implementation, batch_size=batch_size,
                             max_cache_len=max_cache_len, prefill_chunk_size=prefill_chunk_size,
                             model_kwargs=model_kwargs)
        if pooled:
            self.caches[key] = cache
            if len(self.caches) > self.max_caches:
                self.caches.popitem(last=False)
        return cache


def graph_generate(
    model: Any,
    max_batch_size: int,
    capture_sizes: Optional[Sequence[int]] = None,
    backend: str = "auto",
    **options: Any,
) -> GraphedCallable:
    """Make ``model.generate()`` replay its decode steps: wrap ``model.forward``, default the
    generation config to a static cache (and to no auto-compile), and reuse that cache across
    ``generate()`` calls."""
    if not callable(getattr(model, "generate", None)) or not callable(getattr(model, "forward", None)):
        raise TypeError(f"model: expected a Hugging Face generative model (with generate and forward), "
                        f"got {type(model).__name__}")
    forward = model.forward
    if isinstance(forward, GraphedCallable):
        raise ValueError("model.forward: already wrapped by graphrt; call graph_generate once per model")
    fast = wrap(forward, max_batch_size, capture_sizes, backend, **options)
    model.forward = fast
    config = getattr(model, "generation_config", None)
    if config is not None:
        if getattr(config, "cache_implementation", None) is None:
            config.cache_implementation = "static"
        # On a GPU, generate() would torch.compile the model call around the graphed forward.
        config.disable_compile = True
    prepare = getattr(model, "_prepare_static_cache", None)
    if callable(prepare):
        model._prepare_static_cache = StaticCachePool(prepare)
    else:
        logger.warning("graph_generate(): this transformers version has no _prepare_static_cache; each "
                       "generate() call brings a new StaticCache and records its decode graphs again")
    return fast


__all__ = ["StaticCachePool", "graph_generate"]
