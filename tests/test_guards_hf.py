"""Guards on a real third-party model: plain ``wrap(model.forward)`` with Hugging Face beam search.

transformers' beam search reorders a static cache by rebinding every layer's keys and values
between steps; graphs recorded on the old tensors must not replay (issue 32, reproduction 6).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hf_helpers import family_inputs, tiny_model  # noqa: E402

import graphrt  # noqa: E402


@pytest.mark.parametrize("family", ["llama"])
def test_beam_search_through_plain_wrap_gives_eager_tokens(family):
    model = tiny_model(family)
    inputs = family_inputs(family, batch=2)
    options = dict(max_new_tokens=8, num_beams=2, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        expected = model.generate(**inputs, **options)
        model.forward = graphrt.wrap(model.forward, max_batch_size=8)
        assert torch.equal(model.generate(**inputs, **options), expected)
    stats = model.forward.stats()
    assert stats["eager_reasons"].get("rebound_state", 0) >= 1
    assert any(detail.startswith("rebound_state:") and ("keys" in detail or "values" in detail)
               for detail in stats["guard_failures"]), stats["guard_failures"]


def test_a_steering_hook_added_after_graph_generate_gives_eager_tokens():
    """Activation steering: a forward hook on a decoder layer adds a vector to its hidden states,
    registered after graph_generate recorded; generate() must follow it, as eager does, and once
    it is removed replay the first graphs again (issue 38: torch.compile skips hook guards by default)."""
    model = tiny_model("llama")
    reference = tiny_model("llama")
    inputs = family_inputs("llama", batch=2)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    steering = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4

    def steer(module, args, output):
        return (output[0] + steering, *output[1:]) if isinstance(output, tuple) else output + steering

    with torch.no_grad():
        plain = reference.generate(**inputs, **options)
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            assert torch.equal(model.generate(**inputs, **options), plain)
        handles = [each.model.layers[0].register_forward_hook(steer) for each in (model, reference)]
        steered = reference.generate(**inputs, **options)
        assert not torch.equal(steered, plain)
        assert torch.equal(model.generate(**inputs, **options), steered)
        for handle in handles:
            handle.remove()
        runs = fast.stats()["graph_runs"]
        assert torch.equal(model.generate(**inputs, **options), plain)
    assert fast.stats()["graph_runs"] > runs
    assert any(detail.startswith("hooks:") for detail in fast.stats()["guard_failures"])
