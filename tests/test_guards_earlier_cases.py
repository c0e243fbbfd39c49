"""Earlier held-out cases (issue 49, item 8), each compared with eager on the same state.

A parameter's storage swapped under it (``param.data = other``, ``set_``; cudagraph trees' ``test_unstable_ptr``)
and a KV cache replaced with ``set_`` must not replay the old memory; a forward drawing from Python's
``random`` or numpy's global generator (a layer-drop pattern) is refused at capture, naming the draw; a
Hugging Face model cast after ``graph_generate`` captured runs as eager does (no cache of the old dtype); a
step returning a sparse tensor works; an input eager refuses is refused as eager refuses it.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import ToyPagedModel, calls, captured_runner, decode_batch, eager_step, failures
from torch import nn

from graphrt import wrap


@pytest.mark.parametrize("swap", ["data", "set_"])
def test_a_parameter_storage_swapped_after_capture_is_not_replayed(swap):
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    fast = wrap(linear, max_batch_size=2, capture_sizes=[2])
    x = torch.randn(2, 4)
    with torch.no_grad():
        calls(fast, x)
        new = torch.randn(4, 4)
        if swap == "data":
            linear.weight.data = new
        else:
            linear.weight.set_(new)
        assert all(torch.equal(fast(x), linear(x)) for _ in range(3))
        linear.weight.add_(1)  # an in-place update of the new memory: read by the graphs recorded on it
        assert torch.equal(fast(x), linear(x))
    assert "module_moved:" in failures(fast) and "weight" in failures(fast)


def test_a_runner_kv_cache_replaced_with_set_runs_eagerly():
    model = ToyPagedModel()
    runner = captured_runner(model)
    batch = decode_batch(4)
    model.kv.set_(torch.randn_like(model.kv))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch))
    assert runner.stats()["eager_reasons"] == {"module_moved": 1}, runner.stats()["guard_failures"]
    assert torch.equal(model.kv, reference.kv)  # the step's write landed where eager writes it


class LayerDrop(nn.Module):
    """Each layer skipped at random (train mode), drawing from Python's ``random`` or numpy's global generator."""

    def __init__(self, source):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.source = source

    def forward(self, x):
        for layer in self.layers:
            draw = random.random() if self.source == "random" else float(__import__("numpy").random.rand())
            if draw > 0.5:
                x = layer(x)
        return x


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_a_step_drawing_from_a_host_generator_is_refused_at_capture_naming_it(source):
    if source == "numpy":
        np = pytest.importorskip("numpy")
    model = LayerDrop(source)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    seed = {"random": random.seed, "numpy": lambda value: np.random.seed(value)}[source]
    with torch.no_grad():
        for step in range(4):
            seed(step)
            out = fast(x)
            seed(step)
            assert torch.equal(out, model(x)), step  # each call draws anew, as eager does
    stats = fast.stats()
    assert stats["graph_runs"] == 0
    assert any(("random.random" if source == "random" else "numpy") in reason
               for reason in stats["failed_keys"].values()), stats["failed_keys"]


def test_graph_generate_of_a_model_cast_after_capture_runs_as_eager_does():
    pytest.importorskip("transformers")
    from hf_helpers import family_inputs, tiny_model

    import graphrt.hf

    model = tiny_model("llama")
    inputs = family_inputs("llama", batch=2)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):
            model.generate(**inputs, **options)
        model.to(torch.bfloat16)
        expected = tiny_model("llama").to(torch.bfloat16).generate(**inputs, **options)
        for _ in range(2):
            assert torch.equal(model.generate(**inputs, **options), expected)


def test_a_step_returning_a_sparse_tensor_works():
    fast = wrap(lambda x: (x * 2).to_sparse(), max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 6)
    with torch.no_grad():
        for _ in range(3):
            out = fast(x)
            assert out.is_sparse and torch.equal(out.to_dense(), x * 2)


def test_a_transposed_input_eager_refuses_is_refused_after_contiguous_calls_recorded():
    def flat(x):
        return x.view(-1) * 2

    fast = wrap(flat, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        contiguous = torch.randn(4, 6)
        calls(fast, contiguous)
        transposed = torch.randn(6, 4).t()
        for _ in range(3):
            with pytest.raises(RuntimeError, match="view"):
                fast(transposed)
        assert torch.equal(fast(contiguous), flat(contiguous))
