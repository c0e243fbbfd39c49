"""graph_generate(): Hugging Face ``model.generate()`` replaying its forward calls, in one line.

``graphrt.wrap(model.forward)`` alone already replays every decode step of a
``generate(..., cache_implementation="static")`` call after that call's warm-up and recording
steps. But transformers (5.x) builds a new StaticCache on every ``generate()`` call, and the cache
object is a constant of the call layout (compared by identity), so each call opens new layouts
and records its graphs again. ``graph_generate`` wraps ``forward`` and hands ``generate()`` the
same cache again (reset in place) for the same batch size, cache length and encoder length, so
later calls replay from their first forward call. The caches it hands out are graph-safe:
sliding-window layers, which keep a Python counter in transformers, are replaced by layers whose
state is on the device (graphrt.hf.window_layers); an encoder-decoder cache's first step, which computes
the cross-attention keys and values, goes through a view of the cache of its own
(graphrt.hf.cross_attention). Layer kinds it cannot graph are named up front.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from graphrt.backends.compiled import (
    compiled_like, describe_callable, is_compiled, opaque_to_dynamo, original_module, refuse_compiled_cudagraphs,
)
from graphrt.graphed_callable import GraphedCallable, wrap
from graphrt.hf.cache_keyword import passed_cache_keyword
from graphrt.hf.cross_attention import CrossAttentionFills, needs_fill

logger = logging.getLogger(__name__)

MAX_POOLED_CACHES = 4  # StaticCaches kept for reuse; the least recently used is let go past it
PROBE_CACHE_LENGTH = 8  # the length of the StaticCache built up front to list the model's layer kinds
# Generation-config cache implementations that name a static cache of the config's own layer layout (Gemma 2/3
# checkpoints ship "hybrid"; transformers 5.x no longer knows them and falls back to a DynamicCache): made "static".
STATIC_ALIASES = ("hybrid", "hybrid_chunked", "sliding_window")


def graph_safe_cache(cache: Any, config: Any = None) -> Any:
    """Make a transformers StaticCache (or EncoderDecoderCache) graph-safe in place: its sliding-window layers,
    which keep a Python counter, are replaced by layers whose state is on the device, and beam search reorders
    every layer's tensors in place (keys, values, linear-attention states). With the model's ``config``, a window
    longer than the cache becomes a plain static layer (no gather per step). Returns ``cache``."""
    from graphrt.hf.layer_kinds import make_graph_safe

    return make_graph_safe(cache, config)


def decode_masks(model: Any, cache: Any) -> Callable[[Any], Any]:
    """For a decode loop of your own over a graph-safe ``cache``: ``masks(position_ids)`` (``[batch, 1]``)
    is the attention mask of a one-token step, built on the device, to pass as ``attention_mask``. The
    model then builds no mask inside the step, where a sliding-window layer would read the cache's
    length on the host (a host sync, which fails the capture). None where the model's own needs no such read."""
    from graphrt.hf.step_masks import DecodeMasks

    masks = DecodeMasks.for_cache(cache, model.config, model.dtype)
    return masks if masks is not None else (lambda position_ids: None)


class GenerateForward:
    """``model.forward`` under graph_generate(): the wrapped forward, with an encoder-decoder cache's
    filling step (cross-attention keys and values still to compute) called through that cache's
    filling view, a call layout of its own."""

    def __init__(self, fast: GraphedCallable) -> None:
        self.fast = fast
        self.__wrapped__ = fast.fn  # generate() passes forward the keywords its signature accepts
        self.fills = CrossAttentionFills()

    @opaque_to_dynamo  # model.forward compiled after graph_generate: graphs replay
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keyword = passed_cache_keyword(kwargs)
        if keyword is None or not needs_fill(kwargs[keyword]):
            return self.fast(*args, **kwargs)
        cache = kwargs[keyword]
        view = self.fills.view(cache)
        output = self.fast(*args, **{**kwargs, keyword: view})
        self.fills.filled(cache)
        if getattr(output, keyword, None) is view:
            setattr(output, keyword, cache)  # generate() goes on with the cache it made
        return output


