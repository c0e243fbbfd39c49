"""Containers and plain objects the step reads, changed in place (issue 49, items 3 and 4).

A tensor rebound inside a container the step reads (``tables["cos"] = new`` in its closure, an entry of a
global list) is a binding like a module's; a value changed inside a container or a plain object the step
reads (``model.sampling_cfg["temperature"] = 0.5``, ``partial.keywords``, a closure's list, a module-level
dict, a ``model.config`` dataclass field, Gemma 2's ``final_logit_softcapping``, ``set_attn_implementation``,
a hook object's attribute, an object nested in an object argument) is Python state like a module's
attribute. torch.compile guards each source it read; a change after capture must give eager's result.
"""

from __future__ import annotations

import array
import copy
import dataclasses
import functools

import numpy
import pytest
import torch
from conftest import ToyPagedModel, calls, captured_runner, decode_batch, eager_step, failures
from torch import nn

from graphrt import wrap
from graphrt.guards.in_place import MAX_BUFFER_BYTES, compared_buffer


# ---- 3. tensors rebound inside containers --------------------------------------------------------


def test_a_tensor_rebound_in_a_closure_dict_is_read_where_it_is_bound_now():
    torch.manual_seed(0)
    tables = {"cos": torch.randn(8), "sin": torch.randn(8)}

    def rotate(x):
        return x * tables["cos"] + x.flip(-1) * tables["sin"]

    fast = wrap(rotate, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        tables["cos"] = torch.randn(8)
        assert all(torch.equal(fast(x), rotate(x)) for _ in range(3))
    assert "rebound_state:" in failures(fast) and "cos" in failures(fast)


BIASES = [torch.zeros(8)]


def biased(x):
    return x + BIASES[0]


def test_a_tensor_rebound_in_a_global_list_is_read_where_it_is_bound_now():
    fast = wrap(biased, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        BIASES[0] = torch.full((8,), 3.1)
        try:
            assert all(torch.equal(fast(x), biased(x)) for _ in range(3))
        finally:
            BIASES[0] = torch.zeros(8)
    assert "rebound_state:" in failures(fast)


def test_a_tensor_rebound_in_partial_keywords_is_read_where_it_is_bound_now():
    def shifted(x, shift):
        return x + shift

    step = functools.partial(shifted, shift=torch.zeros(8))
    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        step.keywords["shift"] = torch.ones(8)
        assert all(torch.equal(fast(x), step(x)) for _ in range(3))
    assert "rebound_state:" in failures(fast)


# ---- 4. containers and plain objects changed in place ------------------------------------------


class Sampled(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)
        self.sampling_cfg = {"temperature": 1.0}

    def forward(self, x):
        return self.head(x) / self.sampling_cfg["temperature"]


def test_a_dict_attribute_changed_in_place_is_read():
    model = Sampled()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model.sampling_cfg["temperature"] = 0.5
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        model.sampling_cfg["temperature"] = 1.0  # back: the first graphs replay
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), model(x)) and fast.stats()["graph_runs"] == runs + 1
    assert "temperature" in failures(fast)


class PartialActivation(nn.Module):
    """Holds its activation as a ``functools.partial`` attribute (``partial(F.leaky_relu, negative_slope=...)``)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.activation = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return self.activation(self.linear(x))


def partial_wrapped():
    linear = nn.Linear(8, 8)

    def scaled(x, scale):
        return linear(x) * scale

    step = functools.partial(scaled, scale=2.0)
    return step, step, "scale", 3.0


def partial_attribute():
    model = PartialActivation()
    return model, model.activation, "negative_slope", 0.5


@pytest.mark.parametrize("case", [partial_wrapped, partial_attribute], ids=["the wrapped partial", "a module's partial"])
def test_partial_keywords_changed_in_place_are_read(case):
    """The wrapped callable a partial, or a partial a module holds and calls (an activation): its keywords are
    what the call passes. Before, a module's partial was not read: the old keyword replayed, silently."""
    step, partial, keyword, value = case()
    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        partial.keywords[keyword] = value
        assert all(torch.equal(fast(x), step(x)) for _ in range(3))
    assert "python_state:" in failures(fast) and f"keywords['{keyword}']" in failures(fast)


def test_a_closure_list_changed_in_place_is_read():
    linear = nn.Linear(8, 8)
    scales = [1.0]

    def step(x):
        return linear(x) * scales[0]

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        scales[0] = 2.0
        assert all(torch.equal(fast(x), step(x)) for _ in range(3))
    assert "python_state:" in failures(fast)


BUFFERS = {"numpy": lambda: numpy.array([1.0, 0.5]), "array": lambda: array.array("d", [1.0, 0.5]),
           "bytearray": lambda: bytearray([1, 5])}
