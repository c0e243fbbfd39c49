"""Hugging Face on CUDA graphs (issue 40, items 2 and 7): what no CPU run shows, run on a GPU.

``graph_generate`` on Llama and Gemma 2 (static caches, Gemma 2's window layers, transformers'
capture-only mask path: the warm-ups see a capture under way, so they run the kernels the capture
runs) replays every decode step with eager's tokens and logits. The engine on a tiny MoE
(GPT-OSS): transformers' default experts implementation calls ``grouped_mm``, whose float32 path
copies offsets to the host inside the kernel (torch <= 2.11), so its MoE keys fail capture, are
named, and run eagerly with eager's tokens; bfloat16 on Hopper or datacenter Blackwell and
``experts_implementation="batched_mm"`` replay. scripts/gpu_first_session.sh runs this file as its
Hugging Face smoke.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import family_inputs, tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.backends.op_graph import grouped_mm_fallback_reason  # noqa: E402
from graphrt.verify import rounding_tolerance  # noqa: E402

pytestmark = pytest.mark.cuda
NEW_TOKENS = 4


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_graph_generate_replays_every_decode_step_with_eagers_tokens(family):
    model = tiny_model(family, "cuda")
    inputs = {name: value.cuda() for name, value in family_inputs(family, 2, 6).items()}
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                   output_logits=True)
    with torch.no_grad():
        expected = copy.deepcopy(model).generate(**inputs, cache_implementation="static", **options)
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):  # the first call records (warm-up, capture), the second replays every forward call
            runs = fast.stats()["graph_runs"]
            got = model.generate(**inputs, **options)
            assert torch.equal(got.sequences, expected.sequences)
            for mine, theirs in zip(got.logits, expected.logits):
                torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
    stats = fast.stats()
    assert stats["backend"] == "cuda" and stats["failed_keys"] == {}, stats["failed_keys"]
    assert stats["graph_runs"] - runs == NEW_TOKENS  # prefill and every decode step of the second call


def moe_model(dtype: torch.dtype, experts: str = "grouped_mm") -> torch.nn.Module:
    return tiny_model("gpt-oss", "cuda", experts_implementation=experts).to(dtype)


@pytest.mark.parametrize("dtype, experts", [(torch.float32, "grouped_mm"), (torch.bfloat16, "grouped_mm"),
                                            (torch.float32, "batched_mm")], ids=["fp32", "bf16", "batched_mm"])
def test_the_engine_on_a_moe_replays_where_grouped_mm_keeps_to_the_device(dtype, experts):
    """float32: tokens equal generate()'s. bfloat16 rounds differently at every batch shape (generate() runs
    one prompt at a time, the engine pads to its keys), so its graphs are compared with the engine's own
    eager steps, as capture verifies them: within bfloat16's rounding (``rounding_tolerance``)."""
    model = moe_model(dtype, experts)
    prompts = ragged_prompts([6, 3, 9])
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=4)
    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=[0, 0, 2])
    stats = engine.stats()  # generate()'s: stats() tells the last call only, and the last below runs eagerly
    if dtype is torch.float32:
        assert tokens == generate_alone(model, prompts, NEW_TOKENS)
    for graphed, eager in zip(engine.prompt_logits(prompts[:2]), engine.prompt_logits(prompts[:2], graphs=False)):
        torch.testing.assert_close(graphed, eager, **rounding_tolerance(eager))
    weight = torch.empty(2, 8, 8, device="cuda", dtype=dtype)
    syncs = experts == "grouped_mm" and grouped_mm_fallback_reason(weight[0], weight) is not None
    if syncs:  # every key running the experts fails its capture; those steps run eagerly
        assert stats["failed_keys"], stats
    else:
        assert stats["failed_keys"] == {} and stats["graph_runs"] > 0, stats["failed_keys"]
