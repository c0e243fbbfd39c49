"""Guards through wrap(): a graph replays only under the state it was captured for.

Each test is a reproduction from issue 32, written against the peers' semantics: a call under
another autocast or training state gets graphs of its own, aliased arguments run eagerly, a
rebound tensor is never read through an old graph, a graph recorded under inference mode serves
no_grad calls, and a step that rebinds its own module state is refused with the model left as
eager leaves it. Every result is compared with eager on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphrt import wrap
from graphrt.guards import StaleStateError


def calls(fast, *args, times=3, **kwargs):
    """``times`` calls (warm-up, recording, replay by default); the last result."""
    result = None
    for _ in range(times):
        result = fast(*args, **kwargs)
    return result


def test_autocast_gets_graphs_of_its_own():
    """PyTorch test_graph_make_graphed_callables (autocast cases) and dynamo's GLOBAL_STATE guard:
    a graph recorded under autocast must not serve a call outside it, nor the reverse."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    fast = wrap(linear, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 16)
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            inside = calls(fast, x)
            eager_inside = linear(x)
        outside = calls(fast, x)
        eager_outside = linear(x)
        with torch.autocast("cpu", torch.bfloat16):
            again = fast(x)
    assert inside.dtype == eager_inside.dtype == torch.bfloat16
    assert outside.dtype == eager_outside.dtype == torch.float32
    assert torch.equal(inside, eager_inside) and torch.equal(outside, eager_outside)
    assert torch.equal(again, eager_inside)
    stats = fast.stats()
    assert stats["graph_runs"] == 5  # two replays per state (recording call, then a replay), then bfloat16 again
    assert len(stats["layouts"]) == 2 and stats["eager_reasons"] == {"warmup": 2}


def test_a_graph_recorded_under_inference_mode_serves_no_grad_calls_and_back():
    """pytorch#135892: static slots made under inference_mode() refused the staging copy under
    no_grad(), and the fallback's reset raised the same error, so every later call raised."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    fast = wrap(mlp, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.inference_mode():
        calls(fast, x)
    with torch.no_grad():
        out = fast(x)
        expected = mlp(x)
        out.add_(1)  # an output a no_grad caller can write, as eager's
    assert torch.equal(out, expected + 1)
    with torch.inference_mode():
        assert torch.equal(fast(x), mlp(x))
    assert fast.stats()["graph_runs"] == 4 and fast.stats()["eager_reasons"] == {"warmup": 1}


def test_eval_after_train_gets_its_own_graphs_and_train_replays_again():
    """dynamo test_simple_module_recompile: a module recorded in train mode (dropout active) must
    not replay dropout after eval(); back in train mode the train graph draws as eager does."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model.eval()
        evaluated = [fast(x) for _ in range(3)]
        assert all(torch.equal(out, model(x)) for out in evaluated)
        model.train()
        torch.manual_seed(7)
        trained = fast(x)
        torch.manual_seed(7)
        assert torch.equal(trained, model(x))
    assert fast.stats()["graph_runs"] == 5 and len(fast.stats()["layouts"]) == 2


def test_a_submodule_switched_to_eval_is_seen():
    """The check per call reads the root's flag; a submodule's train()/eval() is counted too."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    fast = wrap(lambda x: model(x), max_batch_size=4, capture_sizes=[4])  # the module is a global of the lambda
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model[1].eval()
        assert torch.equal(fast(x), model(x)) and torch.equal(fast(x), model[0](x))


def test_the_same_tensor_twice_runs_eagerly():
    """tinygrad test_jit_duplicate_fail: one tensor passed as two arguments, one written, the other
    read. Separate static slots would give 3x where eager gives 4x."""

    def step(a, b):
        a.mul_(2)
        return a + b

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x, reference = torch.ones(4, 3), torch.ones(4, 3)
    for _ in range(4):
        out = fast(x, x)
        assert torch.equal(out, step(reference, reference)) and torch.equal(x, reference)
    assert fast.stats()["eager_reasons"]["aliased_inputs"] == 3  # every call after the warm-up
    y, z = torch.ones(4, 3), torch.ones(4, 3)
    assert torch.equal(calls(fast, y, z), torch.full((4, 3), 9.0))  # distinct tensors replay: 8 + 1
    assert fast.stats()["graph_runs"] >= 1


def test_overlapping_views_of_one_base_run_eagerly():
    """Dynamo de-duplicates aliased inputs: two overlapping views of one tensor share memory."""

    def step(a, b):
        a.add_(1)
        return b * 2

    base, reference = torch.zeros(4, 6), torch.zeros(4, 6)
    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    for _ in range(3):
        out = fast(base[:, :3], base[:, 2:5])
        assert torch.equal(out, step(reference[:, :3], reference[:, 2:5])) and torch.equal(base, reference)
    assert fast.stats()["eager_reasons"].get("aliased_inputs") == 2


@pytest.mark.parametrize("argument", [lambda total: total, lambda total: total[:, 1:], torch.Tensor.detach],
                         ids=["the buffer", "a view at an offset", "a detached alias"])
def test_an_argument_that_is_state_the_step_writes_runs_eagerly(argument):
    """A module buffer passed in as an argument while the step writes the buffer: eager sees the
    write through the argument, a static slot would not. So for a view of it at an offset, and for
    ``detach()``, which shares the memory but is no view."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(4, 2))

        def forward(self, x):
            self.total.add_(1)
            return x * 2

    model, reference = Counter(), Counter()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    for _ in range(3):
        assert torch.equal(fast(argument(model.total)), reference(argument(reference.total)))
    assert fast.stats()["eager_reasons"].get("aliased_inputs") == 2
    assert torch.equal(model.total, reference.total)


