"""Guards through GraphRunner: a key captured under one state never serves a step under another.

A runner captures its keys up front, so a step under another autocast or ``training`` state, with
a rebound tensor or with a field that shares memory with the model's state runs eagerly, counted
under the guard's reason and named in ``stats()["guard_failures"]``; ``recapture()`` captures
again under the state of now. Every result is compared with eager on the same batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ToyPagedModel, captured_runner, decode_batch, eager_step
from torch import nn

from graphrt import GraphRunner
from graphrt.guards import StaleStateError
from graphrt.guards.torch_settings import FP32_PRECISION as FP32_PRECISION_NAMES


class DropoutModel(ToyPagedModel):
    """The toy paged model with a dropout on its hidden state (active in train mode only)."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, input_ids, positions, forward_batch):
        return self.dropout(super().forward(input_ids, positions, forward_batch))


def test_a_step_under_autocast_runs_eagerly_with_its_reason():
    model = ToyPagedModel()
    runner = captured_runner(model)
    reference = copy.deepcopy(model)
    batch = decode_batch(4)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out = runner(batch)
        expected = eager_step(reference, batch)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    stats = runner.stats()
    assert stats["eager_reasons"] == {"autocast": 1} and stats["graph_runs"] == 0
    assert any("autocast cpu bfloat16" in detail for detail in stats["guard_failures"])
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch)) and runner.stats()["graph_runs"] == 1


class Engine:
    """A model callable that is not a module: an engine object holding the model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch)


@pytest.mark.parametrize("holder", [lambda model: model, Engine], ids=["module", "callable object"])
def test_eval_after_a_train_capture_runs_eagerly_until_recapture(holder):
    """A callable object holding the model has the model's flags watched as the model's own are."""
    model = DropoutModel()
    runner = captured_runner(holder(model))
    reference = copy.deepcopy(model)
    model.eval()
    reference.eval()
    batch = decode_batch(4)
    assert torch.equal(runner(batch), eager_step(reference, batch))
    assert runner.stats()["eager_reasons"] == {"training": 1}
    runner.recapture()
    assert torch.equal(runner(batch), eager_step(reference, batch)) and runner.stats()["graph_runs"] == 1


def test_a_runner_captured_under_inference_mode_replays_under_no_grad():
    """pytorch#135892: the first no_grad step used to fail at staging and disable the key."""
    with torch.inference_mode():
        model = ToyPagedModel()
        runner = captured_runner(model)
    reference = ToyPagedModel()
    for seed in range(3):
        batch = decode_batch(4, seed=seed)
        with torch.no_grad():
            assert torch.equal(runner(batch), eager_step(reference, batch))
        with torch.inference_mode():
            assert torch.equal(runner(batch), eager_step(reference, batch))
    assert runner.stats()["graph_runs"] == 6 and runner.stats()["eager_runs"] == 0


def test_a_rebound_state_tensor_runs_eagerly_until_recapture():
    model = ToyPagedModel()
    runner = captured_runner(model)
    reference = copy.deepcopy(model)
    model.kv = torch.zeros_like(model.kv)  # a new cache: the graph holds the old one
    reference.kv = torch.zeros_like(reference.kv)
    batch = decode_batch(4)
    assert torch.equal(runner(batch), eager_step(reference, batch)) and torch.equal(model.kv, reference.kv)
    assert runner.stats()["eager_reasons"] == {"rebound_state": 1}
    assert any("ToyPagedModel.kv" in detail for detail in runner.stats()["guard_failures"])
    runner.recapture()
    batch = decode_batch(4, seed=1)
    assert torch.equal(runner(batch), eager_step(reference, batch)) and torch.equal(model.kv, reference.kv)
    assert runner.stats()["graph_runs"] == 1


def test_a_field_sharing_memory_with_written_state_runs_eagerly():
    """A batch whose out_cache_loc is a view of an integer table the step advances in place first:
    eager writes the KV rows the advanced values name, a static slot would hold the old ones."""

    class SlotLog(ToyPagedModel):
        def __init__(self):
            super().__init__()
            self.register_buffer("used", torch.arange(256))

        def forward(self, input_ids, positions, forward_batch):
            self.used.add_(1)
            return super().forward(input_ids, positions, forward_batch)

    model = SlotLog()
    runner = captured_runner(model)
    reference = copy.deepcopy(model)
    batch = decode_batch(4, out_cache_loc=model.used[10:14])
    expected = eager_step(reference, decode_batch(4, out_cache_loc=reference.used[10:14]))
    assert torch.equal(runner(batch), expected) and torch.equal(model.used, reference.used)
    assert runner.stats()["eager_reasons"] == {"aliased_inputs": 1}


