"""The CUDA backend keeps its shared graph pool capturable (issue 26, items 3 and 4).

PyTorch's caching allocator refuses a capture into a pool id whose graphs are all gone
(``use_count > 0``), and a capture that failed can leave the allocator routing to its pool
(``captures_underway``; torch <= 2.11) so that the next capture into that id fails, and any
``empty_cache()`` asserts (torch 2.7) or silently frees nothing of the default pools (from 2.8). Each scenario below ends with a graph-less or a failed pool, then needs
the next capture to work: the largest key failing verification, a clean capture failure,
``retune()`` on a decode-only runner, a disabled last graph, ``wrap()`` dropping its only layout
(item 3); a capture invalidated by a host read, whole and in pieces (item 4).

Every test runs real graphrt objects (``GraphRunner(backend="cuda")``, ``wrap(backend="cuda")``)
over tests/fake_cuda.py, a fake torch.cuda that keeps the allocator's private-pool rules (CPU
tensors stand for device memory, so runners keep ``device="cpu"``), once per PyTorch behaviour it
models, and, marked ``cuda``, on a GPU. ``settle()`` then checks the allocator: no INTERNAL
ASSERT was hit (even one graphrt caught), no routing is left (over the fake; on a GPU from torch 2.8
``empty_cache()`` no longer tells: it skips the default pools while a routing is left, pytorch#158152),
``empty_cache()`` is legal.
"""

from __future__ import annotations

import gc
import importlib
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from fake_cuda import (
    BEHAVIOURS, TORCH_2_7, TORCH_2_11, TORCH_2_12, TORCH_RESET_RELEASES, FakeCuda, FakeCUDAGraph, InternalAssert, install,
)
from piecewise_helpers import double_rows

from graphrt import GraphRunner, wrap
from graphrt.backends.cuda_pool import CudaPool
from graphrt.entry import GraphEntry, GraphStatus
from graphrt.reference import make_extend_batch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
READY, FAILED = GraphStatus.READY, GraphStatus.FAILED
ENVIRONMENTS = [*(pytest.param(behaviour, id=f"fake-torch-{behaviour.name}") for behaviour in BEHAVIOURS),
                pytest.param(None, id="cuda", marks=pytest.mark.cuda)]


class Device:
    """Where a scenario runs: over the fake torch.cuda (tensors on the CPU) or on a GPU."""

    def __init__(self, fake: Optional[FakeCuda]) -> None:
        self.fake = fake
        self.name = "cpu" if fake is not None else "cuda"

    def settle(self) -> None:
        """The allocator is left sound: no assertion hit, no routing left, ``empty_cache`` legal."""
        if self.fake is not None:
            assert self.fake.allocator.asserts == [] and self.fake.aborts == []
            assert self.fake.allocator.captures_underway == []
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def older_objects_frozen():
    """gc.collect() leaves out what existed before the test (graphrt collects once per capture
    session, and a scan of torch's whole heap costs a quarter second); what the test makes, the
    graphs a scenario drops among it, is collected as usual."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(params=ENVIRONMENTS)
def device(request, monkeypatch):
    """Each scenario over the fake torch.cuda, once per PyTorch behaviour it models, and (marked
    ``cuda``) on a GPU. Over the fake, the graphs the scenario left are freed at the end too: none
    may release its pool twice (an abort on a GPU) or hit another assertion."""
    if request.param is None:
        yield Device(None)
        return
    with install(monkeypatch, request.param) as fake:
        yield Device(fake)
        gc.collect()
        assert fake.aborts == [] and fake.allocator.asserts == []


@pytest.fixture
def checks(monkeypatch):
    """scripts/gpu_checks.py: its misbehaving model, helpers and GPU checks."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("gpu_checks")


def statuses(runner) -> Dict[str, GraphStatus]:
    """Every key of the runner and its status, by name."""
    return {str(key): entry.status for key, entry in runner.registry.entries.items()}


def wrapped_entries(fast) -> Dict[int, GraphEntry]:
    """The keys of the layout ``fast`` used last, by size."""
    return {key.num_tokens: entry for key, entry in fast.layouts.current.graphs.registry.entries.items()}


