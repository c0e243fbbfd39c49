"""Rotary embeddings whose frequencies depend on the forward's length, on the engine path (issue 50, item 2).

Longrope takes its long factors once a forward reaches past ``original_max_position_embeddings`` (16 here),
dynamic NTK scaling grows its base with the forward's length past ``max_position_embeddings`` (16 here).
``generate()`` of one request picks them from its prompt's length, then from each new token's position. The
engine packs a 20-token prompt beside short ones (in steps of 8 tokens: its first chunks end before position
16) and decodes a 14-token prompt past position 16: every request's tokens equal ``generate()``'s of that
request alone, graphed (decode graphs, piecewise prefill, multi-step launches) and eager; the prompt logits
equal ``model(prompt)``'s. Phi-3's ``generate()`` computes a request's cache again when it grows past 16
tokens: the engine serves Phi-3 the requests that do not (a prompt past 16 tokens, or few new tokens) and
refuses by name the ones that would.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.hf.request_rope import RopeDispatch  # noqa: E402

NEW_TOKENS = 6
SHORT, LONG = 16, 64  # original and extended context of the models below
LONGROPE = dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[3.0, 7.0, 19.0, 41.0],
                original_max_position_embeddings=SHORT, factor=LONG / SHORT, rope_theta=10000.0)
DYNAMIC = dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0)
# The 20-token prompt is past 16 from its first chunk's frequencies on; a 14-token one decodes past 16 (Phi-3: a
# 17-token one, whose generate() keeps its cache).
LENGTHS = {"llama-longrope": [5, 20, 9, 14], "llama-dynamic": [5, 20, 9, 14], "phi3-longrope": [5, 20, 9, 17]}


def model_of(kind: str) -> torch.nn.Module:
    if kind == "phi3-longrope":  # Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini ship longrope
        return tiny_model("phi3", max_position_embeddings=LONG, original_max_position_embeddings=SHORT,
                          rope_parameters=LONGROPE)
    if kind == "llama-longrope":
        return tiny_model("llama", max_position_embeddings=LONG, rope_parameters=LONGROPE)
    return tiny_model("llama", max_position_embeddings=SHORT, rope_parameters=DYNAMIC)


def alone(model: torch.nn.Module, prompts, new_tokens: int = NEW_TOKENS) -> list:
    """Each prompt's generate() tokens on a fresh copy of ``model``: dynamic NTK keeps the frequencies an earlier
    call grew (its module's state), so a request's own are those of a freshly loaded model."""
    return [generate_alone(copy.deepcopy(model), [prompt], new_tokens)[0] for prompt in prompts]


def engine_of(model: torch.nn.Module) -> graphrt.hf.HFEngine:
    return graphrt.hf.engine_model(model, max_requests=3, max_context=32, max_step_tokens=8, warmup_iters=1,
                                   piecewise_sizes=[4, 8])


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def served(request) -> dict:
    model = model_of(request.param)
    prompts = ragged_prompts(LENGTHS[request.param])
    expected = alone(model, prompts)
    with torch.no_grad():
        logits = [copy.deepcopy(model)(torch.tensor([prompt])).logits[0] for prompt in prompts[:3]]
    return dict(kind=request.param, model=model, prompts=prompts, expected=expected, logits=logits,
                engine=engine_of(model))


def test_each_request_gets_its_own_frequencies_in_packed_and_chunked_steps(served):
    engine, prompts, expected = served["engine"], served["prompts"], served["expected"]
    graphed = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=[0, 0, 1, 2])
    stats = engine.stats()
    assert graphed == expected
    assert stats["failed_keys"] == {} and stats["graph_runs"] > 0
    assert stats["serve"]["decode_steps_graphed"] == stats["serve"]["decode_steps"]
    assert stats["serve"]["prefill_tokens_graphed"] == stats["serve"]["prefill_tokens"]
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=False) == expected
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=2) == expected
    assert engine.stats()["multi_step_runs"] > 0


def test_the_frequencies_are_what_a_forward_of_the_request_alone_uses(served):
    # The whole prompt in one forward (its length decides), as the engine prefills it in chunks of 8.
    for got, want in zip(served["engine"].prompt_logits(served["prompts"][:3]), served["logits"]):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())


def test_one_packed_forward_would_give_the_short_requests_the_long_frequencies(served):
    # Why the engine cannot leave the module to the packed step: in one forward of two requests (positions
    # restarting, causal: the short prompt first sees only itself), the short prompt's logits change.
    model, prompts = served["model"], served["prompts"]
    packed = torch.tensor([prompts[0] + prompts[1]])
    positions = torch.tensor([list(range(len(prompts[0]))) + list(range(len(prompts[1])))])
    with torch.no_grad():
        rows = copy.deepcopy(model)(packed, position_ids=positions).logits[0, :len(prompts[0])]
    assert not torch.allclose(rows, served["logits"][0], atol=1e-3)


def test_the_model_outside_the_engine_keeps_its_own_rotary_forward(served):
    model, prompts = served["model"], served["prompts"]
    assert isinstance(vars(model.model.rotary_emb)["forward"], RopeDispatch)
    assert alone(model, prompts[:2]) == served["expected"][:2]


@pytest.mark.parametrize("served", ["phi3-longrope"], indirect=True)  # Phi-3's generate() alone does this
def test_a_phi3_request_whose_generate_would_compute_its_cache_again_is_refused_by_name(served):
    engine, crossing = served["engine"], ragged_prompts([14], seed=3)
    with pytest.raises(ValueError, match=r"prompts\[0\]: Phi3ForCausalLM's generate\(\) computes a request's cache "
                                         r"again, .* when it reaches 17 tokens .* serve it with at most 3 new tokens"):
        engine.generate(crossing, max_new_tokens=NEW_TOKENS)
    assert engine.generate(crossing, max_new_tokens=3) == alone(served["model"], crossing, 3)
