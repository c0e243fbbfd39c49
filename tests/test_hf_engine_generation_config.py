"""graphrt.hf.engine_model follows the model's generation config as ``generate()`` reads it (issue 50, items 3
and 4): a config that samples (``do_sample`` with temperature, top-k, top-p, min-p, as Llama-3-Instruct and
Qwen2.5 ship it) is sampled, seeded per request as ``sampling=`` is, and ``sampling=`` still overrides it;
``min_new_tokens`` holds back every stop id of a request, as ``generate()`` given them all as
``eos_token_id`` does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.generation import logits_process as hf  # noqa: E402

from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.host.sampling import SamplingMetadata  # noqa: E402

NEW_TOKENS = 8
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)


def build(model: torch.nn.Module) -> graphrt.hf.HFEngine:
    return graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                   piecewise_sizes=[8])


@pytest.fixture(scope="module")
def sampling_model() -> torch.nn.Module:
    model = tiny_model("llama")
    for name, value in SAMPLING.items():
        setattr(model.generation_config, name, value)
    return model


def test_a_config_that_samples_is_sampled_seeded_per_request(sampling_model):
    engine = build(sampling_model)
    prompts = ragged_prompts([5, 7, 3], seed=21)
    explicit = SamplingMetadata.from_params(temperatures=[0.7] * 3, top_ks=[4] * 3, top_ps=[0.9] * 3, min_ps=[0.05] * 3)
    sampled = engine.generate(prompts, max_new_tokens=NEW_TOKENS, seed=4, eos_token_id=None)
    greedy = generate_alone(sampling_model, prompts, NEW_TOKENS, eos_token_id=None)

    assert sampled != greedy  # before issue 50 the config's sampling was decoded greedily
    assert sampled == engine.generate(prompts, max_new_tokens=NEW_TOKENS, seed=4, eos_token_id=None, sampling=explicit)
    assert sampled == engine.generate(prompts, max_new_tokens=NEW_TOKENS, seed=4, eos_token_id=None, graphs=False)
    assert engine.generate(prompts[1:2], max_new_tokens=NEW_TOKENS, seed=5, eos_token_id=None)[0] == sampled[1]
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, seed=9, eos_token_id=None) != sampled
    # sampling= overrides the config: temperature 0 is greedy; generation_config=None drops it
    override = SamplingMetadata.from_params(temperatures=[0.0] * 3, top_ks=[-1] * 3, top_ps=[1.0] * 3)
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None, sampling=override) == greedy
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None, generation_config=None) == greedy

    # every token drawn lies where transformers' own warpers (generate()'s order) leave a finite score
    warpers = [hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(4), hf.TopPLogitsWarper(0.9),
               hf.MinPLogitsWarper(0.05)]
    with torch.no_grad():
        for prompt, tokens in zip(prompts, sampled):
            ids = torch.tensor([prompt + tokens])
            logits = sampling_model(ids).logits[0, len(prompt) - 1:-1]
            for step, token in enumerate(tokens):
                scores = logits[step: step + 1]
                for warper in warpers:
                    scores = warper(ids[:, : len(prompt) + step], scores)
                assert torch.isfinite(scores[0, token]), (prompt, step, token)


def test_a_sampling_config_is_refused_where_the_engine_cannot_follow_it(sampling_model):
    engine = build(sampling_model)
    prompts = ragged_prompts([4], seed=2)
    with pytest.raises(ValueError, match="steps_per_launch.*do_sample"):
        engine.generate(prompts, max_new_tokens=4, steps_per_launch=2)
    sampling_model.generation_config.typical_p = 0.5
    try:
        with pytest.raises(ValueError, match="generation_config.typical_p"):
            engine.generate(prompts, max_new_tokens=4)
    finally:
        sampling_model.generation_config.typical_p = None
    assert engine.slots.available == engine._slots - 1


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_min_new_tokens_holds_back_every_stop_id_of_a_request(graphs):
    model = tiny_model("llama")
    prompts = ragged_prompts([5, 7, 3], seed=13)
    plain = generate_alone(model, prompts, NEW_TOKENS, eos_token_id=None)
    eos = plain[2][0]  # prompt 2 would stop on its first token
    stops = [[plain[0][0]], [plain[1][1], plain[1][2]], []]  # prompts 0 and 1 on their own stop ids, early
    model.generation_config.eos_token_id = eos
    model.generation_config.min_new_tokens = 3
    expected = [generate_alone(model, [prompt], NEW_TOKENS, eos_token_id=[eos, *own], min_new_tokens=3)[0]
                for prompt, own in zip(prompts, stops)]
    engine = build(model)

    assert all(len(tokens) > 3 for tokens in expected[:2])  # the stop ids were held back, then the request went on
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=stops, graphs=graphs) == expected
