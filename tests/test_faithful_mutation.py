"""Mutated inputs and grad mode in wrap(): every call leaves the caller's tensors as eager would.

Mutated inputs. A function that writes one of its arguments in place must leave the caller's
tensor as the eager call leaves it, on every call (warm-up, recording, replay). graphrt may write
the written rows back into the caller's tensor after the replay, or run such calls eagerly with a
counted reason (``EagerReason`` value ``mutated_input``, torch.compile's "skipping cudagraphs due
to mutation on input"); either passes these tests, a replay that silently leaves the caller's
tensor unchanged does not. Ports of PyTorch's ``test/inductor/test_cudagraph_trees.py``
``test_mutation_on_inp`` and ``test_mutation_cudagraph_managed_tensors``.

Grad mode. A call whose eager outputs would carry autograd history (parameters that require
grad, not only inputs) runs eagerly with autograd, warm-ups included, so a training loop through
wrap() trains as eager does. Port of PyTorch's ``test/test_cuda.py::
test_graph_make_graphed_callables``: three model sections, ``relu`` and ``mse_loss`` each wrapped,
ten SGD steps with dropout, the parameters equal to a control model's.

All on the emulated backend, compared bitwise with eager (the same ops on the same inputs).
"""

from __future__ import annotations

import copy
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from faithful_helpers import assert_identical

from graphrt import wrap

MUTATED_INPUT = "mutated_input"  # the EagerReason a call that writes its input may run eagerly with


def writes_first_argument(x):
    """Writes its (batched) argument in place, as ``x.add_(2)`` in the PyTorch test."""
    x.add_(2)
    return x * 3


def writes_a_nested_state(x, state):
    """A streaming cell whose state (in a dict, batched like ``x``) is updated in place."""
    state["h"].mul_(0.5).add_(x)
    return state["h"].tanh()


def counts_its_calls(x, calls):
    """Bumps a one-element counter passed in (a whole, unbatched argument) and scales by it."""
    calls.add_(1)
    return x * calls


CASES: Dict[str, Callable] = {
    "batched argument": writes_first_argument,
    "nested state": writes_a_nested_state,
    "unbatched counter": counts_its_calls,
}


def arguments(case: str, rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=generator)
    if case == "nested state":
        return x, {"h": torch.randn(rows, 5, generator=generator)}
    if case == "unbatched counter":
        return x, torch.zeros(1)
    return (x,)


def mutated_tensors(args):
    """The tensors a case writes: its arguments' tensor leaves, in order."""
    leaves = []
    for arg in args:
        leaves.extend(arg.values() if isinstance(arg, dict) else [arg])
    return leaves


def assert_mutations_handled(stats) -> None:
    """Graphs replayed with write-back, or the calls ran eagerly with the counted reason."""
    reasons = stats["eager_reasons"]
    assert set(reasons) <= {"warmup", "axis_probe", MUTATED_INPUT}, reasons
    assert stats["graph_runs"] > 0 or reasons.get(MUTATED_INPUT, 0) > 0, stats


