"""graphrt's watchdog over lockstep replays carrying collectives (issue 48, item 4).

NCCL collectives captured into a CUDA graph are launched by its replay, never enqueued to
ProcessGroupNCCL, so its watchdog never times them out: a peer that dies mid-replay leaves the survivor's
stream waiting in the collective forever, and the survivor's next host read blocks with it. Now a
lockstep replay on CUDA ends when an event recorded after it completes, polled up to the model group's
timeout: past it the step raises ``PeerLostError``. Over the fake torch.cuda (a stalled stream stands for
the collective that never completes) and on gloo (two processes, the emulated backend: the replay's own
collective fails at the peer's death or at the group's timeout, and that becomes ``PeerLostError`` too).
"""

from __future__ import annotations


import datetime
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import decode_batch
from lockstep_helpers import report_now, run_ranks

from graphrt import GraphRunner
from graphrt.parallel.lockstep import Lockstep, PeerLostError
from graphrt.parallel.watchdog import ReplayTimeout, ReplayWatchdog, group_timeout_s

TIMEOUT_S = 60
GROUP_TIMEOUT_S = 1.0


@torch.library.custom_op("graphrt_test::device_all_reduce", mutates_args=("hidden",))
def device_all_reduce(hidden: torch.Tensor) -> None:
    """A collective on the device (NCCL's all-reduce over one rank: the values stay). Over the fake torch.cuda,
    once its peers are gone (the fake device's ``peers_lost``), the kernel launched by a replay never completes:
    the stream stalls."""
    from fake_cuda import FakeCuda

    if FakeCuda.installed is not None:
        FakeCuda.installed.collective("an all-reduce waiting for a peer that died")


class CollectiveModel(torch.nn.Module):
    """Embeds tokens and positions, all-reduces the hidden states (on the device, or over ``group`` with
    gloo), projects."""

    def __init__(self, group=None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, 16, generator=generator))
        self.proj = torch.nn.Parameter(torch.randn(16, 11, generator=generator))
        self.group = group

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed[input_ids] + positions[:, None].to(self.embed.dtype) * 1e-2
        if self.group is None:
            device_all_reduce(hidden)
        else:
            dist.all_reduce(hidden, group=self.group)
        return hidden @ self.proj


def fake_cuda_worker(rank: int) -> dict:
    """One rank in lockstep on the fake torch.cuda (torch 2.11's rules), its model group timing out after
    ``GROUP_TIMEOUT_S``: a replay whose collective never completes, then the host's read of its output."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fake_cuda import TORCH_2_11, FakeCuda, FakeHang, install

    installed = install(pytest.MonkeyPatch(), TORCH_2_11)  # held to the end: its block keeps the recording mode
    installed.__enter__()
    group = dist.new_group([0], backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    runner = GraphRunner(CollectiveModel(), max_batch_size=4, capture_sizes=[2, 4], backend="cuda", device="cpu",
                         process_group=group, progress=False)
    runner.capture()
    healthy = runner(decode_batch(3, seed=1)).clone()
    FakeCuda.installed.peers_lost = True
    start, outcome = time.monotonic(), {}
    try:
        out = runner(decode_batch(3, seed=2))
        outcome["returned"] = True
        out.sum().item()  # the host reads the step's result
    except (PeerLostError, FakeHang) as error:
        outcome.update(error=type(error).__name__, message=str(error))
    outcome.update(seconds=time.monotonic() - start, healthy_rows=healthy.shape[0], timeout=group_timeout_s(group),
                   watchdog=runner.lockstep.watchdog is not None, failed=runner.stats()["failed_keys"])
    installed.__exit__(None, None, None)
    return outcome


def test_a_replay_whose_collective_never_completes_raises_peer_lost_within_the_groups_timeout():
    """Over the fake torch.cuda: before, the step returned and the host's read of its output waited forever
    (``FakeHang``); now the step raises ``PeerLostError`` naming the replay, after the group's timeout."""
    outcome = run_ranks(fake_cuda_worker, world_size=1, timeout_s=TIMEOUT_S)[0]
    assert outcome["watchdog"] and outcome["timeout"] == GROUP_TIMEOUT_S and outcome["healthy_rows"] == 3
    assert outcome["failed"] == {}, outcome
    assert outcome.get("error") == "PeerLostError" and "returned" not in outcome, outcome
    assert "the replay of decode/bs=4 did not complete on the device within the group's timeout of 1 s" in \
        outcome["message"], outcome["message"]
    assert GROUP_TIMEOUT_S <= outcome["seconds"] < GROUP_TIMEOUT_S + 5, outcome