def scale(x: torch.Tensor) -> torch.Tensor:
    """A function of one batched tensor for ``wrap()``."""
    return x * 2 + 1


def differs_when_captured_at_4(x: torch.Tensor) -> torch.Tensor:
    """``scale``, but a capture at 4 rows takes another path: that graph's first replay differs from eager."""
    return scale(x) + (1.0 if x.shape[0] == 4 and torch.cuda.is_current_stream_capturing() else 0.0)


# ---- item 3: a pool that outlives its graphs ---------------------------------------------------

def test_a_largest_key_failing_verification_leaves_the_next_keys_capturable(device, checks):
    model = checks.Misbehaving("differ", at=4, device=device.name)
    runner = checks.runner_for(model, device.name, [1, 2, 4])
    runner.capture()
    assert statuses(runner) == {"decode/bs=4": GraphStatus.VERIFY_FAILED, "decode/bs=2": READY, "decode/bs=1": READY}
    assert len(checks.pools(runner)) == 1  # the keys that serve share one pool
    assert checks.replay_equal_eager(runner, model, device.name, [1, 2, 3], 6) == 4  # bs 3 pads to the failed 4
    # wrap() records each key in a capture session of its own (gc.collect() first): the failed graph is gone
    fast = wrap(differs_when_captured_at_4, max_batch_size=4, capture_sizes=[2, 4], backend="cuda")
    big, small = torch.randn(4, 16, device=device.name), torch.randn(2, 16, device=device.name)
    fast(big), fast(big)
    assert wrapped_entries(fast)[4].status is GraphStatus.VERIFY_FAILED
    fast(small)
    assert torch.equal(fast(small), scale(small)) and wrapped_entries(fast)[2].status is READY
    device.settle()


def test_a_clean_capture_failure_leaves_the_next_keys_capturable(device, checks):
    model = checks.Misbehaving("raise", at=4, device=device.name)
    runner = checks.runner_for(model, device.name, [1, 2, 4])
    runner.capture()
    assert statuses(runner) == {"decode/bs=4": FAILED, "decode/bs=2": READY, "decode/bs=1": READY}
    assert runner.stats()["failed_keys"]["decode/bs=4"].startswith("ValueError")
    assert checks.replay_equal_eager(runner, model, device.name, [1, 2], 4) == 4
    device.settle()


def test_retune_on_a_decode_only_runner_recaptures_every_key_in_a_fresh_pool(device, checks):
    model = checks.Misbehaving(device=device.name)
    runner = checks.runner_for(model, device.name, [2, 4])
    runner.capture()
    first = checks.pools(runner)
    checks.replay_equal_eager(runner, model, device.name, [1, 3], 4)
    runner.retune(2)  # drops every decode graph, then captures sizes 1 and 3
    assert statuses(runner) == {"decode/bs=3": READY, "decode/bs=1": READY}
    assert len(checks.pools(runner)) == 1 and checks.pools(runner) != first
    assert checks.replay_equal_eager(runner, model, device.name, [1, 3], 4) == 4
    device.settle()


def test_a_disabled_last_graph_leaves_the_next_size_capturable(device):
    fast = wrap(scale, max_batch_size=4, capture_sizes=[2, 4], backend="cuda")
    x = torch.randn(2, 8, device=device.name)
    fast(x), fast(x)  # warm-up, then recorded
    entry = wrapped_entries(fast)[2]
    assert entry.status is READY

    def fail() -> None:
        raise RuntimeError("injected replay failure")

    entry.graph.replay = fail  # the next replay raises where eager does not
    assert torch.equal(fast(x), scale(x))  # re-run eagerly; the key is disabled and its graph dropped
    assert entry.status is GraphStatus.DISABLED
    y = torch.randn(4, 8, device=device.name)
    fast(y)
    assert torch.equal(fast(y), scale(y)) and wrapped_entries(fast)[4].status is READY
    device.settle()


