"""Plain objects with ``__slots__`` the step reads (issue 49, item 4: objects read in place).

A ``@dataclass(slots=True)`` config or an object argument declaring ``__slots__`` has no ``__dict__``: its
attributes live in the slots its classes declare. Changed after capture, it must give eager's result as an
object with a ``__dict__`` does (graphrt.guards.read_objects). A slotted config under ``GraphRunner`` and a
slotted hook object are the ``slots`` cases of tests/test_guards_in_place.py.
"""

from __future__ import annotations

import dataclasses

import torch
from conftest import calls, failures
from torch import nn

from graphrt import wrap


@dataclasses.dataclass(slots=True)
class Knobs:
    scale: float = 1.0


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


SETTINGS = Knobs(scale=1.0)


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
