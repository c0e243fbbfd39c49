"""The engine path on real Hugging Face families: greedy tokens equal generate()'s per prompt.

Each tiny random model (tests/hf_helpers.py) is served through ``graphrt.hf.engine_model`` with two
request rows for three prompts (the third queues, and arrives late) and a step budget of four
tokens (prompts longer than that prefill in chunks, beside running decodes: MIXED steps). The
sliding-window families have a window of 4 tokens, shorter than prompt + new tokens, so windows
slide while graphs replay; Gemma 2 soft-caps its attention logits, GPT-OSS has attention sinks,
DeepSeek-V3 keys wider than its values (MLA run as per-head keys and values). Tokens alone hardly
see a small error in attention on such tiny models, so the prompts' logits are compared too: a prefill
step (the paged attention op between piecewise graphs) and a decode step (a full graph) against the
model's own forward with transformers' eager attention (transformers 5.17 runs Gemma 2 on sdpa, which
drops the soft-cap, by default).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import ENGINE_FAMILIES, generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402

NEW_TOKENS = 4



@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_tokens_equal_generate_under_continuous_batching(family):
    model = tiny_model(family)
    prompts = ragged_prompts([6, 3, 9])
    expected = generate_alone(model, prompts, NEW_TOKENS)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=4, warmup_iters=1,
                                     piecewise_sizes=[2, 4])

    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=[0, 0, 2])

    assert tokens == expected
    stats = engine.stats()
    serve = stats["serve"]
    assert serve["max_running"] == 2 and serve["prefill_steps"] > 0
    assert 0 < serve["decode_steps_graphed"] and stats["graph_runs"] > 0  # full decode graphs
    assert 0 < serve["prefill_tokens_graphed"] and stats["piecewise_runs"] > 0  # piecewise prefill
    assert stats["failed_keys"] == {}

    logits = engine.prompt_logits(prompts[:2])
    model.set_attn_implementation("eager")  # the one that honours every argument (sdpa drops soft-capping)
    with torch.no_grad():
        for prompt, served in zip(prompts, logits):
            expected_logits = model(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(served, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt-oss"])
def test_engine_on_cuda_graphs_keeps_generate_tokens(family):
    # float32 grouped_mm takes torch's host-syncing fallback on every GPU (tests/test_cuda_hf.py): the MoE on bmm
    model = tiny_model(family, "cuda", **({"experts_implementation": "batched_mm"} if family == "gpt-oss" else {}))
    prompts = ragged_prompts([6, 3, 9])
    expected = generate_alone(model, prompts, NEW_TOKENS)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=4)

    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=[0, 0, 2]) == expected
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=2) == expected
    stats = engine.stats()
    assert stats["backend"] == "cuda" and stats["failed_keys"] == {}
    assert stats["multi_step_runs"] > 0 and stats["serve"]["prefill_tokens_graphed"] > 0
