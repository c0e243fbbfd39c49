"""Verification tells a wrong graph from a rounded one.

Capture compares each graph's first replay with eager. A graph that computes something else (a
path taken only under capture, a kernel outside the dispatcher) must still fail that check. A
graph that differs from eager only by reduced-precision rounding must not: transformers builds an
explicit causal mask while a CUDA stream captures (``is_tracing``) instead of taking its
``is_causal`` shortcut, so under capture SDPA runs another kernel than in eager, and a bfloat16
Hugging Face Llama prefill differs from eager by a few bfloat16 roundings; today verification
drops it with ``verify_failed``.

On CPU both paths run the same fused kernel, so the emulated tests give the tiny Llama an
attention function that picks kernels as CUDA's SDPA does: the fused kernel for ``is_causal``
without a mask, another kernel (the eager-attention math) for an explicit mask. The cuda twin uses
transformers' own ``sdpa`` on the GPU.

Outputs of a graph that verified are checked against eager with an absolute tolerance scaled by
the output's largest magnitude (``SCALED_ATOL``): what rounding a few reduced-precision operations
differently explains, and far below what the wrong graphs below differ by.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import BACKENDS

from graphrt import wrap

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Allowed |graph - eager| as a fraction of max |eager|, per dtype (measured on the tiny Llama below:
# 3e-7, 6e-3 and 1e-3 of the largest logit for float32, bfloat16 and float16).
SCALED_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
KERNEL_CHOICE = "graphrt_test_kernel_choice"
NONCAUSAL_UNDER_CAPTURE = "graphrt_test_noncausal_under_capture"


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as the additive float mask the eager attention math expects."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def kernel_choice_attention(module, query, key, value, attention_mask, **kwargs):
    """Fused SDPA for ``is_causal`` without a mask (eager); with an explicit mask (capture), the eager
    attention math: the same attention, rounded another way, as CUDA's SDPA kernels differ."""
    if attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    kwargs.pop("is_causal", None)
    return eager_attention_forward(module, query, key, value, additive(attention_mask, query.dtype), **kwargs)


def noncausal_under_capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Drops the explicit mask (capture): every token attends to later ones, something else than eager."""
    if attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def test_attention_functions():
    for name, function in ((KERNEL_CHOICE, kernel_choice_attention),
                           (NONCAUSAL_UNDER_CAPTURE, noncausal_under_capture_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)


def tiny_llama(dtype: torch.dtype, attention: str, device: str = "cpu") -> torch.nn.Module:
    """A 2-layer random Llama with transformers' default initialization (realistic logit scale)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    model.set_attn_implementation(attention)
    return model


def prefill_calls(model: torch.nn.Module, backend: str, device: str):
    """Three prefill calls of 4 prompts x 8 tokens through wrap() (warm-up, recording, replay), and eager's logits."""

    def prefill(input_ids):
        return model(input_ids=input_ids, use_cache=False).logits

    fast = wrap(prefill, max_batch_size=4, capture_sizes=[4], backend=backend)
    ids = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        outputs = [fast(ids).clone() for _ in range(3)]
        eager = prefill(ids)
    return fast.stats(), outputs, eager


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_a_prefill_that_differs_from_eager_only_by_rounding_verifies_and_replays(backend_device, dtype):
    backend, device = backend_device
    attention = KERNEL_CHOICE if backend == "emulated" else "sdpa"
    stats, outputs, eager = prefill_calls(tiny_llama(dtype, attention, device), backend, device)
    assert stats["failed_keys"] == {}, stats["failed_keys"]
    assert stats["graph_runs"] == 2 and stats["eager_reasons"] == {"warmup": 1}, stats
    atol = SCALED_ATOL[dtype] * eager.float().abs().max().item()
    for output in outputs:
        torch.testing.assert_close(output.float(), eager.float(), rtol=0, atol=atol)


class PathUnderCapture(torch.nn.Module):
    """Returns ``x * 3`` while a CUDA stream captures and ``x * 2`` otherwise (a capture-only path)."""

    def forward(self, x):
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU build of torch raises outside a capture
            capturing = False
        return x * (3 if capturing else 2)


def outside_the_dispatcher(x):
    """A raw memory copy, as a C extension's kernel writes: no recording sees it."""
    out = torch.zeros_like(x)
    ctypes.memmove(out.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
    return out * 2


def wrong_step(kind: str, dtype: torch.dtype):
    """(step, example input, eager reference) for one kind of graph that computes something else."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    if kind == "non-causal attention under capture":
        model = tiny_llama(dtype, NONCAUSAL_UNDER_CAPTURE)
        ids = torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(0))
        return (lambda input_ids: model(input_ids=input_ids, use_cache=False).logits), ids
    if kind == "a path taken only under capture":
        return PathUnderCapture(), x
    return outside_the_dispatcher, x


WRONG_KINDS = ["non-causal attention under capture", "a path taken only under capture",
               "a kernel outside the dispatcher"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("kind", WRONG_KINDS)
def test_a_graph_that_computes_something_else_still_fails_verification(kind, dtype):
    """Whatever tolerance reduced precision gets, these graphs are wrong by far more: the key is
    ``verify_failed`` and every call returns eager's result. (Holds today; must keep holding.)"""
    step, example = wrong_step(kind, dtype)
    fast = wrap(step, max_batch_size=4, capture_sizes=[4], backend="emulated")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fast(example), step(example), rtol=0, atol=0)
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["eager_reasons"] == {"warmup": 1, "verify_failed": 2}, stats
    [reason] = stats["failed_keys"].values()
    assert reason.startswith("VerifyError: output leaf 0 differs from eager"), reason


def test_the_wrong_graphs_differ_from_eager_by_more_than_the_tolerance():
    """Guards the test above: under capture, the non-causal attention's logits are off by more than
    ten times the bfloat16 tolerance, so passing verification there would be a real miss."""
    from unittest import mock

    model = tiny_llama(torch.bfloat16, NONCAUSAL_UNDER_CAPTURE)
    ids = torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits.float()
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
            captured = model(input_ids=ids, use_cache=False).logits.float()
    assert (captured - eager).abs().max() > 10 * SCALED_ATOL[torch.bfloat16] * eager.abs().max()