TABLE = numpy.array([1.0, 0.5])


def scaled_by_table(x):
    return x * float(TABLE[0])


class BufferScaled(nn.Module):
    """Scales by the first item of a buffer of numbers it holds (a table of constants)."""

    def __init__(self, scales):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scales = scales

    def forward(self, x):
        return self.linear(x) * float(self.scales[0])


def buffer_in_a_closure(scales):
    def step(x):
        return x * float(scales[0])

    return step


@pytest.mark.parametrize("holder,kind", [pytest.param(holder, kind, id=f"{holder}-{kind}") for holder, kind in
                                         [*((holder, kind) for holder in ("attribute", "closure") for kind in BUFFERS),
                                          ("global", "numpy")]])
def test_an_item_of_a_buffer_of_numbers_changed_in_place_is_read(holder, kind):
    """A numpy array, an ``array.array`` or a ``bytearray`` the step reads items of: its numbers live in
    memory, not in Python objects, and ``scales[0] = 2`` writes them in place. Eager reads the new item; a
    graph replays the one of the capture unless the buffer's bytes are compared. An equal item written
    again is no change."""
    scales = TABLE if holder == "global" else BUFFERS[kind]()
    step = {"attribute": lambda: BufferScaled(scales), "closure": lambda: buffer_in_a_closure(scales),
            "global": lambda: scaled_by_table}[holder]()
    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        runs = fast.stats()["graph_runs"]
        scales[1] = scales[1]
        assert torch.equal(fast(x), step(x)) and fast.stats()["graph_runs"] == runs + 1
        scales[0] = 2
        try:
            assert all(torch.equal(fast(x), step(x)) for _ in range(3))
        finally:
            scales[0] = 1
    assert "python_state:" in failures(fast) and "[0] 1" in failures(fast)


def test_buffers_up_to_64_kib_are_compared_per_call_and_larger_tables_are_not():
    """Comparing a buffer costs a pass over its bytes per call: up to ``MAX_BUFFER_BYTES`` (a few microseconds);
    a larger one (a table of constants) would cost more than the step, and is not read (docs/MANUAL.md)."""
    assert MAX_BUFFER_BYTES == 64 * 1024
    assert compared_buffer(numpy.zeros(8192)) and not compared_buffer(numpy.zeros(8193))
    assert compared_buffer(array.array("d", bytes(MAX_BUFFER_BYTES)))
    assert not compared_buffer(bytearray(MAX_BUFFER_BYTES + 1))
    assert not compared_buffer([1.0]) and not compared_buffer(torch.zeros(4))


def eager_after_write(model, write):
    """``model`` wrapped and recorded, then ``write(model)``: the next calls must give eager's result. Returns
    the guard failures, which name what changed."""
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        write(model)
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    return failures(fast)


