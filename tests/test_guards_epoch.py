"""The state epoch while serving (issue 47, item 1): graphrt's own bookkeeping never moves it, and a
change re-reads only what it names.

A key re-reads its Python state only after the epoch moved (graphrt.guards.epoch). An engine that
kept its timers as attributes of a watched object moved it twice a step, and every key then re-read
every module it ran: the one-integer check never happened on the engine path. Each front is served
here for many steps after capture, and the epoch must stay where it was; a change the guards read
(a user's) still moves it, and then costs the re-read of what changed, not of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, captured_runner, decode_batch, eager_step
from torch import nn

from graphrt import wrap
from graphrt.guards import epoch, python_state


class Server:
    """A user's serving object: holds the model the step runs, and keeps its own timers and counters."""

    def __init__(self, model):
        self.model = model
        self.steps = 0
        self.seconds = 0.0

    def __call__(self, *args):
        return self.model(*args)


def test_runner_steps_of_a_server_that_counts_them_leave_the_epoch_where_it_was():
    server = Server(ToyPagedModel())
    runner = captured_runner(server)
    batch = decode_batch(4)
    before = epoch.EPOCH[0]
    for _ in range(20):
        runner(batch)
        server.steps += 1  # the server's bookkeeping: no guard reads it
        server.seconds += 0.001
    assert epoch.EPOCH[0] == before
    assert runner.stats()["graph_runs"] == 20
    torch.manual_seed(1)
    server.model = ToyPagedModel()  # what the step reads: the user's change moves it
    assert epoch.EPOCH[0] != before
    assert torch.equal(runner(batch), eager_step(copy.deepcopy(server.model), batch))
    assert runner.stats()["eager_reasons"] == {"rebound_state": 1}


def test_wrap_calls_of_a_server_that_counts_them_leave_the_epoch_where_it_was():
    server = Server(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    fast = wrap(server, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):  # warm-up, recording, replay
            fast(x)
        before = epoch.EPOCH[0]
        for _ in range(20):
            assert torch.equal(fast(x), server.model(x))
            server.steps += 1
        assert epoch.EPOCH[0] == before
        assert fast.stats()["graph_runs"] == 22
        server.model[0].weight = nn.Parameter(torch.randn(8, 8))  # a user's change still moves it
        assert epoch.EPOCH[0] != before
        assert torch.equal(fast(x), server.model(x))
    assert any(detail.startswith("rebound_state:") for detail in fast.stats()["guard_failures"])


def test_graph_generate_calls_leave_the_epoch_where_it_was():
    pytest.importorskip("transformers")
    from hf_helpers import family_inputs, tiny_model

    import graphrt.hf

    model = tiny_model("llama")
    inputs = family_inputs("llama", batch=2)
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            model.generate(**inputs, **options)
        before, runs = epoch.EPOCH[0], fast.stats()["graph_runs"]
        model.generate(**inputs, **options)
    assert epoch.EPOCH[0] == before
    assert fast.stats()["graph_runs"] - runs == 8  # every forward call of it replayed: the prefill, 7 decode steps


def test_engine_generate_leaves_the_epoch_where_it_was():
    """HFEngine's step kept its timers as attributes of the engine (a watched object): two bumps a step."""
    pytest.importorskip("transformers")
    from hf_helpers import tiny_model

    import graphrt.hf

    engine = graphrt.hf.engine_model(tiny_model("llama"), max_requests=3, max_context=32, max_step_tokens=8,
                                     warmup_iters=1)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    engine.generate(prompts, max_new_tokens=8)  # captures
    expected = engine.generate(prompts, max_new_tokens=8, graphs=False)
    before = epoch.EPOCH[0]
    assert engine.generate(prompts, max_new_tokens=8) == expected
    assert epoch.EPOCH[0] == before
    serve = engine.stats()["serve"]
    assert serve["decode_steps"] >= 7 and serve["decode_steps_graphed"] == serve["decode_steps"]


class Layers(nn.Module):
    """``depth`` linear layers, each scaled by a Python float attribute its forward reads."""

    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(depth)])
        for layer in self.layers:
            layer.scale = 1.0

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * layer.scale
        return x


def counting_reads(monkeypatch):
    """The number of whole-module and whole-object state reads, as a list of one count."""
    count = [0]
    for name in ("module_state", "object_state"):
        original = getattr(python_state, name)

        def counted(*args, original=original):
            count[0] += 1
            return original(*args)

        monkeypatch.setattr(python_state, name, counted)
    return count


@pytest.mark.parametrize("depth", [2, 16])
def test_one_attribute_assigned_reads_that_attribute_again_not_the_model(monkeypatch, depth):
    model = Layers(depth)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        reads = counting_reads(monkeypatch)
        model.layers[-1].scale = 1.0  # the same value: the guard reads it again, and holds
        model.layers[0].scale = model.layers[0].scale
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), model(x)) and fast.stats()["graph_runs"] == runs + 1
        assert reads[0] == 0  # the two attributes only (before: every module the step ran, twice)
        model.layers[-1].scale = 3.0  # a change: found, and only the module that holds it read whole
        assert torch.equal(fast(x), model(x))
        assert reads[0] == 1
    assert "python_state:" in " | ".join(fast.stats()["guard_failures"])


def test_a_change_among_more_than_the_log_keeps_is_still_seen(monkeypatch):
    """Past ``MAX_CHANGES`` the older changes are dropped: a key that had not read them reads everything."""
    monkeypatch.setattr(epoch, "MAX_CHANGES", 8)
    model = Layers(2)
    elsewhere = nn.Linear(2, 2)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    other = wrap(elsewhere, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
            other(torch.randn(4, 2))
        model.layers[1].scale = 2.0
        for step in range(30):  # another watched module's changes push the first out of the log
            elsewhere.step = step
        assert torch.equal(fast(x), model(x))
    assert "python_state:" in " | ".join(fast.stats()["guard_failures"])


def test_a_hook_removed_is_seen_through_the_dict_it_was_in():
    """``RemovableHandle.remove`` names the hook dicts it removed from; the module's are its own."""
    model = Layers(2)
    handle = model.layers[1].register_forward_hook(lambda module, args, out: out * 2)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        handle.remove()
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "hooks:" in " | ".join(fast.stats()["guard_failures"])
