"""wrap(): graphs for a plain callable of tensors, per call layout."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import BACKENDS

from graphrt import wrap


def make_mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_wrapped_mlp_matches_eager_for_random_batch_sizes(backend_device):
    backend, device = backend_device
    mlp = make_mlp(device)
    bias = torch.randn(8, device=device)

    def fn(x, bias, mask=None, scale=1.0):
        return (mlp(x) + bias) * mask * scale

    fast = wrap(fn, max_batch_size=32, capture_sizes=[1, 2, 4, 8, 16, 32], backend=backend)
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(40):
            batch_size = rng.randint(1, 32)
            x = torch.randn(batch_size, 16, device=device)
            mask = torch.rand(batch_size, 1, device=device)
            eager_runs = fast.stats()["eager_runs"]
            out = fast(x, bias, mask=mask, scale=0.5)
            torch.testing.assert_close(out, fn(x, bias, mask=mask, scale=0.5), atol=1e-5, rtol=1e-5)
            if fast.stats()["eager_runs"] > eager_runs:
                continue  # a padded size's warm-up, or the one probe of output axes: the real step, run eagerly
            padded = 1 << (batch_size - 1).bit_length()
            x_pad = torch.cat([x, x.new_zeros(padded - batch_size, 16)])
            mask_pad = torch.cat([mask, mask.new_zeros(padded - batch_size, 1)])
            assert torch.equal(out, fn(x_pad, bias, mask=mask_pad, scale=0.5)[:batch_size])
    stats = fast.stats()
    reasons = stats["eager_reasons"]
    assert reasons["warmup"] == len(stats["captured_keys"]) and set(reasons) <= {"warmup", "axis_probe"}
    assert reasons.get("axis_probe", 0) <= 1, "one eager run at a second size shows the output's batch axis"
    assert stats["graph_runs"] + stats["eager_runs"] == 40


def test_non_batch_tensors_are_staged_each_call():
    fast = wrap(lambda x, weight: x @ weight, max_batch_size=8, capture_sizes=[8], backend="emulated")
    x = torch.randn(3, 4)
    first, second = torch.randn(4, 2), torch.randn(4, 2)
    torch.testing.assert_close(fast(x, first).clone(), x @ first)
    torch.testing.assert_close(fast(x, second), x @ second)


def test_a_call_with_another_layout_gets_graphs_of_its_own():
    mlp = make_mlp("cpu")
    fast = wrap(lambda x, scale=1.0: mlp(x) * scale, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    with torch.no_grad():
        fast(torch.randn(4, 16))
        wide = torch.randn(3, 16)
        for _ in range(3):  # new keyword: a layout of its own, warmed up, recorded, then replayed
            torch.testing.assert_close(fast(wide, scale=2.0), mlp(wide) * 2.0)
        # The first layout, padded: outputs were seen at bs=4 only, so this real step runs eagerly and
        # its output shapes show the batch axis; the next call records and replays.
        torch.testing.assert_close(fast(wide.double().float()), mlp(wide))
        assert fast(torch.randn(3, 16, dtype=torch.float64).float()).shape == (3, 8)
        with pytest.raises(RuntimeError):
            fast(torch.randn(3, 15))  # a third layout's warm-up, eager: the model itself rejects it
        fast(torch.randn(9, 16))
    stats = fast.stats()
    assert stats["eager_reasons"] == {"warmup": 3, "axis_probe": 1, "batch_too_large": 1}
    assert stats["graph_runs"] == 3 and stats["key_hits"] == {"call/bs=4": 1, "layout1:call/bs=4": 2}
    assert stats["arg_layout"] == {"args[0]": "dim 0"} and len(stats["layouts"]) == 3


def test_wrap_needs_a_batched_tensor():
    fast = wrap(lambda scale: scale, max_batch_size=4, backend="emulated")
    with pytest.raises(ValueError, match="args: expected at least one tensor"):
        fast(2.0)