class StaticCachePool:
    """Stands in for ``model._prepare_static_cache``: the cache made before for the same batch size,
    length, encoder output length and model dtype and device, reset in place, else a new one made
    graph-safe (kept for next time, up to ``max_caches``, unless it has layers of a kind graphrt does not
    know). A cache that an earlier ``generate()`` returned (``return_dict_in_generate``) is reset by the
    next call of the same shape. A model cast or moved since gets a cache of its own, as transformers
    would make it (a cache of the old dtype would refuse its writes)."""

    def __init__(self, prepare: Callable[..., Any], max_caches: int = MAX_POOLED_CACHES, config: Any = None,
                 model: Any = None) -> None:
        self.prepare = prepare
        self.config = config  # the model's, for the windows its layers are configured with
        self.model = model  # whose dtype and device a cache is made for
        self.max_caches = max_caches
        self.caches: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.reused = 0

    def __call__(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                 prefill_chunk_size: Optional[int], model_kwargs: dict) -> Any:
        encoder_outputs = model_kwargs.get("encoder_outputs")
        encoder_length = None if encoder_outputs is None else encoder_outputs[0].shape[1]  # the cross-attention length
        placement = None if self.model is None else (self.model.dtype, self.model.device)
        key = (cache_implementation, batch_size, max_cache_len, prefill_chunk_size, encoder_length, placement)
        cache = self.caches.get(key)
        if cache is not None:
            self.caches.move_to_end(key)
            cache.reset()  # zeroes keys, values and the length counters in place: the graphs' tensors stay
            self.reused += 1
            return cache
        from graphrt.hf.layer_kinds import layer_kinds

        cache = graph_safe_cache(self.prepare(
            cache_implementation=cache_implementation, batch_size=batch_size, max_cache_len=max_cache_len,
            prefill_chunk_size=prefill_chunk_size, model_kwargs=model_kwargs), self.config)
        if layer_kinds(cache).unsupported:
            return cache  # Python state that reset() puts back could take another path than the one recorded
        self.caches[key] = cache
        if len(self.caches) > self.max_caches:
            self.caches.popitem(last=False)
        return cache


