"""What capture's own runs of the step leave behind (issue 49, item 2, as the graph contract has it).

Capture runs the user's step several times besides the call it serves (warm-up, recording, verification,
the padding check); a replay runs none of its Python, so Python state the step writes (a class-level
counter, a helper object's counter, a dict it counts into) is frozen in replays. Capture puts back what
each of its runs wrote, logging the write and its line: after N calls through graphrt that state reads as
eager leaves it after the calls graphrt ran eagerly, never advanced by capture's runs; the key is not
refused, and the step's own writes (an eager call of the model between two calls) are no change of state
the key's guard reads.
"""

from __future__ import annotations

import array
import inspect
import itertools
import logging

import numpy
import pytest
import torch
from torch import nn

from graphrt import GraphRunner, wrap

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


class SlottedStats:
    __slots__ = ("calls",)

    def __init__(self):
        self.calls = 0


class HelperCounter(nn.Module):
    def __init__(self, stats=Stats):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.stats = stats()

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


class BufferCounter(nn.Module):
    """Counts into a buffer of numbers (a numpy array, an ``array.array``) it holds."""

    def __init__(self, counts):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.counts = counts

    def forward(self, x):
        self.counts[0] += x.shape[0]
        self.counts[1] += 1
        return self.proj(x) * (1 + 0.01 * float(self.counts[1]))


def eager_then_graphrt(model, state, reset):
    """``CALLS`` eager calls, then as many through wrap() from the same starting state: the outputs of
    both and what ``state()`` read after the graphrt series."""
    x = torch.randn(4, 8)
    with torch.no_grad():
        reset()
        eager = [model(x) for _ in range(CALLS)]
        reset()
        fast = wrap(model, max_batch_size=4, capture_sizes=[4])
        graphed = [fast(x) for _ in range(CALLS)]
    return x, eager, graphed, state(), fast


def line_of(function, text: str) -> int:
    """The line of ``function``'s source that holds ``text`` (the write the log must name)."""
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if text in line)


def class_counter():
    def reset():
        ClassCounter.calls = 0

    line = line_of(ClassCounter.forward, "type(self).calls += 1")
    return ClassCounter(), lambda: ClassCounter.calls, reset, "ClassCounter.calls", line, lambda calls: calls


def helper_counter(stats=Stats):
    model = HelperCounter(stats)

    def reset():
        model.stats.calls = 0

    line = line_of(HelperCounter.forward, "self.stats.calls += 1")
    return model, lambda: model.stats.calls, reset, "HelperCounter.stats.calls", line, lambda calls: calls


def slotted_helper_counter():
    return helper_counter(SlottedStats)


def dict_counter():
    def reset():
        COUNTS.update(rows=0, calls=0)

    line = line_of(DictCounter.forward, 'COUNTS["rows"] +=')
    return (DictCounter(), lambda: dict(COUNTS), reset, "COUNTS['rows']", line,
            lambda calls: {"rows": 4 * calls, "calls": calls})


def buffer_counter(counts):
    model = BufferCounter(counts)

    def reset():
        model.counts[0] = model.counts[1] = 0

    line = line_of(BufferCounter.forward, "self.counts[0] +=")
    return (model, lambda: [int(count) for count in model.counts], reset, "BufferCounter.counts", line,
            lambda calls: [4 * calls, calls])


def numpy_counter():
    return buffer_counter(numpy.zeros(2))


def array_counter():
    return buffer_counter(array.array("q", [0, 0]))


@pytest.mark.parametrize("case", [class_counter, helper_counter, slotted_helper_counter, dict_counter, numpy_counter,
                                  array_counter],
                         ids=lambda case: case.__name__)
def test_python_state_the_step_writes_is_put_back_after_captures_runs_and_frozen_in_replays(case, caplog):
    model, state, reset, path, line, after = case()
    with caplog.at_level(logging.INFO, logger="graphrt.guards.step_writes"):
        x, eager, graphed, graphed_state, fast = eager_then_graphrt(model, state, reset)
    # call 1: the warm-up, eager; call 2: capture (each of its runs put back), served by the graph; 3-5: replays
    assert fast.stats()["eager_reasons"] == {"warmup": 1} and fast.stats()["graph_runs"] == CALLS - 1
    assert not fast.stats()["failed_keys"]
    assert graphed_state == after(1), "capture's runs must leave no trace, replays run no Python"
    assert torch.equal(graphed[0], eager[0])
    assert all(torch.equal(out, eager[1]) for out in graphed[1:]), "the recording's counter, frozen"
    logs = [record.getMessage() for record in caplog.records if path in record.getMessage()]
    logged = logs[0]  # once per observed run (the padding check's and capture's)
    assert logged.startswith(f"{path}: the step writes it") and "put back after each capture run" in logged
    assert f"test_guards_capture_runs.py:{line} in forward" in logged
    with torch.no_grad():
        model(x)  # the step's own write, outside graphrt: no change of state the key reads
        fast(x)
    assert state() == after(2) and fast.stats()["graph_runs"] == CALLS and not fast.stats()["guard_failures"]


def test_a_step_writing_no_python_state_still_replays():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert all(torch.equal(fast(x), model(x)) for _ in range(CALLS))
    assert fast.stats()["graph_runs"] >= CALLS - 2 and not fast.stats()["failed_keys"]


# A count the journal cannot put back (an iterator's position): how many times capture ran the step.
RUNS = itertools.count()


def runs_so_far() -> int:
    return int(repr(RUNS).removeprefix("count(").removesuffix(")"))


class CountedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        next(RUNS)
        return self.proj(x)


class CountedEngineModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, input_ids, positions, forward_batch):
        next(RUNS)
        return self.embed(input_ids % 16) + positions.unsqueeze(-1)


def test_a_graph_runners_capture_runs_the_step_three_times_per_key():
    runner = GraphRunner(CountedEngineModel(), max_batch_size=4, capture_sizes=[1, 2, 4])
    before = runs_so_far()
    report = runner.capture()
    assert len(report.ok) == 3
    assert runs_so_far() - before == 3 * 3, "one warm-up (observed), the recording, the verification per key"


@pytest.mark.parametrize("first_rows", [2, 4, 3], ids=["exact", "exact-then-padded", "padded"])
def test_a_wrapped_steps_recording_call_runs_it_three_times(first_rows):
    """wrap()'s first call of a size is its warm-up (the call's own eager step); the next records the
    key: one warm-up (observed), the recording, the verification. A key smaller calls will pad to also
    compares the padding rows' writes and outputs with the real rows' (graphrt.padding_rows): the
    check's padded-size run is the capture's warm-up and its real-size run the verification's eager run,
    against whose real rows the warm-up is compared (and the replay with the warm-up): no run of its own."""
    runs = 3
    model = CountedLinear()
    fast = wrap(model, max_batch_size=4, capture_sizes=[1, 2, 4])
    x = torch.randn(first_rows, 8)
    with torch.no_grad():
        fast(x)
        before = runs_so_far()
        out = fast(x)
        assert runs_so_far() - before == runs
        assert fast.stats()["graph_runs"] == 1 and not fast.stats()["failed_keys"]
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
