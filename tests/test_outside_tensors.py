"""Tensors a step reads from outside its arguments (graphrt.outside_reads).

nano-vllm's attention reads ``slot_mapping``, ``context_lens`` and ``block_tables`` from a module
global set before every step (``utils/context.py``: ``set_context``/``get_context``), as vLLM's
layers read ``get_forward_context()``. Wrapped with ``graphrt.wrap(model)``, every replay would
read the recorded step's context tensors: silent wrong tokens. A recording whose step reads, at an
op where the warm-up call read another tensor, one that is neither an argument nor held by the
model or an argument object is refused (``OutsideTensorError`` naming the op and line), and
``graphrt.check`` reports such reads. The two ways that work: pass the tensors as arguments, or
use GraphRunner and build the context inside the step from ``graphrt.current_batch()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from conftest import decode_batch

import graphrt
from graphrt import GraphRunner, wrap
from graphrt.forward_context import use_batch

SLOTS, HIDDEN = 256, 8


@dataclass
class Context:
    slot_mapping: Optional[torch.Tensor] = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(slot_mapping: Optional[torch.Tensor]) -> None:
    global _CONTEXT
    _CONTEXT = Context(slot_mapping)


class ContextAttention(torch.nn.Module):
    """Stores each row's projection at its slot and mixes in the slot before it, the slots read
    from the global context (nano-vllm's Attention.forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cache", torch.zeros(SLOTS, HIDDEN))

    def forward(self, x: torch.Tensor, slot_mapping: Optional[torch.Tensor] = None) -> torch.Tensor:
        slots = get_context().slot_mapping if slot_mapping is None else slot_mapping
        hidden = self.proj(x)
        self.cache.index_copy_(0, slots, hidden)
        return hidden + self.cache[slots - 1]


def steps(call, model, count: int = 5, rows: int = 4, through_context: bool = True):
    """``count`` decode steps of ``rows`` sequences, each at fresh slots; outputs and the cache after."""
    outputs = []
    with torch.no_grad():
        for step in range(count):
            slots = torch.arange(rows) * 8 + step + 1
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(step))
            if through_context:
                set_context(slots)  # a new tensor every step, as nano-vllm's prepare_decode makes
                outputs.append(call(x).clone())
            else:
                outputs.append(call(x, slots).clone())
    set_context(None)
    return outputs, model.cache.clone()


def test_a_global_forward_context_is_refused_at_capture_naming_op_and_line():
    """Fails on main: every replay read the recorded step's slots (silent wrong outputs and cache)."""
    reference = ContextAttention().eval()
    expected = steps(reference, reference)
    model = ContextAttention().eval()
    fast = wrap(model, max_batch_size=8)
    outputs, cache = steps(fast, model)
    assert all(torch.equal(got, want) for got, want in zip(outputs, expected[0])) and torch.equal(cache, expected[1])
    stats = fast.stats()
    assert stats["graph_runs"] == 0
    (reason,) = stats["failed_keys"].values()
    assert reason.startswith("OutsideTensorError: aten.index_copy_ at ") and "test_outside_tensors.py" in reason
    assert "in forward" in reason and "Pass it as an argument" in reason and "current_batch()" in reason


_BLOCK = torch.zeros(64, dtype=torch.int64)  # device memory the caching allocator hands out again


def slots_in_the_freed_block(values: torch.Tensor) -> torch.Tensor:
    """``values`` in a storage made anew over ``_BLOCK``: a tensor made each call that the caching allocator
    puts in the block the last call's tensor freed (the same address, another storage)."""
    storage = torch._C._construct_storage_from_data_pointer(_BLOCK.data_ptr(), _BLOCK.device,
                                                            values.numel() * values.element_size())
    tensor = torch.empty(0, dtype=values.dtype).set_(storage, 0, values.shape, values.stride())
    return tensor.copy_(values)


