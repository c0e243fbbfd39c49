"""GraphRunner against eager execution: equivalence, KV side effects, static buffers, outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import BACKENDS, SCRATCH_SLOT, ToyPagedModel, decode_batch, pad_batch

from graphrt import ForwardMode, GraphRunner
from graphrt.sizes import default_capture_sizes

MAX_BS = 24
# Different batch sizes may pick different GEMM kernels, so real-size eager is compared with a tolerance.
ATOL, RTOL = 1e-5, 1e-5


def make_runner(backend, device, **options):
    model = ToyPagedModel(device=device)
    options.setdefault("progress", False)
    runner = GraphRunner(model, max_batch_size=MAX_BS, backend=backend, device=device, **options)
    return model, runner


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_every_batch_size_matches_eager(backend_device):
    backend, device = backend_device
    model, runner = make_runner(backend, device)
    runner.capture()
    table = {n: min(s for s in default_capture_sizes(MAX_BS) if s >= n) for n in range(1, MAX_BS + 1)}
    for batch_size in range(1, MAX_BS + 1):
        batch = decode_batch(batch_size, device, seed=batch_size)
        out = runner(batch).clone()
        assert out.shape == (batch_size, 97)
        padded = pad_batch(batch, table[batch_size])
        eager_padded = model(padded.input_ids, padded.positions, padded)[:batch_size]
        assert torch.equal(out, eager_padded), f"bs={batch_size}: graph differs from eager at padded size"
        eager = model(batch.input_ids, batch.positions, batch)
        torch.testing.assert_close(out, eager, atol=ATOL, rtol=RTOL)
    stats = runner.stats()
    assert stats["graph_runs"] == MAX_BS and stats["eager_runs"] == 0
    assert stats["real_tokens"] == sum(range(1, MAX_BS + 1))
    assert stats["padded_tokens"] == sum(table[n] - n for n in table)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_kv_writes_match_eager_and_padding_touches_only_scratch(backend_device):
    backend, device = backend_device
    model, runner = make_runner(backend, device)
    runner.capture()
    for batch_size in (3, 5, 13):
        batch = decode_batch(batch_size, device, seed=100 + batch_size)
        model.kv.zero_()
        runner(batch)
        graph_kv = model.kv.clone()
        model.kv.zero_()
        model(batch.input_ids, batch.positions, batch)
        eager_kv = model.kv.clone()
        assert torch.equal(graph_kv[1:], eager_kv[1:]), "graph wrote other KV rows than eager"
        touched = set(torch.nonzero(graph_kv.abs().sum(1)).flatten().tolist())
        assert touched <= set(batch.out_cache_loc.tolist()) | {SCRATCH_SLOT}
        assert SCRATCH_SLOT in touched, "padding rows should write the scratch slot"


def test_pad_values_override_scratch_slot():
    model, runner = make_runner("emulated", "cpu", pad_values={"out_cache_loc": 7})
    runner.capture()
    model.kv.zero_()
    batch = decode_batch(3, seed=1, out_cache_loc=torch.tensor([1, 2, 3]))
    runner(batch)
    touched = set(torch.nonzero(model.kv.abs().sum(1)).flatten().tolist())
    assert touched == {1, 2, 3, 7}


def test_static_tensors_keep_data_ptr_and_hold_one_max_batch():
    _, runner = make_runner("emulated", "cpu")
    pointers = {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()}
    runner.capture()
    for batch_size in (1, 7, 24, 2, 16, 9):
        runner(decode_batch(batch_size, seed=batch_size))
        assert {name: slot.tensor.data_ptr() for name, slot in runner.buffers.slots.items()} == pointers
    for entry in runner.registry.entries.values():
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
            view = getattr(entry.static_inputs, name)
            assert view.data_ptr() == pointers[name], f"{entry.key} {name} is not a view of the static slot"
    # input_ids, positions, out_cache_loc, req_pool_indices: int64; seq_lens and its host mirror: int32.
    assert runner.stats()["static_input_bytes"] == MAX_BS * (4 * 8 + 2 * 4)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_outputs_are_overwritten_by_next_replay_unless_copied(backend_device):
    backend, device = backend_device
    _, runner = make_runner(backend, device)
    runner.capture()
    first = runner(decode_batch(4, device, seed=1))
    kept = first.clone()
    runner(decode_batch(4, device, seed=2))
    assert not torch.equal(first, kept), "a view of the static output must reflect the next replay"
    _, copying = make_runner(backend, device, copy_outputs=True)
    copying.capture()
    first = copying(decode_batch(4, device, seed=1))
    kept = first.clone()
    copying(decode_batch(4, device, seed=2))
    assert torch.equal(first, kept), "copy_outputs=True must return owned tensors"


def test_staging_repads_rows_left_by_a_larger_step():
    model, runner = make_runner("emulated", "cpu")
    runner.capture()
    runner(decode_batch(8, seed=3))
    small = decode_batch(5, seed=4)
    out = runner(small).clone()
    ids = runner.buffers.get_slot("input_ids").tensor
    seq_lens = runner.buffers.get_slot("seq_lens").tensor
    assert ids[5:].eq(0).all() and seq_lens[5:].eq(1).all()
    padded = pad_batch(small, 8)
    assert torch.equal(out, model(padded.input_ids, padded.positions, padded)[:5])


def test_dict_and_tuple_outputs_are_sliced_to_real_rows():
    def model(input_ids, positions, forward_batch):
        hidden = input_ids.float()[:, None] * 2
        return {"logits": hidden, "pair": (hidden + 1, positions)}, torch.ones(3)

    runner = GraphRunner(model, max_batch_size=8, backend="emulated", progress=False)
    runner.capture()
    outputs, constant = runner(decode_batch(3, seed=5))
    assert outputs["logits"].shape == (3, 1) and outputs["pair"][0].shape == (3, 1)
    assert outputs["pair"][1].shape == (3,) and constant.shape == (3,)


def test_capture_report_lists_every_key_largest_first():
    _, runner = make_runner("emulated", "cpu", capture_sizes=[1, 4, 24])
    report = runner.capture()
    assert [key.num_reqs for key in report.ok] == [24, 4, 1]
    assert all(key.mode is ForwardMode.DECODE for key in report.ok)
    assert not report.failed and report.seconds >= 0
    assert "decode/bs=24" in str(report)


def test_attention_hooks_are_called_with_padded_static_batches():
    class RecordingBackend:
        def __init__(self):
            self.calls = []

        def init_graph_state(self, max_bs, max_num_tokens):
            self.calls.append(("state", max_bs, max_num_tokens))

        def init_forward_metadata_capture(self, forward_batch):
            self.calls.append(("capture", forward_batch.batch_size))

        def init_forward_metadata_replay(self, forward_batch):
            self.calls.append(("replay", forward_batch.batch_size, forward_batch.seq_lens_sum,
                               forward_batch.seq_lens_cpu.tolist() if forward_batch.seq_lens_cpu is not None else None))

        def init_forward_metadata(self, forward_batch):
            self.calls.append(("eager", forward_batch.batch_size))

    attn = RecordingBackend()
    runner = GraphRunner(ToyPagedModel(), max_batch_size=8, capture_sizes=[2, 8], backend="emulated",
                         batch_context={"attn_backend": attn}, progress=False)
    runner.capture()
    assert attn.calls == [("state", 8, 8), ("capture", 8), ("capture", 2)]
    attn.calls.clear()
    batch = decode_batch(5, seed=6)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    runner(batch)
    assert attn.calls == [("replay", 8, batch.seq_lens_sum + 3, batch.seq_lens.tolist() + [1, 1, 1])]
    attn.calls.clear()
    runner(decode_batch(9, seed=7, forward_mode=ForwardMode.DECODE))
    assert attn.calls == [("eager", 9)]


def test_graphs_disabled_env_runs_everything_eagerly(monkeypatch):
    monkeypatch.setenv("GRAPHRT_DISABLE", "1")
    model, runner = make_runner("emulated", "cpu")
    assert runner.capture().keys == []
    batch = decode_batch(4, seed=8)
    torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["eager_reasons"] == {"graphs_disabled": 1}


def test_attention_graph_state_is_allocated_once_across_captures():
    class CountingBackend:
        def __init__(self):
            self.states = 0

        def init_graph_state(self, max_bs, max_num_tokens):
            self.states += 1

    attn = CountingBackend()
    runner = GraphRunner(GemmFreeModel(), max_batch_size=8, capture_sizes=[2, 8], backend="emulated",
                         batch_context={"attn_backend": attn}, progress=False)
    runner.capture()
    for _ in range(20):
        runner(decode_batch(2, seed=1))
    runner.retune(max_graphs=1)  # recaptures: graphs captured before must keep reading the same buffers
    assert attn.states == 1
    assert runner.stats()["capture_sizes"] == [2]


class GemmFreeModel(torch.nn.Module):
    def forward(self, input_ids, positions, forward_batch):
        return input_ids[:, None] * 2.0


def test_runner_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_batch_size: expected an int >= 1"):
        GraphRunner(GemmFreeModel(), max_batch_size=0)
    with pytest.raises(ValueError, match="warmup_iters"):
        GraphRunner(GemmFreeModel(), max_batch_size=4, warmup_iters=-1)


@pytest.mark.cuda
def test_cuda_step_never_synchronizes_with_the_device():
    _, runner = make_runner("cuda", "cuda")
    runner.capture()
    batches = [decode_batch(n, "cuda", seed=n) for n in (5, 8, 3)]
    for batch in batches:  # first use of each size builds cached views
        runner(batch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches * 3:
            runner(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.stats()["graph_runs"] == 12
