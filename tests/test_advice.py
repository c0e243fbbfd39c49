"""Advice that works: an error that recommends a remedy names one that works for that model.

A Gemma 2 decode loop of one's own (``model.forward`` wrapped, a DynamicCache) fails capture with
RebindError; its message recommended ``graph_safe_cache(StaticCache(...))``, which then failed with
HostSyncError: the model builds its sliding-window mask inside the step, reading the cache's fill
count on the host. Following the messages must end at replays: the RebindError names the masks
built outside the step (``graphrt.hf.decode_masks``) too, the HostSyncError names them, and the loop
that follows them replays with eager's tokens. (The padding and outside-tensor remedies are followed
in tests/test_padding_rows.py and tests/test_outside_tensors.py.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import cache_argument, tiny_model  # noqa: E402

import graphrt  # noqa: E402
from graphrt.hf import decode_masks, graph_safe_cache  # noqa: E402

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])
STEPS = 6


def decode_loop(model, forward, cache, masks=None):
    """Prefill, then one token per step with its cache position (and the masks, when given)."""
    with torch.no_grad():
        logits = forward(input_ids=PROMPT, use_cache=True, **cache_argument(model, cache)).logits
        token = logits[:, -1:].argmax(-1)
        tokens, position = [token], PROMPT.shape[1]
        for _ in range(STEPS):
            positions = torch.tensor([[position]])
            extra = {} if masks is None else {"position_ids": positions, "attention_mask": masks(positions)}
            logits = forward(input_ids=token, cache_position=torch.tensor([position]), use_cache=True,
                             **cache_argument(model, cache), **extra).logits
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
            position += 1
    return torch.cat(tokens, dim=1)


def static_cache(model):
    from transformers import StaticCache

    return graph_safe_cache(StaticCache(config=model.config, max_cache_len=32), model.config)


def test_following_the_messages_of_a_gemma2_decode_loop_ends_at_replays():
    from transformers import DynamicCache

    model = tiny_model("gemma2")
    expected = decode_loop(model, model.forward, DynamicCache(config=model.config))

    fast = graphrt.wrap(model.forward, max_batch_size=4)
    assert torch.equal(decode_loop(model, fast, DynamicCache(config=model.config)), expected)
    rebind = next(reason for reason in fast.stats()["failed_keys"].values() if reason.startswith("RebindError"))
    assert "graphrt.hf.graph_safe_cache(StaticCache(" in rebind and "graphrt.hf.decode_masks(model, cache)" in rebind

    fast = graphrt.wrap(model.forward, max_batch_size=4)  # the cache the message names, without the masks
    assert torch.equal(decode_loop(model, fast, static_cache(model)), expected)
    host_sync = next(iter(fast.stats()["failed_keys"].values()))
    assert host_sync.startswith("HostSyncError: host sync in the captured step: SlidingRingLayer.get_mask_sizes")
    assert "attention_mask=graphrt.hf.decode_masks(model, cache)(position_ids)" in host_sync

    fast = graphrt.wrap(model.forward, max_batch_size=4)  # both, as the messages say
    cache = static_cache(model)
    assert torch.equal(decode_loop(model, fast, cache, decode_masks(model, cache)), expected)
    stats = fast.stats()
    assert stats["failed_keys"] == {} and stats["graph_runs"] == STEPS - 1


def test_decode_masks_of_a_model_without_sliding_layers_leave_the_mask_to_the_model():
    model = tiny_model("llama")
    cache = static_cache(model)
    assert decode_masks(model, cache)(torch.tensor([[3]])) is None
    expected = decode_loop(model, model.forward, static_cache(model))
    fast = graphrt.wrap(model.forward, max_batch_size=4)
    assert torch.equal(decode_loop(model, fast, cache, decode_masks(model, cache)), expected)
    assert fast.stats()["graph_runs"] == STEPS - 1
