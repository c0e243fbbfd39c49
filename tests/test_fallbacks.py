"""Eager fallbacks (every reason reachable and counted) and malformed input (clear errors, no writes)."""

from __future__ import annotations

import pytest
import torch
from conftest import Faults, ToyPagedModel, decode_batch, static_checksums

from graphrt import EagerReason, ForwardMode, GraphRunner, wrap
from graphrt.entry import GraphStatus
from graphrt.graphed_callable import CHURN_LIMIT


class FlakyModel(ToyPagedModel):
    """Raises while capturing one batch size, or on demand at replay time."""

    def __init__(self, fail_capture_at=None):
        super().__init__()
        self.faults = Faults(fail_capture_at)

    def forward(self, input_ids, positions, forward_batch):
        self.faults.point(input_ids.shape[0])
        return super().forward(input_ids, positions, forward_batch)


def runner_for(model, **options):
    options.setdefault("capture_sizes", [1, 2, 4, 8])
    return GraphRunner(model, max_batch_size=8, backend="emulated", progress=False, **options)


def test_capture_failure_disables_one_key_and_others_keep_replaying():
    model = FlakyModel(fail_capture_at=4)
    runner = runner_for(model)
    report = runner.capture()
    assert [key.num_reqs for key in report.failed] == [4]
    assert "simulated failure" in next(iter(report.failed.values()))
    model.faults.capture_at = None
    for batch_size, expected in ((3, "eager"), (4, "eager"), (5, "graph"), (2, "graph"), (1, "graph")):
        batch = decode_batch(batch_size, seed=batch_size)
        before = runner.stats()["graph_runs"]
        out = runner(batch)
        torch.testing.assert_close(out, model(batch.input_ids, batch.positions, batch), atol=1e-5, rtol=1e-5)
        assert (runner.stats()["graph_runs"] > before) == (expected == "graph"), batch_size
    assert runner.stats()["eager_reasons"] == {"capture_failed": 2}
    assert "simulated failure" in runner.stats()["failed_keys"]["decode/bs=4"]


def test_replay_failure_reruns_eagerly_and_disables_only_a_key_eager_serves():
    model = FlakyModel()
    runner = runner_for(model)
    runner.capture()
    key = next(key for key in runner.registry.entries if key.num_reqs == 4)

    def failing_replay():
        raise RuntimeError("simulated failure")

    runner.registry.entries[key].graph.replay = failing_replay
    model.faults.now = True
    with pytest.raises(RuntimeError, match="simulated failure"):
        runner(decode_batch(3, seed=1))  # replay raised, the eager re-run raised too: the error surfaces
    assert runner.registry.entries[key].status is GraphStatus.READY, "eager failed too: the input was at fault"
    model.faults.now = False
    runner(decode_batch(3, seed=2))  # replay raised where eager succeeds: the graph is at fault
    assert runner.registry.entries[key].status is GraphStatus.DISABLED
    runner(decode_batch(3, seed=3))
    assert runner.stats()["eager_reasons"] == {"replay_failed": 2, "disabled": 1}


def every_reason_runner():
    model = ToyPagedModel()
    runner = runner_for(model, batch_context={"token_to_kv_pool": object()})
    return model, runner


