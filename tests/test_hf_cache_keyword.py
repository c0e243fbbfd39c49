"""The cache keyword across transformers releases: ``cache`` since 5.24, ``past_key_values`` before.

graph_generate's forward must route an encoder-decoder cache's filling step under whichever keyword
generate() used, and MultiStepGenerate must pass its cache under the keyword the model declares.
These run without transformers (plain functions and objects stand in for the model and the cache).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphrt.hf import GenerateForward
from graphrt.hf.cache_keyword import accepted_cache_keyword, passed_cache_keyword


def forward_5_24(input_ids, cache=None, use_cache=None):
    """A model forward as transformers >= 5.24 declares it."""


def forward_5_23(input_ids, past_key_values=None, use_cache=None):
    """A model forward as transformers < 5.24 declares it."""


def forward_of_cache_params(input_ids, cache_params=None, **kwargs):
    """Mamba's forward on transformers 5.17: a cache under either keyword would land in ``**kwargs``, unread."""


@pytest.mark.parametrize("forward, keyword", [(forward_5_24, "cache"), (forward_5_23, "past_key_values"),
                                              (forward_of_cache_params, None)])
def test_the_keyword_a_forward_declares(forward, keyword):
    assert accepted_cache_keyword(forward) == keyword


def test_the_keyword_a_call_passed():
    cache = object()
    assert passed_cache_keyword({"cache": cache, "use_cache": True}) == "cache"
    assert passed_cache_keyword({"past_key_values": cache}) == "past_key_values"
    assert passed_cache_keyword({"cache": None, "input_ids": 1}) is None
    assert passed_cache_keyword({}) is None


class EncoderDecoderCache:
    """Stands in for transformers' EncoderDecoderCache: which layers' cross-attention is computed."""

    def __init__(self, layers: int) -> None:
        self.is_updated = {layer: False for layer in range(layers)}


class RecordingFast:
    """Stands in for the wrapped forward: records the cache each call got, returns it under the same keyword."""

    def __init__(self) -> None:
        self.fn = forward_5_24
        self.calls = []

    def __call__(self, **kwargs):
        keyword = passed_cache_keyword(kwargs)
        self.calls.append((keyword, kwargs[keyword]))
        return SimpleNamespace(logits=None, **{keyword: kwargs[keyword]})


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_filling_step_goes_through_the_view_under_the_keyword_generate_used(keyword):
    """The first step of an encoder-decoder cache (cross-attention still to compute) runs on the
    filling view, under the caller's keyword; the output hands generate() back its own cache, now
    marked filled; the next step runs on the cache itself."""
    cache = EncoderDecoderCache(2)
    fast = RecordingFast()
    forward = GenerateForward(fast)
    output = forward(input_ids=1, **{keyword: cache})
    (used, view), = fast.calls
    assert used == keyword and view is not cache and view.is_updated[0] is False
    assert getattr(output, keyword) is cache and cache.is_updated == {0: True, 1: True}
    forward(input_ids=2, **{keyword: cache})
    assert fast.calls[-1] == (keyword, cache)
