"""Captures made under ``torch.inference_mode()``, where nano-vllm, vLLM and SGLang capture.

Under inference mode ``to``, ``reshape`` and ``contiguous`` reach the dispatcher as themselves
(their schemas say the result may alias the input) instead of as ``_to_copy``/``view``/``clone``.
A step that writes in place into the copy one of them made (nano-vllm's RMSNorm:
``x = x.float(); x.mul_(...)``) writes a temporary, not the model's state; capture must see that
or verification blames the model's state for the temporary (``verify_failed``).
"""

from __future__ import annotations

import pytest
import torch
from client_helpers import RMSNorm as InPlaceRMSNorm  # nano-vllm's: in place into the float copy, residual fused
from conftest import decode_batch

from graphrt import GraphRunner, wrap
from graphrt.backends.state_journal import StateJournal

HIDDEN = 16


class NormBlock(torch.nn.Module):
    """Linear, nano-vllm's RMSNorm with residual, transformers' LlamaRMSNorm, reshape/contiguous in between."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = InPlaceRMSNorm(HIDDEN)
        self.final = InPlaceRMSNorm(HIDDEN)
        self.llama_norm = LlamaRMSNorm(HIDDEN)
        for norm in (self.norm, self.final, self.llama_norm):
            norm.weight.data.uniform_(0.5, 1.5)

    def forward(self, hidden):
        h, residual = self.norm(self.linear(hidden), hidden)
        h = h.reshape(-1, 2, HIDDEN // 2).contiguous().reshape(-1, HIDDEN)
        h.add_(1.0)  # in place into the contiguous copy
        return self.llama_norm(self.final(h + residual))


def test_a_copy_made_by_to_under_inference_mode_is_not_state():
    source = torch.randn(4, 8, dtype=torch.bfloat16)
    journal = StateJournal()
    with torch.inference_mode(), journal:
        copy = source.float()  # aten.to.dtype: its schema says it may alias its input
        copy.mul_(2)
    assert not journal.regions and not journal.written, "the copy's write was taken for a write of state"
    journal.restore()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wrap_captured_under_inference_mode_verifies_and_replays(dtype):
    model = NormBlock().to(dtype).eval()
    fast = wrap(model, max_batch_size=8)
    with torch.inference_mode():
        for step in range(4):
            hidden = torch.randn(4, HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(step))
            torch.testing.assert_close(fast(hidden.clone()), model(hidden.clone()), rtol=0, atol=0)
    stats = fast.stats()
    assert stats["failed_keys"] == {}
    assert stats["graph_runs"] == 3 and stats["eager_reasons"] == {"warmup": 1}


class PagedNormModel(torch.nn.Module):
    """A GraphRunner model whose step normalizes in place into bfloat16 -> float32 copies."""

    def __init__(self) -> None:
        super().__init__()
        self.block = NormBlock().to(torch.bfloat16)

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.block.embed(input_ids) + self.block.embed(positions % 32)
        return self.block(hidden)


def test_graph_runner_captured_under_inference_mode_verifies_and_replays():
    model = PagedNormModel().eval()
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[2, 4], progress=False)
    with torch.inference_mode():
        report = runner.capture()
        assert report.failed == {} and len(report.ok) == 2
        for size in (1, 2, 3, 4):
            batch = decode_batch(size, seed=size)
            batch.input_ids %= 32
            want = model(batch.input_ids, batch.positions, batch)
            torch.testing.assert_close(runner(batch), want, rtol=1.6e-2, atol=1e-2)
    assert runner.stats()["graph_runs"] == 4
