"""graphrt.wrap() on real model code: tiny random Hugging Face causal LMs and torch built-ins.

Every model is built from a tiny config with random weights (no checkpoint download). On CPU
wrap() picks the emulated backend, on a GPU real CUDA graphs.

These are the cases that broke before capture ran nothing twice: a StaticCache advances its
in-place counter ``StaticLayer.cumulative_length`` and writes K/V at it on every run of the
step, so any extra run during capture (warm-up, recording) shifted the cache and changed the
tokens; a counter buffer counted the extra runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import VOCAB, cache_argument  # noqa: E402
from hf_helpers import tiny_causal_lm as tiny_model  # noqa: E402
from transformers import StaticCache  # noqa: E402

import graphrt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH = 4
PROMPT_LEN = 8
DECODE_STEPS = 24
# Room for a few extra steps, so a capture that wrongly ran the step shows up as wrong tokens
# rather than as an index_copy_ out-of-range error.
MAX_CACHE_LEN = 64
MODELS = ["llama", "qwen2", "gpt2"]
BATCH_SIZES = (1, 3, 5, 8)  # padded to the capture sizes [2, 4, 8] in parts b and c


def tiny_causal_lm(kind: str) -> torch.nn.Module:
    return tiny_model(kind, DEVICE)


def make_prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, PROMPT_LEN), generator=generator).to(DEVICE)


def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, wrapped: bool):
    """Eager prefill into a fresh StaticCache, then DECODE_STEPS greedy steps through
    ``step`` (eager) or ``graphrt.wrap(step)``. Returns (tokens, cache, callable)."""
    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)

    def step(input_ids, position_ids):
        # transformers 5.x models take no cache_position: StaticCache writes at its own counter,
        # position_ids drive RoPE / learned positions.
        return model(input_ids=input_ids, **cache_argument(model, cache), position_ids=position_ids,
                     use_cache=True).logits[:, -1]

    fast = graphrt.wrap(step, max_batch_size=BATCH, capture_sizes=[BATCH]) if wrapped else step
    with torch.no_grad():
        token = model(input_ids=prompt, **cache_argument(model, cache),
                      use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        for position in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
            position_ids = torch.full((BATCH, 1), position, device=DEVICE)
            token = fast(token, position_ids).argmax(-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, dim=1).tolist(), cache, fast


def cache_length(cache: StaticCache) -> int:
    return int(cache.layers[0].cumulative_length)


# ---------------------------------------------------------------- a. StaticCache decode


@pytest.mark.parametrize("kind", MODELS)
def test_eager_static_cache_decode_is_self_consistent(kind):
    """The reference the wrapped test compares against: deterministic and non-degenerate."""
    model = tiny_causal_lm(kind)
    prompt = make_prompt()
    first, cache, _ = greedy_decode(model, prompt, wrapped=False)
    second, _, _ = greedy_decode(copy.deepcopy(model), prompt, wrapped=False)
    assert first == second
    assert cache_length(cache) == PROMPT_LEN + DECODE_STEPS
    assert all(len(set(row)) >= 5 for row in first), "greedy decode collapsed: the comparison would be weak"


@pytest.mark.parametrize("kind", MODELS)
def test_static_cache_greedy_decode_matches_eager(kind):
    # Any extra run of step() during capture would advance StaticLayer.cumulative_length and
    # write duplicate K/V rows: the tokens and the final cache length both catch it.
    model = tiny_causal_lm(kind)
    prompt = make_prompt()
    expected, eager_cache, _ = greedy_decode(copy.deepcopy(model), prompt, wrapped=False)
    got, cache, fast = greedy_decode(model, prompt, wrapped=True)
    stats = fast.stats()
    assert stats["graph_runs"] > 0, stats
    assert got == expected, (
        f"tokens differ from eager; cache length {cache_length(cache)} after wrap, "
        f"{cache_length(eager_cache)} eagerly (expected {PROMPT_LEN + DECODE_STEPS})"
    )
    assert cache_length(cache) == PROMPT_LEN + DECODE_STEPS


# ---------------------------------------------------------------- b. no cache, padded batches


SEQ_LEN = 12


@pytest.mark.parametrize("mask", ["4d", "none"])
@pytest.mark.parametrize("kind", MODELS)
def test_full_forward_without_cache_matches_eager_with_padding(kind, mask):
    """mask="4d": a ready [1, 1, L, L] causal mask, so transformers builds no mask itself and the
    forward has no host sync: every call must replay a graph. mask="none": transformers'
    find_packed_sequence_indices reads a device value (masking_utils.py:776,
    `(packed_sequence_mask[:, -1] == 0).all()` in an `if`), which a CUDA graph cannot capture;
    results must still be right, whether replayed (emulated) or run eagerly (capture_failed)."""
    model = tiny_causal_lm(kind)
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool, device=DEVICE).tril()[None, None]
    attention_mask = causal if mask == "4d" else None

    def forward(input_ids):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    fast = graphrt.wrap(forward, max_batch_size=8, capture_sizes=[2, 4, 8])
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for batch_size in 2 * BATCH_SIZES:
            input_ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator).to(DEVICE)
            out = fast(input_ids)
            expected = model(input_ids=input_ids, use_cache=False).logits  # the plain eager call
            assert out.shape == expected.shape == (batch_size, SEQ_LEN, VOCAB)
            # float32, a padded size against the real one: GEMMs may round differently per batch size, and
            # the difference grows through the layers (3.6e-5 seen on logits with per-size rounding:
            # tests/gemm_rounding.py)
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    stats = fast.stats()
    if mask == "4d":  # the second pass at least replays graphs, whatever the first call per size does
        assert stats["graph_runs"] >= len(BATCH_SIZES), stats
    else:
        assert stats["graph_runs"] + stats["eager_runs"] == 2 * len(BATCH_SIZES), stats


# ---------------------------------------------------------------- c. torch built-ins

def check_against_eager(fn, make_input, compare=lambda out: out):
    """Call wrap(fn) twice at each of several padded batch sizes; compare(out) must match eager
    (atol=1e-5, rtol=1e-4, float32) and at least the second pass must replay graphs."""
    fast = graphrt.wrap(fn, max_batch_size=8, capture_sizes=[2, 4, 8])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch_size in 2 * BATCH_SIZES:
            x = make_input(batch_size, generator).to(DEVICE)
            got, expected = compare(fast(x)), compare(fn(x))
            for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    assert fast.stats()["graph_runs"] >= len(BATCH_SIZES), fast.stats()


def sequences(batch_size, generator):
    return torch.randn(batch_size, 6, 32, generator=generator)


def test_transformer_encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(DEVICE).eval()
    check_against_eager(encoder, sequences)


def test_multihead_attention_output_and_weights():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True).to(DEVICE).eval()
    # Returns (attn_output [B, L, E], attn_weights [B, L, L] averaged over heads): both batch-first.
    check_against_eager(lambda x: attention(x, x, x), sequences, compare=lambda out: (out[0], out[1]))


def make_gru():
    torch.manual_seed(0)
    return torch.nn.GRU(32, 16, num_layers=2, batch_first=True).to(DEVICE).eval()


def test_gru_output():
    check_against_eager(make_gru(), sequences, compare=lambda out: out[0])


def test_gru_h_n():
    # h_n is [num_layers, batch, hidden]: cut along dim 1, the axis whose size followed the batch.
    check_against_eager(make_gru(), sequences, compare=lambda out: out[1])


def test_cnn_with_batchnorm_eval():
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10),
    ).to(DEVICE)
    with torch.no_grad():  # non-trivial running stats, so eval-mode BatchNorm does something
        for bn in (cnn[1], cnn[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    cnn.eval()
    check_against_eager(cnn, lambda batch_size, generator: torch.randn(batch_size, 3, 12, 12, generator=generator))


# ---------------------------------------------------------------- d. side effects run once per call


class CountingModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return self.linear(x)


def test_in_place_buffer_update_runs_once_per_call():
    # One warm-up call (eager), one recorded call (its recording undone, then replayed), then replays.
    module = CountingModule().to(DEVICE)
    fast = graphrt.wrap(module, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        for _ in range(5):
            fast(torch.randn(4, 8, device=DEVICE))
    assert fast.stats()["graph_runs"] > 0
    assert int(module.steps) == 5