def test_every_eager_reason_is_reachable_and_counted():
    model, runner = every_reason_runner()
    runner(decode_batch(2, seed=1))  # not captured yet
    runner.capture()
    runner(decode_batch(9, seed=1))
    runner(decode_batch(2, seed=1, positions=None))
    runner(decode_batch(2, seed=1, pixel_values=torch.zeros(2, 3)))
    runner(decode_batch(2, seed=1, return_logprob=True))
    runner(decode_batch(2, seed=1, token_to_kv_pool=object()))
    runner.registry.disable(next(k for k in runner.registry.entries if k.num_reqs == 2), "test")
    runner(decode_batch(2, seed=1))
    extend = decode_batch(2, seed=1, forward_mode=ForwardMode.EXTEND, extend_num_tokens=2,
                          extend_seq_lens=torch.ones(2, dtype=torch.int32),
                          extend_prefix_lens=torch.zeros(2, dtype=torch.int32),
                          extend_start_loc=torch.arange(2, dtype=torch.int32))
    runner(extend)
    reasons = runner.stats()["eager_reasons"]
    assert reasons == {
        "not_captured": 1, "batch_too_large": 1, "unsupported_field": 3, "context_mismatch": 1,
        "disabled": 1, "mode_not_captured": 1,
    }
    flaky = FlakyModel(fail_capture_at=2)
    failing = runner_for(flaky)
    failing.capture()
    flaky.faults.capture_at = None
    failing(decode_batch(2, seed=1))
    eager = GraphRunner(ToyPagedModel(), max_batch_size=8, backend="eager", progress=False)
    eager(decode_batch(2, seed=1))
    fast = wrap(lambda x: x * 2, max_batch_size=4, capture_sizes=[4], backend="emulated")
    fast(torch.ones(4, 3))  # warmup
    fast(torch.ones(2, 3))  # axis_probe: outputs were seen at the padded size only
    for width in range(5, 5 + CHURN_LIMIT + 1):  # a new layout on every call: the last runs eagerly, shape_mismatch
        fast(torch.ones(2, width))
    fast(torch.ones(2, 3, requires_grad=True))  # autograd
    seen = set(reasons) | set(failing.stats()["eager_reasons"]) | set(eager.stats()["eager_reasons"])
    seen |= set(fast.stats()["eager_reasons"]) | {"replay_failed"}  # replay_failed: test above
    seen |= {"peer_eager"}  # needs two ranks: tests/test_lockstep.py
    seen |= {"unsliceable_output", "ambiguous_batch_axis"}  # tests/test_wrap_signatures.py
    seen |= {"verify_failed"}  # tests/test_verify.py
    seen |= {"autocast", "training", "rebound_state", "aliased_inputs"}  # tests/test_guards_runner.py
    seen |= {"python_state", "hooks", "module_moved", "tensor_subclass"}  # tests/test_guards_observed.py
    assert seen == {reason.value for reason in EagerReason}


MALFORMED = [
    ("input_ids", dict(input_ids=torch.zeros(3)), TypeError, "input_ids: expected dtype"),
    ("seq_lens", dict(seq_lens=torch.ones(4, dtype=torch.int32)), ValueError, r"seq_lens: expected shape \[3\]"),
    ("input_ids", dict(input_ids=torch.zeros(4, dtype=torch.long)), ValueError, "input_ids: expected shape"),
    ("out_cache_loc", dict(out_cache_loc=torch.zeros(3, dtype=torch.long, device="meta")), ValueError,
     "out_cache_loc: expected a tensor on cpu"),
    ("req_pool_indices", dict(req_pool_indices=torch.tensor([1, -2, 3])), ValueError,
     "req_pool_indices: expected non-negative"),
    ("out_cache_loc", dict(out_cache_loc=None), ValueError, "out_cache_loc: required field is missing"),
    ("seq_lens_sum", dict(seq_lens_sum=5), ValueError, "seq_lens_sum: expected seq_lens.sum"),
    ("seq_lens_sum", dict(seq_lens_sum=5.0), TypeError, "seq_lens_sum: expected a Python int"),
    ("batch_size", dict(batch_size="3"), TypeError, "batch_size"),
    ("forward_mode", dict(forward_mode=2), TypeError, "forward_mode"),
    ("positions", dict(positions=torch.zeros(3, 1, dtype=torch.long)), ValueError, "positions: expected shape"),
]


@pytest.mark.parametrize("field,overrides,error,message", MALFORMED, ids=[m[1].__repr__()[:40] for m in MALFORMED])
def test_malformed_batches_raise_naming_the_field_and_leave_static_tensors(field, overrides, error, message,
                                                                        value_check_path):
    runner = runner_for(ToyPagedModel())
    runner.capture()
    runner(decode_batch(5, seed=9))
    before = static_checksums(runner)
    with pytest.raises(error, match=message):
        runner(decode_batch(3, seed=3, **overrides))
    after = static_checksums(runner)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert runner.stats()["graph_runs"] == 1 and runner.stats()["eager_runs"] == 0


def test_runner_rejects_non_batches_and_bad_options():
    runner = runner_for(ToyPagedModel())
    with pytest.raises(TypeError, match="batch: expected a ForwardBatch"):
        runner({"input_ids": torch.zeros(2)})
    with pytest.raises(ValueError, match="capture_sizes"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, capture_sizes=[0, 4])
    with pytest.raises(ValueError, match="capture_sizes"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, capture_sizes=[16])
    with pytest.raises(ValueError, match="backend"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, backend="tpu")
    with pytest.raises(ValueError, match="pad_values"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, pad_values={"nope": 1})
    with pytest.raises(ValueError, match="pad_values"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, pad_values={"seq_lens": 0})
    with pytest.raises(ValueError, match="batch_context"):
        GraphRunner(ToyPagedModel(), max_batch_size=8, batch_context={"pool": 1})
