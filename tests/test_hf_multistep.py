"""graphrt.hf.MultiStepGenerate: greedy generation of a tiny random Llama with several decode steps per
launch on a StaticCache gives generate()'s tokens (EOS inside a launch, every row stopping early),
and a repeated call replays every launch; so do sliding-window and chunked-attention models, whose
step masks are built on the device. A forward that takes no cache keyword is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_helpers import family_inputs, tiny_model  # noqa: E402

from graphrt.hf import MultiStepGenerate  # noqa: E402

BATCH, PROMPT, NEW = 3, 6, 13


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def generate(model, prompt, eos=None):
    model.generation_config.eos_token_id = eos
    return model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                          attention_mask=torch.ones_like(prompt))


@pytest.mark.parametrize("steps", [1, 4])
def test_several_steps_per_launch_give_generates_tokens_and_a_second_call_replays_every_launch(model, steps):
    prompt = torch.randint(2, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    expected = generate(model, prompt)
    fast = MultiStepGenerate(model, steps_per_launch=steps, max_cache_len=64, max_batch_size=4)
    assert torch.equal(fast(prompt, NEW), expected)
    launches = -(-(NEW - 1) // steps)
    before = fast.stats()["graph_runs"]
    assert torch.equal(fast(prompt, NEW), expected)
    assert fast.stats()["graph_runs"] - before == launches and fast.stats()["eager_reasons"] == {"warmup": 1}
    # EOS inside a launch: the row's later tokens are the pad token; then every row stopping early
    eos = int(expected[1, PROMPT + 5])
    model.generation_config.eos_token_id = eos
    try:
        assert torch.equal(fast(prompt, NEW), generate(model, prompt, eos))
        stops = [int(expected[row, PROMPT + column]) for row, column in ((0, 2), (1, 3), (2, 1))]
        early = generate(model, prompt, stops)
        model.generation_config.eos_token_id = stops
        assert early.shape[1] < PROMPT + NEW and torch.equal(fast(prompt, NEW), early)
    finally:
        model.generation_config.eos_token_id = None


def test_bad_arguments_name_the_argument(model):
    fast = MultiStepGenerate(model, steps_per_launch=4, max_cache_len=16, max_batch_size=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast(torch.ones(1, 8, dtype=torch.int64), 12)  # 8 + 1 + 3 launches of 4 > 16 positions
    with pytest.raises(ValueError, match="input_ids"):
        fast(torch.ones(8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="steps_per_launch"):
        MultiStepGenerate(model, steps_per_launch=0)


class CacheParamsModel(torch.nn.Module):
    """A forward that takes its cache as ``cache_params`` (Mamba on transformers 5.17): a cache passed under
    ``cache`` or ``past_key_values`` would land in ``**kwargs``, unread, and the tokens would be wrong."""

    def forward(self, input_ids, cache_params=None, **kwargs):
        raise AssertionError("never called: the model is refused up front")


def test_a_model_whose_forward_takes_no_cache_keyword_is_refused_naming_the_keywords():
    with pytest.raises(ValueError, match=r"model.forward: takes no cache keyword \(expected `cache` or "
                                         r"`past_key_values`; it declares input_ids, cache_params, kwargs\)"):
        MultiStepGenerate(CacheParamsModel())


def llama4_chunked() -> torch.nn.Module:
    """A tiny Llama 4 text model: one chunked-attention layer (chunks of 4 tokens), one full-attention layer."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_chunk_size=4, num_local_experts=2,
        num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 0], initializer_range=0.5,
        pad_token_id=0, eos_token_id=None)
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["mistral-window", "gemma2-eager", "llama4-chunked"])
def test_sliding_window_and_chunked_launches_replay(family):
    """The window (4 tokens) fills, then slides, and the chunks (4 tokens) turn over inside launches: the masks, computed on the
    device from each step's positions (boolean for sdpa, additive for eager attention), give generate()'s tokens,
    and a repeated call replays every launch."""
    if family == "llama4-chunked":
        model = llama4_chunked()
    elif family == "gemma2-eager":
        model = tiny_model("gemma2", attn_implementation="eager")
    else:
        model = tiny_model(family)
    model.generation_config.eos_token_id = None
    # 2 prompt tokens: the first launch's steps fill the 4-token window (slots not yet written are masked)
    prompt = family_inputs("llama", BATCH, 2, padded_rows=0)["input_ids"]
    try:
        expected = generate(model, prompt)
    except TypeError as error:  # transformers 5.17's chunked mask takes no block_sequence_ids: eager fails too
        pytest.skip(f"this transformers' own generate() fails on {family}: {error}")
    fast = MultiStepGenerate(model, steps_per_launch=4, max_cache_len=32, max_batch_size=4)
    assert torch.equal(fast(prompt, NEW), expected)
    before = fast.stats()["graph_runs"]
    assert torch.equal(fast(prompt, NEW), expected)
    assert fast.stats()["graph_runs"] - before == -(-(NEW - 1) // 4) and not fast.stats()["failed_keys"]
