"""Micro-batching: ForwardBatch splits are valid, merged outputs are exact, dynamic sizing adapts.

Shared helpers (batches, a row-wise model, sizes) live in ubatch_helpers.py.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, namedtuple

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ubatch_helpers import SIZE_SETS, SIZES, batch_model, call_and_close, make_batch  # noqa: E402

from graphrt.pools import memory  # noqa: E402
from graphrt.ubatch import (
    DynamicUBatchWrapper,
    UBatchConfig,
    UBatchSlice,
    UBatchWrapper,
    current_ubatch,
    split_forward_batch,
)

FAST = settings(max_examples=40, deadline=None)


def rows_model(x, y, weight, scale):
    """Row-wise model with tuple/dict outputs and a non-batch weight passed whole."""
    assert weight.shape == (1, 4) and scale.dim() == 0
    return x * scale + y[:, :1], {"total": x.sum(1) + weight.sum()}


def test_split_forward_batch_builds_valid_sub_batches():
    batch = make_batch([5, 1, 7, 3], seed=1)
    parts = split_forward_batch(batch, [UBatchSlice.from_range(0, 6, 0, 2), UBatchSlice.from_range(6, 16, 2, 4)])
    for part, (tokens, reqs) in zip(parts, [(6, 2), (10, 2)]):
        part.validate()
        assert (part.num_tokens, part.batch_size, part.extend_num_tokens) == (tokens, reqs, tokens)
        assert part.seq_lens_sum == int(part.seq_lens_cpu.sum()) and int(part.extend_start_loc[0]) == 0
        assert part.attn_backend is batch.attn_backend and part.forward_mode is batch.forward_mode
    assert parts[1].extend_seq_lens_cpu == [7, 3] and parts[1].extend_start_loc.tolist() == [0, 7]


def test_slice_inputs_gives_one_micro_batchs_call():
    """The seed's per-slice API: a ForwardBatch call sliced as split_forward_batch slices it, a
    tensor call along dim 0; anything else is refused naming the inputs."""
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=SIZES))
    batch = make_batch([5, 1, 7, 3], seed=1)
    piece = UBatchSlice.from_range(6, 16, 2, 4)
    (sliced,), kwargs = wrapper.slice_inputs(((batch,), {}), piece)
    [expected] = split_forward_batch(batch, [piece])
    assert kwargs == {} and sliced.extend_seq_lens_cpu == expected.extend_seq_lens_cpu == [7, 3]
    assert torch.equal(sliced.input_ids, expected.input_ids) and sliced.seq_lens_sum == expected.seq_lens_sum
    x = torch.arange(12.0).view(6, 2)
    (rows,), _ = wrapper.slice_inputs(((x,), {}), UBatchSlice.from_range(2, 5, 2, 5))
    assert torch.equal(rows, x[2:5])
    with pytest.raises(ValueError, match="inputs: expected a ForwardBatch or a tensor"):
        wrapper.slice_inputs((("no tensors",), {}), piece)


def test_split_forward_batch_rejects_a_split_request_and_multimodal_batches():
    batch = make_batch([2, 2])
    with pytest.raises(ValueError, match="whole requests"):
        split_forward_batch(batch, [UBatchSlice.from_range(0, 3, 0, 1)])
    with pytest.raises(ValueError, match="pixel_values"):
        batch.pixel_values = torch.zeros(1, 3)
        split_forward_batch(batch, [UBatchSlice.from_range(0, 2, 0, 1)])


@FAST
@given(batch_size=st.integers(1, 200), sizes=st.sampled_from(SIZE_SETS), seed=st.integers(0, 9),
       threaded=st.booleans())
def test_decode_batches_match_the_whole_batch(batch_size, sizes, seed, threaded):
    batch = make_batch([1] * batch_size, seed=seed, mirrors=seed % 2 == 0)
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=sizes, threaded=threaded, barrier_timeout_s=10))
    assert torch.equal(call_and_close(wrapper, batch), batch_model(batch))


@FAST
@given(counts=st.lists(st.integers(1, 24), min_size=1, max_size=30), sizes=st.sampled_from(SIZE_SETS),
       seed=st.integers(0, 9), threaded=st.booleans())
def test_extend_batches_match_the_whole_batch(counts, sizes, seed, threaded):
    batch = make_batch(counts, seed=seed, mirrors=seed % 2 == 0)
    wrapper = UBatchWrapper(batch_model, UBatchConfig(capture_sizes=sizes, threaded=threaded, barrier_timeout_s=10))
    assert torch.equal(call_and_close(wrapper, batch), batch_model(batch))


@FAST
@given(rows=st.integers(1, 150), ubatches=st.integers(1, 4), sizes=st.sampled_from(SIZE_SETS + [[]]))
def test_generic_tensor_calls_merge_tuples_and_dicts(rows, ubatches, sizes):
    x = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
    y = -torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2)
    args = (x, y, torch.ones(1, 4, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
    wrapper = UBatchWrapper(rows_model, UBatchConfig(num_ubatches=ubatches, capture_sizes=sizes))
    out, extra = wrapper(*args)
    want, want_extra = rows_model(*args)
    assert torch.equal(out, want) and torch.equal(extra["total"], want_extra["total"])


def test_named_tuple_outputs_keep_their_type():
    Pair = namedtuple("Pair", "a b")
    wrapper = UBatchWrapper(lambda x: Pair(x + 1, x * 2), UBatchConfig(capture_sizes=[4, 8]))
    out = wrapper(torch.arange(20))
    assert isinstance(out, Pair)
    assert torch.equal(out.a, torch.arange(20) + 1) and torch.equal(out.b, torch.arange(20) * 2)


def test_nested_inputs_are_sliced_and_outputs_keep_their_container_types():
    Pair = namedtuple("Pair", "a b")

    def model(pair, extra):
        assert extra["w"].shape == (3,)  # no batch dim: passed whole
        return OrderedDict(total=pair.a + pair.b, rows=[extra["x"] * 2, None])

    x = torch.arange(70)
    pair, extra = Pair(x, x * 10), OrderedDict(x=x, w=torch.ones(3))
    out = UBatchWrapper(model, UBatchConfig(capture_sizes=SIZES))(pair, extra=extra)
    want = model(pair, extra)
    assert isinstance(out, OrderedDict) and list(out) == ["total", "rows"] and out["rows"][1] is None
    assert torch.equal(out["total"], want["total"]) and torch.equal(out["rows"][0], want["rows"][0])


class StaticBufferModel:
    """Stands in for graph replays: each padded size returns a view of its own static output buffer."""

    def __init__(self, sizes):
        self.sizes, self.buffers = sizes, {}

    def __call__(self, x):
        size = self.sizes[bisect.bisect_left(self.sizes, x.shape[0])]
        buffer = self.buffers.setdefault(size, torch.empty(size, dtype=x.dtype))
        buffer[: x.shape[0]].copy_(x * 3)
        return buffer[: x.shape[0]]


def test_outputs_of_repeated_sizes_are_copied_before_the_next_replay():
    wrapper = UBatchWrapper(StaticBufferModel(SIZES), UBatchConfig(capture_sizes=SIZES))
    x = torch.arange(130)
    assert [s.num_tokens for s in wrapper.compute_slices(130, 130)] == [64, 64, 2]
    assert torch.equal(wrapper(x), x * 3)


def test_current_ubatch_exposes_each_piece_to_the_model():
    seen = []

    def model(batch):
        meta = current_ubatch()
        seen.append((meta.context.slice_info.num_tokens, meta.num_tokens, meta.input_ids is batch.input_ids))
        return batch_model(batch)

    wrapper = UBatchWrapper(model, UBatchConfig(capture_sizes=SIZES))
    wrapper(make_batch([1] * 70))
    assert sorted(seen, reverse=True) == [(64, 64, True), (4, 4, True), (2, 2, True)]
    assert current_ubatch() is None


def test_wrapper_delegates_attributes_and_unwraps():
    model = StaticBufferModel(SIZES)
    wrapper = UBatchWrapper(model, UBatchConfig(capture_sizes=SIZES))
    assert wrapper.unwrap() is model and wrapper.sizes is SIZES
    with pytest.raises(AttributeError):
        wrapper.missing_attribute


# ---- dynamic sizing ----


def test_dynamic_wrapper_splits_more_under_memory_pressure():
    pressure = [0.0]
    wrapper = DynamicUBatchWrapper(lambda x: x + 1, UBatchConfig(capture_sizes=SIZES), memory_threshold=0.8,
                                   pressure_fn=lambda: pressure[0], pressure_every=1)
    counts = []
    for value in (0.0, 0.5, 0.8, 0.85, 0.9, 1.0):
        pressure[0] = value
        counts.append(len(wrapper.compute_slices(64, 64)))
    assert counts[:3] == [1, 1, 1] and counts == sorted(counts) and counts[-1] > counts[3] > 1
    x = torch.arange(150)
    assert torch.equal(wrapper(x), x + 1)


def test_dynamic_wrapper_probes_memory_once_every_pressure_every_calls():
    probes = []
    wrapper = DynamicUBatchWrapper(lambda x: x, UBatchConfig(capture_sizes=SIZES),
                                   pressure_fn=lambda: probes.append(1) or 0.95, pressure_every=8)
    counts = [len(wrapper.compute_slices(64, 64)) for _ in range(17)]
    assert len(probes) == 3 and len(set(counts)) == 1 and counts[0] > 1  # calls 1, 9 and 17 probe
    with pytest.raises(ValueError, match="pressure_every"):
        DynamicUBatchWrapper(lambda x: x, UBatchConfig(capture_sizes=SIZES), pressure_every=0)


def test_the_default_pressure_leaves_out_the_allocators_cached_blocks(monkeypatch):
    monkeypatch.setattr(memory, "probe_memory", lambda device=None: memory.MemoryInfo(10 << 30, 80 << 30, "nvml"))
    monkeypatch.setattr(memory, "_cuda_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 60 << 30)  # 40 GiB of it cached, unused
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 20 << 30)
    assert memory.memory_pressure() == 70 / 80
    assert memory.unreclaimable_pressure() == 30 / 80


def test_dynamic_wrapper_learns_the_best_size_from_timings():
    wrapper = DynamicUBatchWrapper(lambda x: x, UBatchConfig(capture_sizes=SIZES), pressure_fn=lambda: 0.0,
                                   min_samples=3)
    for _ in range(2):
        wrapper.record_timing(64, 1.0)  # 64 tokens/s
        wrapper.record_timing(30, 0.2)  # 150 tokens/s, in the 32 bucket
    assert wrapper.optimal_ubatch_size() is None
    wrapper.record_timing(64, 1.0)
    assert wrapper.optimal_ubatch_size() == 64
    wrapper.record_timing(32, 0.25)
    assert wrapper.optimal_ubatch_size() == 32
    assert [s.num_tokens for s in wrapper.compute_slices(64, 64)] == [32, 32]
    with pytest.raises(ValueError, match="elapsed"):
        wrapper.record_timing(8, 0.0)
