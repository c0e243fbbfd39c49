"""Two threads recording at once: the CPU recorder's process-wide patches (``Tensor.tolist``/``numpy``,
``torch.cuda.is_current_stream_capturing``) act for the recording threads only and are removed when the
last recording ends, whatever order the recordings end in; each thread's graph gives eager's result."""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from graphrt import wrap
from graphrt.backends.op_graph import OpRecorder

ORIGINALS = (torch.Tensor.tolist, torch.Tensor.numpy, torch.cuda.is_current_stream_capturing)


def test_two_recordings_in_two_threads_leave_torch_as_it_was():
    both_recording = threading.Barrier(2, timeout=30)
    first_done = threading.Event()
    seen = {}
    results = {}

    def make(name: str, scale: float):
        def step(x: torch.Tensor) -> torch.Tensor:
            if isinstance(_get_current_dispatch_mode(), OpRecorder):  # the call wrap() records
                both_recording.wait()
                seen[name] = torch.cuda.is_current_stream_capturing()  # as under a CUDA capture
                if name == "second":
                    first_done.wait(30)  # the first recording ends while this one goes on
            return x * scale + 1

        return wrap(step, max_batch_size=4, capture_sizes=[4], backend="emulated", warmup_iters=0)

    def run(name: str, scale: float) -> None:
        fast = make(name, scale)
        x = torch.arange(8.0).view(4, 2)
        outputs = [fast(x + call).clone() for call in range(4)]
        results[name] = (outputs, [x + call for call in range(4)], scale, fast.stats())
        if name == "first":
            seen["tolist outside, while the other records"] = torch.ones(2).tolist()
            first_done.set()

    threads = [threading.Thread(target=run, args=(name, scale)) for name, scale in (("first", 2.0), ("second", 3.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert (torch.Tensor.tolist, torch.Tensor.numpy, torch.cuda.is_current_stream_capturing) == ORIGINALS
    assert torch.ones(2).tolist() == [1.0, 1.0]
    assert seen["first"] is True and seen["second"] is True
    assert seen["tolist outside, while the other records"] == [1.0, 1.0]
    for name, (outputs, inputs, scale, stats) in results.items():
        assert stats["graph_runs"] >= 1, name
        for output, x in zip(outputs, inputs):
            assert torch.equal(output, x * scale + 1), name
