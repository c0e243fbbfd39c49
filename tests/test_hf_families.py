"""Every Hugging Face family graphrt covers, through graph_generate(): eager's tokens, and every forward
call of a repeated generate() call replayed.

One tiny random model per family (hf_helpers.FAMILIES: decoder-only, mixture-of-experts, hybrid
sliding-window + full attention, all-sliding, encoder-decoder, speech). Each generates twice on a
left-padded batch, greedy then with seeded sampling, and is compared with eager generate() on a
copy of the model with transformers' own static cache. The sliding-window families have a window
of WINDOW tokens, shorter than prompt + new tokens: the window slides while graphs replay.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import (  # noqa: E402
    FAMILIES, WINDOW, ForwardCalls, cache_argument, captured_at, failure_of, family_inputs, replays_here, tiny_model,
)

import graphrt  # noqa: E402
from graphrt.hf import graph_generate, graph_safe_cache  # noqa: E402
from graphrt.hf.window_layers import CacheLongWindowLayer, SlidingRingLayer  # noqa: E402

NEW_TOKENS = 8
PROMPT_LEN = 5


def generate(model: torch.nn.Module, inputs: Dict[str, Any], sample_seed: Optional[int] = None, **options: Any):
    """Greedy, or sampled (top-k 20) from ``sample_seed``."""
    kwargs = dict(inputs, max_new_tokens=NEW_TOKENS, pad_token_id=0, **options)
    if sample_seed is None:
        return model.generate(do_sample=False, **kwargs)
    torch.manual_seed(sample_seed)
    return model.generate(do_sample=True, top_k=20, **kwargs)


def assert_same_generation(got: Any, expected: Any, family: str) -> None:
    """The same tokens, and the same logits at every step (more sensitive than tokens: a key one position off in a
    sliding window changes them while argmax may not move)."""
    assert torch.equal(got.sequences, expected.sequences), f"{family}: tokens differ from eager's"
    for step, (mine, theirs) in enumerate(zip(got.logits, expected.logits)):
        torch.testing.assert_close(mine, theirs, msg=lambda why: f"{family}: logits of step {step}: {why}")


def repeated_call(family: str, batch: int = 2, padded_rows: int = 1):
    """graph_generate() on ``family``: a greedy call, then a sampled one (each checked against eager).
    Returns (the GraphedCallable, forward calls and replays of the second call, the model)."""
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    inputs = family_inputs(family, batch, PROMPT_LEN, padded_rows=padded_rows)
    fast = graph_generate(model, max_batch_size=4)
    counter = ForwardCalls(model)
    outputs = dict(return_dict_in_generate=True, output_logits=True)
    for seed in (None, 1):
        expected = generate(reference, inputs, seed, cache_implementation="static", **outputs)
        calls, replays = counter.calls, fast.stats()["graph_runs"]
        assert_same_generation(generate(model, inputs, seed, **outputs), expected, family)
    return fast, counter.calls - calls, fast.stats()["graph_runs"] - replays, model


def twice_against_eager(family: str, inputs: Dict[str, Any], check: Callable[[Any, Any], None], **options: Any):
    """graph_generate() on ``family`` called twice with ``options``, each result checked against eager generate()
    on transformers' static cache by ``check(got, expected)``. Returns (the GraphedCallable, forward calls and
    replays of the second call)."""
    model = tiny_model(family)
    expected = generate(copy.deepcopy(model), inputs, cache_implementation="static", **options)
    fast = graph_generate(model, max_batch_size=4)
    counter = ForwardCalls(model)
    for _ in range(2):
        calls, replays = counter.calls, fast.stats()["graph_runs"]
        check(generate(model, inputs, **options), expected)
    return fast, counter.calls - calls, fast.stats()["graph_runs"] - replays


def eager_calls(family: str) -> int:
    """How many forward calls of a repeated generate() call run eagerly for ``family`` (see hf_helpers.Family)."""
    return 1 if FAMILIES[family].eager_prefill else 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_repeated_generate_call_replays_every_forward_call(family):
    fast, calls, replays, model = repeated_call(family)
    failed = fast.stats()["failed_keys"]
    if not replays_here(family):  # an older transformers: its modeling code reads the host inside the step
        assert replays == 0 and all(reason.startswith("HostSyncError") for reason in failed.values()), failed
        return
    assert calls >= 2 and replays == calls - eager_calls(family), (family, fast.stats()["eager_reasons"], failed)
    (cache,) = model._prepare_static_cache.caches.values()
    assert model._prepare_static_cache.reused == 1
    if FAMILIES[family].sliding:
        layers = getattr(cache, "self_attention_cache", cache).layers
        windows = [layer for layer in layers if layer.is_sliding]
        assert windows and all(type(layer) in (SlidingRingLayer, CacheLongWindowLayer) for layer in windows)
        if "sliding_window" in FAMILIES[family].fields:  # a window of WINDOW tokens: a ring, and it slid
            assert all(type(layer) is SlidingRingLayer for layer in windows)
            assert all(layer.max_cache_len == WINDOW < int(layer.cumulative_length) for layer in windows)


def test_opt_reads_a_device_value_in_an_unpadded_prefill_which_stays_eager():
    """OPT computes positions from the cache length (a tensor) when generate() passes no mask, a host read:
    that prefill's capture fails and it runs eagerly on every call; the decode steps replay."""
    fast, calls, replays, _ = repeated_call("opt", padded_rows=0)
    assert replays == calls - 1
    (reason,) = fast.stats()["failed_keys"].values()
    assert reason.startswith("HostSyncError: host sync in the captured step") and "modeling_opt.py" in reason