def test_wrap_dropping_its_only_layout_leaves_the_next_layout_capturable(device):
    fast = wrap(scale, max_batch_size=4, capture_sizes=[2], backend="cuda", max_signatures=1)
    x = torch.randn(2, 8, device=device.name)
    fast(x), fast(x)
    assert wrapped_entries(fast)[2].status is READY
    y = torch.randn(2, 6, device=device.name)  # another layout: the first one (and its graph) is dropped
    fast(y)
    assert torch.equal(fast(y), scale(y))
    assert fast.stats()["layouts_dropped"] == 1 and wrapped_entries(fast)[2].status is READY
    device.settle()


def test_a_padded_wrap_keys_capture_leaves_the_state_as_it_was(device):
    """A key smaller calls pad to is verified by replaying it against its warm-up: a CUDA replay writes what
    the step writes, where no journal sees it (a launch), so capture puts those regions back itself. Every
    call's step still counts once."""
    counter = torch.zeros((), device=device.name)

    def step(x):
        counter.add_(1)
        return x * 2

    fast = wrap(step, max_batch_size=4, capture_sizes=[4], backend="cuda")
    for call in range(1, 6):
        x = torch.full((3, 2), float(call), device=device.name)
        assert torch.equal(fast(x), x * 2) and int(counter) == call
    assert fast.stats()["graph_runs"] == 4 and wrapped_entries(fast)[4].status is READY
    device.settle()


# ---- item 4: one failed capture does not break the next ---------------------------------------

def test_a_capture_invalidated_by_a_host_read_fails_only_its_key(device, checks):
    model = checks.Misbehaving("item", at=4, device=device.name)
    runner = checks.runner_for(model, device.name, [1, 2, 4])
    runner.capture()
    assert statuses(runner) == {"decode/bs=4": FAILED, "decode/bs=2": READY, "decode/bs=1": READY}
    assert len(checks.pools(runner)) == 1
    assert checks.replay_equal_eager(runner, model, device.name, [1, 2, 3], 6) == 4
    assert runner.stats()["eager_reasons"] == {"capture_failed": 2}  # only bs 3, padded to the failed key
    device.settle()


