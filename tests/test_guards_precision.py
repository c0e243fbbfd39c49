"""torch's precision settings, every API (issue 49, item 6).

Since torch 2.9 the recommended TF32 API is per backend and operator (``torch.backends.cuda.matmul.
fp32_precision = "tf32"``, ``torch.backends.cudnn.conv.fp32_precision``, the global
``torch.backends.fp32_precision``); once it is used, torch's legacy getters
(``torch.get_float32_matmul_precision()``, ``torch.backends.cuda.matmul.allow_tf32``) raise. A graph keeps
the kernels chosen at capture, so a change after capture must give eager's result on both fronts (torch.compile
guards the global state), through any API: the new attributes, the legacy ones (``cudnn.allow_tf32``), and a
setter imported before graphrt patched torch (the original function object).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, captured_runner, decode_batch, eager_step
from torch import nn

from graphrt import wrap
from graphrt.guards.torch_settings import FP32_PRECISION

PAIRS = [pair for pair, _ in FP32_PRECISION]  # torch's store: (backend, operator)


def original(function):
    """The setter as a module imported before graphrt holds it (graphrt's patch wraps it)."""
    return getattr(function, "__wrapped__", function)


@pytest.fixture(autouse=True)
def precision_restored():
    """Every fp32 precision as it was (the new API reflects the legacy one), and the reduced-precision flags."""
    matmul = torch.backends.cuda.matmul
    saved = {pair: torch._C._get_fp32_precision_getter(*pair) for pair in PAIRS}
    reduced = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    yield
    for pair, value in saved.items():
        torch._C._set_fp32_precision_setter(*pair, value)
    matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = reduced


CHANGES = {  # (change it, named as)
    "cuda.matmul.fp32_precision": (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
                                   "torch.backends.cuda.matmul.fp32_precision"),
    "backends.fp32_precision": (lambda: setattr(torch.backends, "fp32_precision", "tf32"),
                                "torch.backends.fp32_precision"),
    "cudnn.conv.fp32_precision": (lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
                                  "torch.backends.cudnn.conv.fp32_precision"),
    "cudnn.allow_tf32": (lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
                         "torch.backends.cudnn.conv.fp32_precision"),
    "mkldnn.matmul.fp32_precision": (lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
                                     "torch.backends.mkldnn.matmul.fp32_precision"),
    "set_float32_matmul_precision imported before graphrt": (
        lambda: original(torch.set_float32_matmul_precision)("high"), "torch.backends.cuda.matmul.fp32_precision"),
    "allow_bf16_reduced_precision_reduction": (
        lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False),
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_runner_step_after_a_precision_change_runs_eagerly_naming_it(change):
    model = ToyPagedModel()
    runner = captured_runner(model)
    reference = copy.deepcopy(model)
    batch = decode_batch(4)
    set_it, named = CHANGES[change]
    set_it()
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch))
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1} and stats["graph_runs"] == 0
    assert any(f"torch's {named} is" in detail for detail in stats["guard_failures"]), stats["guard_failures"]


def test_a_runner_captured_under_the_new_api_replays_and_sees_it_changed_back():
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    model = ToyPagedModel()
    runner = captured_runner(model)
    batch = decode_batch(4)
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(model, batch)) and runner.stats()["graph_runs"] == 1
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert torch.equal(runner(batch), eager_step(model, batch))
    assert runner.stats()["eager_reasons"] == {"python_state": 1}


def test_wrap_records_under_the_new_api_and_gets_graphs_of_its_own_after_a_change():
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    linear = nn.Linear(8, 8)
    fast = wrap(linear, max_batch_size=8, capture_sizes=[4, 8])
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert all(torch.equal(fast(x), linear(x)) for _ in range(4))
        assert fast.stats()["graph_runs"] == 3, fast.stats()["eager_reasons"]  # all but the warm-up
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        assert all(torch.equal(fast(x), linear(x)) for _ in range(4))
    assert any("torch.backends.cudnn.conv.fp32_precision" in detail for detail in fast.stats()["guard_failures"])
