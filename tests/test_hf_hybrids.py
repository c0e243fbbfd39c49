"""Caches beyond plain attention through graphrt.hf: state-space and linear-attention layers (reordered in
place for beam search, pooled, graph-safe), T5Gemma's cross-attention cache rebound on every call, and the
"hybrid" cache implementations that Gemma 2/3 checkpoints ship.

The tiny models are hf_helpers' (tests/test_hf_families.py runs each family's repeated call; these are the
cases that family test does not reach)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import ForwardCalls, family_inputs, replays_here, tiny_model  # noqa: E402

from graphrt.hf import StaticCachePool, graph_generate, graph_safe_cache  # noqa: E402
from graphrt.hf.layer_kinds import layer_kinds  # noqa: E402

NEW_TOKENS = 8


def linear_attention_cache() -> transformers.StaticCache:
    """A StaticCache of a full-attention layer and a linear-attention one (a state-space hybrid's layout)."""
    config = tiny_model("llama").config
    config.layer_types = ["full_attention", "linear_attention"]
    return transformers.StaticCache(config=config, max_cache_len=8)


def test_linear_attention_states_are_reordered_in_place_for_beam_search():
    """transformers' reorder_cache rebinds the conv and recurrent states to new tensors, which graphs recorded
    before never read (beam search on Bamba gave other tokens than eager's, even without a graph)."""
    cache = graph_safe_cache(linear_attention_cache())
    layer = cache.layers[1]
    generator = torch.Generator().manual_seed(0)
    layer.update_conv_state(torch.randn(3, 4, 2, generator=generator))
    layer.update_recurrent_state(torch.randn(3, 4, 5, generator=generator))
    conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
    expected = conv[[2, 0, 0]].clone(), recurrent[[2, 0, 0]].clone()
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert layer.conv_states[0] is conv and layer.recurrent_states[0] is recurrent
    assert torch.equal(conv, expected[0]) and torch.equal(recurrent, expected[1])


def test_linear_attention_layers_are_graph_safe_and_their_caches_reused():
    assert not layer_kinds(linear_attention_cache()).unsupported
    pool = StaticCachePool(lambda **_: linear_attention_cache())
    request = dict(cache_implementation="static", batch_size=2, max_cache_len=8, prefill_chunk_size=None,
                   model_kwargs={})
    assert pool(**request) is pool(**request) and pool.reused == 1


def test_a_layer_recording_past_states_is_named():
    """Assisted decoding makes linear-attention layers keep growing conv states, rebound on every step."""
    cache = linear_attention_cache()
    cache.layers[1].activate_past_recording()
    kinds = layer_kinds(cache)
    assert list(kinds.unsupported) == ["LinearAttentionLayer"] and "records past states" in kinds.describe()


def repeated_generate(model, inputs, calls: int, **options):
    """``calls`` greedy generate() calls through graph_generate, each against eager on transformers' static cache;
    returns (forward calls, replays) of the last."""
    expected = copy.deepcopy(model).generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                             cache_implementation="static")
    fast = graph_generate(model, max_batch_size=4)
    counter = ForwardCalls(model)
    for _ in range(calls):
        forward_calls, replays = counter.calls, fast.stats()["graph_runs"]
        got = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **options)
        assert torch.equal(got, expected)
    return counter.calls - forward_calls, fast.stats()["graph_runs"] - replays


def test_t5gemma_keeps_one_cross_attention_cache_across_calls():
    """T5Gemma binds a new cross-attention cache on every generate() call; the pooled cache's filling view kept
    the first, never reset: the third call raised IndexError. Now every call gives eager's tokens."""
    model = tiny_model("t5gemma")
    calls, replays = repeated_generate(model, family_inputs("t5gemma", 2, 5), calls=3)
    assert replays == (calls if replays_here("t5gemma") else 0)


def test_a_hybrid_cache_implementation_is_taken_as_static():
    """Gemma 2/3 checkpoints ship cache_implementation="hybrid": transformers drops it for a DynamicCache, so
    nothing replayed. graph_generate makes it (and "hybrid_chunked", "sliding_window") "static": every forward
    call of a repeated call replays."""
    model = tiny_model("gemma2")
    model.generation_config.cache_implementation = "hybrid"
    calls, replays = repeated_generate(model, family_inputs("gemma2", 2, 5), calls=2)
    assert model.generation_config.cache_implementation == "static" and replays == calls == NEW_TOKENS
