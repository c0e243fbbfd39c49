"""Capture verifies each graph: its first replay is compared with eager on the same inputs.

A graph that computes something else than eager (random ops, a path that differs under capture,
memory written outside the dispatcher) never serves a call: the key runs eagerly with reason
``verify_failed`` and ``failed_keys`` names the output or state tensor that differed.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from graphrt import GraphRunner, wrap
from graphrt.backends.cuda import stream_capturing
from graphrt.entry import GraphStatus
from tests.conftest import ToyPagedModel, decode_batch



class PathUnderCapture(torch.nn.Module):
    """Takes another path while a CUDA stream captures (a model with a capture-only branch)."""

    def __init__(self, write_state: bool) -> None:
        super().__init__()
        self.write_state = write_state
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        under_capture = stream_capturing() is True
        if self.write_state:
            self.seen.copy_(torch.full((4,), 2.0 if under_capture else 1.0))  # state differs, output does not
            return x * 2
        return x * (3 if under_capture else 2)


# Calls of 3 rows pad to the key of 4: its verification's eager run is the padding check's run on the real
# rows (off the capture path), and its replay is compared with the capture's warm-up on all 4 rows.
ROWS = pytest.mark.parametrize("rows", [4, 3], ids=["exact", "padded"])


@ROWS
def test_output_that_differs_from_eager_disables_the_key_and_names_the_output(rows, caplog):
    model = PathUnderCapture(write_state=False)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated")
    x = torch.arange(2.0 * rows).reshape(rows, 2)
    with caplog.at_level("WARNING", logger="graphrt"):
        outputs = [fast(x) for _ in range(3)]
    for out in outputs:
        assert torch.equal(out, x * 2)  # every call has eager's numbers
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["eager_reasons"] == {"warmup": 1, "verify_failed": 2}
    reason = stats["failed_keys"]["call/bs=4"]
    assert reason.startswith("VerifyError: output leaf 0 differs from eager")
    assert "Greatest absolute difference" in reason
    said = " ".join(record.getMessage() for record in caplog.records)
    assert not stats["exact_sizes"] and "exact sizes" not in said, "a capture-only path, not the padding rows' doing"


@ROWS
def test_state_write_that_differs_from_eager_is_named_with_its_op_and_line(rows):
    model = PathUnderCapture(write_state=True)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated")
    x = torch.ones(rows, 2)
    fast(x)
    fast(x)
    reason = fast.stats()["failed_keys"]["call/bs=4"]
    assert "state written by aten.copy_.default" in reason
    assert "test_verify.py" in reason and "tensor [4] float32" in reason
    assert torch.equal(model.seen, torch.ones(4))  # the eager second call's write, as eager leaves it


def test_dropout_in_training_mode_verifies_and_each_replay_draws_what_eager_draws():
    """Verification runs eager and the replay from one generator state, so a random step verifies;
    every call then draws what the eager call would draw at that point of the sequence."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated")
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    with torch.no_grad():
        torch.manual_seed(1)
        graphed = [fast(x).clone() for x in inputs]
        torch.manual_seed(1)
        eager = [model(x) for x in inputs]
    assert all(torch.equal(got, want) for got, want in zip(graphed, eager))
    stats = fast.stats()
    assert stats["graph_runs"] == 3 and stats["eager_reasons"] == {"warmup": 1} and not stats["failed_keys"]


