"""SamplingMetadata, sample(), InputBuffers, InputBatch and BatchBuilder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis")
from conftest import ToyPagedModel
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from graphrt import GraphRunner
from graphrt.batch import ForwardMode
from graphrt.host.input_batch import SCRATCH_SLOT, BatchBuilder, InputBatch, InputBuffers, KvSlots
from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata, sample


def make_buffers(**kwargs) -> InputBuffers:
    """Small CPU buffers with a block table."""
    args = dict(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=4, block_size=4)
    args.update(kwargs)
    return InputBuffers.allocate(**args)


def slots(start: int, n: int) -> KvSlots:
    """Request row ``start`` writing to slots ``100*start ..``."""
    return KvSlots(start, out_cache_loc=list(range(100 * start, 100 * start + n)))


# --- SamplingMetadata -------------------------------------------------------------------------


def test_from_defaults_is_neutral():
    meta = SamplingMetadata.from_defaults(3)
    assert meta.num_reqs == 3
    for name, value in SAMPLING_DEFAULTS.items():
        assert getattr(meta, name).tolist() == [value] * 3, name
    assert meta.top_ks.dtype == torch.int64 and meta.temperatures.dtype == torch.float32
    assert not meta.is_greedy().any()


def test_from_params_fills_omitted_and_validates():
    meta = SamplingMetadata.from_params([0.0, 0.5], [-1, 5], [1.0, 0.9], presence_penalties=[0.0, 1.5])
    assert meta.is_greedy().tolist() == [True, False]
    assert meta.top_ks.tolist() == [-1, 5]
    assert meta.min_ps.tolist() == [0.0, 0.0]
    assert meta.presence_penalties.tolist() == [0.0, 1.5]
    with pytest.raises(ValueError, match="top_ps: expected 2 entries"):
        SamplingMetadata.from_params([1.0, 1.0], [-1, -1], [1.0])
    with pytest.raises(ValueError, match="frequency_penalties: expected 1 entries"):
        SamplingMetadata.from_params([1.0], [-1], [1.0], frequency_penalties=[0.0, 0.0])
    with pytest.raises(ValueError, match="temperatures: expected values >= 0"):
        SamplingMetadata.from_params([-0.5], [-1], [1.0])
    with pytest.raises(ValueError, match="top_ks"):
        SamplingMetadata.from_params([1.0], [0], [1.0])
    with pytest.raises(ValueError, match="top_ps"):
        SamplingMetadata.from_params([1.0], [-1], [0.0])


def test_slice_is_a_view_of_rows():
    meta = SamplingMetadata.from_params([0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4], [1.0] * 4)
    part = meta.slice(1, 3)
    assert part.num_reqs == 2 and part.top_ks.tolist() == [2, 3]
    part.top_ks[0] = 9
    assert meta.top_ks[1] == 9


# --- sample -----------------------------------------------------------------------------------


def test_sample_uses_each_requests_parameters():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    meta = SamplingMetadata.from_params([0.0, 5.0, 0.0, 5.0], [-1, 1, -1, -1], [1.0] * 4)
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([sample(logits, meta, generator=gen) for _ in range(20)])
    argmax = logits.argmax(dim=-1)
    assert (draws[:, 0] == argmax[0]).all() and (draws[:, 2] == argmax[2]).all()  # greedy rows
    assert (draws[:, 1] == argmax[1]).all()  # top_k=1 at a high temperature is still argmax
    assert len(set(draws[:, 3].tolist())) > 1  # a plain temperature-5 row really samples


def test_temperature_row_matches_manual_computation():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    meta = SamplingMetadata.from_params([0.7], [-1], [1.0])
    probs = torch.softmax(logits / 0.7, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    for seed in range(10):
        expected = sorted_ids[0, torch.multinomial(sorted_probs, 1, generator=torch.Generator().manual_seed(seed))]
        got = sample(logits, meta, generator=torch.Generator().manual_seed(seed))
        assert got.tolist() == expected.view(-1).tolist()


def test_sample_frequencies_follow_tempered_softmax():
    rows = 8000
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5]).repeat(rows, 1)
    meta = SamplingMetadata.from_params([2.0] * rows, [-1] * rows, [1.0] * rows)
    tokens = sample(logits, meta, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, dim=-1), atol=0.025)


@pytest.mark.parametrize("params", [dict(top_ps=[0.7]), dict(min_ps=[0.5]), dict(top_ks=[2])])
def test_top_p_min_p_top_k_keep_only_the_head(params):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 2000
    args = dict(temperatures=[1.0], top_ks=[-1], top_ps=[1.0])
    args.update(params)
    meta = SamplingMetadata.from_params(**args)
    meta = meta.map(lambda t: t.repeat(rows))
    tokens = sample(probs.log().repeat(rows, 1), meta, generator=torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) == {0, 1}


def test_penalties_apply_only_with_token_counts():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [-1.0, -2.0, -3.0]])
    meta = SamplingMetadata.from_params([0.0] * 3, [-1] * 3, [1.0] * 3, repetition_penalties=[2.0, 1.0, 4.0],
                                        presence_penalties=[0.0, 0.6, 0.0], frequency_penalties=[0.0, 0.3, 0.0])
    counts = torch.tensor([[1, 0, 0], [2, 0, 0], [1, 0, 0]])
    assert sample(logits, meta).tolist() == [0, 0, 0]
    # row 0: 3/2 < 2; row 1: 3 - 0.6 - 0.6 = 1.8 < 2; row 2: -1*4 < -2
    assert sample(logits, meta, token_counts=counts).tolist() == [1, 1, 1]


def test_sample_rejects_wrong_logits_shape():
    with pytest.raises(ValueError, match="logits: expected shape"):
        sample(torch.zeros(3, 5), SamplingMetadata.from_defaults(2))


# --- InputBuffers -----------------------------------------------------------------------------


def test_allocate_layout_and_embeds():
    buffers = InputBuffers.allocate(4, 16, embed_dim=8, max_blocks_per_req=3, dtype=torch.float64)
    assert buffers.inputs_embeds.shape == (16, 8) and buffers.inputs_embeds.dtype == torch.float64
    assert buffers.device_views["block_table"].shape == (4, 3)
    assert buffers.device_views["query_start_loc"].shape == (5,)
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert buffers.host_views[name].shape == (16,)
        assert buffers.device_views[name].untyped_storage().data_ptr() == buffers.device_arena.data_ptr()
    assert not buffers.host_arena.is_pinned()  # no CUDA here: never pin
    with pytest.raises(ValueError, match="max_num_tokens"):
        InputBuffers.allocate(4, 0)
    with pytest.raises(ValueError, match="block_size"):
        InputBuffers.allocate(4, 4, block_size=0)


def test_reset_zeroes_arenas_and_restores_sampling():
    buffers = make_buffers(embed_dim=2)
    builder = BatchBuilder(buffers)
    builder.add_request("a", [5, 6], [0, 1], temperature=0.0, top_k=3, kv=slots(1, 2))
    builder.build()
    buffers.inputs_embeds.fill_(1.0)
    assert buffers.device_arena.abs().sum() > 0
    buffers.reset()
    assert buffers.host_arena.abs().sum() == 0 and buffers.device_arena.abs().sum() == 0
    assert buffers.inputs_embeds.abs().sum() == 0
    assert buffers.sampling.temperatures[0] == 1.0 and buffers.sampling.top_ks[0] == -1


# --- BatchBuilder -----------------------------------------------------------------------------


def test_builder_counts_and_fields():
    builder = BatchBuilder(make_buffers())
    assert builder.is_empty and not builder.is_full
    assert builder.add_request("p", [1, 2, 3], [4, 5, 6], top_p=0.5, kv=KvSlots(2, block_ids=[7, 8])) == 0
    assert builder.add_request("d", [9], [3], temperature=0.0, kv=slots(1, 1)) == 1
    assert (builder.num_reqs, builder.total_tokens, builder.is_empty) == (2, 4, False)
    batch = builder.build()
    assert batch.forward_mode == ForwardMode.MIXED
    assert batch.input_ids.tolist() == [1, 2, 3, 9] and batch.positions.tolist() == [4, 5, 6, 3]
    assert batch.out_cache_loc.tolist() == [8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2, 100]  # positions 4..6: block 1 = 8
    assert batch.block_table.tolist() == [[7, 8, 0, 0], [0, 0, 0, 0]]
    assert batch.query_start_loc.tolist() == [0, 3, 4]
    assert batch.seq_lens.tolist() == [7, 4] and batch.seq_lens_sum == 11
    assert batch.extend_prefix_lens.tolist() == [4, 3] and batch.extend_seq_lens.tolist() == [3, 1]
    assert batch.req_pool_indices.tolist() == [2, 1]
    assert batch.sampling_metadata.top_ps.tolist() == [0.5, 1.0]
    assert batch.sampling_metadata.is_greedy().tolist() == [False, True]
    builder.reset()
    assert builder.is_empty and builder.total_tokens == 0


def test_builder_full_by_requests_or_tokens():
    builder = BatchBuilder(make_buffers(max_num_reqs=2, max_num_tokens=5))
    builder.add_request("a", [1, 2, 3, 4, 5], range(5))
    assert builder.is_full and builder.num_reqs == 1
    builder.reset()
    builder.add_request("a", [1], [0])
    builder.add_request("b", [1], [0])
    assert builder.is_full and builder.total_tokens == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(req_id="a"), "req_id: duplicate"),
        (dict(input_ids=[1, 2], positions=[0]), "positions: expected 2"),
        (dict(input_ids=[], positions=[]), "input_ids: expected at least one"),
        (dict(input_ids=[1] * 6, positions=range(6)), "max_num_tokens=8"),
        (dict(positions=[-1]), "positions: expected non-negative"),
        (dict(input_ids=[1, 2], positions=[0, 0]), "positions: last position 0"),
        (dict(input_ids=[[1]], positions=[[0]]), "input_ids: expected a 1-D"),
        (dict(temperature=float("nan")), "temperatures"),
        (dict(min_p=1.5), "min_ps"),
        (dict(top_k=0), "top_ks: expected values -1"),
        (dict(top_p=0.0), "top_ps"),
        (dict(repetition_penalty=0.0), "repetition_penalties"),
        (dict(kv=KvSlots(-1, out_cache_loc=[0])), "req_pool_index"),
        (dict(kv=KvSlots(0, out_cache_loc=[0, 1])), "out_cache_loc: expected 1 slots"),
        (dict(kv=KvSlots(0)), "out_cache_loc: KvSlots needs"),
        (dict(positions=[9], kv=KvSlots(0, block_ids=[1, 2])), "block_ids: positions up to 9 need 3"),
        (dict(kv=KvSlots(0, block_ids=[1] * 5)), "max_blocks_per_req=4"),
    ],
)
def test_add_request_errors_name_the_field_and_change_nothing(kwargs, field):
    builder = BatchBuilder(make_buffers(max_num_tokens=8))
    builder.add_request("a", [1, 2, 3], [0, 1, 2], kv=slots(0, 3))
    args = dict(req_id="b", input_ids=[7], positions=[3])
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        builder.add_request(**args)
    assert (builder.num_reqs, builder.total_tokens) == (1, 3)
    builder.add_request("c", [4], [3], kv=slots(1, 1))
    assert builder.build().input_ids.tolist() == [1, 2, 3, 4]


def test_add_past_request_capacity():
    builder = BatchBuilder(make_buffers(max_num_reqs=1))
    builder.add_request("a", [1], [0])
    with pytest.raises(ValueError, match="max_num_reqs=1"):
        builder.add_request("b", [1], [0])


def test_block_table_row_is_cleared_when_reused():
    buffers = make_buffers()
    builder = BatchBuilder(buffers)
    builder.add_request("a", [1], [0], kv=KvSlots(0, block_ids=[5, 6, 7]))
    builder.build()
    builder.reset()
    builder.add_request("b", [1], [0], kv=KvSlots(0, block_ids=[9]))
    assert builder.build().block_table.tolist() == [[9, 0, 0, 0]]


# --- InputBatch -------------------------------------------------------------------------------


def test_from_requests_and_lookups():
    buffers = make_buffers()
    meta = SamplingMetadata.from_params([0.0, 0.3, 0.9], [-1, 2, 3], [1.0, 0.8, 0.7])
    batch = InputBatch.from_requests(["x", "y", "z"], [[1, 2], [3], [4, 5, 6]], [[0, 1], [7], [0, 1, 2]],
                                     buffers, sampling_metadata=meta)
    assert (batch.num_reqs, batch.num_tokens) == (3, 6)
    assert batch.get_req_index("z") == 2
    with pytest.raises(KeyError, match="req_id"):
        batch.get_req_index("nope")
    assert batch.get_logits_indices().tolist() == [1, 2, 5]
    assert [batch.get_token_range(i) for i in range(3)] == [(0, 2), (2, 3), (3, 6)]
    with pytest.raises(IndexError, match="req_idx"):
        batch.get_token_range(3)
    for i in range(3):  # sampling rows line up with request token ranges
        view = batch.slice_request(i)
        start, end = view.token_range
        assert view.input_ids.tolist() == batch.input_ids[start:end].tolist()
        assert view.positions.tolist() == batch.positions[start:end].tolist()
        assert view.sampling_metadata.top_ks.tolist() == [meta.top_ks[i].item()]
        assert view.sampling_metadata.temperatures.tolist() == meta.slice(i, i + 1).temperatures.tolist()


def test_from_requests_validates_list_lengths():
    buffers = make_buffers()
    with pytest.raises(ValueError, match="positions_list: expected 2"):
        InputBatch.from_requests(["a", "b"], [[1], [2]], [[0]], buffers)
    with pytest.raises(ValueError, match="sampling_metadata: expected 1 rows"):
        InputBatch.from_requests(["a"], [[1]], [[0]], buffers, sampling_metadata=SamplingMetadata.from_defaults(2))
    with pytest.raises(ValueError, match="kv_slots: expected 1"):
        InputBatch.from_requests(["a"], [[1]], [[0]], buffers, kv_slots=[])


def test_make_dummy_is_harmless_and_converts():
    batch = InputBatch.make_dummy(3, 7, make_buffers())
    assert [batch.get_token_range(i) for i in range(3)] == [(0, 2), (2, 4), (4, 7)]
    assert batch.input_ids.tolist() == [0] * 7 and set(batch.out_cache_loc.tolist()) == {SCRATCH_SLOT}
    assert batch.seq_lens.tolist() == [2, 2, 3] and batch.forward_mode == ForwardMode.EXTEND
    batch.to_forward_batch().validate()
    decode = InputBatch.make_dummy(4, 4, make_buffers())
    assert decode.forward_mode == ForwardMode.DECODE and decode.seq_lens.tolist() == [1] * 4
    idle = InputBatch.make_dummy(0, 0, make_buffers())
    assert idle.forward_mode == ForwardMode.IDLE
    idle.to_forward_batch().validate()
    with pytest.raises(ValueError, match="num_tokens"):
        InputBatch.make_dummy(3, 2, make_buffers())


def test_to_forward_batch_decode_has_no_extend_fields():
    batch = InputBatch.from_requests(["a", "b"], [[3], [4]], [[5], [0]], make_buffers(),
                                     kv_slots=[slots(1, 1), slots(2, 1)])
    fb = batch.to_forward_batch(return_logprob=True)
    fb.validate()
    assert fb.forward_mode == ForwardMode.DECODE and fb.return_logprob
    assert fb.extend_seq_lens is None and fb.extend_num_tokens is None
    assert fb.seq_lens_sum == 7 and fb.seq_lens_cpu.tolist() == [6, 1] and fb.seq_lens_cpu.device.type == "cpu"
    assert fb.out_cache_loc.tolist() == [100, 200] and fb.req_pool_indices.tolist() == [1, 2]


def test_to_forward_batch_extend_fields_and_mirrors():
    batch = InputBatch.from_requests(["a", "b"], [[1, 2, 3], [4, 5]], [[0, 1, 2], [6, 7]], make_buffers(),
                                     kv_slots=[slots(1, 3), slots(2, 2)])
    fb = batch.to_forward_batch()
    fb.validate()
    assert fb.forward_mode == ForwardMode.EXTEND and fb.extend_num_tokens == 5
    assert fb.extend_start_loc.tolist() == [0, 3] and fb.extend_seq_lens.tolist() == [3, 2]
    assert fb.extend_prefix_lens.tolist() == [0, 6] and fb.extend_prefix_lens_cpu == [0, 6]
    assert fb.extend_seq_lens_cpu == [3, 2] and fb.seq_lens_sum == 3 + 8


def test_to_forward_batch_needs_kv_from_somewhere():
    batch = InputBatch.from_requests(["a", "b"], [[1], [2]], [[0], [0]], make_buffers())
    with pytest.raises(ValueError, match="out_cache_loc: requests were added without KvSlots"):
        batch.to_forward_batch()
    fb = batch.to_forward_batch(req_pool_indices=torch.tensor([3, 4]), out_cache_loc=torch.tensor([30, 40]))
    fb.validate()
    assert fb.out_cache_loc.tolist() == [30, 40] and fb.req_pool_indices.tolist() == [3, 4]


def test_builds_never_allocate_and_copy_only_the_used_prefix():
    buffers = make_buffers(max_num_reqs=8, max_num_tokens=32)
    builder = BatchBuilder(buffers)
    host_ptrs, dev_ptr = {arena.data_ptr() for arena in buffers.host_arenas}, buffers.device_arena.data_ptr()
    expected_ptrs = {name: buffers.device_views[name].data_ptr() for name in ("input_ids", "positions", "seq_lens")}
    rng = np.random.default_rng(0)
    for step in range(100):
        builder.reset()
        lengths = rng.integers(1, 5, size=rng.integers(1, 8))
        for i, n in enumerate(lengths):
            builder.add_request(f"r{step}-{i}", np.full(n, step), np.arange(n), kv=KvSlots(i, block_ids=[i]))
        batch = builder.build()
        assert buffers.host_arena.data_ptr() in host_ptrs and buffers.device_arena.data_ptr() == dev_ptr
        for name, ptr in expected_ptrs.items():
            assert getattr(batch, name).data_ptr() == ptr, name
        assert batch.sampling_metadata.temperatures.data_ptr() == buffers.sampling.temperatures.data_ptr()
        assert batch.input_ids.tolist() == [step] * int(lengths.sum())
    # rows of the block table past the batch are not copied: a sentinel there survives a build
    buffers.device_views["block_table"][1:].fill_(-7)
    builder.reset()
    builder.add_request("only", [1], [0], kv=KvSlots(0, block_ids=[3]))
    builder.build()
    assert (buffers.device_views["block_table"][1:] == -7).all()
    used = buffers.device_views["block_table"].storage_offset() + buffers.max_blocks_per_req
    assert torch.equal(buffers.device_arena[:used], buffers.host_arena[:used])


class CopyEvent:
    """A CUDA event of a host-to-device copy, as the host sees it: pending from ``record()`` until the
    test completes it; ``synchronize()`` logs a wait (the host would block there)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.streams = []  # the stream of each record()

    def record(self, stream=None) -> None:
        self.streams.append(stream)
        self.log.append(("copy from", self.name))

    def synchronize(self) -> None:
        self.log.append(("host waits for", self.name))


