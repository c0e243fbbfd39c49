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