@ROWS
def test_kernel_outside_the_dispatcher_is_caught(rows):
    """A raw memory write (as a C extension's kernel does) is no aten op: no recording sees
    it, the replay would leave its output zero, so verification must refuse the graph (padded: the
    replay against the warm-up, whose real rows match the real-size run)."""

    def step(x):
        out = torch.zeros_like(x)
        ctypes.memmove(out.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        return out * 2

    fast = wrap(step, max_batch_size=4, capture_sizes=[4], backend="emulated")
    x = torch.arange(1.0, 1.0 + 2 * rows).reshape(rows, 2)
    for _ in range(3):
        assert torch.equal(fast(x), x * 2)
    assert fast.stats()["eager_reasons"] == {"warmup": 1, "verify_failed": 2}
    assert fast.stats()["failed_keys"]["call/bs=4"].startswith("VerifyError: output leaf 0 differs from eager")


def test_verify_false_skips_the_comparison_and_a_wrong_graph_serves():
    model = PathUnderCapture(write_state=False)
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated", verify=False)
    x = torch.ones(4, 2)
    fast(x)
    assert torch.equal(fast(x), x * 3)  # the graph recorded the capture-only path: what CUDA would replay
    assert fast.stats()["graph_runs"] == 1


def test_runner_capture_verifies_each_key_and_reports_its_cost(toy_runner_factory):
    runner = toy_runner_factory()
    report = runner.capture()
    assert report.ok and not report.failed
    assert all(key.verify_seconds > 0 for key in report.keys)
    assert "verify s" in str(report)
    unverified = toy_runner_factory(verify=False).capture()
    assert all(key.verify_seconds == 0 for key in unverified.keys)


def test_runner_key_whose_replay_differs_is_verify_failed_and_counted():
    class CaptureBranch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4096, 8)

        def forward(self, input_ids, positions, forward_batch):
            hidden = self.embed(input_ids)
            return hidden * 2 if stream_capturing() else hidden

    model = CaptureBranch()
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[2, 4], backend="emulated", progress=False)
    report = runner.capture()
    assert not report.ok and set(map(str, report.failed)) == {"decode/bs=2", "decode/bs=4"}
    assert all(entry.status is GraphStatus.VERIFY_FAILED for entry in runner.registry.entries.values())
    batch = decode_batch(3, seed=0)
    out = runner(batch)
    assert torch.equal(out, model.embed(batch.input_ids))
    assert runner.stats()["eager_reasons"] == {"verify_failed": 1}


@pytest.fixture
def toy_runner_factory():
    def make(**options):
        return GraphRunner(ToyPagedModel(), max_batch_size=8, capture_sizes=[2, 8], backend="emulated",
                           progress=False, **options)

    return make


def test_up_front_wrap_capture_verifies_and_leaves_state_as_it_was():
    model = PathUnderCapture(write_state=True)
    fast = wrap(model, max_batch_size=4, capture_sizes=[2, 4], backend="emulated")
    report = fast.capture(torch.ones(4, 2))
    assert not report.ok and all("VerifyError: state written by" in reason for reason in report.failed.values())
    assert torch.equal(model.seen, torch.zeros(4))  # recording, eager run and replay all undone


def test_a_bfloat16_result_cast_to_float32_is_judged_by_bfloat16s_rounding():
    """The first H200 session: the bench's bfloat16 model returns ``logits.float()``, and its piecewise keys
    differed from eager by one bfloat16 ulp (2**-6 at logits of 2 to 4) where verification allowed
    float32's 1e-5, so two healthy keys failed. A float32 tensor whose values are all bfloat16s is
    judged by bfloat16's rounding; a float32 computation keeps float32's, and a wrong graph still fails."""
    from graphrt.verify import computed_dtype, rounding_tolerance

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 128, generator=generator) * 2).to(torch.bfloat16)
    bumped = logits.clone()
    bumped[0, 16] = (logits[0, 16].float() * (1 + 2 ** -7)).to(torch.bfloat16)  # about one bfloat16 ulp up
    expected, replayed = logits.float(), bumped.float()
    assert computed_dtype(expected) is torch.bfloat16 and 0 < float((replayed - expected).abs().max()) <= 2 ** -5
    torch.testing.assert_close(replayed, expected, **rounding_tolerance(expected))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(replayed * 1.5, expected, **rounding_tolerance(expected))
    float32 = torch.randn(16, 128, generator=generator)
    assert computed_dtype(float32) is torch.float32
    assert rounding_tolerance(float32)["atol"] < 1e-4
    assert computed_dtype(torch.arange(8.0)) is torch.float32  # whole numbers say nothing of the dtype