def test_the_host_fills_the_next_step_while_the_last_copy_reads_its_arena(monkeypatch):
    """Two host arenas in turn (issue 40, item 8): the host writes step N+1 while step N's copy may
    still read its arena, and waits for a copy only when it comes back to that arena (step N+2)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    buffers = make_buffers()
    log = []
    buffers.copy_events = [CopyEvent("arena 0", log), CopyEvent("arena 1", log)]
    builder = BatchBuilder(buffers)
    for step in range(3):
        builder.reset()
        builder.add_request(f"r{step}", [step + 1, step + 2], [0, 1], kv=slots(1, 2))
        log.append(("built", step))
        assert builder.build().input_ids.tolist() == [step + 1, step + 2]
    assert log == [("built", 0), ("copy from", "arena 0"), ("built", 1), ("copy from", "arena 1"),
                   ("host waits for", "arena 0"), ("built", 2), ("copy from", "arena 0")]


def test_the_copy_events_record_on_the_stream_of_the_arenas_device(monkeypatch):
    """Issue 48, item 6: the copy to the device arena runs on its device's current stream (the copy's
    device guard), so its event records there, not on the current device's stream (another device's
    when the arena sits on cuda:1)."""
    buffers = make_buffers()
    events = buffers.copy_events = [CopyEvent("arena 0", []), CopyEvent("arena 1", [])]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    builder = BatchBuilder(buffers)
    builder.add_request("r", [1, 2], [0, 1], kv=slots(1, 2))
    builder.build()
    assert events[0].streams == [("stream of", buffers.device)]


def test_the_copy_back_event_records_on_the_stream_of_the_arenas_device(monkeypatch):
    """Issue 48, item 6 on the copy back the engine reads its tokens through (issue 47): the copy from the
    device arena runs on its device's current stream, so the event ``read_back`` waits for records there."""
    buffers = make_buffers(result_regions={"tokens": 4})
    events = buffers.result_events = [CopyEvent("arena 0", []), CopyEvent("arena 1", [])]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    copied = buffers.copy_back("tokens", torch.tensor([7, 8, 9]))
    assert events[0].streams == [("stream of", buffers.device)] and buffers.read_back(copied) == [7, 8, 9]


