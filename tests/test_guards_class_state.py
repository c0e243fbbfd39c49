"""Class-level state the step reads (issue 49, item 1).

A graph froze what a lookup through the class found at capture: a class attribute read through ``self``
(``MyAttention.softmax_scale = 0.25``), a ``forward`` patched on the class (Liger-style kernels patch
``RMSNorm.forward``), a staticmethod swapped, an attribute of a settings class the step reads as a global.
torch.compile guards each of them (the attribute's source through ``type(self)``); a change after capture
must give eager's result, with the change named in ``stats()["guard_failures"]``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, calls, captured_runner, decode_batch, eager_step, failures
from torch import nn

from graphrt import wrap
from graphrt.guards.class_state import ClassDict


def attention_class():
    """A new attention class with a class-level softmax scale (each test changes its own)."""

    class Attention(nn.Module):
        softmax_scale = 1.0

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.proj(x) * self.softmax_scale, -1)

    return Attention


def test_a_class_attribute_read_through_self_is_guarded(monkeypatch):
    """A class attribute changed after capture gives eager's result. Only what the step's lookups find is
    compared: an equal value assigned again (another float object) and a new attribute of the class are no
    change, every call still replays; the equal value is read again once, then compared by identity."""
    reads = []
    change = ClassDict.change
    monkeypatch.setattr(ClassDict, "change", lambda self: reads.append(self) or change(self))
    Attention = attention_class()
    model = Attention()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        runs = fast.stats()["graph_runs"]
        Attention.softmax_scale = float("1.0")
        Attention.unread = 3
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        assert fast.stats()["graph_runs"] == runs + 3 and not failures(fast) and len(reads) == 1
        Attention.softmax_scale = 0.25
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "Attention.softmax_scale" in failures(fast)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def fused_norm(self, x):
    """A kernel patched in for ``Norm.forward`` after capture (it computes another thing: doubled)."""
    return 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ChildNorm(Norm):
    """A subclass that defines no ``forward``: its lookup finds ``Norm``'s."""


@pytest.mark.parametrize("norm_class", [Norm, ChildNorm], ids=["on its class", "on a subclass shadowing its base"])
def test_a_forward_patched_after_capture_runs_and_undone_replays_the_first_graphs(norm_class):
    """Kernel libraries patch ``Norm.forward``; on a subclass that defines none (``ChildNorm``), the lookup
    walks its dict before ``Norm``'s: an assignment there shadows the base's, a change although the dict that
    defines the name is untouched, and deleting it undoes it."""
    model = nn.Sequential(nn.Linear(8, 8), norm_class())
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    own = vars(norm_class).get("forward")
    with torch.no_grad():
        calls(fast, x)
        norm_class.forward = fused_norm
        try:
            assert all(torch.equal(fast(x), model(x)) for _ in range(3))
        finally:
            if own is None:
                del norm_class.forward
            else:
                norm_class.forward = own
        runs = fast.stats()["graph_runs"]
        assert torch.equal(fast(x), model(x)) and fast.stats()["graph_runs"] == runs + 1  # the first graphs again
    assert f"{norm_class.__name__}.forward" in failures(fast)


def test_a_staticmethod_swapped_on_the_class_is_guarded():
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        @staticmethod
        def activation(x):
            return torch.relu(x)

        def forward(self, x):
            return self.activation(self.linear(x))

    model = Gated()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        Gated.activation = staticmethod(torch.sigmoid)
        assert all(torch.equal(fast(x), model(x)) for _ in range(3))
    assert "Gated.activation" in failures(fast)


class Settings:
    """A settings class the step reads as a global."""

    temperature = 1.0


def test_an_attribute_of_a_settings_class_read_as_a_global_is_guarded():
    linear = nn.Linear(8, 8)

    def step(x):
        return linear(x) / Settings.temperature

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        Settings.temperature = 0.5
        try:
            assert all(torch.equal(fast(x), step(x)) for _ in range(3))
        finally:
            Settings.temperature = 1.0
    assert "Settings.temperature" in failures(fast)


class SoftCapped(ToyPagedModel):
    """The toy paged model with a class-level soft cap on its logits."""

    softcap = 30.0

    def forward(self, input_ids, positions, forward_batch):
        logits = super().forward(input_ids, positions, forward_batch)
        return torch.tanh(logits / self.softcap) * self.softcap


def test_a_runner_step_after_a_class_level_soft_cap_changed_runs_eagerly():
    model = SoftCapped()
    runner = captured_runner(model)
    batch = decode_batch(4)
    SoftCapped.softcap = 0.5
    reference = copy.deepcopy(model)
    try:
        with torch.no_grad():
            assert torch.equal(runner(batch), eager_step(reference, batch))
    finally:
        SoftCapped.softcap = 30.0
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1}, stats["guard_failures"]
    assert any("SoftCapped.softcap" in detail for detail in stats["guard_failures"])


def test_graph_generate_follows_an_rms_norm_forward_patched_on_the_class():
    """Liger-style: a transformers class's forward replaced after graph_generate recorded."""
    pytest.importorskip("transformers")
    from hf_helpers import family_inputs, tiny_model
    from transformers.models.llama import modeling_llama

    import graphrt.hf

    model = tiny_model("llama")
    inputs = family_inputs("llama", batch=2)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    norm = modeling_llama.LlamaRMSNorm
    original = norm.forward

    def patched(self, hidden_states):
        return original(self, hidden_states) * 1.5

    with torch.no_grad():
        plain = model.generate(**inputs, **options)
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            assert torch.equal(model.generate(**inputs, **options), plain)
        norm.forward = patched
        try:
            reference = tiny_model("llama")
            expected = reference.generate(**inputs, **options)
            assert not torch.equal(expected, plain)
            assert torch.equal(model.generate(**inputs, **options), expected)
        finally:
            norm.forward = original
    assert "LlamaRMSNorm.forward" in failures(fast)
