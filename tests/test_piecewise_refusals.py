"""Piecewise capture refuses clearly what it cannot replay; options; current_batch(); the CUDA call sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from piecewise_helpers import OP_CALLS, batch_total, double_rows, host_lengths, real_rows
from test_cuda_backend_api import fake_cuda  # noqa: F401 - the autospecced torch.cuda fixture
from ubatch_helpers import make_batch

import graphrt
from graphrt import ForwardMode, GraphRunner, RunnerConfig
from graphrt.capture import capture_graph
from graphrt.verify import verify_graph
from graphrt.backends.cuda import CudaGraphBackend, stream_capturing
from graphrt.layout.tensor_tree import same_value
from graphrt.piecewise import resolve_splitting_ops
from graphrt.piecewise.graph import PieceRecorder
from graphrt.reference import VARLEN_OP


class SplitToy(torch.nn.Module):
    """Embeds tokens, calls ``op`` between two row-wise steps, optionally reads a batch field in a piece."""

    def __init__(self, op, read_field=None, capture_only_path: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(1000, 8, generator=torch.Generator().manual_seed(0)))
        self.op, self.read_field, self.capture_only_path = op, read_field, capture_only_path

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed[input_ids] + positions[:, None]
        result = self.op(hidden)
        hidden = hidden if result is None else result
        if self.read_field is not None:
            hidden = hidden + getattr(forward_batch, self.read_field).sum()
        if self.capture_only_path:  # a path taken only while recorded: a replay cannot equal eager
            hidden = hidden + float(stream_capturing() is True)
        return hidden * 3



def toy_runner(model, **options) -> GraphRunner:
    options = {"max_batch_size": 4, "backend": "emulated", "progress": False, "splitting_ops": [model.op],
               "piecewise_sizes": [8, 16], **options}
    return GraphRunner(model, **options)


def extend_batch(counts):
    return dataclasses.replace(make_batch(counts), attn_backend=None)


def test_a_piece_reading_a_request_shaped_field_is_refused_naming_it():
    runner = toy_runner(SplitToy(double_rows, read_field="seq_lens"))
    report = runner.capture()
    failed = {str(key): reason for key, reason in report.failed.items()}
    assert sorted(failed) == ["piecewise/tokens=16", "piecewise/tokens=8"]
    assert "request-shaped field 'seq_lens'" in failed["piecewise/tokens=8"]
    assert "decode/bs=4" in runner.stats()["captured_keys"]  # a full decode graph may read it
    runner(extend_batch([3, 2]))
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1}


def test_check_reports_the_request_shaped_read_before_capture():
    report = toy_runner(SplitToy(double_rows, read_field="seq_lens")).check()
    [finding] = report.findings
    assert finding.kind == "step_raised" and "request-shaped field 'seq_lens'" in finding.message
    assert finding.source.startswith("tests/test_piecewise_refusals.py:") and report.pieces == 2
    assert toy_runner(SplitToy(double_rows)).check().ok


def test_a_splitting_op_that_writes_its_argument_splits_the_step():
    """The written argument is static memory between the pieces: the next piece reads what the op wrote."""
    model = SplitToy(torch.ops.graphrt_test.double_rows_)
    runner = toy_runner(model)
    assert not runner.capture().failed
    batch = extend_batch([3, 2])
    expected = (model.embed[batch.input_ids] + batch.positions[:, None]) * 2 * 3
    assert torch.equal(runner(batch), expected)
    assert runner.stats()["piecewise_runs"] == 1


def test_a_splitting_op_returning_another_shape_at_replay_disables_the_key_and_runs_eagerly():
    runner = toy_runner(SplitToy(real_rows))
    assert not runner.capture().failed  # at capture the live batch is the dummy one: the shapes agree
    batch = extend_batch([3, 2])
    result = runner(batch)
    assert result.shape == (5, 8)
    stats = runner.stats()
    assert stats["eager_reasons"] == {"replay_failed": 1} and stats["piecewise_runs"] == 0
    assert "splitting op graphrt_test::real_rows: returned shapes [[5, 8]], expected the captured [[8, 8]]" in (
        stats["failed_keys"]["piecewise/tokens=8"])


def test_a_first_replay_that_differs_from_eager_fails_the_key():
    runner = toy_runner(SplitToy(double_rows, capture_only_path=True))
    failed = {str(key): reason for key, reason in runner.capture().failed.items()}
    # The shared capture sequence verifies piecewise keys as it verifies full graphs.
    assert set(failed) >= {"piecewise/tokens=16", "piecewise/tokens=8"}
    assert all(failed[key].startswith("VerifyError: output leaf 0 differs from eager")
               for key in ("piecewise/tokens=16", "piecewise/tokens=8")), failed
    runner(extend_batch([3, 2]))
    assert runner.stats()["eager_reasons"] == {"verify_failed": 1}


def test_a_splitting_op_may_read_host_values_but_a_full_graph_may_not():
    runner = toy_runner(SplitToy(host_lengths), max_batch_size=2)
    failed = {str(key): reason for key, reason in runner.capture().failed.items()}
    # Inside a full graph the op's .tolist() is a host read during capture; between pieces it runs eagerly.
    assert sorted(failed) == ["decode/bs=1", "decode/bs=2"] and all("Tensor.tolist" in r for r in failed.values())
    batch = extend_batch([3, 2])
    assert torch.equal(runner(batch), (SplitToy(host_lengths).embed[batch.input_ids] + batch.positions[:, None])
                       * float(batch.seq_lens.sum()) * 3)
    assert runner.stats()["piecewise_runs"] == 1
    # graphrt.check agrees: the read fails the two full decode keys it records, not the piecewise step.
    [finding] = runner.check().of_kind("host_sync")
    assert finding.count == 2 and finding.op == "Tensor.tolist"


def test_a_splitting_op_the_step_never_calls_is_named():
    runner = toy_runner(SplitToy(double_rows), splitting_ops=[double_rows, "aten::cos"])
    failed = list(runner.capture().failed.values())
    assert len(failed) == 2 and all("aten::cos never called by the step" in reason for reason in failed), failed


def test_splitting_ops_and_piecewise_sizes_are_checked():
    with pytest.raises(TypeError, match="splitting_ops: expected OpOverload, OpOverloadPacket, custom op"):
        RunnerConfig(splitting_ops=[3])
    with pytest.raises(ValueError, match="splitting_ops: expected 'namespace::name'"):
        RunnerConfig(splitting_ops=["double_rows"])
    with pytest.raises(ValueError, match="no op 'graphrt_test::nope' is registered"):
        RunnerConfig(splitting_ops=["graphrt_test::nope"])
    with pytest.raises(ValueError, match="piecewise_sizes: expected None without splitting_ops"):
        RunnerConfig(piecewise_sizes=[8])
    with pytest.raises(ValueError, match="piecewise_sizes: expected ints"):
        RunnerConfig(splitting_ops=[VARLEN_OP], piecewise_sizes=[0, 8])
    config = RunnerConfig(max_batch_size=64, splitting_ops=["graphrt_reference::varlen_attention", VARLEN_OP.default])
    assert config.splitting_ops.names == ("graphrt_reference::varlen_attention", "graphrt_reference::varlen_attention.default")
    assert config.piecewise_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert RunnerConfig(max_batch_size=48, splitting_ops=[VARLEN_OP], modes=[ForwardMode.EXTEND],
                        extend_capture_sizes=([16, 40], [4])).piecewise_sizes == (1, 2, 4, 8, 16, 32, 48)


def test_current_batch_is_live_in_eager_and_piecewise_steps_and_frozen_in_full_graphs():
    assert graphrt.current_batch() is None
    runner = toy_runner(SplitToy(batch_total))
    assert not runner.capture().failed
    decode = make_batch([1, 1, 1])  # 3 requests, padded to the full decode graph of 4
    decode = dataclasses.replace(decode, attn_backend=None)
    replayed = runner(decode)
    # As on CUDA: the full graph keeps the host value its capture read (4 padding requests of length 1).
    assert runner.stats()["graph_runs"] == 1
    assert torch.equal(replayed, torch.full_like(replayed, 4.0 * 3))
    extend = extend_batch([3, 2])
    assert torch.equal(runner(extend), torch.full((5, 8), 3.0 * extend.seq_lens_sum))
    assert runner.stats()["piecewise_runs"] == 1
    eager = runner(extend_batch([9, 9]))  # above the largest piecewise size
    assert torch.equal(eager, torch.full((18, 8), 3.0 * extend_batch([9, 9]).seq_lens_sum))
    assert runner.stats()["eager_reasons"] == {"batch_too_large": 1}
    assert graphrt.current_batch() is None


def test_cuda_pieces_follow_torch_cuda_signatures_and_order(fake_cuda):  # noqa: F811 - the fixture
    events, fakes = fake_cuda
    backend = CudaGraphBackend(torch.device("cuda", 0))
    recorder = PieceRecorder(resolve_splitting_ops([double_rows]), {})
    side_stream = fakes["Stream"].return_value
    graph_mock = fakes["CUDAGraph"].return_value
    x = torch.arange(4.0)
    OP_CALLS.append(lambda: events.append(("splitting op",)))
    try:
        step = lambda: [double_rows(x + 1) * 3]  # noqa: E731
        with backend.capture_session():
            graph = capture_graph(backend, step, warmup_iters=1,
                                  record=lambda fn, generators: recorder(backend, fn, generators))
            verify_graph(graph, step, same_value)  # what capture runs after each recording
        events.append(("replay",))
        graph.replay()
    finally:
        OP_CALLS.clear()
    begin = ("capture_begin", {"pool": (0, 1), "capture_error_mode": "thread_local"})
    assert events == [
        ("enter stream", side_stream), ("splitting op",), ("exit stream", side_stream),  # warm-up
        ("enter stream", side_stream), begin, ("capture_end",),  # the pool's anchor, an empty graph
        begin, ("capture_end",), ("splitting op",), begin, ("capture_end",),  # piece 1 replays before the op
        ("exit stream", side_stream),
        ("splitting op",), ("splitting op",),  # the first replay checked against eager
        ("replay",), ("splitting op",),
    ]
    assert graph.piece_count == 2 and graph_mock.replay.call_count == 5
    fakes["synchronize"].assert_called_with(torch.device("cuda", 0))
    assert torch.equal(graph.outputs[0], (x + 1) * 6)