class NestedSettings(nn.Module):
    """Reads numbers nested in containers it holds: a dict in a dict (``rope_scaling``-like), a list in a list
    (per-layer settings), a list in a tuple."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.config = {"rope": {"factor": 1.0}}
        self.rows = [[1.0]]
        self.pair = ([1.0],)

    def forward(self, x):
        return self.linear(x) * self.config["rope"]["factor"] * self.rows[0][0] * self.pair[0][0]


@pytest.mark.parametrize("write,named", [
    (lambda model: model.config["rope"].__setitem__("factor", 4.0), "NestedSettings.config['rope']"),
    (lambda model: model.rows[0].__setitem__(0, 2.0), "NestedSettings.rows[0]"),
    (lambda model: model.pair[0].__setitem__(0, 2.0), "NestedSettings.pair[0]"),
], ids=["dict in a dict", "list in a list", "list in a tuple"])
def test_a_container_nested_in_one_the_step_reads_changed_in_place_is_read(write, named):
    """Before, a read container was compared with a shallow copy, which shares the containers inside it (and a
    tuple was no container): a write inside them replayed the old value, silently."""
    assert f"python_state: {named}" in eager_after_write(NestedSettings(), write)


class IndexedOptions:
    """A settings object whose own methods index its containers: the step reads ``self.options.scale``."""

    def __init__(self):
        self.values = [1.0]
        self.named = {"shift": 0.0}

    @property
    def scale(self):
        return self.values[0]

    def shift(self):
        return self.named["shift"]


class OptionsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.options = IndexedOptions()

    def forward(self, x):
        return self.linear(x) * self.options.scale + self.options.shift()


@pytest.mark.parametrize("write,named", [
    (lambda model: model.options.values.__setitem__(0, 2.0), "OptionsModel.options.values["),
    (lambda model: model.options.named.__setitem__("shift", 0.5), "OptionsModel.options.named["),
], ids=["a list a property indexes", "a dict a method indexes"])
def test_a_container_an_objects_own_methods_index_is_read(write, named):
    """The step reads ``self.options.scale``, whose getter returns ``self.values[0]``: the container is the
    object's, indexed by its own code on a line that ran. Changed in place after capture, eager's result."""
    assert named in eager_after_write(OptionsModel(), write)


class ComprehensionModel(nn.Module):
    """Reads a dict attribute, a class attribute and a plain object's container inside code nested in
    ``forward`` (a comprehension, a lambda): code objects of their own, which close over ``self``."""

    softcap = 1.0

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scales = {"a": 1.0}
        self.options = IndexedOptions()

    def forward(self, x):
        scaled = sum([self.linear(x) * self.scales[key] for key in ("a",)])
        capped = (lambda: scaled * self.softcap)()
        return capped * max(self.options.values[index] for index in range(1))


def softcap_halved(model):
    ComprehensionModel.softcap = 0.5


@pytest.mark.parametrize("write,named", [
    (lambda model: model.scales.__setitem__("a", 2.0), "ComprehensionModel.scales['a']"),
    (softcap_halved, "ComprehensionModel.softcap 1.0 -> 0.5"),
    (lambda model: model.options.values.__setitem__(0, 3.0), "ComprehensionModel.options.values[0]"),
], ids=["dict", "class", "object"])
def test_what_a_comprehension_or_lambda_in_forward_reads_through_self_is_read(write, named):
    """Before, the loads through ``self`` in nested code were not seen: changing any of these replayed the
    old value, silently."""
    try:
        assert named in eager_after_write(ComprehensionModel(), write)
    finally:
        ComprehensionModel.softcap = 1.0


class Scales:
    def __init__(self):
        self.scale_a = 1.0
        self.table_a = [1.0]


class ComputedNameModel(nn.Module):
    """Reads attributes of a plain object by a name computed at run time (``getattr(self.scales, "scale_" +
    self.kind)``): the bytecode names no attribute of it, so no attribute could be singled out."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scales = Scales()
        self.kind = "a"
        self.offsets_a = [0.0]

    def forward(self, x):
        scales = getattr(self.scales, "scale_" + self.kind) * getattr(self.scales, f"table_{self.kind}")[0]
        return self.linear(x) * scales + getattr(self, "offsets_" + self.kind)[0]


@pytest.mark.parametrize("write,named", [
    (lambda model: setattr(model.scales, "scale_a", 2.0), "ComputedNameModel.scales.scale_a 1.0 -> 2.0"),
    (lambda model: model.scales.table_a.__setitem__(0, 3.0), "ComputedNameModel.scales.table_a[0]"),
    (lambda model: model.offsets_a.__setitem__(0, 1.0), "ComputedNameModel.offsets_a[0]"),
], ids=["an object's attribute", "an object's container", "a module's container"])
def test_what_a_step_reads_by_a_computed_name_is_read(write, named):
    """Before, an attribute read by ``getattr`` with a computed name was not seen: changing it replayed the old
    value, silently. Now every attribute of an object such code reads counts, and the containers it holds."""
    assert named in eager_after_write(ComputedNameModel(), write)


class CountingScales(Scales):
    def __init__(self):
        super().__init__()
        self.calls = 0


class ComputedNameCounter(ComputedNameModel):
    """Reads by a computed name and counts its calls in the object it reads: the count is the step's own
    state (frozen in replays), not a change between calls."""

    def __init__(self):
        super().__init__()
        self.scales = CountingScales()

    def forward(self, x):
        self.scales.calls += 1
        return super().forward(x)


def test_what_a_step_reads_by_a_computed_name_leaves_out_what_it_writes_itself():
    """Every attribute of a read object counts, less those the step itself writes: an eager call of the model
    between two calls advances its counter, and the next call still replays."""
    model = ComputedNameCounter()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model(x)
        replays = fast.stats()["graph_runs"]
        fast(x)
    assert fast.stats()["graph_runs"] == replays + 1 and not failures(fast)


CONFIG = {"scale": 1.0}


def configured(x):
    return x * CONFIG["scale"]


