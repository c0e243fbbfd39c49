"""Per-call context the step reads at forward time (issue 49, item 5).

A ``ContextVar``, a ``threading.local``, ``os.environ``, a submodule's attribute read without calling the
submodule (``F.leaky_relu(h, self.act.negative_slope)``, as fused kernels read their modules' settings),
and an ``lru_cache``'d helper reading a global (after ``cache_clear()``): each is Python state a replay
froze. torch.compile guards what it traced of them (and traces through the cache wrapper); a change
after capture must give eager's result, never silently the captured one.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading

import torch
import torch.nn.functional as F
from conftest import calls, failures
from torch import nn

from graphrt import wrap

SCALE = contextvars.ContextVar("scale", default=1.0)


def scaled_by_context(x):
    return x * SCALE.get()


def test_a_context_variable_read_in_the_step_is_guarded():
    fast = wrap(scaled_by_context, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        token = SCALE.set(2.0)
        try:
            assert all(torch.equal(fast(x), scaled_by_context(x)) for _ in range(3))
        finally:
            SCALE.reset(token)
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), x) and fast.stats()["graph_runs"] == runs + 1  # the first graphs again
    assert "SCALE" in failures(fast) or "scale" in failures(fast)


LOCAL = threading.local()
LOCAL.scale = 1.0


def scaled_by_thread(x):
    return x * LOCAL.scale


def test_a_thread_local_read_in_the_step_is_guarded_per_thread():
    fast = wrap(scaled_by_thread, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    results = []
    with torch.no_grad():
        calls(fast, x)
        LOCAL.scale = 3.0
        try:
            assert all(torch.equal(fast(x), x * 3.0) for _ in range(3))
        finally:
            LOCAL.scale = 1.0

        def other_thread():
            LOCAL.scale = 5.0
            with torch.no_grad():
                results.append(torch.equal(fast(x), x * 5.0))

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert results == [True]
    assert "scale" in failures(fast)


def scaled_by_environment(x):
    return x * float(os.environ.get("GRAPHRT_TEST_SCALE", "1"))


def test_an_environment_variable_read_in_the_step_is_guarded(monkeypatch):
    monkeypatch.delenv("GRAPHRT_TEST_SCALE", raising=False)
    fast = wrap(scaled_by_environment, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        monkeypatch.setenv("GRAPHRT_TEST_OTHER", "1")  # another variable: the graphs still replay
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), x) and fast.stats()["graph_runs"] == runs + 1
        monkeypatch.setenv("GRAPHRT_TEST_SCALE", "2.5")
        assert all(torch.equal(fast(x), x * 2.5) for _ in range(3))
    assert "GRAPHRT_TEST_SCALE" in failures(fast)


class Fused(nn.Module):
    """Reads its activation module's setting without calling it, as fused kernels do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        return F.leaky_relu(self.linear(x), self.act.negative_slope)


def test_a_submodule_attribute_read_without_calling_it_is_guarded():
    model = Fused()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model.act.negative_slope = 0.5
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "negative_slope" in failures(fast)


FACTOR = 2.0


@functools.lru_cache(maxsize=None)
def cached_factor():
    return FACTOR * 1.5


def scaled_by_cached(x):
    return x * cached_factor()


def test_an_lru_cached_helper_over_a_global_is_guarded_after_cache_clear():
    global FACTOR
    fast = wrap(scaled_by_cached, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        FACTOR = 4.0
        cached_factor.cache_clear()
        try:
            assert all(torch.equal(fast(x), x * 6.0) for _ in range(3))
        finally:
            FACTOR = 2.0
            cached_factor.cache_clear()
    assert "FACTOR" in failures(fast)