def test_a_parameter_whose_memory_was_swapped_runs_eagerly_and_debug_names_a_swap_no_api_told_of():
    """cudagraph trees test_unstable_ptr: ``.data`` swapped after capture; a CUDA graph reads the old memory.
    The swap is seen (issue 49): eager, ``module_moved``. A swap past every Python API (torch's C method
    itself) is seen by debug mode's per-call storage check."""
    model = ToyPagedModel()
    runner = captured_runner(model, debug=True)
    model.proj.data = torch.randn_like(model.proj)
    assert torch.equal(runner(decode_batch(4)), eager_step(copy.deepcopy(model), decode_batch(4)))
    assert runner.stats()["eager_reasons"] == {"module_moved": 1}
    runner.recapture()
    assert torch.equal(runner(decode_batch(4)).clone(), eager_step(copy.deepcopy(model), decode_batch(4)))
    with torch.no_grad():
        torch._C.TensorBase.set_(model.proj, torch.randn_like(model.proj))
    with pytest.raises(StaleStateError, match="ToyPagedModel.proj"):
        runner(decode_batch(4))


def test_a_step_rebinding_model_state_is_refused_and_capture_restores_it():
    class Rebinding(ToyPagedModel):
        def forward(self, input_ids, positions, forward_batch):
            self.kv = self.kv.clone()  # a new tensor every step instead of an in-place write
            return super().forward(input_ids, positions, forward_batch)

    model = Rebinding()
    kv = model.kv
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[4], backend="emulated", progress=False)
    report = runner.capture()
    assert model.kv is kv and not torch.count_nonzero(kv)
    assert all("RebindError" in reason and "Rebinding.kv" in reason for reason in report.failed.values())



class ZerosModel(ToyPagedModel):
    """The toy paged model plus a tensor made without a dtype: its dtype is torch's default dtype."""

    def forward(self, input_ids, positions, forward_batch):
        return super().forward(input_ids, positions, forward_batch) + torch.zeros(input_ids.shape[0], 1)


SETTINGS = {  # a setting torch.compile's global-state guard also reads: (change it, put it back, named as)
    "default dtype": (lambda: torch.set_default_dtype(torch.float64), lambda: torch.set_default_dtype(torch.float32),
                      "default dtype"),
    "float32 matmul precision": (lambda: torch.set_float32_matmul_precision("high"), lambda: None,
                                 "torch.backends.cuda.matmul.fp32_precision"),
    "deterministic algorithms": (lambda: torch.use_deterministic_algorithms(True),
                                 lambda: torch.use_deterministic_algorithms(False), "deterministic algorithms"),
    # torch stores both as the CUDA matmul's fp32 precision (torch >= 2.9)
    "allow_tf32": (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True), lambda: None,
                   "torch.backends.cuda.matmul.fp32_precision"),
}
FP32_PRECISION = [pair for pair, _ in FP32_PRECISION_NAMES]  # torch's store: the legacy setters write it too


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_torch_setting_changed_after_capture_runs_eagerly_until_it_is_back(setting):
    # A graph keeps the dtype its factory calls made and the kernels chosen at capture (dynamo guards them).
    change, restore, named = SETTINGS[setting]
    model = ZerosModel()
    runner = captured_runner(model)
    reference = copy.deepcopy(model)
    batch = decode_batch(4)
    precision = {pair: torch._C._get_fp32_precision_getter(*pair) for pair in FP32_PRECISION}
    change()
    try:
        with torch.no_grad():
            out, expected = runner(batch), eager_step(reference, batch)
    finally:
        restore()
        for pair, value in precision.items():  # as it was, "none" included
            torch._C._set_fp32_precision_setter(*pair, value)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    stats = runner.stats()
    assert stats["eager_reasons"] == {"python_state": 1} and stats["graph_runs"] == 0
    assert any(f"torch's {named} is" in detail for detail in stats["guard_failures"]), stats["guard_failures"]
    with torch.no_grad():
        assert torch.equal(runner(batch), eager_step(reference, batch)) and runner.stats()["graph_runs"] == 1
