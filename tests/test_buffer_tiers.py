"""Seed 001 beyond the core: HierarchicalBufferPool, PredictiveBufferManager, create_input_buffer_manager."""

from __future__ import annotations

import pytest
import torch

from graphrt.pools.buffers import SimpleBufferPool
from graphrt.pools.tiers import (
    HierarchicalBufferPool,
    PredictiveBufferManager,
    Tier,
    create_input_buffer_manager,
    tier_availability,
)
from graphrt.staging import BufferSpec, InputBufferManager

ALL_AVAILABLE = {tier: "" for tier in Tier}


def fake_allocate(spec, tier):
    """Plain CPU tensors standing in for every tier, so tier logic is testable without CUDA."""
    return torch.zeros(spec.shape, dtype=spec.dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_cpu_only_machine_reports_host_tier_only():
    pool = HierarchicalBufferPool()
    stats = pool.tier_stats()
    assert stats["host"]["available"] and not stats["device"]["available"]
    assert "CUDA" in stats["pinned_host"]["reason"] and "managed" in stats["managed"]["reason"]
    tensor = pool.allocate(BufferSpec((4,)))
    pool.release(tensor)
    assert pool.allocate(BufferSpec((4,))) is tensor
    assert pool.tier_stats()["host"]["reuses"] == 1 and pool.tier_stats()["host"]["allocations"] == 1
    for _ in range(10):  # hot, but pinned memory is unavailable: stays on the host tier
        pool.release(tensor)
        tensor = pool.allocate(BufferSpec((4,)))
    assert pool.tier_for(BufferSpec((4,))) is Tier.HOST
    with pytest.raises(RuntimeError, match="tier device is unavailable"):
        pool.allocate(BufferSpec((4,), device=torch.device("cuda")))
    assert tier_availability()[Tier.HOST] == ""


def test_hot_host_specs_are_promoted_to_pinned_memory():
    pool = HierarchicalBufferPool(promote_after=3, availability=ALL_AVAILABLE, allocate=fake_allocate)
    spec = BufferSpec((8,), torch.int64)
    tiers = []
    for _ in range(5):
        tensor = pool.allocate(spec)
        tiers.append(pool.tier_for(spec))
        pool.release(tensor)
    assert tiers == [Tier.HOST, Tier.HOST, Tier.PINNED_HOST, Tier.PINNED_HOST, Tier.PINNED_HOST]
    stats = pool.tier_stats()
    assert stats["pinned_host"]["promotions"] == 1 and stats["pinned_host"]["reuses"] == 2


def test_pinned_tier_over_budget_demotes_released_buffers_to_host():
    spec = BufferSpec((16,), torch.int64)  # 128 bytes
    pool = HierarchicalBufferPool(availability=ALL_AVAILABLE, allocate=fake_allocate,
                                  tier_budgets={Tier.PINNED_HOST: 256})
    pinned = [pool.allocate(BufferSpec((16,), torch.int64, pin_memory=True)) for _ in range(3)]
    for tensor in pinned:
        pool.release(tensor)
    stats = pool.tier_stats()
    assert stats["pinned_host"]["bytes_free"] + stats["pinned_host"]["bytes_in_use"] <= 256
    assert stats["pinned_host"]["demotions"] == 1 and stats["host"]["bytes_free"] == spec.size_bytes()
    assert pool.allocate(spec) is not None and pool.tier_stats()["host"]["reuses"] == 1


def test_device_pressure_frees_released_device_buffers():
    pressure = {"value": 0.5}
    pool = HierarchicalBufferPool(availability=ALL_AVAILABLE, allocate=fake_allocate,
                                  pressure=lambda device: pressure["value"], pressure_threshold=0.8)
    spec = BufferSpec((4,), device=torch.device("cuda"))
    first = pool.allocate(spec)
    pool.release(first)
    assert pool.allocate(spec) is first, "no pressure: reused"
    pressure["value"] = 0.95
    pool.release(first)
    stats = pool.tier_stats()["device"]
    assert stats["demotions"] == 1 and stats["bytes_free"] == 0
    assert pool.allocate(spec) is not first
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.release(torch.zeros(1))


def test_predictive_manager_learns_and_prewarms():
    manager = PredictiveBufferManager(SimpleBufferPool(), max_batch_size=16, max_seq_len=16)
    for size in [3, 3, 3, 8, 8, 12, 12, 12, 12]:
        manager.record_usage(size)
    assert manager.predict_next_sizes(2) == [12, 3]
    assert manager.prewarm(2) == [12, 3]
    slot = manager.get_slot("input_ids")
    assert slot._views[12] is not None and slot._views[3] is not None and slot._views[5] is None
    with pytest.raises(ValueError, match="num_tokens"):
        manager.record_usage(17)
    assert PredictiveBufferManager(max_batch_size=4).predict_next_sizes() == []


def test_factory_builds_each_combination():
    plain = create_input_buffer_manager(8, 32)
    assert type(plain) is InputBufferManager and isinstance(plain.pool, SimpleBufferPool)
    assert plain.get_slot("input_ids").rows == 32 and plain.get_slot("seq_lens").rows == 8
    tiered = create_input_buffer_manager(8, use_hierarchical=True, use_predictive=True)
    assert isinstance(tiered, PredictiveBufferManager) and isinstance(tiered.pool, HierarchicalBufferPool)
    assert tiered.pool.tier_stats()["host"]["bytes_in_use"] == tiered.static_bytes()


def test_a_runner_takes_its_static_slots_from_a_configured_pool():
    from conftest import ToyPagedModel, decode_batch

    from graphrt import GraphRunner

    pool = HierarchicalBufferPool()
    model = ToyPagedModel()
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=[4, 8], backend="emulated", progress=False,
                         slot_pool=pool)
    assert pool.tier_stats()["host"]["bytes_in_use"] == runner.buffers.static_bytes() > 0
    runner.capture()
    batch = decode_batch(3, seed=1)
    expected = model(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(runner(batch), expected)
    with pytest.raises(TypeError, match="slot_pool: expected a buffer pool"):
        GraphRunner(model, max_batch_size=8, slot_pool=object())
