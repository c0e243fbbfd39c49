"""The engine path after its model changed (issue 50, item 1): what the probe read is followed, or the call refused.

Mistral reads ``config.sliding_window`` on every forward, so ``generate()`` follows a window set or removed
after the engine was built; ``model.to(torch.bfloat16)`` changes the dtype its keys and values are computed
in. Each call of the engine probes the model again when its config's values or a tensor's dtype or device
changed since, and makes its KV pools and runners anew when the probe reads otherwise: every request's
tokens equal ``generate()``'s on the changed model and a new engine's, graphed and eager. A change the probe
reads alike keeps the runners; a change that makes the model unservable is refused naming it.

(*) In bfloat16 graphrt's paged attention rounds otherwise than transformers' sdpa (it scales the scores in
float32): on some prompts a new bfloat16 engine's tokens differ from ``generate()``'s; on these it gives
``generate()``'s, and a new engine's tokens are compared exactly everywhere.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402

NEW_TOKENS = 6
PROMPTS = ragged_prompts([5, 12, 9])  # 12 + 6 tokens: far past a window of 4
DTYPE_PROMPTS = ragged_prompts([5, 12, 9], seed=23)  # bfloat16 changes two of their continuations (*)


def engine_of(model):
    return graphrt.hf.engine_model(model, max_requests=3, max_context=32, max_step_tokens=8, warmup_iters=1,
                                   piecewise_sizes=[4, 8])


def served_both_ways(engine, prompts=PROMPTS) -> tuple:
    """The engine's tokens graphed (with its stats) and eager."""
    graphed = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    stats = engine.stats()
    return graphed, stats, engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=False)


def test_a_window_set_or_removed_after_the_build_is_followed_graphed_and_eager():
    model = tiny_model("mistral-window")  # window 4
    engine = engine_of(model)
    assert engine.layout.layers[0].window == 4
    built = engine.runners
    for window in (None, 6, 4):
        model.config.sliding_window = window
        expected = generate_alone(model, PROMPTS, NEW_TOKENS)
        graphed, stats, eager = served_both_ways(engine)
        assert graphed == expected and eager == expected, window
        assert engine.layout.layers[0].window == (window or 0)
        assert engine.runners is not built  # made anew, its keys captured again and replayed
        built = engine.runners
        assert stats["graph_runs"] > 0 and stats["failed_keys"] == {}
        assert stats["serve"]["prefill_tokens_graphed"] == stats["serve"]["prefill_tokens"]
        if window is None:
            assert engine_of(model).generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected  # a new engine's
    model.config.sliding_window = None
    assert generate_alone(model, PROMPTS, NEW_TOKENS) != expected  # the window changes these prompts' tokens


@pytest.mark.parametrize("through_recapture", [False, True])
def test_a_dtype_change_makes_the_kv_pools_anew_also_through_recapture(through_recapture):
    model = tiny_model("llama")
    engine = engine_of(model)
    float32_tokens = engine.generate(DTYPE_PROMPTS, max_new_tokens=NEW_TOKENS)
    model.to(torch.bfloat16)
    if through_recapture:
        engine.recapture()
        assert engine.layout.layers[0].dtype == torch.bfloat16  # before any call
    expected = generate_alone(model, DTYPE_PROMPTS, NEW_TOKENS)
    graphed, stats, eager = served_both_ways(engine, DTYPE_PROMPTS)
    assert graphed == expected and eager == expected
    assert float32_tokens != expected  # bfloat16 changes these prompts' tokens
    assert {buffer.dtype for buffer in engine.pools.kv.k_buffers + engine.pools.kv.v_buffers} == {torch.bfloat16}
    assert engine.kv_bytes()["per_token_per_layer"] == 2 * 2 * 8 * 2  # K and V, 2 KV heads of 8, 2 bytes
    assert stats["graph_runs"] > 0 and stats["failed_keys"] == {}
    assert engine_of(model).generate(DTYPE_PROMPTS, max_new_tokens=NEW_TOKENS) == expected  # a new engine's


def test_a_change_the_probe_reads_alike_keeps_the_runners_and_their_graphs():
    model = tiny_model("llama")
    engine = engine_of(model)
    expected = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    runners, captured = engine.runners, engine.stats()["captured_keys"]
    model.config.use_cache = False  # a config value the engine's steps never read (they pass use_cache=False)
    assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
    assert engine.runners is runners and engine.stats()["captured_keys"] == captured
    assert engine.stats()["graph_runs"] > 0


def test_a_change_that_makes_the_model_unservable_is_refused_naming_it():
    model = tiny_model("qwen2")
    engine = engine_of(model)
    expected = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    pools = engine.pools
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"model: changed since the engine was built \(config.layer_types: "
                                         r".*'linear_attention'.*\) and can no longer be served: Qwen2ForCausalLM "
                                         r"has layers of type linear_attention"):
        engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert engine.pools is pools  # nothing was made anew
    model.config.layer_types = ["full_attention", "full_attention"]
    assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
