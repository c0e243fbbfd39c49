"""Guards found from what the step ran (issue 38): modules however reached, their structure, hooks,
the Python values the step reads, storage moves by module APIs, autograd and inputs.

Each test is a reproduction from issue 38, named after where its semantics come from (dynamo's
``test_modules.py``/``test_hooks.py``/``test_recompiles.py``, cudagraph trees' ``test_unstable_ptr``,
LayerDrop): a call after the state changed must give eager's result, with the change counted in
``stats()["guard_failures"]``; ``wrap()`` gets graphs of its own for the new state and
``GraphRunner`` runs eagerly with the reason. Every result is compared with eager on the same inputs.
"""

from __future__ import annotations

import copy
import functools
import random
import sys
import threading

import pytest
import torch
from conftest import ToyPagedModel, calls, captured_runner, decode_batch, eager_step, failures
from torch import nn

from graphrt import GraphRunner, wrap


class Tempered(nn.Module):
    """A linear layer, dropout (train mode only), and a temperature keyword."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x, temperature=1.0):
        return self.dropout(self.linear(x)) / temperature


# ---- 1. modules graphrt never found ------------------------------------------------------------


def test_partial_over_a_module_sees_eval():
    """dynamo test_modules (functools.partial of a module): the module runs however it is reached."""
    torch.manual_seed(0)
    model = Tempered()
    fast = wrap(functools.partial(model, temperature=0.5), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        model.eval()
        assert all(torch.equal(fast(x), model(x, temperature=0.5)) for _ in range(3))
    assert "training:" in failures(fast) and fast.stats()["graph_runs"] >= 3


class Engine:
    """An engine class that wraps a lambda over itself, as serving code does."""

    def __init__(self, model):
        self.model = model
        self.fast = wrap(lambda x: self.model(x), max_batch_size=4, capture_sizes=[4])

    def forward_step(self, x):
        return self.model(x)


def test_a_lambda_over_an_engine_sees_the_model_switched_to_eval():
    model = Tempered()
    engine = Engine(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(engine.fast, x)
        engine.model.eval()
        assert all(torch.equal(engine.fast(x), model(x)) for _ in range(3))
    assert "training:" in failures(engine.fast)


def test_an_engine_method_sees_a_sequential_item_replaced():
    """dynamo test_modules (a Sequential's child replaced after compile): the new head is served."""
    torch.manual_seed(0)
    engine = Engine(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)))
    fast = wrap(engine.forward_step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x, times=6)
        engine.model[2] = nn.Linear(8, 4)
        assert all(torch.equal(fast(x), engine.model(x)) for _ in range(4))
    assert "rebound_state:" in failures(fast) and fast.stats()["graph_runs"] >= 4


MODEL = nn.Linear(8, 8)


def step_through_global(x):
    return MODEL(x)