class PieceReader(torch.nn.Module):
    """Embeds tokens, calls the splitting op, then, at 16 tokens, reads a value on the host in the
    second piece (which invalidates that piece's capture)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(97, 8, generator=torch.Generator().manual_seed(0)).to(device))

    def forward(self, input_ids, positions, forward_batch):
        hidden = double_rows(self.embed[input_ids] + positions[:, None])
        if input_ids.shape[0] == 16:
            hidden = hidden / max(1.0, float(hidden.abs().max().item()))
        return hidden * 3


def test_a_piece_invalidated_by_a_host_read_fails_only_its_key(device):
    model = PieceReader(device.name)
    runner = GraphRunner(model, max_batch_size=4, backend="cuda", device=device.name, progress=False,
                         splitting_ops=[double_rows], piecewise_sizes=[8, 16])
    runner.capture()
    failed = {key: status for key, status in statuses(runner).items() if status is not READY}
    assert failed == {"piecewise/tokens=16": FAILED} and len(statuses(runner)) == 5
    for tokens in (12, 6, 6):  # 12 pads to the failed key; the first 6 shows the output axes (axis_probe)
        batch = make_extend_batch([list(range(tokens))], [1], [0], torch.arange(1, tokens + 1, device=device.name),
                                  device.name)
        with torch.no_grad():
            assert torch.equal(runner(batch), model(batch.input_ids, batch.positions, batch))
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1, "axis_probe": 1}
    assert runner.stats()["piecewise_runs"] == 1
    device.settle()


def test_graphs_without_weak_references_capture_each_in_a_fresh_pool(monkeypatch):
    with install(monkeypatch, TORCH_2_11) as cuda, cuda.stream(torch.cuda.Stream()):
        pool = CudaPool()
        first = pool.for_capture()
        pool.captured(object())  # takes no weak reference: whether the pool is held cannot be known
        second, third = pool.for_capture(), pool.for_capture()
        assert len({first, second, third}) == 3
        assert cuda.allocator.asserts == []


# ---- scripts/gpu_checks.py, over the fake -------------------------------------------------------

FEWER_STEPS = {"retune_after_failed_largest": {"steps": 12}, "invalidated_then_healthy": {"replays": 30},
               "invalidated_last_then_random": {"steps": 6}}


@pytest.mark.parametrize("behaviour", [TORCH_2_11, TORCH_RESET_RELEASES],
                         ids=["fake-torch-2.11", "fake-torch-pr190348"])
@pytest.mark.parametrize("check", sorted(FEWER_STEPS))
def test_the_gpu_checks_pass_over_the_fake(check, behaviour, checks, monkeypatch):
    with install(monkeypatch, behaviour) as fake:
        result = checks.run_check(check, "cpu", **FEWER_STEPS[check])
        assert result["ok"], result["error"]
        assert fake.allocator.asserts == [] and fake.allocator.captures_underway == []


# ---- the fake refuses what PyTorch refuses ------------------------------------------------------

def capture_once(cuda: FakeCuda, pool, step=lambda: torch.ones(2) * 2) -> FakeCUDAGraph:
    """One fake graph capturing ``step`` into ``pool`` on a side stream."""
    graph = FakeCUDAGraph()
    with cuda.stream(torch.cuda.Stream()):
        graph.capture_begin(pool=pool)
        step()
        graph.capture_end()
    return graph


def test_the_fake_refuses_a_pool_whose_graphs_are_gone(monkeypatch):
    with install(monkeypatch, TORCH_2_11) as cuda:
        pool = torch.cuda.graph_pool_handle()
        kept = capture_once(cuda, pool)
        capture_once(cuda, pool)  # shares the pool while ``kept`` lives
        del kept
        with pytest.raises(InternalAssert, match="use_count > 0"):
            capture_once(cuda, pool)


@pytest.mark.parametrize("behaviour, left", [(TORCH_2_11, True), (TORCH_2_12, False)], ids=["2.11", "2.12"])
def test_the_fake_leaves_an_invalidated_captures_routing_as_its_torch_does(behaviour, left, monkeypatch):
    with install(monkeypatch, behaviour) as cuda:
        graph, pool = FakeCUDAGraph(), torch.cuda.graph_pool_handle()
        with cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=pool)
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                torch.ones(2).sum().item()
            assert torch.cuda.is_current_stream_capturing()  # invalidated, not ended
            with pytest.raises(RuntimeError, match="previous error during capture"):
                graph.capture_end()
            assert not torch.cuda.is_current_stream_capturing()
        assert [underway for underway, _ in cuda.allocator.captures_underway] == ([pool] if left else [])
        torch.cuda.empty_cache()  # from 2.8 legal even while a routing is left: it then skips the default pools
        assert cuda.allocator.asserts == []


@pytest.mark.parametrize("behaviour, asserts", [(TORCH_2_7, True), (TORCH_2_11, False), (TORCH_2_12, False)],
                         ids=["2.7", "2.11", "2.12"])
def test_empty_cache_during_a_capture_asserts_only_up_to_2_7(behaviour, asserts, monkeypatch):
    """The first GPU session (H200, torch 2.11): ``empty_cache()`` during a capture raised nothing. Up to 2.7
    ``release_cached_blocks`` synced first and its ``captures_underway`` assertion failed; from 2.8
    (pytorch#158152) it leaves the default pools as they are while a capture routes, and the capture
    goes on to end and replay."""
    with install(monkeypatch, behaviour) as cuda:
        graph, x = FakeCUDAGraph(), torch.ones(4)
        with cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=torch.cuda.graph_pool_handle())
            y = x * 2
            if asserts:
                with pytest.raises(InternalAssert, match="captures_underway"):
                    torch.cuda.empty_cache()
            else:
                torch.cuda.empty_cache()
            graph.capture_end()
        graph.replay()
        assert torch.equal(y, x * 2)
        assert cuda.allocator.asserts == (["captures_underway.size() == 0"] if asserts else [])
