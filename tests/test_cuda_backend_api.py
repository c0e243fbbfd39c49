"""The CUDA backend's calls checked against torch.cuda's real signatures, on any machine.

No GPU is needed: every torch.cuda entry point the backend touches is replaced by an autospec
of the real one, so a call with a wrong name or argument raises TypeError here as it would on a
GPU. The shared capture sequence (warm-up on the capture stream, undo, then capture) runs for
real around the mocks.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from graphrt.capture import capture_graph
from graphrt.backends.cuda import CudaGraphBackend


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda with autospecced functions; records the order of stream and graph events."""
    events = []
    stream_type = mock.create_autospec(torch.cuda.Stream)

    @contextlib.contextmanager
    def on_stream(stream):
        events.append(("enter stream", stream))
        try:
            yield
        finally:
            events.append(("exit stream", stream))

    main_stream = mock.create_autospec(torch.cuda.Stream, instance=True)
    graph_type = mock.create_autospec(torch.cuda.CUDAGraph)
    graph = graph_type.return_value
    capturing = []  # non-empty between capture_begin and capture_end

    def begin(**kwargs):
        events.append(("capture_begin", kwargs))
        capturing.append(True)

    def end():
        events.append(("capture_end",))
        capturing.clear()

    graph.capture_begin.side_effect = begin
    graph.capture_end.side_effect = end
    fakes = {
        "is_available": mock.create_autospec(torch.cuda.is_available, return_value=True),
        "graph_pool_handle": mock.create_autospec(torch.cuda.graph_pool_handle, return_value=(0, 1)),
        "Stream": stream_type,
        "current_stream": mock.create_autospec(torch.cuda.current_stream, return_value=main_stream),
        "stream": mock.create_autospec(torch.cuda.stream, side_effect=on_stream),
        "synchronize": mock.create_autospec(torch.cuda.synchronize),
        "memory_reserved": mock.create_autospec(torch.cuda.memory_reserved, return_value=0),
        "CUDAGraph": graph_type,
        "is_current_stream_capturing": mock.create_autospec(torch.cuda.is_current_stream_capturing,
                                                            side_effect=lambda: bool(capturing)),
        "current_device": mock.create_autospec(torch.cuda.current_device, return_value=0),
        "empty_cache": mock.create_autospec(torch.cuda.empty_cache),
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    fakes["main_stream"] = main_stream
    return events, fakes


def test_capture_calls_match_torch_cuda_signatures_and_order(fake_cuda):
    events, fakes = fake_cuda
    backend = CudaGraphBackend(torch.device("cuda", 0))
    side_stream = fakes["Stream"].return_value
    counter = torch.zeros((), dtype=torch.long)

    def step():
        events.append(("step", int(counter)))
        counter.add_(1)
        return counter * 2

    with backend.capture_session():
        graph = capture_graph(backend, step, warmup_iters=2)

    fakes["Stream"].assert_called_once_with(device=torch.device("cuda", 0))
    side_stream.wait_stream.assert_called_with(fakes["main_stream"])
    fakes["main_stream"].wait_stream.assert_called_with(side_stream)
    graph_mock = fakes["CUDAGraph"].return_value
    assert graph_mock.capture_begin.call_count == 2  # the pool's anchor (an empty graph), then the step
    graph_mock.capture_begin.assert_called_with(pool=(0, 1), capture_error_mode="thread_local")
    graph_mock.capture_end.assert_called_with()
    assert fakes["empty_cache"].call_args_list == [mock.call()] * 2  # when the session began, before the capture
    assert graph.replay == graph_mock.replay
    # Warm-ups run on the capture stream, each on the state as it was; their writes are undone before
    # capture begins.
    begin = ("capture_begin", {"pool": (0, 1), "capture_error_mode": "thread_local"})
    assert events == [
        ("enter stream", side_stream), ("step", 0), ("step", 0), ("exit stream", side_stream),
        ("enter stream", side_stream), begin, ("capture_end",), begin, ("step", 0),
        ("capture_end",), ("exit stream", side_stream),
    ]


def test_failed_capture_ends_the_capture_and_keeps_the_first_error(fake_cuda):
    events, fakes = fake_cuda
    backend = CudaGraphBackend(torch.device("cuda", 0))
    ends = []

    def invalidated_after_the_anchor():  # the pool's anchor captures; every later capture_end raises
        events.append(("capture_end",))
        ends.append(1)
        if len(ends) > 1:
            raise RuntimeError("capture invalidated")

    fakes["CUDAGraph"].return_value.capture_end.side_effect = invalidated_after_the_anchor

    def step():
        raise ValueError("model error")

    with pytest.raises(ValueError, match="model error"):
        capture_graph(backend, step, warmup_iters=0)
    begin = ("capture_begin", {"pool": (0, 1), "capture_error_mode": "thread_local"})
    # the pool's anchor; the step's capture, ended by abandon; an empty capture in a pool of its own
    # that ends the generators' capture (its capture_end raises here too: logged, the first error kept)
    assert events[3:] == [begin, ("capture_end",), begin, ("capture_end",),
                          ("capture_begin", {"pool": None, "capture_error_mode": "thread_local"}),
                          ("capture_end",), ("exit stream", fakes["Stream"].return_value)]
    fakes["CUDAGraph"].return_value.reset.assert_called_with()  # the failed graph is released at once