def test_a_module_level_dict_changed_in_place_is_read():
    fast = wrap(configured, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        CONFIG["scale"] = 3.0
        try:
            assert all(torch.equal(fast(x), configured(x)) for _ in range(3))
        finally:
            CONFIG["scale"] = 1.0
    assert "python_state:" in failures(fast) and "scale" in failures(fast)


@dataclasses.dataclass
class HeadConfig:
    softcap: float = 30.0


@dataclasses.dataclass(slots=True)
class SlottedHeadConfig:
    """Its field lives in a slot: no ``__dict__`` to read it from."""

    softcap: float = 30.0


class Capped(ToyPagedModel):
    """The toy paged model reading a dataclass config at forward time."""

    def __init__(self, config=HeadConfig):
        super().__init__()
        self.config = config()

    def forward(self, input_ids, positions, forward_batch):
        logits = super().forward(input_ids, positions, forward_batch)
        return torch.tanh(logits / self.config.softcap) * self.config.softcap


@pytest.mark.parametrize("config", [HeadConfig, SlottedHeadConfig], ids=["dict", "slots"])
def test_a_runner_step_after_a_config_dataclass_field_changed_runs_eagerly(config):
    model = Capped(config)
    runner = captured_runner(model)
    batch = decode_batch(4)
    model.config.softcap = 0.1
    reference = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1}, stats["guard_failures"]
    assert any("softcap" in detail for detail in stats["guard_failures"])


class ScaleBy:
    """A forward hook object: scales a module's output by its factor (declares no attribute of its own)."""

    __slots__ = ()

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, module, args, output):
        return output * self.factor


class Scale(ScaleBy):
    """Its factor in its ``__dict__``."""


class SlottedScale(ScaleBy):
    """Its factor in a slot, and no ``__dict__``."""

    __slots__ = ("factor",)


@pytest.mark.parametrize("hook_class", [Scale, SlottedScale], ids=["dict", "slots"])
def test_a_hook_objects_attribute_changed_after_capture_is_read(hook_class):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    hook = hook_class(1.0)
    model[0].register_forward_hook(hook)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        hook.factor = -2.0
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "factor" in failures(fast)


class Inner:
    def __init__(self, scale):
        self.scale = scale


class Options:
    def __init__(self, scale):
        self.inner = Inner(scale)


def test_an_attribute_of_an_object_nested_in_an_object_argument_is_read():
    linear = nn.Linear(8, 8)

    def step(x, options):
        return linear(x) * options.inner.scale

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    options = Options(1.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x, options)
        options.inner.scale = 2.5
        assert all(torch.equal(fast(x, options), step(x, options)) for _ in range(3))
    assert "scale" in failures(fast)


def hf_case(family):
    pytest.importorskip("transformers")
    from hf_helpers import family_inputs, tiny_model

    return tiny_model(family), tiny_model(family), family_inputs(family, batch=2)


def test_graph_generate_follows_gemma2_final_logit_softcapping_changed_in_its_config():
    import graphrt.hf

    model, reference, inputs = hf_case("gemma2")
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            model.generate(**inputs, **options)
        for each in (model, reference):
            each.config.final_logit_softcapping = 0.05
        expected = reference.generate(**inputs, **options)
        assert torch.equal(model.generate(**inputs, **options), expected)
    assert "final_logit_softcapping" in failures(fast)


def test_graph_generate_follows_set_attn_implementation():
    """``set_attn_implementation`` only writes the config: every graph recorded under the old implementation
    must refuse the calls after it (here they also come with another mask, so they get layouts of their own)."""
    import graphrt.hf

    model, reference, inputs = hf_case("llama")
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            model.generate(**inputs, **options)
        guards = [entry.guard for layout in fast.layouts.layouts.values()
                  for entry in layout.graphs.registry.entries.values() if entry.guard is not None]
        for each in (model, reference):
            each.set_attn_implementation("eager")
        expected = reference.generate(**inputs, **options)
        assert torch.equal(model.generate(**inputs, **options), expected)
    assert guards and all("_attn_implementation" in guard.state_failure().detail for guard in guards)


class Tables:
    """RoPE tables and a scale held by a plain object the wrapped function closes over."""

    def __init__(self):
        self.cos, self.sin, self.scale = torch.randn(8), torch.randn(8), 1.0


def test_an_object_in_the_wrapped_functions_closure_is_read_like_a_global_one():
    """Its tensor rebound (same shape and dtype: staged into the captured one, still replaying) and its
    scale changed (eager's result, named) after capture: before, a closure cell's object was the wrapped
    callable's own bookkeeping, never read, and replays gave the old tables' result."""
    torch.manual_seed(0)
    tables = Tables()

    def rotate(x):
        return (x * tables.cos + x.flip(-1) * tables.sin) * tables.scale

    fast = wrap(rotate, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        replays = fast.stats()["graph_runs"]
        tables.cos = torch.randn(8)
        assert all(torch.equal(fast(x), rotate(x)) for _ in range(3))
        assert fast.stats()["graph_runs"] == replays + 3
        tables.scale = -2.0
        assert all(torch.equal(fast(x), rotate(x)) for _ in range(3))
    assert "scale" in failures(fast)
