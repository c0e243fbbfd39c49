"""What a reading of torch 2.11's CUDA path predicted for the first GPU run (issue 40), fixed before it.

Each scenario runs real graphrt objects over tests/fake_cuda.py, which now models what the reading
found: the default generator's one capture flag for the process (another thread's eager draw, and the
replay of a graph that drew random numbers, raise while any capture is under way; a graph that drew
nothing replays, pytorch#143777: issue 48), captures legal on several streams at once, the cuBLAS
workspace and the generator's seed and offset taking memory, a failed capture's pool reference that
torch 2.11 never gives back. Marked ``cuda``, the same scenarios run on a GPU (the ``device``
fixture of tests/test_cuda_pool.py); scripts/gpu_probe.py checks each modelled rule there.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable, List

import pytest
import torch
from fake_cuda import TORCH_2_7, TORCH_2_11, TORCH_RESET_RELEASES, FakeCuda, RecordingMode, install
from test_cuda_first_run import DrawingModel
from test_cuda_pool import checks, device, older_objects_frozen, statuses  # noqa: F401 - fixtures

import graphrt
from graphrt.backends.cuda_pool import CAPTURE_ERROR_MODE
from graphrt.backends.op_graph import grouped_mm_fallback_reason
from graphrt.entry import GraphStatus

READY = GraphStatus.READY


def in_thread(run: Callable[[], Any], fake) -> threading.Thread:
    """``run`` started in a thread of its own (with the fake's recording mode, which is per thread)."""

    def target() -> None:
        with contextlib.nullcontext() if fake is None else RecordingMode(fake):
            run()

    thread = threading.Thread(target=target)
    thread.start()
    return thread


class Pause(torch.nn.Module):
    """``checks.Misbehaving`` whose runs inside a real capture (``in_capture``), or outside one (its warm-ups),
    tell ``reached`` and wait up to ``timeout`` s for ``go``: another thread's step runs meanwhile, or waits."""

    def __init__(self, inner: torch.nn.Module, reached: threading.Event, go: threading.Event,
                 timeout: float = 0.3, in_capture: bool = True) -> None:
        super().__init__()
        self.inner, self.reached, self.go, self.timeout, self.in_capture = inner, reached, go, timeout, in_capture

    def forward(self, input_ids, positions, forward_batch):
        if stream_really_captures() == self.in_capture:
            self.reached.set()
            self.go.wait(timeout=self.timeout)
        return self.inner(input_ids, positions, forward_batch)


def serving_beside_a_capture(device, checks, pause: Pause):
    """A captured runner serving ``Misbehaving``, and another runner of ``pause`` capturing in a thread."""
    model = checks.Misbehaving(device=device.name)
    serving = checks.runner_for(model, device.name, [2])
    serving.capture()
    capturing_runner = checks.runner_for(pause, device.name, [2])
    return model, serving, capturing_runner, in_thread(capturing_runner.capture, device.fake)


def stream_really_captures() -> bool:
    """Whether the current stream captures (the warm-ups' ``is_current_stream_capturing()`` says True too)."""
    fake = FakeCuda.installed
    if fake is not None:
        return fake.current_stream().status != "none"
    return torch._C._cuda_isCurrentStreamCapturing()


# ---- item 1: no step of another thread runs into a capture; no key disabled for another's error ------

def test_a_replay_in_another_thread_waits_for_a_capture_and_its_key_stays(device, checks):
    capturing, go = threading.Event(), threading.Event()
    serving_model, serving, capturing_runner, thread = serving_beside_a_capture(
        device, checks, Pause(checks.Misbehaving(device=device.name), capturing, go))
    capturing.wait(timeout=10)
    got = [serving(checks.decode_batch(2, device.name, seed=1))]  # torch <= 2.11: raised inside the capture
    go.set()
    thread.join(timeout=30)
    assert torch.allclose(got[0], checks.eager(serving_model, checks.decode_batch(2, device.name, seed=1)), **checks.TOLERANCE)
    assert statuses(serving) == {"decode/bs=2": READY} and serving.stats()["eager_reasons"] == {}
    assert statuses(capturing_runner) == {"decode/bs=2": READY}
    device.settle()


def test_a_step_in_another_thread_runs_during_a_captures_warm_ups(device, checks):
    """Issue 48, item 3: the step lock is held around the recording only (torch <= 2.11 needs no more):
    while another thread's capture session warms up (or compiles), a step of another runner replays at
    once, and steps wait only for the recording itself (the test above). Before: every step waited for
    the whole session, compile runs included."""
    warming, go, served = threading.Event(), threading.Event(), threading.Event()
    serving_model, serving, capturing_runner, capture = serving_beside_a_capture(
        device, checks, Pause(checks.Misbehaving(device=device.name), warming, go, timeout=10, in_capture=False))
    assert warming.wait(timeout=10)
    batch, got = checks.decode_batch(2, device.name, seed=1), []
    server = in_thread(lambda: (got.append(serving(batch).clone()), served.set()), device.fake)
    served_during_warm_up = served.wait(timeout=5)
    go.set()
    capture.join(timeout=30)
    server.join(timeout=30)
    assert served_during_warm_up, "the step waited for another thread's capture session"
    assert torch.allclose(got[0], checks.eager(serving_model, batch), **checks.TOLERANCE)
    assert serving.stats()["graph_runs"] == 1 and serving.stats()["eager_reasons"] == {}
    assert statuses(capturing_runner) == {"decode/bs=2": READY}
    device.settle()


def test_a_users_own_draw_beside_a_capture_raises_on_2_11_unless_it_waits_in_no_recording(device, checks):
    """Issue 48, item 3 (docs/MANUAL.md, "Random numbers while another thread captures"): graphrt cannot
    lock out a draw it does not make; up to torch 2.11 one from the default generator raises while
    another thread records, and ``graphrt.backends.no_recording()`` makes it wait for the recording."""
    capturing, go = threading.Event(), threading.Event()
    runner = checks.runner_for(Pause(checks.Misbehaving(device=device.name), capturing, go, timeout=10),
                               device.name, [2])
    capture = in_thread(runner.capture, device.fake)
    assert capturing.wait(timeout=10)
    process_wide = graphrt.backends.session.GENERATOR_FLAG_PROCESS_WIDE
    try:
        bare = _error_of_draw(device.name)
        waited = threading.Timer(0.2, go.set)  # the recording ends a moment after the draw began to wait
        waited.start()
        with graphrt.backends.no_recording():  # waits where torch needs it (<= 2.11), holds nothing after
            sample = torch.rand(4, device=device.name)
        assert go.is_set() == process_wide, "the draw ran during the recording"
    finally:
        go.set()
        capture.join(timeout=30)
    assert bare.startswith("Offset increment outside graph capture") if process_wide else bare == "", bare
    assert sample.shape == (4,) and statuses(runner) == {"decode/bs=2": READY}
    device.settle()


def _error_of_draw(device: str) -> str:
    """"" when an eager draw from the default generator works, else its error's first line."""
    try:
        torch.rand(4, device=device)
        return ""
    except RuntimeError as error:
        return str(error).splitlines()[0]


@pytest.mark.parametrize("draws", [False, True], ids=["draws-nothing", "draws"])
def test_a_replay_raising_for_another_capture_runs_eagerly_and_keeps_its_key(device, checks, draws):
    """A capture graphrt does not lock out (the user's own ``torch.cuda.graph`` in another thread). Up to
    torch 2.11 a replay raises during it only if its graph drew random numbers (``replay_prologue``
    returns before ``increase()`` for a graph that drew nothing, pytorch#143777): then the step runs
    eagerly, whose own draw raises too, so the caller gets the error, and the healthy key stays in use.
    A graph that drew nothing replays, on every release."""
    began, go = threading.Event(), threading.Event()
    model = checks.Misbehaving(device=device.name)
    if draws:
        model = DrawingModel(model)  # a whole-graph increment: each replay advances the generator
    runner = checks.runner_for(model, device.name, [2])
    runner.capture()

    def users_capture() -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            began.set()
            go.wait(timeout=10)
            graph.capture_end()

    thread = in_thread(users_capture, device.fake)
    began.wait(timeout=10)
    batch = checks.decode_batch(2, device.name, seed=1)
    raised = draws and graphrt.backends.session.GENERATOR_FLAG_PROCESS_WIDE
    error = None
    try:
        during = runner(batch).clone()
    except RuntimeError as caught:
        error = caught
    finally:
        go.set()
        thread.join(timeout=30)
    if raised:
        assert error is not None and "Offset increment outside graph capture" in str(error)
    else:
        assert error is None, error
        assert torch.allclose(during, checks.eager(model, batch), **checks.TOLERANCE)
    assert runner.stats()["eager_reasons"] == ({"replay_failed": 1} if raised else {})
    assert statuses(runner) == {"decode/bs=2": READY}
    assert checks.replay_equal_eager(runner, model, device.name, [2], 1) == 1
    device.settle()


# ---- item 6: a failed capture's pool is freed once nothing holds it ------------------------------------

@pytest.mark.parametrize("behaviour", [TORCH_2_7, TORCH_2_11, TORCH_RESET_RELEASES],
                         ids=["fake-torch-2.7", "fake-torch-2.11", "fake-torch-pr190348"])
def test_a_failed_captures_pool_is_freed_once_nothing_holds_it(behaviour, checks, monkeypatch):
    with install(monkeypatch, behaviour) as fake:
        runner = checks.runner_for(checks.Misbehaving("item", at=4, device="cpu"), "cpu", [2, 4])
        runner.capture()
        assert statuses(runner) == {"decode/bs=4": GraphStatus.FAILED, "decode/bs=2": READY}
        del runner
        gc.collect()
        torch.cuda.empty_cache()
        assert fake.allocator.graph_pools == {}, "a pool stays reserved for the process's life"
        assert fake.allocator.asserts == [] and fake.aborts == []


@pytest.mark.parametrize("behaviour", [TORCH_2_7, TORCH_2_11, TORCH_RESET_RELEASES],
                         ids=["fake-torch-2.7", "fake-torch-2.11", "fake-torch-pr190348"])
def test_a_capture_begin_failing_after_its_pool_routing_gives_its_reference_back(behaviour, checks, monkeypatch):
    """Issue 48, item 6: ``capture_begin`` takes the pool reference and routes the pool
    (``beginAllocateToPool``) before ``cudaStreamBeginCapture``, which may fail; the graph's ``reset()``
    gives back no reference of a capture that never ended (up to 2.11). graphrt ended the routing but kept
    the reference, so the pool stayed reserved for the process's life; now the routing it ended says the
    reference was taken, and it gives it back (never where torch's reset() does, pytorch#190348)."""
    from fake_cuda import FakeStream

    with install(monkeypatch, behaviour) as fake:
        runner = checks.runner_for(checks.Misbehaving(device="cpu"), "cpu", [2, 4])
        begin, failures = FakeStream.begin_capture, []

        def begin_capture(stream, graph, mode):
            if not failures and graph.ops == [] and stream.graph is None and fake.capturing_streams() == [] and \
                    len(fake.pools_begun) >= 1:  # the first key's capture, after the pool's anchor
                failures.append(graph)
                raise RuntimeError("CUDA error: operation not supported (cudaStreamBeginCapture)")
            return begin(stream, graph, mode)

        monkeypatch.setattr(FakeStream, "begin_capture", begin_capture)
        runner.capture()
        assert failures and statuses(runner) == {"decode/bs=4": GraphStatus.FAILED, "decode/bs=2": READY}
        del runner, failures
        gc.collect()
        torch.cuda.empty_cache()
        assert fake.allocator.graph_pools == {}, "a pool stays reserved for the process's life"
        assert fake.allocator.asserts == [] and fake.aborts == [] and fake.allocator.captures_underway == []


# ---- items 5 and 8: the cache emptied before each capture, nothing of it per call once captured --------

class Logged(torch.nn.Module):
    """``inner``, each call logged as ("step", whether the stream really captures, what
    ``torch.cuda.is_current_stream_capturing()`` says)."""

    def __init__(self, inner: torch.nn.Module, log: List[Any]) -> None:
        super().__init__()
        self.inner, self.log = inner, log

    def forward(self, input_ids, positions, forward_batch):
        self.log.append(("step", stream_really_captures(), torch.cuda.is_current_stream_capturing()))
        return self.inner(input_ids, positions, forward_batch)


def logging_calls(monkeypatch, log: List[Any], module: Any, name: str) -> None:
    """``module.name`` logs ``name`` and its positional arguments, then runs."""
    real = getattr(module, name)

    def logged(*args: Any, **kwargs: Any) -> Any:
        log.append((name, *args))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, logged)


