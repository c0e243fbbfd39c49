"""The CUDA-graph contract, proven on CPU with the recording (emulated) backend.

Replay runs the recorded ops, never the model's Python: branches and Python scalars are frozen
in the graph (the guards see a change to what the step read and run the call under the new state),
Python state the step writes itself is frozen in replays, captured tensors are read live, host
syncs fail capture naming the op and the model's line, and capture leaves every tensor the model
can reach as it was.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from conftest import ToyPagedModel, decode_batch

from graphrt import GraphRunner, wrap
from graphrt.backends.op_graph import HostSyncError
from graphrt.entry import GraphStatus
from graphrt.reference import ReferenceConfig, build_reference, graph_runner_kwargs


def runner_for(model, **options):
    options.setdefault("capture_sizes", [1, 2, 4, 8])
    return GraphRunner(model, max_batch_size=8, backend="emulated", progress=False, **options)


class Entries:
    """A count of Python entries, held as an object: the step changes no attribute of the model (an
    attribute it assigned would be refused at capture: a replay cannot advance it)."""

    def __init__(self) -> None:
        self.count = 0


class CountingModel(ToyPagedModel):
    """Counts Python entries into forward and steps taken on the device (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries = Entries()
        self.steps = torch.zeros((), dtype=torch.long)

    def forward(self, input_ids, positions, forward_batch):
        self.entries.count += 1
        self.steps.add_(1)
        return super().forward(input_ids, positions, forward_batch)


def test_replay_never_enters_forward_and_capture_leaves_the_counter_alone():
    model = CountingModel()
    runner = runner_for(model)
    runner.capture()
    assert int(model.steps) == 0, "capture's warm-up and recording runs must be undone"
    calls_after_capture = model.entries.count
    for step in range(5):
        runner(decode_batch(3, seed=step))
    assert model.entries.count == calls_after_capture
    assert int(model.steps) == 5 and runner.stats()["graph_runs"] == 5


def test_wrap_runs_each_user_call_exactly_once():
    counter = torch.zeros((), dtype=torch.long)
    entries = []

    def step(x):
        entries.append(x.shape[0])
        counter.add_(1)
        return x * 2

    fast = wrap(step, max_batch_size=4, capture_sizes=[4], backend="emulated")
    for call in range(1, 6):
        out = fast(torch.full((3, 2), float(call)))
        assert torch.equal(out, torch.full((3, 2), 2.0 * call))
        assert int(counter) == call
    # call 1: warm-up, the real step at its real size; call 2: the capture's warm-up on 4 rows (the
    # padded-size run of the padding check), the recording, then the verification's eager run on 1 row
    # (the fewest that pad to 4: the check's real-size run; the replay is compared with the warm-up),
    # every run's writes undone, and the replay; calls 3-5: replays, no Python. The counter still
    # advanced once per call.
    assert entries == [3, 4, 4, 1]
    assert fast.stats()["eager_reasons"] == {"warmup": 1} and fast.stats()["graph_runs"] == 4


def test_explicit_wrap_capture_leaves_state_unchanged():
    counter = torch.zeros((), dtype=torch.long)
    history = torch.zeros(8)

    def step(x):
        counter.add_(1)
        history.index_copy_(0, counter.view(1), x.sum().view(1))
        return x + 1

    fast = wrap(step, max_batch_size=4, capture_sizes=[2, 4], backend="emulated")
    report = fast.capture(torch.ones(3, 2))
    assert report.ok and not report.failed
    assert int(counter) == 0 and not history.any()
    fast(torch.ones(3, 2))
    assert int(counter) == 1 and history[1] == 6.0  # three real rows of two ones, one zero padding row


class BranchyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.double = True

    def forward(self, x):
        return x * 2 if self.double else x * 3


def test_a_python_branch_changed_after_capture_takes_the_new_branch():
    """A graph replays the branch its capture took (as on CUDA); the attribute that picked it is
    guarded (issue 38), so the call after the change runs the new branch, from graphs of its own."""
    model = BranchyModel()
    fast = wrap(model, max_batch_size=2, capture_sizes=[2], backend="emulated")
    fast(torch.ones(2, 3))
    fast(torch.ones(2, 3))  # recorded with double=True
    model.double = False
    assert torch.equal(fast(torch.ones(2, 3)), torch.full((2, 3), 3.0))
    assert "python_state: BranchyModel.double True -> False" in fast.stats()["guard_failures"]


def test_tensors_are_read_live_and_a_python_scalar_changed_in_place_is_seen():
    """A captured tensor is read by every replay; a Python float is baked into the graph, and the dict it
    came from is compared per call (issue 49, item 4: a container the step reads changed in place gives
    eager's result), so the call after the change runs with the new value, naming it."""
    weight = torch.ones(3)
    settings = {"scale": 2.0}
    fast = wrap(lambda x: x * weight * settings["scale"], max_batch_size=2, capture_sizes=[2], backend="emulated")
    fast(torch.ones(2, 3))
    fast(torch.ones(2, 3))
    weight.fill_(5.0)  # a captured tensor: read at every replay
    assert torch.equal(fast(torch.ones(2, 3)), torch.full((2, 3), 10.0)) and fast.stats()["graph_runs"] == 2
    settings["scale"] = 10.0  # a Python float the graph baked in
    assert torch.equal(fast(torch.ones(2, 3)), torch.full((2, 3), 50.0))
    (failure,) = fast.stats()["guard_failures"]
    assert failure.startswith("python_state: settings (closure of") and failure.endswith("['scale'] 2.0 -> 10.0")


def test_a_tensor_rebound_in_a_container_after_capture_is_seen():
    """The graph keeps the tensor it captured; the dict holding it is a binding guarded per call (issue 49,
    item 3), so the call after the rebinding gives eager's result, naming the entry."""
    holder = {"bias": torch.zeros(3)}
    fast = wrap(lambda x: x + holder["bias"], max_batch_size=2, capture_sizes=[2], backend="emulated")
    fast(torch.ones(2, 3))
    fast(torch.ones(2, 3))
    holder["bias"] = torch.full((3,), 7.0)  # a new tensor: the graph holds the captured one
    assert torch.equal(fast(torch.ones(2, 3)), torch.full((2, 3), 8.0))
    (failure,) = fast.stats()["guard_failures"]
    assert failure.startswith("rebound_state: holder (closure of")
    assert failure.endswith("['bias'] is bound to another object than at capture")


def test_outputs_are_the_same_tensors_every_replay():
    fast = wrap(lambda x: x * 2, max_batch_size=2, capture_sizes=[2], backend="emulated")
    fast(torch.ones(2, 3))
    first = fast(torch.ones(2, 3))
    second = fast(torch.full((2, 3), 4.0))
    assert first.data_ptr() == second.data_ptr() and torch.equal(first, torch.full((2, 3), 8.0))


def _line_of(marker: str) -> int:
    source, start = inspect.getsourcelines(HostSyncModel.forward)
    return start + next(index for index, line in enumerate(source) if marker in line)


class HostSyncModel(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "item":
            return x * x.sum().item()  # sync: item
        if self.kind == "tolist":
            return x * len(x.tolist())  # sync: tolist
        if self.kind == "nonzero":
            return x[:1] + x.nonzero().shape[0]  # sync: nonzero
        if self.kind == "numpy":
            return x * float(np.asarray(x).max())  # sync: numpy
        if self.kind == "bool":
            return x * 2 if x.sum() > 0 else x  # sync: bool
        if self.kind == "int":
            return x * int(x[0, 0])  # sync: int
        if self.kind == "float":
            return x * float(x[0, 0])  # sync: float
        if self.kind == "unique":
            return x + torch.unique(x).shape[0]  # sync: unique
        return x + x[x > 0].sum()  # sync: mask


@pytest.mark.parametrize("kind, op", [
    ("item", "aten._local_scalar_dense"), ("tolist", "Tensor.tolist"),
    ("nonzero", "aten.nonzero"), ("mask", "aten.index.Tensor"), ("numpy", "Tensor.numpy"),
    ("bool", "aten._local_scalar_dense"), ("int", "aten._local_scalar_dense"), ("float", "aten._local_scalar_dense"),
    ("unique", "aten._unique2"),
])
def test_host_sync_fails_capture_naming_the_op_and_line(kind, op):
    model = HostSyncModel(kind)
    fast = wrap(model, max_batch_size=2, capture_sizes=[2], backend="emulated")
    x = torch.arange(1.0, 7.0).view(2, 3)
    for _ in range(3):
        torch.testing.assert_close(fast(x), model(x))  # eager every time, with the right result
    reason = fast.stats()["failed_keys"]["call/bs=2"]
    assert reason.startswith(HostSyncError.__name__) and op in reason
    assert f"{__file__}:{_line_of('# sync: ' + kind)} in forward" in reason
    assert fast.stats()["eager_reasons"] == {"warmup": 1, "capture_failed": 2}


def test_host_sync_in_graph_runner_capture_disables_only_that_key():
    class SyncAtFour(ToyPagedModel):
        def forward(self, input_ids, positions, forward_batch):
            if input_ids.shape[0] == 4:
                positions = positions[positions >= 0]
            return super().forward(input_ids, positions, forward_batch)

    runner = runner_for(SyncAtFour())
    report = runner.capture()
    assert [key.num_reqs for key in report.failed] == [4]
    assert runner.registry.entries[report.failed.popitem()[0]].status is GraphStatus.FAILED
    runner(decode_batch(3, seed=1))
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1}


# ---- capture leaves the model's state as it was ----------------------------------------------


def reference_setup():
    model, attn, pools = build_reference(ReferenceConfig(), num_requests=8)
    return model, attn, pools, make_reference_runner(model, attn, pools)


def make_reference_runner(model, attn, pools):
    return GraphRunner(model, max_batch_size=8, capture_sizes=[1, 2, 4, 8], backend="emulated",
                       progress=False, **graph_runner_kwargs(attn, pools))


def state_snapshot(model, pools) -> dict:
    tensors = dict(model.state_dict())
    for layer, (k, v) in enumerate(zip(pools.kv.k_buffers, pools.kv.v_buffers)):
        tensors[f"kv.k.{layer}"], tensors[f"kv.v.{layer}"] = k, v
    tensors["req_to_token"] = pools.req_to_token.req_to_token
    return {name: tensor.clone() for name, tensor in tensors.items()}


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"capture changed {changed}"


def fill_kv(pools) -> None:
    generator = torch.Generator().manual_seed(3)
    for buffer in list(pools.kv.k_buffers) + list(pools.kv.v_buffers):
        buffer.copy_(torch.randn(buffer.shape, generator=generator))


def test_reference_state_is_bitwise_unchanged_by_capture_retune_and_resumed_capture(monkeypatch):
    model, attn, pools, runner = reference_setup()
    fill_kv(pools)  # non-zero everywhere, the scratch slot included
    before = state_snapshot(model, pools)
    assert not runner.capture().failed
    assert_same_state(before, state_snapshot(model, pools))

    runner._stats.merge_histogram({runner.config.modes[0]: {3: 10, 6: 5}})
    assert not runner.retune(max_graphs=2).failed
    assert_same_state(before, state_snapshot(model, pools))

    resumed = make_reference_runner(model, attn, pools)  # same model and pools, fresh keys
    original = resumed.capturer.capture_entry
    calls = []

    def interrupt_second_key(registry, entry, warmup_iters, **options):
        calls.append(entry.key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(registry, entry, warmup_iters, **options)

    monkeypatch.setattr(resumed.capturer, "capture_entry", interrupt_second_key)
    with pytest.raises(KeyboardInterrupt):
        resumed.capture()
    monkeypatch.setattr(resumed.capturer, "capture_entry", original)
    report = resumed.capture()  # captures the keys the interruption left pending
    assert len(report.keys) == 3 and not report.failed
    assert_same_state(before, state_snapshot(model, pools))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM (peak resident memory) to the current RSS
        return True
    except OSError:
        return False


def test_capture_with_a_1_gib_kv_cache_allocates_memory_for_the_written_rows_only():
    model = ToyPagedModel(num_slots=1 << 23)  # 2**23 slots x 32 floats = 1 GiB, touched by zeros()
    assert model.kv.numel() * model.kv.element_size() == 1 << 30
    runner = runner_for(model)
    runner_for(ToyPagedModel()).capture()  # pays one-time costs (imports) outside the measurement
    if not _reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable: cannot measure peak memory here")
    resident = _rss_kib("VmRSS")
    report = runner.capture()
    peak_growth_mib = (_rss_kib("VmHWM") - resident) / 1024
    assert not report.failed
    assert peak_growth_mib < 64, f"capture's peak memory grew by {peak_growth_mib:.0f} MiB"
