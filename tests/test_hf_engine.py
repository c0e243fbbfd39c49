"""graphrt.hf.engine_model on a tiny Llama: what the engine path promises beyond the family table.

Multi-step launches (``steps_per_launch``) replay multi-step keys and keep generate()'s tokens;
seeded per-request sampling draws the same tokens whether a request runs alone or beside others,
eagerly or through graphs; the model's own attention implementation is left as it was; models
without the modeling-backend contract or with non-attention layers are refused by name; bad
arguments are ValueErrors naming the field.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import engine, generate_alone, llama, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.host.sampling import SamplingMetadata  # noqa: E402

NEW_TOKENS = 5


def test_multi_step_launches_replay_and_keep_generate_tokens(llama, engine):
    prompts = ragged_prompts([5, 2, 7], seed=3)
    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=2)
    assert tokens == generate_alone(llama, prompts, NEW_TOKENS)
    stats = engine.stats()
    assert stats["multi_step_runs"] > 0 and stats["serve"]["multi_step_launches"] == stats["multi_step_runs"]
    assert stats["serve"]["decode_steps_graphed"] == stats["serve"]["decode_steps"]


def test_eager_engine_path_is_the_same_generation(llama, engine):
    prompts = ragged_prompts([4, 9], seed=4)
    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=False)
    assert tokens == generate_alone(llama, prompts, NEW_TOKENS)
    stats = engine.stats()
    assert stats["graph_runs"] == stats["piecewise_runs"] == 0 and stats["eager_runs"] > 0
    assert stats["serve"]["decode_steps_graphed"] == 0


def test_engine_leaves_the_models_attention_implementation(llama, engine):
    before = llama.config._attn_implementation
    engine.generate(ragged_prompts([3]), max_new_tokens=2, graphs=False)
    assert llama.config._attn_implementation == before


def test_seeded_sampling_per_request_does_not_depend_on_batching_or_graphs(engine):
    prompts = ragged_prompts([6, 3, 8], seed=5)
    sampling = SamplingMetadata.from_params(temperatures=[0.9, 0.0, 1.2], top_ks=[20, -1, -1], top_ps=[0.9, 1.0, 1.0])
    together = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=sampling, seed=7, eos_token_id=None)
    eager = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=sampling, seed=7, eos_token_id=None,
                            graphs=False)
    late = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=sampling, seed=7, eos_token_id=None,
                           arrivals=[3, 0, 1])
    alone = engine.generate(prompts[:1], max_new_tokens=NEW_TOKENS, sampling=sampling.slice(0, 1), seed=7,
                            eos_token_id=None)
    reseeded = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=sampling, seed=8, eos_token_id=None)
    greedy = engine.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert together == eager == late
    assert alone[0] == together[0]
    assert together[1] == greedy[1]  # temperature 0 is argmax
    assert reseeded[0] != together[0] or reseeded[2] != together[2]


def test_requests_queue_beyond_max_requests(llama, engine):
    prompts = ragged_prompts([3, 5, 2, 6, 4], seed=6)
    tokens = engine.generate(prompts, max_new_tokens=3, arrivals=[0, 0, 0, 0, 9])
    assert tokens == generate_alone(llama, prompts, 3)
    assert engine.stats()["serve"]["max_running"] == 3


def test_multi_query_attention_on_the_eager_engine_path():
    model = tiny_model("llama", num_key_value_heads=1)  # MQA: every query head reads one KV head
    prompts = ragged_prompts([7, 4], seed=9)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32)
    assert engine.generate(prompts, max_new_tokens=3, graphs=False) == generate_alone(model, prompts, 3)
    with torch.no_grad():
        for prompt, logits in zip(prompts, engine.prompt_logits(prompts, graphs=False)):
            torch.testing.assert_close(logits, model(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


def test_requests_wait_for_kv_slots(llama):
    prompts = ragged_prompts([6, 5, 7], seed=8)  # need 6+3, 5+3 and 7+3 slots: two fit in 19 at once
    small = graphrt.hf.engine_model(llama, max_requests=3, max_context=32, kv_slots=20)
    assert small.generate(prompts, max_new_tokens=4, graphs=False) == generate_alone(llama, prompts, 4)
    assert small.stats()["serve"]["max_running"] == 2
    with pytest.raises(ValueError, match="kv_slots: request 0 needs 21"):
        small.generate([list(range(3, 21))], max_new_tokens=4, graphs=False)


def test_models_without_the_contract_or_with_other_layers_are_refused_by_name():
    import transformers

    with pytest.raises(ValueError, match=r"BloomForCausalLM.*_supports_attention_backend"):
        graphrt.hf.engine_model(tiny_model("bloom"))
    config = transformers.Lfm2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention"])
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM has layers of type conv"):
        graphrt.hf.engine_model(transformers.Lfm2ForCausalLM(config))


@pytest.mark.parametrize("call, match", [
    (dict(prompts=[]), "prompts"),
    (dict(prompts=[[5, 6], []]), "prompts"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=40), "max_context=32"),
    (dict(arrivals=[0]), "arrivals"),
    (dict(steps_per_launch=0), "steps_per_launch"),
    (dict(sampling=SamplingMetadata.from_params([1.0] * 2, [-1] * 2, [1.0] * 2), steps_per_launch=2),
     "steps_per_launch"),
    (dict(sampling=SamplingMetadata.from_params([1.0] * 3, [-1] * 3, [1.0] * 3)), "sampling"),
])
def test_bad_generate_arguments_name_the_field(engine, call, match):
    arguments = {"prompts": [[5, 6], [7]], "max_new_tokens": 2, **call}
    with pytest.raises(ValueError, match=match):
        engine.generate(**arguments)


def test_bad_engine_arguments_name_the_field(llama):
    with pytest.raises(ValueError, match="max_requests"):
        graphrt.hf.engine_model(llama, max_requests=0)
    with pytest.raises(TypeError, match="runner_options"):
        graphrt.hf.engine_model(llama, capture_size=[1])
