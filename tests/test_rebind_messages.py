"""RebindError names the class whose state the step rebinds, and says what to do (Hugging Face caches: graphrt.hf)."""

from __future__ import annotations

import pytest
import torch

from graphrt import wrap


class CountingState:
    def __init__(self) -> None:
        self.calls = 0


def test_a_rebound_attribute_names_its_class_and_the_generic_advice():
    def step(x, state):
        state.calls += 1
        return x * 2

    state = CountingState()
    fast = wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated")
    for _ in range(2):  # a warm-up, then the refused recording
        fast(torch.ones(2, 3), state)
    (reason,) = fast.stats()["failed_keys"].values()
    assert reason.startswith("RebindError: args[1].calls: the step assigns it (1 -> 2, at ")
    assert "test_rebind_messages.py:18 in step)" in reason
    assert f"(state of a {CountingState.__module__}.CountingState);" in reason
    assert reason.endswith("Use an object updated in place, or pass its tensors as arguments")
    assert state.calls == 2


def test_a_hugging_face_cache_layer_is_named_with_graph_generate_and_graph_safe_cache():
    transformers = pytest.importorskip("transformers")
    from hf_helpers import cache_argument, tiny_model

    model = tiny_model("llama")

    def step(ids, cache):
        return model(input_ids=ids, **cache_argument(model, cache), use_cache=True).logits[:, -1]

    cache = transformers.DynamicCache(config=model.config)
    fast = wrap(step, max_batch_size=2, capture_sizes=[2], backend="emulated")
    with torch.no_grad():
        for _ in range(2):  # a warm-up, then the refused recording (the DynamicCache grows by torch.cat)
            fast(torch.ones(2, 1, dtype=torch.long), cache)
    (reason,) = fast.stats()["failed_keys"].values()
    assert reason.startswith("RebindError: args[1].layers[0].keys: the step rebinds it")
    assert "(state of a transformers.cache_utils.DynamicLayer)" in reason
    assert "DynamicLayer is a Hugging Face cache class whose update keeps Python state" in reason
    assert "graphrt.hf.graph_generate(model, ...)" in reason and "graphrt.hf.graph_safe_cache" in reason