def test_the_cache_is_emptied_after_each_keys_warm_ups_and_never_per_serving_call(monkeypatch, checks):
    log: List[Any] = []
    with install(monkeypatch, TORCH_2_11):
        runner = checks.runner_for(Logged(checks.Misbehaving(device="cpu"), log), "cpu", [1, 2])
        logging_calls(monkeypatch, log, gc, "collect")
        logging_calls(monkeypatch, log, torch.cuda, "empty_cache")
        logging_calls(monkeypatch, log, torch.cuda, "synchronize")
        runner.capture()
        calls = [entry for entry in log if entry[0] != "synchronize"]
        assert calls[:2] == [("collect",), ("empty_cache",)], "a session collects first, then empties the cache"
        captures = [index for index, entry in enumerate(calls) if entry[:2] == ("step", True)]
        assert len(captures) == 2
        for index in captures:
            warmed = max(i for i in range(index) if calls[i][:2] == ("step", False))
            assert ("collect", 1) in calls[warmed:index] and ("empty_cache",) in calls[warmed:index], calls
        log.clear()
        for size in (1, 2, 1, 2):
            runner(checks.decode_batch(size, "cpu", seed=size))
        assert log == [] and runner.stats()["graph_runs"] == 4


# ---- item 7: warm-ups take the capture's path -----------------------------------------------------------