def test_a_global_model_loaded_again_is_served():
    """A notebook cell run again rebinds the module-level model the wrapped function reads."""
    global MODEL
    fast = wrap(step_through_global, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        MODEL = nn.Linear(8, 8)
        assert all(torch.equal(fast(x), MODEL(x)) for _ in range(4))
    assert "global MODEL" in failures(fast)


class PagedEngine:
    """A runner's model callable that is an engine object holding the model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch)


def test_a_runner_engine_given_another_model_runs_it():
    engine = PagedEngine(ToyPagedModel())
    runner = captured_runner(engine)
    torch.manual_seed(1)
    engine.model = ToyPagedModel()
    reference = copy.deepcopy(engine.model)
    batch = decode_batch(4)
    assert torch.equal(runner(batch), eager_step(reference, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"rebound_state": 1}, stats["guard_failures"]
    assert any("PagedEngine.model" in detail for detail in stats["guard_failures"])


def test_a_capture_under_cprofile_still_sees_the_modules_and_leaves_the_profiler_on():
    """A C profiler cannot be chained: the modules are seen through a forward pre-hook instead."""
    import cProfile

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        with torch.no_grad():
            calls(fast, x)
            model.eval()
            assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        assert sys.getprofile() is profiler
    finally:
        profiler.disable()
    assert "training:" in failures(fast)


# ---- 2. module structure --------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("change", ["append", "insert", "pop", "setitem"])
def test_a_module_list_changed_after_capture_runs_its_layers(change):
    """dynamo test_modules (ModuleList mutation between calls): the forward loops over the list as it is now."""
    torch.manual_seed(0)
    model = Stack()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        layer = nn.Linear(8, 8)
        {"append": lambda: model.layers.append(layer), "insert": lambda: model.layers.insert(0, layer),
         "pop": lambda: model.layers.pop(1), "setitem": lambda: model.layers.__setitem__(0, layer)}[change]()
        assert all(torch.equal(fast(x), model(x)) for _ in range(4))
    assert "rebound_state:" in failures(fast)


# ---- 3. hooks -----------------------------------------------------------------------------------


def test_a_forward_hook_registered_after_capture_runs_and_removed_stops():
    """dynamo test_hooks (a hook added after compile): torch.compile skips hook guards by default
    (``skip_nnmodule_hook_guards``); graphrt guards them, so the hook always applies as in eager."""
    torch.manual_seed(0)
    model = Stack()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        plain = calls(fast, x).clone()
        handle = model.layers[0].register_forward_hook(lambda module, args, output: output * 3)
        hooked = model(x)
        assert all(torch.equal(fast(x), hooked) for _ in range(3))
        handle.remove()
        assert torch.equal(fast(x), plain)
        pre = model.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        pre.remove()
    assert "hooks:" in failures(fast)
    assert fast.stats()["graph_runs"] >= 6  # graphs per hook state: back to the first replays again


def test_a_global_forward_hook_applies():
    """torch.nn.modules.module.register_module_forward_hook: a hook on every module."""
    model = Stack()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: output + 1 if isinstance(module, nn.Linear) else output)
        try:
            assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        finally:
            handle.remove()
        assert torch.equal(fast(x), model(x))
    assert "hooks:" in failures(fast)


# ---- 4. Python values the step reads --------------------------------------------------------------


class Scaled(nn.Module):
    """Reads a float, a bool that picks a branch and an int that sets how many layers run."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.scale, self.residual, self.depth = 1.0, False, 3

    def forward(self, x):
        for layer in self.layers[: self.depth]:
            x = layer(x) + x if self.residual else layer(x)
        return x * self.scale


@pytest.mark.parametrize("attribute, value", [("scale", 4.0), ("residual", True), ("depth", 1)])
def test_a_python_attribute_changed_after_capture_is_read(attribute, value):
    """dynamo test_recompiles (a module attribute guarded by value, recompiled when it changes)."""
    torch.manual_seed(0)
    model = Scaled()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        first = calls(fast, x).clone()
        setattr(model, attribute, value)
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        setattr(model, attribute, vars(Scaled())[attribute])  # back: the first graphs replay again
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), first) and fast.stats()["graph_runs"] == runs + 1
    assert f"python_state: Scaled.{attribute}" in failures(fast)


