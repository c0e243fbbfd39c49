"""GraphRunner(ubatch=...): batches beyond the largest capture size replay as micro-batches."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import BACKENDS, ToyPagedModel, decode_batch

from graphrt import GraphRunner
from graphrt.ubatch import UBatchConfig


def row_independent_batch(batch_size, device="cpu", seed=0):
    """Cache slots (101..) disjoint from request rows (1..100): no row reads what another writes."""
    slots = torch.randperm(150, generator=torch.Generator().manual_seed(seed))[:batch_size] + 101
    return decode_batch(batch_size, device=device, seed=seed, out_cache_loc=slots.to(device))


def make(backend="emulated", device="cpu", **options):
    model = ToyPagedModel(device=device)
    runner = GraphRunner(model, max_batch_size=16, capture_sizes=[1, 2, 4, 8, 16], backend=backend,
                         device=device, progress=False, **options)
    runner.capture()
    return model, runner


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_large_batches_split_into_graph_hits_and_equal_eager(backend_device):
    backend, device = backend_device
    model, runner = make(backend, device, ubatch=UBatchConfig())
    rng = random.Random(3)
    for step in range(12):
        batch_size = rng.randint(17, 60)
        batch = row_independent_batch(batch_size, device=device, seed=step)
        batch.seq_lens_cpu = batch.seq_lens.cpu()
        before = runner.stats()
        out = runner(batch)
        expected = model(batch.input_ids, batch.positions, batch)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        after = runner.stats()
        assert after["eager_runs"] == before["eager_runs"], "every micro-batch should replay a graph"
        assert after["graph_runs"] - before["graph_runs"] >= 2
    assert runner.stats()["histogram"]["DECODE"], "the whole batch size is recorded, not the pieces"
    assert max(runner.stats()["histogram"]["DECODE"]) > 16


def test_exact_split_has_no_padding_and_lands_on_capture_sizes():
    _, runner = make(ubatch=UBatchConfig())
    runner(decode_batch(16 + 16 + 4 + 2, seed=1))
    hits = runner.stats()["key_hits"]
    assert hits == {"decode/bs=16": 2, "decode/bs=4": 1, "decode/bs=2": 1}
    assert runner.stats()["padded_tokens"] == 0


def test_without_ubatch_large_batches_run_eagerly():
    model, runner = make()
    batch = decode_batch(40, seed=2)
    torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["eager_reasons"] == {"batch_too_large": 1}


def test_ubatch_options_are_checked():
    with pytest.raises(ValueError, match="ubatch.threaded"):
        make(ubatch=UBatchConfig(threaded=True))
    with pytest.raises(TypeError, match="ubatch: expected a UBatchConfig"):
        make(ubatch={"num_ubatches": 2})
