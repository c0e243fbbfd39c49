"""What capture's own runs of the step leave behind (issue 49, item 2).

Capture runs the user's step several times besides the call it serves (warm-up, recording, verification,
the padding check). A step that writes Python state no replay would write (a class-level counter, a
helper object's counter, a dict it counts into) must leave, after N calls through graphrt, the state
eager leaves after N calls, and give eager's result on each: capture puts such writes back and refuses
the key by name (RebindError, with the write and its line), so the calls run eagerly from the right state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphrt import wrap

CALLS = 5
COUNTS = {"rows": 0, "calls": 0}


class ClassCounter(nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        type(self).calls += 1
        return self.proj(x) * (1 + 0.01 * type(self).calls)


class Stats:
    def __init__(self):
        self.calls = 0


class HelperCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.stats = Stats()

    def forward(self, x):
        self.stats.calls += 1
        return self.proj(x) * (1 + 0.01 * self.stats.calls)


class DictCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        COUNTS["rows"] += x.shape[0]
        COUNTS["calls"] += 1
        return self.proj(x) * (1 + 0.01 * COUNTS["calls"])


def eager_then_graphrt(model, state, reset):
    """``CALLS`` eager calls, then as many through wrap() from the same starting state: the outputs of
    both and what ``state()`` read after each series."""
    x = torch.randn(4, 8)
    with torch.no_grad():
        reset()
        eager = [model(x) for _ in range(CALLS)]
        eager_state = state()
        reset()
        fast = wrap(model, max_batch_size=4, capture_sizes=[4])
        graphed = [fast(x) for _ in range(CALLS)]
    return eager, graphed, eager_state, state(), fast


def class_counter():
    def reset():
        ClassCounter.calls = 0

    return ClassCounter(), lambda: ClassCounter.calls, reset, "ClassCounter.calls", 30, CALLS


def helper_counter():
    model = HelperCounter()

    def reset():
        model.stats.calls = 0

    return model, lambda: model.stats.calls, reset, "HelperCounter.stats.calls", 46, CALLS


def dict_counter():
    def reset():
        COUNTS.update(rows=0, calls=0)

    return DictCounter(), lambda: dict(COUNTS), reset, "COUNTS['rows']", 56, {"rows": 4 * CALLS, "calls": CALLS}


@pytest.mark.parametrize("case", [class_counter, helper_counter, dict_counter], ids=lambda case: case.__name__)
def test_python_state_the_step_writes_ends_as_eager_leaves_it(case):
    model, state, reset, path, line, expected = case()
    eager, graphed, eager_state, graphed_state, fast = eager_then_graphrt(model, state, reset)
    assert graphed_state == eager_state == expected
    assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    (reason,) = fast.stats()["failed_keys"].values()
    assert reason.startswith(f"RebindError: {path}: the step writes it")
    assert f"test_guards_capture_runs.py:{line} in forward" in reason


def test_a_step_writing_no_python_state_still_replays():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert all(torch.equal(fast(x), model(x)) for _ in range(CALLS))
    assert fast.stats()["graph_runs"] >= CALLS - 2 and not fast.stats()["failed_keys"]
