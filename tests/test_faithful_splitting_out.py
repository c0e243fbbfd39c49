"""A splitting op that writes its result into an ``out`` argument splits the step like one that returns it.

vLLM registers its attention op with ``mutates_args=["out"]``: the caller allocates ``out`` and
the op writes the result there. graphrt must place such a written argument as it places a
returned tensor (the next piece reads it), on both backends, so a vLLM-style model splits
unchanged. Port of vLLM's ``tests/compile/piecewise/test_simple.py`` (``SillyModel`` around
``silly.attention``, ``tests/compile/silly_attention.py``): two attention calls per step, each
called once per replay, the output equal to eager; here run through ``GraphRunner(...,
splitting_ops=...)`` on prefill batches, compared with eager on the batch padded to the piecewise
key (bitwise on the emulated backend, allclose 1e-5 on CUDA).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import BACKENDS
from faithful_helpers import assert_identical, extend_batch, pad_tokens

from graphrt import GraphRunner

SILLY_CALLS = []  # one entry per call of the op


@torch.library.custom_op("graphrt_faithful::silly_attention", mutates_args=("out",))
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's test attention: writes ``q + k + v`` into ``out`` and counts its calls."""
    SILLY_CALLS.append(1)
    out.copy_(q + k + v)


class SillyModel(torch.nn.Module):
    """vLLM's SillyModel on an embedding: ``x + 3``, attention, ``- 3``, attention, ``+ 1``, so the
    step computes ``9 * x + 19`` and calls the op twice. ``out_kind``: where ``out`` lives, a
    tensor the step allocates (``empty_like``, as vLLM's model does) or a view of a buffer the
    model owns (a preallocated attention output)."""

    def __init__(self, out_kind: str, device: str, max_tokens: int = 16) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(1000, 8, generator=generator).to(device))
        self.out_kind = out_kind
        self.register_buffer("attn_out", torch.zeros(2, max_tokens, 8, device=device))

    def output_for(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.out_kind == "allocated in the step":
            return torch.empty_like(x)
        return self.attn_out[layer, : x.shape[0]]

    def forward(self, input_ids, positions, forward_batch):
        x = self.embed[input_ids]
        x = x + 1
        x = x + 2
        out = self.output_for(x, 0)
        silly_attention(x, x, x, out)
        x = out
        x = x - 2
        x = x - 1
        out = self.output_for(x, 1)
        silly_attention(x, x, x, out)
        x = out
        return x + 1


OUT_KINDS = ["allocated in the step", "a view of a model buffer"]
PIECEWISE_SIZES = [8, 16]


def silly_runner(out_kind: str, backend: str, device: str):
    model = SillyModel(out_kind, device)
    runner = GraphRunner(model, max_batch_size=4, backend=backend, device=device, progress=False,
                         splitting_ops=[silly_attention], piecewise_sizes=PIECEWISE_SIZES)
    return model, runner


@pytest.mark.parametrize("out_kind", OUT_KINDS)
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_a_splitting_op_writing_out_splits_the_step_and_replays_eagers_result(backend_device, out_kind):
    """Every piecewise key captures in three pieces; each prefill step replays piecewise, calls the
    op exactly twice (once per call site, the model's Python never runs), and equals eager on the
    batch padded to the key, and ``9 * embedding + 19``."""
    backend, device = backend_device
    model, runner = silly_runner(out_kind, backend, device)
    report = runner.capture()
    assert not report.failed, report.failed
    assert {str(key.key): key.pieces for key in report.keys if str(key.key).startswith("piecewise")} == {
        "piecewise/tokens=8": 3, "piecewise/tokens=16": 3}
    rng = random.Random(0)
    exact = backend == "emulated"
    with torch.no_grad():
        for step in range(4):
            counts = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
            batch = extend_batch(counts, device=device, seed=step)
            tokens = batch.num_tokens
            padded = pad_tokens(batch, min(size for size in PIECEWISE_SIZES if size >= tokens))
            expected = model(padded.input_ids, padded.positions, padded)[:tokens].clone()
            SILLY_CALLS.clear()
            actual = runner(batch)
            assert len(SILLY_CALLS) == 2, f"step {step}: the op ran {len(SILLY_CALLS)} times"
            if exact:
                assert_identical(actual, expected)
            else:
                torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(actual, 9 * model.embed[batch.input_ids] + 19, atol=1e-4, rtol=1e-5)
    stats = runner.stats()
    assert stats["piecewise_runs"] == 4 and stats["eager_runs"] == 0, stats["eager_reasons"]


def test_check_lists_the_out_writing_op_as_a_split_site():
    """``runner.check()`` records the step split at the op (two call sites, three pieces) and finds
    nothing that would fail the piecewise capture."""
    _, runner = silly_runner(OUT_KINDS[0], "emulated", "cpu")
    report = runner.check()
    assert report.ok, str(report)
    assert report.pieces == 3
    assert [(site.op, site.count) for site in report.splits] == [("graphrt_faithful::silly_attention", 1)] * 2