def test_batch_views_follow_the_next_build():
    buffers = make_buffers()
    first = InputBatch.from_requests(["a"], [[1, 2]], [[0, 1]], buffers)
    InputBatch.from_requests(["b"], [[8, 9]], [[0, 1]], buffers)
    assert first.input_ids.tolist() == [8, 9]  # documented: valid until the next build on the buffers


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 20)), min_size=1, max_size=6))
def test_any_request_mix_gives_a_valid_forward_batch(reqs):
    buffers = InputBuffers.allocate(6, 30, max_blocks_per_req=8, block_size=4)
    builder = BatchBuilder(buffers)
    for i, (n, prefix) in enumerate(reqs):
        builder.add_request(f"r{i}", [i] * n, range(prefix, prefix + n), kv=KvSlots(i, block_ids=list(range(8))))
    fb = builder.build().to_forward_batch()
    fb.validate()
    assert fb.seq_lens.tolist() == [p + n for n, p in reqs] and fb.seq_lens_sum == sum(p + n for n, p in reqs)
    assert fb.positions.tolist() == [p for n, prefix in reqs for p in range(prefix, prefix + n)]
    assert fb.out_cache_loc.tolist() == fb.positions.tolist()  # identity block table
    if all(n == 1 for n, _ in reqs):
        assert fb.forward_mode == ForwardMode.DECODE
    else:
        assert fb.extend_start_loc.tolist() == np.cumsum([0] + [n for n, _ in reqs])[:-1].tolist()
        has_decode = any(n == 1 and p > 0 for n, p in reqs)
        assert fb.forward_mode == (ForwardMode.MIXED if has_decode else ForwardMode.EXTEND)


def test_built_batch_replays_through_the_runner():
    model = ToyPagedModel()
    runner = GraphRunner(model, max_batch_size=8, backend="emulated")
    runner.capture()
    builder = BatchBuilder(make_buffers(max_num_reqs=8, max_num_tokens=8))
    for i in range(3):  # requests and slots start at 1: 0 is the reserved padding row/slot
        builder.add_request(f"r{i}", [i + 5], [i + 2], kv=KvSlots(i + 1, out_cache_loc=[i + 1]))
    fb = builder.build().to_forward_batch()
    out = runner(fb).clone()
    assert runner.stats()["graph_runs"] == 1
    assert torch.allclose(out, model(fb.input_ids, fb.positions, fb), atol=1e-5)