def test_a_sliding_window_batch_off_the_capture_sizes_replays_at_its_own_size():
    fast, calls, replays, _ = repeated_call("gemma2", batch=3)  # padded to 4, the 3-row cache refuses it
    assert replays == calls and captured_at(fast.stats(), layout=1, batch=3)


def test_plain_wrap_of_a_sliding_window_model_names_the_layer_and_graph_generate():
    """With ``model.forward = wrap(model.forward)``, generate() brings transformers' own cache, whose
    sliding-window layer cannot replay: eager's tokens, and the reason says which layer and what to do."""
    model = tiny_model("gemma2")
    inputs = family_inputs("gemma2", 2, PROMPT_LEN)
    expected = generate(copy.deepcopy(model), inputs, cache_implementation="static")
    fast = graphrt.wrap(model.forward, max_batch_size=4)
    model.forward = fast
    assert torch.equal(generate(model, inputs, cache_implementation="static"), expected)
    assert fast.stats()["graph_runs"] == 0
    reason = failure_of(fast.stats(), layout=1, batch=2)
    assert "(state of a transformers.cache_utils.StaticSlidingWindowLayer)" in reason
    assert "graphrt.hf.graph_generate(model, ...)" in reason and "graphrt.hf.graph_safe_cache" in reason


def test_plain_wrap_replays_a_sliding_window_model_given_a_graph_safe_cache():
    """The plain form where the same fix applies: a cache of one's own, made graph-safe, passed to generate()."""
    model = tiny_model("gemma3")
    inputs = family_inputs("gemma3", 2, PROMPT_LEN)
    expected = generate(copy.deepcopy(model), inputs, cache_implementation="static")
    fast = graphrt.wrap(model.forward, max_batch_size=4)
    model.forward = fast
    cache = graph_safe_cache(transformers.StaticCache(config=model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS))
    for _ in range(2):
        cache.reset()
        replays = fast.stats()["graph_runs"]
        assert torch.equal(generate(model, inputs, **cache_argument(model, cache)), expected)
    assert fast.stats()["graph_runs"] - replays == NEW_TOKENS


def test_a_model_that_builds_its_sliding_mask_inside_the_step_is_refused_not_frozen():
    """Called without a prepared mask, the model asks the ring for its mask offset inside the step: a host
    read, so the capture fails and every step runs eagerly, with the right tokens."""
    model = tiny_model("mistral-window")
    prompt = family_inputs("mistral-window", 2, PROMPT_LEN, padded_rows=0)["input_ids"]
    tokens = []
    for wrapped in (False, True):
        cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT_LEN + NEW_TOKENS)
        if wrapped:
            cache = graph_safe_cache(cache)

        def step(input_ids, position_ids):
            return model(input_ids=input_ids, **cache_argument(model, cache), position_ids=position_ids).logits[:, -1]

        fast = graphrt.wrap(step, max_batch_size=2, capture_sizes=[2]) if wrapped else step
        with torch.no_grad():
            token = model(input_ids=prompt, **cache_argument(model, cache)).logits[:, -1:].argmax(-1)
            for position in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1):
                token = fast(token, torch.full((2, 1), position)).argmax(-1, keepdim=True)
                tokens.append(token)
    assert all(torch.equal(a, b) for a, b in zip(tokens[:NEW_TOKENS - 1], tokens[NEW_TOKENS - 1:]))
    assert fast.stats()["graph_runs"] == 0
    assert failure_of(fast.stats(), layout=0, batch=2).startswith("HostSyncError")


@pytest.mark.parametrize("family", ["llama", "gemma3", "bamba"])  # each fails without the in-place reorder
def test_beam_search_reorders_the_cache_in_place(family):
    """Beam search reorders the cache between steps; transformers' reorder_cache rebinds every layer's tensors
    (keys and values; a state-space layer's conv and recurrent states), which graphs recorded before never read
    (the tokens differed). graph_generate's caches reorder in place."""
    def same_beams(got: Any, expected: Any) -> None:
        assert torch.equal(got.sequences, expected.sequences)
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores)

    _, calls, replays = twice_against_eager(family, family_inputs(family, 2, PROMPT_LEN), same_beams,
                                            num_beams=2, return_dict_in_generate=True, output_scores=True)
    assert replays == calls - eager_calls(family)


def test_a_chunked_prefill_replays_one_graph_whatever_the_window_holds():
    """generate(prefill_chunk_size=3) on a 9-token prompt: three 3-token steps at 0, 3 and 6 tokens already
    cached, the window of 4 empty, filling and full; the ring's ops depend on the step's size only, so the
    chunk's graph replays for all three, with eager's tokens and logits."""
    _, calls, replays = twice_against_eager(
        "gemma3", family_inputs("gemma3", 2, 9), lambda got, expected: assert_same_generation(got, expected, "gemma3"),
        prefill_chunk_size=3, return_dict_in_generate=True, output_logits=True)
    assert replays == calls == 3 + NEW_TOKENS - 1
