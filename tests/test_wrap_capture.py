"""wrap()'s lazy capture: the backend comes from the call's tensors, and the padded shape is warmed up first.

A CUDA graph captured around CPU tensors launches nothing: verified against the capture's own
outputs it would pass, then return the first call's outputs forever. So ``backend="auto"`` picks
each layout's backend from where its tensors live, and a key whose inputs or outputs live off its
backend's device is refused. And lazy work a step does the first time it meets a shape (library
heuristics, cuBLAS handles, autotuning, a host read) must never first run inside a capture:
recording at a padded size warms that size up first, its writes undone.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_backend_api import fake_cuda  # noqa: F401 - the autospecced torch.cuda fixture

from graphrt import GraphRunner, wrap


def test_auto_picks_the_emulated_backend_for_cpu_tensors_on_a_cuda_machine(fake_cuda):  # noqa: F811
    events, _ = fake_cuda  # torch.cuda.is_available() is True; no CUDA call may happen
    fast = wrap(lambda x: x * 2, max_batch_size=4, capture_sizes=[4], backend="auto")
    for value in (1.0, 2.0, 3.0):
        x = torch.full((4, 3), value)
        assert torch.equal(fast(x), x * 2), "every call's own result, not the first call's"
    stats = fast.stats()
    assert stats["backend"] == "emulated" and stats["graph_runs"] == 2 and events == []
    assert GraphRunner(lambda ids, pos, batch: ids, max_batch_size=4, backend="auto", device="cpu",
                       progress=False).backend_name == "emulated"


def test_a_cuda_graph_of_cpu_tensors_is_refused_and_calls_run_eagerly(fake_cuda, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fast = wrap(lambda x: x * 2, max_batch_size=4, capture_sizes=[4], backend="cuda")
    for value in (1.0, 2.0, 3.0):
        x = torch.full((4, 3), value)
        assert torch.equal(fast(x), x * 2)
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["eager_reasons"] == {"warmup": 1, "capture_failed": 2}
    [reason] = stats["failed_keys"].values()
    assert "input.args[0] is on cpu: a graph captured on cuda:0" in reason, reason


class LazyPerShape(torch.nn.Module):
    """Reads a value on the host the first time it meets a batch size (as lazy library work does
    with its own syncs): harmless eagerly, fatal inside a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = set()

    def forward(self, x):
        if x.shape[0] not in self.seen:
            self.seen.add(x.shape[0])
            float(x.sum())
        return x * 2


def test_recording_at_a_padded_size_warms_that_size_up_first():
    model = LazyPerShape()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4], backend="emulated")
    for _ in range(3):
        x = torch.ones(3, 5)
        assert torch.equal(fast(x), x * 2)
    stats = fast.stats()
    assert stats["failed_keys"] == {} and stats["captured_keys"] == ["call/bs=4"], stats
    assert stats["graph_runs"] == 2 and stats["padded_tokens"] == 2


@pytest.mark.cuda
def test_auto_on_cpu_tensors_on_a_gpu_machine_replays_each_calls_result():
    fast = wrap(lambda x: x * 2, max_batch_size=4, capture_sizes=[4])
    for value in (1.0, 2.0, 3.0):
        x = torch.full((4, 3), value)
        assert torch.equal(fast(x), x * 2)
    assert fast.stats()["backend"] == "emulated"