def gloo_worker(rank: int, fault: str) -> dict:
    """Two ranks in lockstep on a gloo group timing out after ``GROUP_TIMEOUT_S`` (the agreements and the
    model's all-reduce), the emulated backend. After a healthy step, rank 1 agrees on the next step and
    then dies (``fault`` "dies") or sleeps past the timeout ("hangs"): rank 0 replays alone."""
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    runner = GraphRunner(CollectiveModel(group), max_batch_size=4, capture_sizes=[2, 4], backend="emulated",
                         process_group=group, progress=False)
    runner.capture()
    runner(decode_batch(3, seed=1))
    if rank == 1:
        agree = Lockstep.agree_step

        def agree_then_fail(lockstep, *args, **kwargs):
            agreed = agree(lockstep, *args, **kwargs)
            report_now({"agreed": True})
            if fault == "dies":
                os._exit(0)
            time.sleep(GROUP_TIMEOUT_S + 2)
            os._exit(0)

        runner.lockstep.agree_step = agree_then_fail.__get__(runner.lockstep)
    start, outcome = time.monotonic(), {}
    try:
        runner(decode_batch(2, seed=2))
        outcome["returned"] = True
    except RuntimeError as error:
        outcome.update(error=type(error).__name__, message=str(error))
    outcome.update(seconds=time.monotonic() - start,
                   statuses={str(key): entry.status.value for key, entry in runner.registry.entries.items()})
    report_now(outcome)
    os._exit(0)  # the group cannot be destroyed with its peer gone


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_peer_lost_during_a_gloo_replay_raises_peer_lost_on_the_survivor(fault):
    """Before, the survivor's replay raised gloo's RuntimeError and disabled the healthy key; now it raises
    ``PeerLostError`` naming the replay, at once for a death and within the group's timeout for a hang,
    and the key (not at fault) stays ready."""
    reports = run_ranks(gloo_worker, fault, timeout_s=TIMEOUT_S)
    survivor = reports[0]
    assert reports[1] == {"agreed": True}
    assert survivor.get("error") == "PeerLostError", survivor
    assert survivor["message"].startswith("lockstep: rank 0 lost its peers at the replay of decode/bs=2: "
                                          "CollectiveError"), survivor["message"]
    assert survivor["seconds"] < GROUP_TIMEOUT_S + 5 and survivor["statuses"]["decode/bs=2"] == "ready", survivor


def test_the_watchdog_polls_until_the_event_completes_or_the_deadline(monkeypatch):
    """``ReplayWatchdog.watch`` over a fake event and clock: it returns when the event completes, polling
    with growing pauses, and raises ``ReplayTimeout`` once the clock passes the timeout."""
    polls, now = [], [0.0]

    class Event:
        def record(self, stream=None):
            pass

        def query(self):
            polls.append(now[0])
            return len(polls) > 3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)

    def sleep(seconds):
        now[0] += seconds

    watchdog = ReplayWatchdog(5.0, torch.device("cpu"), clock=lambda: now[0], sleep=sleep)
    watchdog.watch("the replay")
    assert len(polls) == 4 and polls[1] - polls[0] < polls[2] - polls[1]
    polls.clear()
    monkeypatch.setattr(Event, "query", lambda self: False)
    with pytest.raises(ReplayTimeout, match="the replay did not complete on the device within the group's timeout"):
        watchdog.watch("the replay")
    assert 5.0 <= now[0] < 5.1