def test_torch_keeps_one_storage_object_per_storage_while_it_lives():
    """What the per-call aliasing check stands on (graphrt.guards.key_guard.held_storages): the state's
    storage objects held, any tensor over the same storage (a view, a detached alias, a reshape) gives
    that very object, and a tensor of its own another."""
    state = torch.zeros(4, 6)
    held = state.untyped_storage()
    assert all(alias.untyped_storage() is held for alias in (state[1:, 2:], state.detach(), state.view(-1), state.t()))
    assert torch.zeros(4, 6).untyped_storage() is not held and state.clone().untyped_storage() is not held


class Memo:
    """An object argument whose tensor the step reads (a cache)."""

    def __init__(self, table):
        self.table = table


def test_a_tensor_rebound_on_an_object_argument_is_read_anew():
    """A recorded graph keeps the tensor bound at capture; a rebound one must not be replayed from the
    old memory. One of the same shape, which the step only reads, is staged into it (issue 49); one of
    another shape is a rebinding: the layout records again."""
    memo = Memo(torch.ones(4, 2))
    fast = wrap(lambda x, memo: x + memo.table, max_batch_size=4, capture_sizes=[4])
    x = torch.zeros(4, 2)
    for _ in range(6):
        fast(x, memo)  # warm-up, recording, 4 more replays
    memo.table = torch.full((4, 2), 5.0)
    for _ in range(3):
        assert torch.equal(fast(x, memo), x + memo.table)
    assert fast.stats()["graph_runs"] == 5 + 3 and "rebound_state" not in fast.stats()["eager_reasons"]
    memo.table = torch.full((1, 2), 7.0)
    for _ in range(3):
        assert torch.equal(fast(x, memo), x + memo.table)
    stats = fast.stats()
    assert stats["eager_reasons"]["rebound_state"] == 1
    assert "rebound_state: args[1].table is bound to another object than at capture" in stats["guard_failures"]
    assert stats["graph_runs"] == 8 + 1  # the new binding's recording call replays


def test_a_binding_that_changes_every_call_stops_recording():
    """Beam search's cache reorder rebinds every step: after two graphs in a row that replayed too few
    times before their binding changed (one such rebinding records again: issue 49, item 7), the layout
    runs eagerly instead of recording on every call."""
    memo = Memo(torch.ones(4, 2))
    fast = wrap(lambda x, memo: x * memo.table, max_batch_size=4, capture_sizes=[4])
    x = torch.full((4, 2), 2.0)

    def steps(count, start):
        for step in range(start, start + count):  # rows 4 and 1 in turn: no copy into the captured tensor serves it
            memo.table = torch.full((4 if step % 2 else 1, 2), float(step))
            assert torch.equal(fast(x, memo), x * memo.table)

    steps(8, 0)
    runs, rebound = fast.stats()["graph_runs"], fast.stats()["eager_reasons"]["rebound_state"]
    steps(6, 8)
    assert fast.stats()["graph_runs"] == runs <= 2
    assert fast.stats()["eager_reasons"]["rebound_state"] == rebound + 6