def test_a_runner_names_the_python_value_that_changed():
    class ScaledPaged(ToyPagedModel):
        scale = 1.0

        def forward(self, input_ids, positions, forward_batch):
            return super().forward(input_ids, positions, forward_batch) * self.scale

    model = ScaledPaged()
    model.scale = 1.0
    runner = captured_runner(model)
    model.scale = 4.0
    reference = copy.deepcopy(model)
    batch = decode_batch(4)
    assert torch.equal(runner(batch), eager_step(reference, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1}
    assert "python_state: ScaledPaged.scale 1.0 -> 4.0" in stats["guard_failures"]


def test_a_closure_variable_changed_with_nonlocal_is_read():
    linear = nn.Linear(8, 8)
    scale = 1.0

    def step(x):
        return linear(x) * scale

    def set_scale(value):
        nonlocal scale
        scale = value

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        set_scale(3.0)
        assert all(torch.equal(fast(x), step(x)) for _ in range(3))
    assert "python_state: scale (closure of" in failures(fast)


class Settings:
    def __init__(self, scale):
        self.scale = scale


def test_a_float_attribute_of_an_object_argument_is_read():
    linear = nn.Linear(8, 8)
    fast = wrap(lambda x, settings: linear(x) * settings.scale, max_batch_size=4, capture_sizes=[4])
    settings = Settings(1.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x, settings)
        settings.scale = 2.5
        assert all(torch.equal(fast(x, settings), linear(x) * 2.5) for _ in range(3))
    assert "python_state: args[1].scale 1.0 -> 2.5" in failures(fast)


SCALE = 1.0


def scaled_by_global(x, linear):
    return linear(x) * SCALE


def test_a_module_level_float_is_read():
    global SCALE
    linear = nn.Linear(8, 8)
    fast = wrap(functools.partial(scaled_by_global, linear=linear), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        SCALE = 2.0
        try:
            assert all(torch.equal(fast(x), linear(x) * 2.0) for _ in range(3))
        finally:
            SCALE = 1.0
    assert "python_state: global SCALE 1.0 -> 2.0" in failures(fast)


# ---- 5. a step that changes Python state ----------------------------------------------------------


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # used as an offset: a replay would add the captured count forever
        return self.linear(x) + self.calls


def test_a_step_that_counts_its_calls_is_refused_naming_the_attribute_and_line():
    model, reference = Counting(), Counting()
    reference.load_state_dict(model.state_dict())
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(fast(x), reference(x))
    assert model.calls == reference.calls == 4  # the capture's runs were undone
    reason = next(iter(fast.stats()["failed_keys"].values()))
    assert "RebindError" in reason and "Counting.calls" in reason and "test_guards_observed.py" in reason, reason


def test_a_runner_capture_of_a_counting_step_is_refused_and_restored():
    class CountingPaged(ToyPagedModel):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, input_ids, positions, forward_batch):
            self.calls += 1
            return super().forward(input_ids, positions, forward_batch)

    model = CountingPaged()
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[4], backend="emulated", progress=False)
    report = runner.capture()
    assert model.calls == 0
    assert all("CountingPaged.calls: the step assigns it (0 -> 1, at " in reason for reason in report.failed.values())


STEPS_SEEN = 0
CONTEXT = None


def counting_step(x, linear):
    global STEPS_SEEN
    STEPS_SEEN += 1  # read, then assigned: a replay would go on with the captured count
    return linear(x) + STEPS_SEEN


