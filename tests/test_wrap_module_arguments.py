"""Modules handed to wrap(): as an argument of each call, or as the wrapped callable itself.

A model passed as an argument (gpt-fast's ``model_forward(model, x, input_pos)``, PyTorch's
cudagraph-trees ``test_unstable_ptr`` shape ``foo(m, inp)``) is a constant of the call layout; its
training flags join the state every call is checked under. That must cost one warm-up like any
other call, and alternating two models must keep a layout for each. A wrapped module stays usable
as the module (``self.model = graphrt.wrap(self.model)`` then ``self.model.compute_logits(...)``),
as torch.compile's OptimizedModule passes attribute access through.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt import wrap


def test_a_model_passed_as_an_argument_replays_on_its_second_call():
    """test_unstable_ptr's call shape; the Linear is in training mode, as there."""
    model = nn.Linear(20, 20)
    fast = wrap(lambda m, inp: m(inp), max_batch_size=32, capture_sizes=[8, 16, 32])
    with torch.no_grad():
        inp = torch.rand(16, 20)
        first = fast(model, inp)
        second = fast(model, inp)
    assert torch.equal(first, second) and torch.equal(second, model(inp))
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 1} and stats["graph_runs"] == 1
    assert len(stats["layouts"]) == 1


def test_alternating_two_models_keeps_a_layout_for_each():
    """gpt-fast's speculative decoding calls model_forward(model, ...) and model_forward(draft_model, ...)."""
    torch.manual_seed(0)
    target, draft = nn.Linear(8, 8), nn.Linear(8, 8).eval()
    fast = wrap(lambda m, x: m(x), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for step in range(8):
            model = (target, draft)[step % 2]
            assert torch.equal(fast(model, x), model(x))
    stats = fast.stats()
    assert len(stats["layouts"]) == 2 and stats["layouts_dropped"] == 0
    assert stats["eager_reasons"] == {"warmup": 2} and stats["graph_runs"] == 6


def test_a_training_flag_flipped_on_a_model_argument_still_gets_graphs_of_its_own():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    fast = wrap(lambda m, x: m(x), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        model.eval()
        for _ in range(3):
            assert torch.equal(fast(model, x), model(x))
        model.train()
        torch.manual_seed(3)
        trained = fast(model, x)
        torch.manual_seed(3)
        assert torch.equal(trained, model(x))
        model.eval()
        assert torch.equal(fast(model, x), model(x))
    assert fast.stats()["graph_runs"] == 3


class Head(nn.Module):
    """A model with a method besides forward, as nano-vllm's Qwen3ForCausalLM has compute_logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 5)
        self.note = "head"

    def forward(self, x):
        return self.body(x)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)


def test_a_wrapped_module_passes_attribute_access_through():
    model = Head().eval()
    fast = wrap(model, max_batch_size=4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        logits = fast.compute_logits(fast(x))
        assert torch.equal(logits, model.compute_logits(model(x)))
    assert fast.lm_head is model.lm_head and fast.note == "head" and fast.training is False
    assert [name for name, _ in fast.named_parameters()] == [name for name, _ in model.named_parameters()]
    fast.note = "changed"  # set on the module, as OptimizedModule does
    assert model.note == "changed" and "note" not in vars(fast)
    assert fast.max_batch_size == 4  # the wrapper's own attributes stay its own


def test_a_wrapped_bound_method_keeps_self():
    model = Head().eval()
    fast = wrap(model.compute_logits, max_batch_size=4)
    assert fast.__self__ is model and fast.__func__ is Head.compute_logits