def test_a_context_tensor_made_anew_at_the_same_address_is_refused_too():
    """Issue 48, item 6: the warm-up call and the recording read context tensors made anew at the same
    address (the caching allocator reused the freed block), which an address alone cannot tell from one
    tensor; later calls put theirs elsewhere, and every replay read the block. Now the storages differ
    (a weak reference to the warm-up's storage, dead by the recording): refused as above."""
    reference = ContextAttention().eval()
    model = ContextAttention().eval()
    fast = wrap(model, max_batch_size=8, capture_sizes=[4])
    with torch.no_grad():
        for step in range(5):
            slots = torch.arange(4) * 8 + step + 1
            x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(step))
            set_context(slots_in_the_freed_block(slots) if step < 2 else slots.clone())
            got = fast(x).clone()
            set_context(slots)
            want = reference(x)
            assert torch.equal(got, want), f"step {step}: the replay read the captured block's slots"
    set_context(None)
    (reason,) = fast.stats()["failed_keys"].values()
    assert reason.startswith("OutsideTensorError: aten.index_copy_ at ")


def test_the_same_tensors_passed_as_arguments_replay():
    reference = ContextAttention().eval()
    expected = steps(reference, reference, through_context=False)
    model = ContextAttention().eval()
    fast = wrap(model, max_batch_size=8)
    outputs, cache = steps(fast, model, through_context=False)
    assert all(torch.equal(got, want) for got, want in zip(outputs, expected[0])) and torch.equal(cache, expected[1])
    assert fast.stats()["graph_runs"] == 4 and fast.stats()["failed_keys"] == {}


SCALE = torch.full((HIDDEN,), 0.5)  # a module-level constant the step reads: the same tensor every call


def test_a_tensor_from_outside_that_stays_the_same_replays():
    model = ContextAttention().eval()
    fast = wrap(lambda x, slots: model(x, slots) * SCALE, max_batch_size=8)
    steps(fast, model, through_context=False)
    assert fast.stats()["graph_runs"] == 4 and fast.stats()["failed_keys"] == {}


class Holder:
    """An argument object whose tensor is rebound between calls: the guards' case, not an outside read."""

    def __init__(self) -> None:
        self.bias = torch.zeros(HIDDEN)


def test_a_tensor_an_argument_object_holds_is_left_to_the_guards():
    holder = Holder()
    fast = wrap(lambda x, holder: x + holder.bias, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        for step in range(6):
            holder.bias = torch.full((HIDDEN,), float(step))  # rebound every call
            x = torch.ones(4, HIDDEN)
            assert torch.equal(fast(x, holder), x + step)
    assert not any("OutsideTensorError" in reason for reason in fast.stats()["failed_keys"].values())


def test_check_reports_a_tensor_read_from_outside():
    model = ContextAttention().eval()
    set_context(torch.tensor([1, 2, 3, 4]))
    try:
        report = graphrt.check(model, torch.randn(4, HIDDEN))
    finally:
        set_context(None)
    (finding,) = report.of_kind("outside_tensor")
    assert not report.ok and finding.op == "aten.index_copy_" and "test_outside_tensors.py" in finding.source
    assert not graphrt.check(model, torch.randn(4, HIDDEN), torch.tensor([1, 2, 3, 4])).of_kind("outside_tensor")


class ContextFromBatch(torch.nn.Module):
    """The GraphRunner way: the step sets the context from the batch it is given (inside a graph,
    the static batch: current_batch()), so a replay reads the staged slots."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = ContextAttention()
        self.embed = torch.nn.Embedding(97, HIDDEN)

    def forward(self, input_ids, positions, forward_batch):
        set_context(graphrt.current_batch().out_cache_loc)
        try:
            return self.attention(self.embed(input_ids))
        finally:
            set_context(None)


def test_graph_runner_with_the_context_built_from_current_batch_replays():
    model = ContextFromBatch().eval()
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=[4, 8], progress=False)
    runner.capture()
    reference = ContextFromBatch().eval()
    reference.load_state_dict(model.state_dict())
    for seed in range(3):
        batch = decode_batch(3, seed=seed)
        got = runner(batch).clone()
        with torch.no_grad(), use_batch(batch):
            want = reference(batch.input_ids, batch.positions, batch)
        torch.testing.assert_close(got, want)
    # The graph ran at 4 rows, the reference at 3: the rows written are the same (bitwise), their values
    # agree within GEMM rounding, which may differ per batch size (tests/gemm_rounding.py).
    written, expected = model.attention.cache[1:], reference.attention.cache[1:]
    assert torch.equal(written != 0, expected != 0)
    torch.testing.assert_close(written, expected, rtol=1e-5, atol=1e-5)
    assert runner.stats()["graph_runs"] == 3