def test_a_step_that_counts_in_a_global_is_refused_and_the_global_put_back():
    global STEPS_SEEN
    linear = nn.Linear(8, 8)
    fast = wrap(functools.partial(counting_step, linear=linear), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    STEPS_SEEN = 0
    with torch.no_grad():
        results = [fast(x) for _ in range(4)]
    assert STEPS_SEEN == 4  # one per call: the capture's runs were put back
    assert all(torch.equal(result, linear(x) + count) for count, result in zip(range(1, 5), results))
    reason = next(iter(fast.stats()["failed_keys"].values()))
    assert "RebindError" in reason and "global STEPS_SEEN" in reason, reason


def set_context(scale):
    global CONTEXT
    CONTEXT = {"scale": scale}  # a new object every step, as nano-vllm's set_context


def step_with_a_context_it_sets(x, scale, linear):
    set_context(scale)
    return linear(x) * CONTEXT["scale"]


def test_a_global_context_the_step_sets_before_reading_it_is_not_guarded():
    """The step binds ``CONTEXT`` before any read: its value before a call is no input, so a new
    object there on every call (each eager run sets one) must not keep the key from replaying."""
    linear = nn.Linear(8, 8)
    scale = torch.full((4, 1), 3.0)
    fast = wrap(functools.partial(step_with_a_context_it_sets, linear=linear), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(fast(x, scale), linear(x) * 3.0)
    assert fast.stats()["graph_runs"] == 3 and not fast.stats()["guard_failures"]


class LayerDrop(nn.Module):
    """LayerDrop written with Python's ``random`` (fairseq style), and numpy noise: in train mode a
    layer is skipped at random."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        np = pytest.importorskip("numpy")
        for layer in self.layers:
            if not self.training or random.random() > 0.5:
                x = layer(x)
        return x * (1.0 + 0.0 * float(np.random.rand()))


def test_layerdrop_with_python_random_leaves_the_generators_as_eager_does():
    """Capture's extra runs draw from Python's ``random`` and numpy's global generator; they must be
    undone, as torch's generators' draws are, so later eager code draws what it would have. A step
    drawing from them is refused at capture (issue 49: a replay would repeat the recording's draws), so
    three calls ran the model's Python three times, as eager would."""
    np = pytest.importorskip("numpy")
    model = LayerDrop()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    random.seed(0)
    np.random.seed(0)
    with torch.no_grad():
        calls(fast, x)  # warm-up (eager), recording call (refused: capture's runs undone, then eager), eager
        after = random.random(), float(np.random.rand())
        random.seed(0)
        np.random.seed(0)
        for _ in range(3):
            model(x)
    assert (random.random(), float(np.random.rand())) == after
    assert fast.stats()["graph_runs"] == 0


# ---- 7. moves through module APIs -----------------------------------------------------------------


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.mark.parametrize("move", ["double", "half_then_float"])
def test_a_model_moved_by_a_module_api_is_not_replayed_on_the_old_memory(move):
    """cudagraph trees test_unstable_ptr, by module APIs: ``_apply`` gives parameters new memory
    (a graph reads the old one); a GPU would replay the stale weights."""
    torch.manual_seed(0)
    model = Embedder()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    ids = torch.randint(0, 16, (4, 3))
    with torch.no_grad():
        calls(fast, ids)
        if move == "double":
            model.double()
        else:
            model.half()
            model.float()
            model.head.weight.mul_(2)  # the weights a replay must read are the new memory's
        assert all(torch.equal(fast(ids), model(ids)) for _ in range(4))
    assert "module_moved:" in failures(fast)


def test_a_runner_model_cast_to_bfloat16_runs_eagerly_until_recapture():
    class Buffered(ToyPagedModel):
        def __init__(self):
            super().__init__()
            kv = self.kv
            del self.kv
            self.register_buffer("kv", kv)

    model = Buffered()
    runner = captured_runner(model)
    model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    batch = decode_batch(4)
    assert torch.equal(runner(batch), eager_step(reference, batch))
    assert runner.stats()["eager_reasons"] == {"module_moved": 1}
    runner.recapture()
    assert torch.equal(runner(batch), eager_step(reference, batch)) and runner.stats()["graph_runs"] == 1


# ---- 8. autograd ----------------------------------------------------------------------------------


def test_a_frozen_backbone_unfrozen_after_capture_gets_gradients():
    """Staged fine-tuning: a backbone wrapped while frozen, then ``requires_grad_(True)``: a grad-mode
    call must carry history so the backbone gets gradients."""
    torch.manual_seed(0)
    backbone = nn.Linear(8, 8).requires_grad_(False)
    fast = wrap(backbone, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    calls(fast, x, times=4)  # grad mode, nothing requires grad: replays
    assert fast.stats()["graph_runs"] >= 2
    backbone.requires_grad_(True)
    out = fast(x)
    assert out.requires_grad
    out.sum().backward()
    assert backbone.weight.grad is not None
    backbone.weight.requires_grad = False  # by assignment, as PEFT freezes its base layers
    backbone.bias.requires_grad = False
    runs = fast.stats()["graph_runs"]
    calls(fast, x)
    assert fast.stats()["graph_runs"] > runs


# ---- 9. inputs --------------------------------------------------------------------------------------


class FakeQuant(torch.Tensor):
    """A tensor subclass with behaviour of its own (fake quantisation rounds every op's input)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            args = [arg.round() if isinstance(arg, FakeQuant) else arg for arg in args]
            return func(*args, **(kwargs or {}))


def test_a_tensor_subclass_input_runs_eagerly_with_its_behaviour():
    linear = nn.Linear(8, 8)
    fast = wrap(linear, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8) * 4
    quantized = x.as_subclass(FakeQuant)
    with torch.no_grad():
        out = calls(fast, quantized)
        assert torch.equal(out, linear(x.round()))
    assert fast.stats()["eager_reasons"].get("tensor_subclass") == 3


def test_a_transposed_input_where_eager_view_raises_is_not_replayed():
    def flatten(x):
        return x.view(x.shape[0], -1) * 2

    fast = wrap(flatten, max_batch_size=4, capture_sizes=[4])
    contiguous = torch.randn(4, 2, 3)
    with torch.no_grad():
        calls(fast, contiguous)
        transposed = torch.randn(4, 3, 2).transpose(1, 2)
        with pytest.raises(RuntimeError, match="view"):
            flatten(transposed)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="view"):
                fast(transposed)
        assert torch.equal(fast(contiguous), flatten(contiguous))


def test_a_sliced_input_replays_on_a_slot_with_its_strides():
    """A slice along a non-batch dim gets a layout of its own whose slot has the caller's strides:
    the step sees what eager sees (a non-contiguous tensor), and replays."""

    def step(x):
        return x * 2 if x.is_contiguous() else x * 3

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    base = torch.randn(4, 6)
    with torch.no_grad():
        assert all(torch.equal(fast(base[:, :2]), step(base[:, :2])) for _ in range(3))
        assert all(torch.equal(fast(base[:3, :2]), step(base[:3, :2])) for _ in range(3))  # padded
        assert all(torch.equal(fast(base[:, 2:]), step(base[:, 2:])) for _ in range(3))
    assert fast.stats()["graph_runs"] >= 5


def test_an_input_with_the_batch_dim_inside_replays_and_one_eager_refuses_keeps_raising():
    """``x.t()`` with the batch along the transposed dim: no slot keeps its strides at a padded size,
    so it is staged into a contiguous slot; a step that raises on it eagerly (``.view()``) never
    records: a warm-up counts only once it returned."""
    fast = wrap(lambda x: x * 2, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(5, 4).t()
    with torch.no_grad():
        assert all(torch.equal(fast(x), x * 2) for _ in range(3))
    assert fast.stats()["graph_runs"] == 2
    viewing = wrap(lambda x: x.view(-1)[: x.shape[0]] * 2, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        for _ in range(3):
            with pytest.raises(RuntimeError, match="view"):
                viewing(x)
    assert viewing.stats()["graph_runs"] == 0


def test_a_third_value_of_a_closure_variable_gets_graphs_of_its_own():
    """Three values in turn: each gets graphs, and a value seen before replays its own (a layout
    whose module state matches but whose closure does not is no match)."""
    linear = nn.Linear(8, 8)
    scale = 1.0

    def step(x):
        return linear(x) * scale

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for value in (1.0, 3.0, 5.0, 3.0):
            scale = value
            assert all(torch.equal(fast(x), linear(x) * value) for _ in range(3))
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), linear(x) * 3.0) and fast.stats()["graph_runs"] == runs + 1
    assert len(fast.stats()["layouts"]) == 3


def test_another_threads_assignments_while_a_step_is_captured_are_not_the_steps():
    # The journal of a capture is its thread's: a server thread tuning a module meanwhile is neither put back
    # nor refused as the step's assignment.
    from graphrt.guards import python_state_kept

    elsewhere = nn.Linear(2, 2)
    elsewhere.scale = 1.0
    assigned = threading.Event()

    def tune():
        elsewhere.scale = 2.0
        assigned.set()

    with python_state_kept(()):
        worker = threading.Thread(target=tune)
        worker.start()
        assert assigned.wait(10)
        worker.join()
    assert elsewhere.scale == 2.0


def test_wrap_under_another_default_dtype_gets_graphs_of_its_own_with_eagers_dtype():
    # torch.zeros without a dtype: the graph keeps capture's float32; eager makes float64 (dynamo guards it).
    def step(x):
        return torch.zeros(x.shape[0], 1) + x

    fast = wrap(step, max_batch_size=8, backend="emulated")
    x = torch.ones(4, 3)
    with torch.no_grad():
        for _ in range(4):
            fast(x)
        torch.set_default_dtype(torch.float64)
        try:
            wide = [fast(x) for _ in range(4)]
            expected = step(x)
        finally:
            torch.set_default_dtype(torch.float32)
        assert all(out.dtype == torch.float64 and torch.equal(out, expected) for out in wide)
        runs = fast.stats()["graph_runs"]
        assert fast(x).dtype == torch.float32 and fast.stats()["graph_runs"] == runs + 1  # capture's graphs again
    assert any("torch's default dtype is torch.float64" in detail for detail in fast.stats()["guard_failures"])
