"""Hugging Face generate() with a wrapped forward: eager's tokens, and every decode step replayed.

``model.forward = graphrt.wrap(model.forward, ...)`` sees one call layout for the prefill and
another for the decode steps; each gets graphs of its own. Batches of 3 and 5 rows are not
capture sizes, and the StaticCache transformers builds holds exactly those rows, so the padded
capture fails and the batch's own size is recorded instead. Tiny random configs (no download).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import GENERATE_MODELS, VOCAB, tiny_causal_lm  # noqa: E402

import graphrt  # noqa: E402
from graphrt.hf import StaticCachePool, graph_generate  # noqa: E402

NEW_TOKENS = 6


def left_padded_prompts(batch: int, length: int = 6, seed: int = 1):
    """Prompts whose first rows are left-padded (pad id 0, masked out)."""
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(min(batch - 1, 2)):
        mask[row, : row + 1] = 0
        ids[row, : row + 1] = 0
    return ids, mask


def generate(model, ids, mask, sample_seed=None, **options):
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0, **options)
    if sample_seed is None:
        return model.generate(ids, do_sample=False, **kwargs)
    torch.manual_seed(sample_seed)
    return model.generate(ids, do_sample=True, top_k=20, **kwargs)


def step_counts(fast, before):
    """(replays, eager runs, eager reasons) since the ``before`` snapshot of ``fast.stats()``."""
    after = fast.stats()
    reasons = {name: count - before["eager_reasons"].get(name, 0) for name, count in after["eager_reasons"].items()}
    return (after["graph_runs"] - before["graph_runs"], after["eager_runs"] - before["eager_runs"],
            {name: count for name, count in reasons.items() if count})


@pytest.mark.parametrize("kind", GENERATE_MODELS)
def test_wrapped_forward_replays_every_decode_step_after_warm_up_and_recording(kind):
    model = tiny_causal_lm(kind)
    ids, mask = left_padded_prompts(3)  # 3 rows: capture sizes are 1, 2, 4, 8
    expected = generate(copy.deepcopy(model), ids, mask, cache_implementation="static")
    fast = graphrt.wrap(model.forward, max_batch_size=8)
    model.forward = fast
    got = generate(model, ids, mask, cache_implementation="static")
    assert torch.equal(got, expected)
    stats = fast.stats()
    # The prefill is its layout's warm-up; the first decode step is the decode layout's warm-up,
    # the second records (at 4 rows the 3-row StaticCache refuses, so at 3) and replays, and
    # every later step replays.
    assert stats["eager_reasons"] == {"warmup": 2}, stats
    assert stats["graph_runs"] == stats["histogram"]["DECODE"][3] - 2 >= 1
    assert stats["key_hits"] == {"layout1:call/bs=3": stats["graph_runs"]}
    assert "index_copy_" in stats["failed_keys"]["layout1:call/bs=4"]


@pytest.mark.parametrize("kind", GENERATE_MODELS)
def test_graph_generate_reuses_its_graphs_across_calls_with_seeded_sampling(kind):
    model = tiny_causal_lm(kind)
    reference = copy.deepcopy(model)
    fast = graph_generate(model, max_batch_size=8)
    for call, batch in enumerate((5, 5, 2)):  # 5: padded to 8 refused, its own size recorded
        ids, mask = left_padded_prompts(batch, seed=call)
        expected = generate(reference, ids, mask, sample_seed=call, cache_implementation="static")
        before = copy.deepcopy(fast.stats())
        got = generate(model, ids, mask, sample_seed=call)  # graph_generate made the static cache the default
        assert torch.equal(got, expected), f"call {call}"
        replays, eager, reasons = step_counts(fast, before)
        if call == 1:  # the same batch size and cache length: the pooled cache, every step a replay
            assert eager == 0 and replays >= 2, (replays, reasons)
        else:  # a cache of another size: new layouts, a warm-up each
            assert reasons == {"warmup": 2}, reasons
    assert model._prepare_static_cache.reused == 1


def test_a_new_static_cache_per_call_opens_new_layouts_and_dropped_ones_free_it():
    """Plain wrap(): transformers builds a new StaticCache on every generate() call, a constant of
    the layout compared by identity, so each call warms up and records again; past
    max_signatures the least recently used layouts are dropped and their caches freed."""
    model = tiny_causal_lm("llama")
    fast = graphrt.wrap(model.forward, max_batch_size=4, max_signatures=2)
    model.forward = fast
    ids, mask = left_padded_prompts(2)
    caches = []
    original = model._prepare_static_cache

    def remember(**kwargs):
        cache = original(**kwargs)
        caches.append(weakref.ref(cache))
        return cache

    model._prepare_static_cache = remember
    first = generate(model, ids, mask, cache_implementation="static")
    for _ in range(2):
        assert torch.equal(generate(model, ids, mask, cache_implementation="static"), first)
    gc.collect()
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 6} and stats["layouts_dropped"] == 4
    assert [cache() is None for cache in caches] == [True, True, False]


def test_a_growing_dynamic_cache_runs_eagerly_and_says_why():
    model = tiny_causal_lm("llama")
    ids, mask = left_padded_prompts(3)
    expected = generate(copy.deepcopy(model), ids, mask)
    fast = graphrt.wrap(model.forward, max_batch_size=8)
    model.forward = fast
    assert torch.equal(generate(model, ids, mask), expected)  # default DynamicCache: a 2-D mask grows each step
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["captured_keys"] == []
    assert stats["eager_reasons"] == {"warmup": 4, "shape_mismatch": NEW_TOKENS - 4}
    assert "attention_mask" in stats["layout_churn"]
    assert "cache_implementation='static'" in stats["layout_churn"]["attention_mask"]


def test_graph_generate_rejects_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="model: expected a Hugging Face generative model"):
        graph_generate(torch.nn.Linear(2, 2), max_batch_size=4)
    model = tiny_causal_lm("llama")
    graph_generate(model, max_batch_size=4)
    with pytest.raises(ValueError, match="model.forward: already wrapped"):
        graph_generate(model, max_batch_size=4)


class CacheStub:
    """Counts reset() calls, as a StaticCache zeroes itself in place."""

    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def test_the_cache_pool_reuses_a_cache_per_shape_and_lets_the_oldest_go():
    made = []

    def prepare(**request):
        made.append(CacheStub())
        return made[-1]

    pool = StaticCachePool(prepare, max_caches=2)
    request = dict(cache_implementation="static", prefill_chunk_size=None, model_kwargs={})
    first = pool(batch_size=3, max_cache_len=16, **request)
    assert pool(batch_size=3, max_cache_len=16, **request) is first and first.resets == 1
    assert pool(batch_size=5, max_cache_len=16, **request) is not first
    pool(batch_size=2, max_cache_len=16, **request)  # a third shape: the least recently used (3 rows) goes
    assert pool(batch_size=3, max_cache_len=16, **request) is not first and len(made) == 4


def test_encoder_decoder_caches_are_reused_per_encoder_length():
    """The cross-attention cache is sized to the encoder output: a cache is reused for the same length only."""
    pool = StaticCachePool(lambda **request: CacheStub())

    def cache_for(encoder_length):
        encoder_outputs = (torch.zeros(2, encoder_length, 8),)  # generate() passes a ModelOutput: [0] is its states
        return pool(cache_implementation="static", batch_size=2, max_cache_len=16, prefill_chunk_size=None,
                    model_kwargs={"encoder_outputs": encoder_outputs})

    first = cache_for(7)
    assert cache_for(7) is first and first.resets == 1
    assert cache_for(9) is not first