def test_a_swapped_parameter_storage_runs_as_eager_and_debug_names_a_swap_no_api_told_of():
    """cudagraph trees test_unstable_ptr: ``.data`` swapped after capture. A CUDA graph replays the
    captured address; the swap is seen (issue 49): calls give eager's result, ``module_moved``. A swap
    past every Python API (torch's C method itself) is seen by debug mode's per-call storage check,
    naming the parameter; recapture() records on the new weights."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    fast = wrap(linear, max_batch_size=2, capture_sizes=[2])
    checked = wrap(linear, max_batch_size=2, capture_sizes=[2], debug=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        calls(fast, x)
        calls(checked, x)
        torch._C.TensorBase.set_(linear.weight, torch.randn(4, 4))
        with pytest.raises(StaleStateError, match="weight"):
            checked(x)
        checked.recapture()
        assert all(torch.equal(checked(x), linear(x)) for _ in range(3))  # each read before the next replay
        linear.weight.data = torch.randn(4, 4)
        assert all(torch.equal(out, linear(x)) for out in (fast(x), fast(x), fast(x)))
    assert "module_moved:" in " | ".join(fast.stats()["guard_failures"])


def test_a_replaced_parameter_is_a_rebinding():
    """``m.weight = nn.Parameter(...)`` goes through torch's registration hooks: the next call sees it."""
    linear = nn.Linear(4, 4)
    fast = wrap(linear, max_batch_size=2, capture_sizes=[2])
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(6):
            fast(x)
        linear.weight = nn.Parameter(torch.randn(4, 4))
        assert torch.equal(fast(x), linear(x))
    assert fast.stats()["eager_reasons"]["rebound_state"] == 1


class Recurrent(nn.Module):
    """Rebinds its own state in the step, as RecurrentGemma's recurrent and conv states do."""

    def __init__(self):
        super().__init__()
        self.state = torch.ones(4, 2)

    def forward(self, x):
        self.state = self.state * 0.5 + x
        return self.state.sum(dim=1)


def test_a_module_rebinding_its_own_state_is_refused_and_left_as_eager_leaves_it():
    """Capture runs the step several times; a rebinding it cannot undo would advance the state each
    time (7.625 on the second call where eager gives 5.0)."""
    model, reference = Recurrent(), Recurrent()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.ones(4, 2)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(fast(x), reference(x))
            assert torch.equal(model.state, reference.state)
    failed = fast.stats()["failed_keys"]
    assert any("RebindError" in reason and "Recurrent.state" in reason for reason in failed.values())


def test_a_module_passed_as_an_argument_has_its_training_flag_watched():
    """A module argument is a constant of the layout; its train()/eval() still changes what the step computes."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    fast = wrap(lambda x, module: module(x), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x, model)
        model.eval()
        assert all(torch.equal(fast(x, model), model(x)) for _ in range(3))
    assert fast.stats()["graph_runs"] >= 1


def test_the_guards_counters_cost_torch_compile_no_recompile():
    """A forward that builds a ModuleList (transformers slices ``self.layers[:n]``) fires torch's
    module registration hooks; the guards' counter must neither count it nor be traced (a global
    torch.compile reads is guarded on: bumping it recompiled every call)."""
    from torch._dynamo.testing import CompileCounter

    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    fast = wrap(layers[0], max_batch_size=2, capture_sizes=[2])  # guards installed, a module watched
    x = torch.randn(2, 4)
    with torch.no_grad():
        calls(fast, x)

        def forward(x):
            for layer in layers[:2]:
                x = layer(x)
            return x

        counter = CompileCounter()
        compiled = torch.compile(forward, backend=counter)
        for _ in range(4):
            assert torch.equal(compiled(x), forward(x))
    assert counter.frame_count == 1


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize("write", [lambda model: object.__setattr__(model, "scale", 2.0),
                                   lambda model: model.__dict__.__setitem__("scale", 2.0)],
                         ids=["object.__setattr__", "__dict__"])
def test_debug_mode_sees_an_attribute_written_past_module_setattr(write, caplog):
    """The state epoch moves with the APIs able to change a module (``Module.__setattr__``); a write past
    them (``object.__setattr__``, the module's ``__dict__``) tells nothing, and the per-call check stays one
    integer compare. Debug mode reads the Python state whole on every call: eager's result, the write named
    in a warning, once."""
    model = Scaled()
    fast = wrap(model, max_batch_size=2, capture_sizes=[2], debug=True)
    x = torch.randn(2, 4)
    with torch.no_grad(), caplog.at_level("WARNING", logger="graphrt.guards.key_guard"):
        calls(fast, x)
        write(model)
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "python_state: Scaled.scale 1.0 -> 2.0" in " | ".join(fast.stats()["guard_failures"])
    assert [record.getMessage() for record in caplog.records].count(
        "python_state: Scaled.scale 1.0 -> 2.0, and no API able to change it ran (a write past "
        "Module.__setattr__: object.__setattr__, the module's __dict__); seen only because debug=True") == 1
