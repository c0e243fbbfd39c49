"""What the engine keeps per layer and what a decode step's attention reads (issue 43).

A window or bias a model puts only in its attention mask is honoured or the model refused by name;
sliding-window layers hold a window plus a step per request, KV-shared layers their producer's
buffers; a decode step's attention reads the width bucket its longest request needs, not
``max_context`` per row; multi-head latent attention is stored per head, and the engine says what the
latent would take. Tokens and logits of the families themselves: tests/test_hf_engine_families.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import WINDOW, tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402

STEP_TOKENS = 4


def test_a_bias_in_the_mask_is_refused_by_name():
    with pytest.raises(ValueError, match="DogeForCausalLM layer 0: its attention mask adds a bias"):
        graphrt.hf.engine_model(tiny_model("doge"), max_requests=2, max_context=32)


@pytest.mark.parametrize("family, sliding", [("qwen2-moe-sliding", [0]), ("phimoe-window", [0, 1]),
                                             ("qwen2-sliding", [1]), ("gemma3", [0])])
def test_sliding_layers_hold_a_window_plus_a_step_per_request(family, sliding):
    engine = graphrt.hf.engine_model(tiny_model(family), max_requests=2, max_context=32,
                                     max_step_tokens=STEP_TOKENS)
    ring = WINDOW - 1 + STEP_TOKENS
    for index, layer in enumerate(engine.layout.layers):
        rows = engine.pools.kv.k_buffers[index].shape[0]
        if index in sliding:  # the windows Qwen2-MoE and PhiMoE apply only through their masks included
            assert (layer.window, layer.ring, rows) == (WINDOW, ring, 3 * ring)
        else:
            assert (layer.window, layer.ring, rows) == (0, 0, 2 * 32 + 1)


def test_kv_shared_layers_read_their_producers_buffers():
    model = tiny_model("gemma3n")
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=STEP_TOKENS)
    keys = engine.pools.kv.k_buffers
    assert keys[2] is keys[0] and keys[3] is keys[1] and keys[0] is not keys[1]
    assert [layer.producer for layer in engine.layout.layers] == [-1, -1, 0, 1]
    assert engine.kv_bytes()["per_token_per_layer"] == engine.kv_bytes()["minimum_per_token_per_layer"]


def test_decode_attention_reads_the_width_its_requests_need(llama_engine):
    model, engine = llama_engine
    short = ragged_prompts([5, 9], seed=21)
    assert engine.generate(short, max_new_tokens=3) == generate_alone(model, short, 3)
    stats = engine.stats()
    assert stats["decode_widths"] == [64] and stats["serve"]["decode_steps_graphed"] == stats["serve"]["decode_steps"]
    backend = engine.runners.all()["decode@64+prefill"].context["attn_backend"]
    assert backend.width == 64  # each request's first 64 table columns, not max_context
    long = ragged_prompts([70], seed=22)
    assert engine.generate(long, max_new_tokens=2) == generate_alone(model, long, 2)
    assert engine.stats()["decode_widths"] == [128]


def test_every_decode_width_is_captured_before_the_first_step_into_one_graph_pool(monkeypatch):
    """Issue 48, item 5: the runner of a decode width was built and captured when a request first needed
    it, between two steps of a request (a collection, a device sync and an emptied cache in the middle of
    serving), each into a pool of its own (on CUDA a cuBLAS workspace each). Now a call captures every
    runner it may use before its first step, and they share one pool: a later request crossing a width
    captures nothing."""
    from graphrt import GraphRunner

    model = tiny_model("llama")
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=256, max_step_tokens=32, warmup_iters=1,
                                     piecewise_sizes=[32], capture_sizes=[2])
    events = []
    capture, call = GraphRunner.capture, GraphRunner.__call__
    monkeypatch.setattr(GraphRunner, "capture", lambda runner: (events.append("capture"), capture(runner))[1])
    monkeypatch.setattr(GraphRunner, "__call__", lambda runner, batch: (events.append("step"), call(runner, batch))[1])
    short = ragged_prompts([5, 9], seed=21)
    assert engine.generate(short, max_new_tokens=3) == generate_alone(model, short, 3)
    assert events.index("step") == 3 and events.count("capture") == 3, events  # prefill@64, then 256, 128
    summary = engine.stats()["capture"]
    assert summary["runners"] == 3 and summary["graph_pools"] == 1 and summary["graphs"] >= 3, summary
    assert len({id(runner.backend) for runner in engine.runners.all().values()}) == 1
    events.clear()
    long = ragged_prompts([70], seed=22)
    assert engine.generate(long, max_new_tokens=2) == generate_alone(model, long, 2)
    assert "capture" not in events and engine.stats()["decode_widths"] == [128], events


def test_latent_attention_is_stored_per_head_and_says_what_the_latent_takes():
    engine = graphrt.hf.engine_model(tiny_model("deepseek-v3"), max_requests=2, max_context=16)
    kv = engine.kv_bytes()  # 4 heads x (16 + 8) float32 per token and layer; the latent: 16, and 8 rotary
    assert (kv["per_token_per_layer"], kv["minimum_per_token_per_layer"]) == (4 * (16 + 8) * 4, (16 + 8) * 4)


@pytest.fixture(scope="module")
def llama_engine():
    model = tiny_model("llama")
    return model, graphrt.hf.engine_model(model, max_requests=2, max_context=256, max_step_tokens=32,
                                          warmup_iters=1, piecewise_sizes=[32])