@pytest.mark.parametrize("rows", [4, 3], ids=["capture size", "padded 3 to 4"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_argument_written_in_place_is_left_as_eager_leaves_it(case, rows):
    """Four calls (warm-up, recording, two replays), each on fresh arguments and on a copy run
    eagerly: outputs equal, and every written argument equals its eagerly written copy (for a padded
    call, only the caller's rows exist to be written)."""
    fn = CASES[case]
    fast = wrap(fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    with torch.no_grad():
        if rows != 4:  # another size first, so the padded call's output axes are known
            fast(*arguments(case, 8, seed=99))
        for call in range(4):
            args = arguments(case, rows, seed=call)
            control = copy.deepcopy(args)
            out = fast(*args)
            assert_identical(out, fn(*control))
            for index, (written, expected) in enumerate(zip(mutated_tensors(args), mutated_tensors(control))):
                assert torch.equal(written, expected), f"call {call}: argument leaf {index} is not as eager left it"
    assert_mutations_handled(fast.stats())


def test_the_same_caller_tensor_written_on_every_call_accumulates_as_eager():
    """One tensor passed on every call (a running state): after each call it holds what that many
    eager calls leave, so a replay that skipped the write shows at once."""
    fast = wrap(writes_first_argument, max_batch_size=4, capture_sizes=[4], backend="emulated")
    state, control = torch.zeros(4, 5), torch.zeros(4, 5)
    with torch.no_grad():
        for call in range(4):
            assert_identical(fast(state), writes_first_argument(control))
            assert torch.equal(state, control), f"call {call}: {state[0, 0].item()} != {control[0, 0].item()}"
    assert_mutations_handled(fast.stats())


def test_mutating_the_output_of_another_graphed_call_is_seen_by_the_caller():
    """Port of test_mutation_cudagraph_managed_tensors: ``mut(foo(inp))`` where ``mut`` writes its
    argument, the output of another graphed function; the caller's tensor (``tmp``) must hold the
    written values, as with ``x.add(2)`` run eagerly."""

    def foo(x):
        return x + 1

    def mut(x):
        x.add_(2)
        return x

    fast_foo = wrap(foo, max_batch_size=4, capture_sizes=[4], backend="emulated")
    fast_mut = wrap(mut, max_batch_size=4, capture_sizes=[4], backend="emulated")
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(4):
            inp = torch.rand(4, 3, generator=generator)
            tmp = fast_foo(inp)
            mut_out = fast_mut(tmp)
            expected = foo(inp).add(2)
            assert_identical(mut_out, expected)
            assert_identical(tmp, expected)
    assert_mutations_handled(fast_mut.stats())


# ---------------------------------------------------------------- grad mode


N, D_IN, HIDDEN, D_OUT = 16, 32, 24, 8


class FirstSection(torch.nn.Module):
    """Linear + dropout reading ``x`` from a dict (an unused input rides along, as in the PyTorch test)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Dropout(p=0.1))

    def forward(self, inputs: dict):
        return self.net(inputs["x"])


class SecondSection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Dropout(p=0.2),
                                       torch.nn.Linear(HIDDEN, D_OUT), torch.nn.Dropout(p=0.1))

    def forward(self, x):
        return self.net(x)


class ParameterlessSection(torch.nn.Module):
    """Gathers rows by an index built from the input's shape and returns a dict."""

    def forward(self, x):
        index = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, index)}


def sections() -> torch.nn.Sequential:
    return torch.nn.Sequential(FirstSection(), SecondSection(), ParameterlessSection())


def train(parameters, forward, relu, loss_fn, inputs, targets, unused) -> None:
    """Ten SGD steps from ``manual_seed(5)``: dropout draws the same masks for both models."""
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    torch.manual_seed(5)
    for data, target in zip(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        prediction = relu(forward({"x": data, "unused_input": unused})["output"])
        loss_fn(prediction, target).backward()
        optimizer.step()


@pytest.mark.parametrize("unused_requires_grad", [False, True], ids=["only parameters require grad",
                                                                     "an input requires grad"])
def test_training_loop_through_graphed_callables_matches_the_control_model(unused_requires_grad):
    """Port of test_graph_make_graphed_callables: two modules with dropout, a parameterless module,
    ``relu`` and ``mse_loss`` each wrapped, ten SGD steps in training mode with grad mode on; the
    parameters end bitwise equal to an unwrapped control's. Then, in eval mode under no_grad, the
    wrapped sections (now free to capture) return the control's outputs.

    The first section's dict carries an unused input; when it does not require grad, only the
    section's parameters give its outputs autograd history (the case that must not replay)."""
    torch.manual_seed(5)
    model, control = sections(), sections()
    model.load_state_dict(control.state_dict())
    options = dict(max_batch_size=N, capture_sizes=[N], backend="emulated")
    first, second, third = (wrap(section, **options) for section in model)
    relu, loss_fn = wrap(F.relu, **options), wrap(F.mse_loss, **options)

    def graphed(inputs):
        return third(second(first(inputs)))

    generator = torch.Generator().manual_seed(6)
    inputs = [torch.rand(N, D_IN, generator=generator) for _ in range(10)]
    targets = [torch.rand(N, D_OUT, generator=generator) for _ in range(10)]
    unused = torch.randn(N, HIDDEN, generator=generator).requires_grad_(unused_requires_grad)

    train(model.parameters(), graphed, relu, loss_fn, inputs, targets, unused)
    train(control.parameters(), control, F.relu, F.mse_loss, inputs, targets, unused)
    for (name, trained), expected in zip(model.named_parameters(), control.parameters()):
        assert torch.equal(trained, expected), f"{name} differs from the control model's"

    model.train(False)
    control.train(False)
    with torch.no_grad():
        for data in inputs[:3]:
            assert_identical(graphed({"x": data, "unused_input": unused}), control({"x": data, "unused_input": unused}))


def test_grad_mode_outputs_carry_history_when_parameters_require_grad():
    """Plain inputs, parameters that require grad, grad mode on: every call (the first included)
    returns an output with autograd history whose gradients equal eager's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    control = copy.deepcopy(linear)
    fast = wrap(linear, max_batch_size=4, capture_sizes=[4], backend="emulated")
    generator = torch.Generator().manual_seed(1)
    for call in range(3):
        x = torch.randn(4, 8, generator=generator)
        out = fast(x)
        assert out.requires_grad, f"call {call}: the output has no autograd history"
        out.square().sum().backward()
        control(x).square().sum().backward()
        assert torch.equal(linear.weight.grad, control.weight.grad), f"call {call}: gradients differ"


def test_grad_mode_with_frozen_parameters_still_replays():
    """With grad mode on but nothing that requires grad, eager outputs carry no history: the calls
    replay as before (the rule is about autograd history, not about grad mode alone)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4).requires_grad_(False)
    fast = wrap(linear, max_batch_size=4, capture_sizes=[4], backend="emulated")
    x = torch.randn(4, 8)
    for _ in range(3):
        assert_identical(fast(x), linear(x))
    assert fast.stats()["graph_runs"] == 2 and fast.stats()["eager_reasons"] == {"warmup": 1}
