"""graphrt.hf window layers: graph-safe sliding-window layers against transformers' own, layer kinds, the swap.

The replacements must answer like transformers' StaticSlidingWindowLayer (mask offset, sequence
length, keys and values at every position the mask shows) for any window and any sequence of
token counts; the comparison itself must catch a replacement that answers otherwise.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from hf_helpers import WINDOW, failure_of, tiny_model  # noqa: E402
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer  # noqa: E402

import graphrt  # noqa: E402
from graphrt.hf import StaticCachePool, graph_generate, graph_safe_cache  # noqa: E402
from graphrt.hf import layer_kinds as kinds_module  # noqa: E402
from graphrt.hf.layer_kinds import layer_kinds  # noqa: E402
from graphrt.hf.window_layers import (  # noqa: E402
    CacheLongWindowLayer, SlidingRingLayer, cache_long_mismatch, replacement_mismatch, ring_mismatch,
)


def test_both_replacements_answer_like_this_transformers_version():
    assert ring_mismatch() is None
    assert cache_long_mismatch() is None


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 5), script=st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_the_ring_answers_like_transformers_for_any_window_and_token_counts(window, script):
    ring = lambda length: SlidingRingLayer(max_cache_len=length)  # noqa: E731
    assert replacement_mismatch(ring, window, 64, [script]) is None


class ReversedRing(SlidingRingLayer):
    """A replacement that returns the right positions in the wrong order."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return keys.flip(2), values.flip(2)


class LateOffset(SlidingRingLayer):
    """A replacement whose mask offset lags one position once the window is full."""

    def get_mask_sizes(self, query_length):
        length, offset = super().get_mask_sizes(query_length)
        return length, max(offset - 1, 0)


def test_the_comparison_catches_a_replacement_that_answers_otherwise():
    scripts = [(2, 1, 1, 1, 2, 1)]
    reversed_ring = replacement_mismatch(lambda length: ReversedRing(max_cache_len=length), 3, 16, scripts)
    assert reversed_ring == "update of 2 token(s) after 0: the keys returned for the visible positions differ"
    late = replacement_mismatch(lambda length: LateOffset(max_cache_len=length), 3, 16, scripts)
    assert late == "update of 1 token(s) after 3: mask sizes (3, 1), the replacement's (3, 0)"


def test_a_host_read_of_the_ring_count_inside_a_recorded_step_fails_its_capture():
    """get_mask_sizes() reads the count on the host; generate() calls it outside the model call. A step that
    calls it inside is refused (the graph would freeze the offset), and runs eagerly."""
    ring = SlidingRingLayer(max_cache_len=3)

    def step(keys):
        length, offset = ring.get_mask_sizes(1)
        cached_keys, _ = ring.update(keys, keys)
        return cached_keys[:, :, :length].sum(-1) + offset

    fast = graphrt.wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated")
    for _ in range(3):
        fast(torch.ones(2, 1, 1, 4))
    assert fast.stats()["graph_runs"] == 0
    assert failure_of(fast.stats(), layout=0, batch=2).startswith("HostSyncError: host sync in the captured step")
    assert int(ring.cumulative_length) == 3  # every call advanced the ring once


def hybrid_cache(max_cache_len: int, window: int = WINDOW) -> transformers.StaticCache:
    config = tiny_model("gemma3").config
    config.sliding_window = window
    return transformers.StaticCache(config=config, max_cache_len=max_cache_len)


def test_sliding_layers_become_a_ring_when_the_window_is_shorter_than_the_cache():
    cache = graph_safe_cache(hybrid_cache(max_cache_len=16))
    assert [type(layer) for layer in cache.layers] == [SlidingRingLayer, StaticLayer]
    assert cache.layers[0].max_cache_len == WINDOW and cache.is_sliding == [True, False]
    assert not layer_kinds(cache).unsupported


def test_a_window_that_cannot_slide_before_the_cache_is_full_is_a_static_layer():
    cache = graph_safe_cache(hybrid_cache(max_cache_len=16, window=32))
    assert [type(layer) for layer in cache.layers] == [CacheLongWindowLayer, StaticLayer]
    config = tiny_model("mistral").config  # all layers sliding, window 4096
    all_sliding = graph_safe_cache(transformers.StaticCache(config=config, max_cache_len=16), config)
    assert {type(layer) for layer in all_sliding.layers} == {CacheLongWindowLayer}
    without_config = graph_safe_cache(transformers.StaticCache(config=config, max_cache_len=16))
    assert {type(layer) for layer in without_config.layers} == {SlidingRingLayer}, \
        "without the configured window, a window as long as the cache may be longer still: a ring, which slides"


UNKNOWN_KIND = "LinearAttentionAndStaticSlidingWindowAttentionLayer"  # a Python counter, no replacement


def config_with_an_unknown_kind() -> object:
    """A Llama config whose second layer is a kind graphrt does not know (linear attention beside a sliding window)."""
    config = tiny_model("llama").config
    config.layer_types = ["full_attention", "hybrid_sliding"]
    config.sliding_window = WINDOW
    return config


def unknown_kind_cache(*args, **kwargs) -> transformers.StaticCache:
    """A StaticCache whose second layer is a kind graphrt does not know."""
    return transformers.StaticCache(config=config_with_an_unknown_kind(), max_cache_len=8)


def test_an_unknown_layer_kind_is_named_and_its_caches_are_not_reused():
    kinds = layer_kinds(unknown_kind_cache())
    assert kinds.unsupported == {UNKNOWN_KIND: ["1"]}
    assert "not a kind graphrt knows to replay" in kinds.describe()
    pool = StaticCachePool(unknown_kind_cache)
    request = dict(cache_implementation="static", batch_size=2, max_cache_len=8, prefill_chunk_size=None,
                   model_kwargs={})
    assert pool(**request) is not pool(**request) and pool.reused == 0
    assert type(pool(**request).layers[1]).__name__ == UNKNOWN_KIND


def test_graph_generate_names_unknown_layer_kinds_once_up_front(caplog):
    model = tiny_model("llama")
    model.config = config_with_an_unknown_kind()
    with caplog.at_level(logging.WARNING, logger="graphrt.hf"):
        graph_generate(model, max_batch_size=4)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "LlamaForCausalLM's cache has layers graphrt cannot graph" in warnings[0]
    assert f"{UNKNOWN_KIND} (layers 1)" in warnings[0]


def test_a_replacement_that_stops_matching_transformers_is_not_used(monkeypatch, caplog):
    """A transformers release that changes the sliding-window layer: graphrt keeps transformers' layer (its
    capture then fails, named) and says so up front, rather than generating other tokens."""
    monkeypatch.setattr(kinds_module, "window_mismatch", lambda: "update of 1 token(s) after 3: mask sizes (3, 1), ...")
    cache = graph_safe_cache(hybrid_cache(max_cache_len=16))
    assert type(cache.layers[0]) is StaticSlidingWindowLayer
    assert "differs from graphrt's graph-safe replacement" in layer_kinds(cache).describe()
    with caplog.at_level(logging.WARNING, logger="graphrt.hf"):
        graph_generate(tiny_model("gemma3"), max_batch_size=4)
    assert "StaticSlidingWindowLayer (layers 0): its behaviour here differs" in caplog.text
