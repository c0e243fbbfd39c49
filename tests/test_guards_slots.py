"""Plain objects with ``__slots__`` the step reads (issue 49, item 4: objects read in place).

A ``@dataclass(slots=True)`` config, a hook object or an object argument declaring ``__slots__`` has no
``__dict__``: its attributes live in the slots its class declares. Changed after capture, it must give
eager's result as an object with a ``__dict__`` does (graphrt.guards.read_objects).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from conftest import ToyPagedModel, calls, captured_runner, decode_batch, eager_step, failures
from torch import nn

from graphrt import wrap


@dataclasses.dataclass(slots=True)
class SlottedConfig:
    softcap: float = 30.0
    scale: float = 1.0


class SlottedCapped(ToyPagedModel):
    """The toy paged model reading a slotted dataclass config at forward time."""

    def __init__(self):
        super().__init__()
        self.config = SlottedConfig()

    def forward(self, input_ids, positions, forward_batch):
        logits = super().forward(input_ids, positions, forward_batch)
        return torch.tanh(logits / self.config.softcap) * self.config.softcap


def test_a_runner_step_after_a_slotted_config_field_changed_runs_eagerly():
    model = SlottedCapped()
    runner = captured_runner(model)
    batch = decode_batch(4)
    model.config.softcap = 0.1
    reference = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1}, stats["guard_failures"]
    assert any("softcap" in detail for detail in stats["guard_failures"])


class SlottedScale:
    """A forward hook object with slots: scales a module's output by its factor."""

    __slots__ = ("factor",)

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, module, args, output):
        return output * self.factor


def test_a_slotted_hook_objects_attribute_changed_after_capture_is_read():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    hook = SlottedScale(1.0)
    model[0].register_forward_hook(hook)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        hook.factor = -2.0
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "factor" in failures(fast)


class Base:
    __slots__ = ("scale",)


class SlottedOptions(Base):
    """Slots declared over two classes: the subclass's and its base's."""

    __slots__ = ("shift",)

    def __init__(self, scale, shift):
        self.scale, self.shift = scale, shift


def test_an_attribute_of_a_slotted_object_argument_is_read_in_every_class_of_its_mro():
    linear = nn.Linear(8, 8)

    def step(x, options):
        return linear(x) * options.scale + options.shift

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    options = SlottedOptions(1.0, 0.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x, options)
        options.scale = 2.5
        assert all(torch.equal(fast(x, options), step(x, options)) for _ in range(3))
        assert "scale" in failures(fast)
        options.shift = -1.0
        assert all(torch.equal(fast(x, options), step(x, options)) for _ in range(3))
    assert "shift" in failures(fast)


SETTINGS = SlottedConfig(scale=1.0)


def scaled(x):
    return x * SETTINGS.scale


def test_a_slotted_global_objects_attribute_changed_after_capture_is_read():
    fast = wrap(scaled, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        SETTINGS.scale = 4.0
        try:
            assert all(torch.equal(fast(x), scaled(x)) for _ in range(3))
        finally:
            SETTINGS.scale = 1.0
    assert "scale" in failures(fast)


class SlottedTables:
    """Rotary tables held in slots: the step reads its tensors through the object."""

    __slots__ = ("cos", "sin")

    def __init__(self):
        self.cos, self.sin = torch.randn(8), torch.randn(8)


TABLES = SlottedTables()


def rotate(x):
    return x * TABLES.cos + x.flip(-1) * TABLES.sin


def test_a_tensor_rebound_in_a_slot_is_read_where_it_is_bound_now():
    """Rebound to a tensor of its shape and dtype, it is staged into the captured one: calls still replay."""
    fast = wrap(rotate, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    cos = TABLES.cos
    with torch.no_grad():
        calls(fast, x)
        replays = fast.stats()["graph_runs"]
        TABLES.cos = torch.randn(8)
        try:
            assert all(torch.equal(fast(x), rotate(x)) for _ in range(3))
        finally:
            TABLES.cos = cos
    assert fast.stats()["graph_runs"] == replays + 3, fast.stats()["eager_reasons"]