class PassedCaches:
    """Stands in for ``model._prepare_cache_for_generation``: a cache the caller passes to ``generate()``
    (the multi-turn recipe: one StaticCache across calls) is used as passed. The static cache
    implementation graph_generate put in the generation config is dropped for that call (transformers
    refuses both together), and a cache no step has written yet is made graph-safe in place (its
    sliding-window layers replaced; one already holding keys keeps its layers)."""

    def __init__(self, prepare: Callable[..., Any], implementation: str, config: Any = None) -> None:
        self.prepare = prepare
        self.implementation = implementation  # the cache implementation graph_generate set
        self.config = config

    def __call__(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        keyword = passed_cache_keyword(model_kwargs)
        if keyword is not None:
            if generation_config.cache_implementation == self.implementation:
                generation_config.cache_implementation = None  # generate()'s own copy of the config
            cache = model_kwargs[keyword]
            owner = getattr(cache, "self_attention_cache", cache)
            if not any(getattr(layer, "is_initialized", False) for layer in getattr(owner, "layers", ())):
                graph_safe_cache(cache, self.config)
        return self.prepare(generation_config, model_kwargs, *args, **kwargs)


def warn_unsupported_layers(model: Any) -> None:
    """Log once, up front, the cache layer kinds of ``model`` that graphrt cannot graph (by class and layer)."""
    try:
        from transformers import StaticCache

        from graphrt.hf.layer_kinds import layer_kinds

        kinds = layer_kinds(StaticCache(config=model.config.get_text_config(decoder=True),
                                        max_cache_len=PROBE_CACHE_LENGTH))
    except Exception as error:  # a model without a static cache: generate() will not use one either
        logger.warning("graph_generate(): cannot list %s's static cache layers (%s: %s); generate() steps whose "
                       "capture fails run eagerly", type(model).__name__, type(error).__name__, error)
        return
    if kinds.unsupported:
        logger.warning("graph_generate(): %s's cache has layers graphrt cannot graph: %s. Their steps are recorded as "
                       "they are (a step that changes their Python state fails capture, naming the layer, and runs "
                       "eagerly), and generate() gets a new cache on every call", type(model).__name__,
                       kinds.describe())


def generating_model(model: Any) -> Any:
    """The model whose ``forward`` ``model.generate()`` calls: ``model`` itself, or for a PEFT model
    (``PeftModel.generate`` calls its base model's ``generate``) the base model, its adapter layers
    in place. A prompt-learning PEFT model (prefix or prompt tuning) builds the base model's inputs
    in its own ``generate``: refused, naming what to wrap instead."""
    if not type(model).__module__.startswith("peft.") or not callable(getattr(model, "get_base_model", None)):
        return model
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise ValueError(f"model: a PEFT {type(config).__name__} model adds its virtual tokens in its own "
                         "generate(), around the base model's forward; graph_generate cannot reach it. Wrap the base "
                         "model's forward yourself: base = model.get_base_model(); base.forward = graphrt.wrap("
                         "base.forward, max_batch_size=...) and generate with cache_implementation='static'")
    base = model.get_base_model()
    logger.info("graph_generate(): %s generates through its base model %s: its forward is wrapped",
                type(model).__name__, type(base).__name__)
    return base


def graph_generate(
    model: Any,
    max_batch_size: int,
    capture_sizes: Optional[Sequence[int]] = None,
    backend: str = "auto",
    **options: Any,
) -> GraphedCallable:
    """Make ``model.generate()`` replay its forward calls: wrap ``model.forward``, default the
    generation config to a static cache (and to no auto-compile), and reuse that cache, made
    graph-safe, across ``generate()`` calls. A ``torch.compile(model)`` (an OptimizedModule) generates
    through its original module: that module's forward, compiled as the model was, is wrapped (a
    compile with CUDA graphs of its own is refused). A configured ``"hybrid"`` or ``"sliding_window"`` cache (a static
    cache of the config's layer layout) becomes ``"static"`` too. Returns the GraphedCallable (its ``stats()``)."""
    if not callable(getattr(model, "generate", None)) or not callable(getattr(model, "forward", None)):
        raise TypeError(f"model: expected a Hugging Face generative model (with generate and forward), "
                        f"got {type(model).__name__}")
    compiled = model if is_compiled(model) and isinstance(model, torch.nn.Module) else None
    if compiled is not None:  # torch.compile(model): generate() runs the original module's forward
        refuse_compiled_cudagraphs(compiled, "model")
        model = original_module(compiled)
    model = generating_model(model)
    forward = model.forward
    if isinstance(forward, (GraphedCallable, GenerateForward)):
        raise ValueError("model.forward: already wrapped by graphrt; call graph_generate once per model")
    if compiled is not None:
        forward = compiled_like(compiled, forward)  # the compile's backend, mode and options kept
    warn_unsupported_layers(model)
    fast = wrap(forward, max_batch_size, capture_sizes, backend, **options)
    logger.info("graph_generate(): generate() of %s calls %s, wrapped", type(model).__name__, describe_callable(forward))
    model.forward = GenerateForward(fast)
    config = getattr(model, "generation_config", None)
    if config is not None:
        implementation = getattr(config, "cache_implementation", None)
        if implementation is None or implementation in STATIC_ALIASES:
            if implementation is not None:
                logger.info("graph_generate(): cache_implementation=%r is a static cache of the config's layer "
                            "layout: generate() gets \"static\"", implementation)
            config.cache_implementation = "static"
            if callable(getattr(model, "_prepare_cache_for_generation", None)):
                model._prepare_cache_for_generation = PassedCaches(model._prepare_cache_for_generation, "static",
                                                                   getattr(model, "config", None))
        # On a GPU, generate() would torch.compile the model call around the graphed forward.
        config.disable_compile = True
    prepare = getattr(model, "_prepare_static_cache", None)
    if callable(prepare):
        model._prepare_static_cache = StaticCachePool(prepare, config=getattr(model, "config", None), model=model)
    else:
        logger.warning("graph_generate(): this transformers version has no _prepare_static_cache; each "
                       "generate() call brings a new StaticCache and records its decode graphs again")
    return fast


__all__ = ["GenerateForward", "PassedCaches", "StaticCachePool", "decode_masks", "generating_model", "graph_generate",
           "graph_safe_cache"]