def test_warm_ups_see_a_capture_under_way_and_eager_steps_do_not(monkeypatch, checks):
    log: List[Any] = []
    with install(monkeypatch, TORCH_2_11):
        runner = checks.runner_for(Logged(checks.Misbehaving(device="cpu"), log), "cpu", [2])
        runner.capture()
        warm_ups, capture, verification = log[:-2], log[-2], log[-1]
        assert warm_ups and all(entry == ("step", False, True) for entry in warm_ups), log
        assert capture == ("step", True, True) and verification == ("step", False, False), log
        log.clear()
        runner(checks.decode_batch(3, "cpu"))  # larger than every key: eager
        assert log == [("step", False, False)]


# ---- item 2: grouped_mm's host-syncing fallback is named ------------------------------------------------

def grouped(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Two experts over x's rows (the first 3 to one, the rest to the other), as MoE layers call it."""
    offsets = torch.tensor([3, x.shape[0]], dtype=torch.int32)
    return torch.nn.functional.grouped_mm(x.to(weight.dtype), weight, offs=offsets)


def test_check_names_a_grouped_mm_that_takes_the_host_syncing_fallback():
    x = torch.randn(8, 16)
    fp32 = graphrt.check(lambda rows: grouped(rows, torch.randn(2, 16, 8)), x)
    syncs = [finding for finding in fp32.findings if finding.kind == "host_sync"]
    assert syncs and "grouped_mm on float32 takes torch's fallback" in syncs[0].message
    bf16 = graphrt.check(lambda rows: grouped(rows, torch.randn(2, 16, 8).bfloat16()), x)
    assert not [finding for finding in bf16.findings if finding.kind == "host_sync"]


@pytest.mark.parametrize("capability, syncs", [((8, 0), True), ((8, 9), True), ((9, 0), False), ((10, 0), False),
                                               ((12, 0), True)])
def test_bfloat16_grouped_mm_syncs_off_hopper_and_datacenter_blackwell(capability, syncs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16()
    assert (grouped_mm_fallback_reason(a, b, cuda_target=True) is not None) == syncs
    assert grouped_mm_fallback_reason(a.float(), b.float(), cuda_target=True) is not None
    assert grouped_mm_fallback_reason(a, b) is None  # CPU tensors run torch's CPU kernel: no GPU to sync
