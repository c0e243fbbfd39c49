"""The recorder is invisible to the model: what a model can test reads as under a CUDA capture.

A model with a fast path guarded by ``has_torch_function`` (``nn.TransformerEncoder``'s
nested-tensor path) takes it while graphrt records, as it would under ``torch.cuda.graph``;
where that path reads the mask on the host the capture fails (as on CUDA) and the calls run
eagerly with eager's numbers, never other numbers from a path the GPU would not take.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import has_torch_function

import graphrt
from graphrt import wrap
from graphrt.capture import capture_graph
from graphrt.backends.emulated import EmulatedBackend

D_MODEL, HEADS, SEQ = 16, 2, 6


def encoder(layers: int = 2) -> torch.nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=32, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor's advice about norm_first
        return torch.nn.TransformerEncoder(layer, num_layers=layers).eval()


def padding_mask(batch: int) -> torch.Tensor:
    mask = torch.zeros(batch, SEQ, dtype=torch.bool)
    for row in range(batch):
        mask[row, SEQ - 1 - row % 3:] = True  # left-aligned padding of 1 to 3 positions
    return mask


def calls(batch: int):
    generator = torch.Generator().manual_seed(batch)
    return [torch.randn(batch, SEQ, D_MODEL, generator=generator) for _ in range(4)]


MODULES = {
    "encoder": lambda: encoder(),
    "encoder_layer": lambda: encoder(1).layers[0],
    "multihead_attention": lambda: MhaSelf(),
}


class MhaSelf(torch.nn.Module):
    """Self-attention through ``nn.MultiheadAttention`` (its fast path in eval mode)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attention = torch.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).eval()

    def forward(self, x, src_key_padding_mask=None):
        return self.attention(x, x, x, key_padding_mask=src_key_padding_mask, need_weights=False)[0]


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("batch", [4, 3], ids=["exact", "padded"])
def test_torch_attention_modules_through_wrap_equal_eager_on_every_call(name, masked, batch):
    module = MODULES[name]()
    fast = wrap(module, max_batch_size=4, capture_sizes=[4], backend="emulated")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested-tensor prototype warning
        for x in calls(batch):
            kwargs = {"src_key_padding_mask": padding_mask(batch)} if masked else {}
            expected = module(x, **kwargs)
            got = fast(x, **kwargs)
            if batch == 4:
                assert torch.equal(got, expected)
            else:  # padded to 4: GEMMs may round differently per batch size
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    stats = fast.stats()
    if masked and name == "encoder":
        # The encoder's nested-tensor path reads the mask on the host: the capture fails as on CUDA.
        assert stats["graph_runs"] == 0
        assert "_nested_tensor_from_mask" in stats["failed_keys"]["call/bs=4"]
    else:
        assert stats["graph_runs"] >= 1, stats


def test_encoder_capture_failure_names_the_torch_line_and_the_callers_line():
    module = encoder()
    fast = wrap(module, max_batch_size=4, capture_sizes=[4], backend="emulated")
    mask = padding_mask(4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in calls(4)[:2]:
            fast(x, src_key_padding_mask=mask)
    reason = fast.stats()["failed_keys"]["call/bs=4"]
    assert "torch/nn/modules/transformer.py" in reason and "HostSyncError" in reason
    assert "test_recorder_invisible.py" in reason


def test_check_reports_the_encoders_host_read_with_both_lines():
    module = encoder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = graphrt.check(module, calls(4)[0], src_key_padding_mask=padding_mask(4))
    assert not report.ok
    reads = [finding for finding in report.findings if finding.kind == "host_sync"]
    assert reads and "_nested_tensor_from_mask" in reads[0].op
    assert "torch/nn/modules/transformer.py" in reads[0].message  # torch's line
    assert reads[0].source.startswith("tests/test_recorder_invisible.py:")  # the caller's line


def observed_flags() -> dict:
    """What a model can test about the mode it runs in."""
    plain = torch.ones(1)
    return {
        "has_torch_function": has_torch_function((plain,)),
        "torch_function_mode": torch._C._is_torch_function_mode_enabled(),
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "stream_capturing": torch.cuda.is_current_stream_capturing(),
        "compiling": torch.compiler.is_compiling(),
        "jit_tracing": torch.jit.is_tracing(),
        "fx_tracing": torch.fx._symbolic_trace.is_fx_tracing(),
    }


# What each flag reads inside graphrt's CUDA capture (capture runs under no_grad, outside inference mode).
UNDER_CUDA_CAPTURE = {
    "has_torch_function": False, "torch_function_mode": False, "grad": False, "inference_mode": False,
    "stream_capturing": True, "compiling": False, "jit_tracing": False, "fx_tracing": False,
}


def test_flags_a_model_can_test_read_as_under_a_cuda_capture():
    seen = []

    def step(x):
        seen.append(observed_flags())
        return x + 1

    capture_graph(EmulatedBackend(), lambda: [step(torch.ones(2))], warmup_iters=0)
    assert seen == [UNDER_CUDA_CAPTURE]
