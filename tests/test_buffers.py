"""Seed 001 core: BufferSpec, BufferEntry, SimpleBufferPool (LRU), InputSlot, InputBufferManager."""

from __future__ import annotations

import pytest
import torch

from graphrt.pools.buffers import BufferEntry, BufferState, SimpleBufferPool
from graphrt.staging import BufferSpec, InputBufferManager, RowAxis


def test_buffer_spec_size_and_hash():
    spec = BufferSpec((4, 3), torch.float16)
    assert spec.size_bytes() == 24
    assert hash(spec) == hash(BufferSpec((4, 3), torch.float16))
    assert len({spec, BufferSpec((4, 3), torch.float16), BufferSpec((4, 3), torch.float32)}) == 2


def test_buffer_entry_lifecycle():
    entry = BufferEntry(BufferSpec((2,)), torch.zeros(2))
    entry.mark_in_use()
    assert entry.state is BufferState.IN_USE and entry.use_count == 1
    entry.release()
    assert entry.state is BufferState.FREE


def test_simple_pool_reuses_released_buffers_and_evicts_least_recently_used():
    pool = SimpleBufferPool(max_buffers=2)
    a = pool.allocate(BufferSpec((4,)))
    b = pool.allocate(BufferSpec((8,)))
    pool.release(a)
    assert pool.allocate(BufferSpec((4,))) is a, "a released buffer of the same spec is reused"
    pool.release(a)
    pool.release(b)
    c = pool.allocate(BufferSpec((16,)))  # full: evicts a (released before b)
    assert len(pool) == 2 and pool.allocate(BufferSpec((8,))) is b
    assert c.shape == (16,)
    with pytest.raises(MemoryError, match="all 2 buffers are in use"):
        pool.allocate(BufferSpec((32,)))
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.release(torch.zeros(1))
    pool.clear()
    assert len(pool) == 0


def test_input_slot_set_data_copies_pads_and_rejects_bad_data():
    manager = InputBufferManager(max_batch_size=6, register_defaults=False)
    slot = manager.register_slot("x", BufferSpec((6, 2), torch.float32), pad_value=-1)
    pointer = slot.tensor.data_ptr()
    slot.set_data(torch.ones(4, 2))
    slot.set_data(torch.full((2, 2), 5.0))
    assert slot.tensor[:2].eq(5).all() and slot.tensor[2:].eq(-1).all()
    before = slot.tensor.clone()
    with pytest.raises(TypeError, match="x: expected dtype torch.float32"):
        slot.set_data(torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="x: expected at most 6 rows"):
        slot.set_data(torch.ones(7, 2))
    with pytest.raises(ValueError, match=r"x: expected shape \['n', 2\]"):
        slot.set_data(torch.ones(2, 3))
    assert torch.equal(slot.tensor, before) and slot.tensor.data_ptr() == pointer


def test_manager_stages_inputs_and_serves_views():
    assert InputBufferManager(max_batch_size=4).pool is None  # static slots are allocated once, outside any pool
    manager = InputBufferManager(SimpleBufferPool(), max_batch_size=4, max_seq_len=8)
    assert set(manager.slots) == {"input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"}
    assert manager.get_slot("input_ids").rows == 8 and manager.get_slot("seq_lens").rows == 4
    manager.stage_inputs({"input_ids": torch.arange(1, 6), "seq_lens": torch.tensor([3, 2], dtype=torch.int32)},
                         num_tokens=5, num_reqs=2)
    views = manager.get_static_tensors(num_tokens=5, num_reqs=2)
    assert views["input_ids"].tolist() == [1, 2, 3, 4, 5] and views["seq_lens"].tolist() == [3, 2]
    assert manager.get_slot("seq_lens").tensor.tolist() == [3, 2, 1, 1]
    for name, view in manager.get_static_tensors(num_tokens=3, num_reqs=1).items():
        assert view.data_ptr() == manager.get_slot(name).tensor.data_ptr(), f"{name} is not a view"
    before = {name: slot.tensor.clone() for name, slot in manager.slots.items()}
    with pytest.raises(ValueError, match="seq_lens: expected 2 rows"):
        manager.stage_inputs({"input_ids": torch.arange(2), "seq_lens": torch.ones(3, dtype=torch.int32)},
                             num_tokens=2, num_reqs=2)
    assert all(torch.equal(before[name], slot.tensor) for name, slot in manager.slots.items())
    with pytest.raises(KeyError, match="nope: no such input slot"):
        manager.get_slot("nope")
    assert manager.static_bytes() == 8 * 8 * 3 + 4 * 8 + 4 * 4
    manager.release_all()
    assert manager.slots == {} and len(manager.pool) == 5


def test_fixed_slots_take_whole_tensors():
    manager = InputBufferManager(max_batch_size=4, register_defaults=False)
    slot = manager.register_slot("w", BufferSpec((2, 2)), axis=RowAxis.FIXED)
    slot.set_data(torch.ones(2, 2, dtype=torch.int64))
    assert slot.tensor.eq(1).all()
    with pytest.raises(ValueError, match=r"w: expected shape \[2, 2\]"):
        slot.set_data(torch.ones(1, 2, dtype=torch.int64))


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op of a block, with the dtypes of the tensor lists it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        lists = [arg for arg in args if isinstance(arg, (list, tuple))]
        self.ops.append((func, [{tensor.dtype for tensor in tensors} for tensors in lists]))
        return func(*args, **(kwargs or {}))


def test_a_decode_step_stages_with_one_fused_copy_per_dtype():
    """The decode fields are int64 ids and int32 lengths: a mixed-dtype _foreach_copy_ takes torch's
    per-tensor path (one copy kernel per field on CUDA), so staging copies each dtype group in one
    fused call, and a steady step (the same size again) re-pads nothing."""
    from conftest import decode_batch

    from graphrt import ForwardMode, GraphRunner

    runner = GraphRunner(lambda ids, pos, batch: ids * 2, max_batch_size=8, backend="emulated", progress=False)
    runner.capture()
    entry = runner.registry.lookup(ForwardMode.DECODE, 3, 3).entry
    batch = decode_batch(3, seed=1)
    entry.stager.stage(entry, batch, 3, 3)  # the first step at this size may re-pad rows
    with OpCounter() as counter:
        entry.stager.stage(entry, batch, 3, 3)
    assert [func.__name__ for func, _ in counter.ops] == ["_foreach_copy_.default"] * 2
    assert all(len(dtypes) == 1 for _, lists in counter.ops for dtypes in lists), counter.ops
    assert entry.stager._plan.copies_per_step == 2
