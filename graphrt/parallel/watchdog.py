"""graphrt's own watchdog over lockstep replays whose collectives run on the device.

ProcessGroupNCCL's watchdog times out the collectives it enqueued; a collective captured into a CUDA graph
is launched by the graph's replay and never enqueued to it, so a peer that dies mid-replay leaves the
survivor's stream waiting inside the collective forever, and the survivor's next host read (the step's
tokens) blocks with it, past every timeout. So after each lockstep replay on the CUDA backend the runner
records an event on the replay's stream and polls it (``ReplayWatchdog.watch``) until it completes, up to
the model group's timeout: past it ``ReplayTimeout``, which ``Lockstep.replayed`` raises as ``PeerLostError``
on the survivor, which must then be restarted (its stream still waits in the collective). The poll costs
the host its run-ahead of one step: a lockstep step on CUDA ends when its replay has.

Collectives on the host (gloo inside an emulated graph) need no poll: the replay waits for them, and their
failure (``CollectiveError``: a peer gone, or the group's timeout) becomes ``PeerLostError`` the same way.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

FIRST_PAUSE_S = 1e-5  # the poll's first sleep, doubled up to LONGEST_PAUSE_S: a completed replay is seen within it
LONGEST_PAUSE_S = 1e-4


def group_timeout_s(group: Any) -> float:
    """The timeout of ``group``'s collectives (its backend's options: NCCL's or gloo's), else torch's default."""
    for device in ("cuda", "cpu"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, TypeError, ValueError):  # private API: any release may lack it
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
    return dist.default_pg_timeout.total_seconds()


class ReplayTimeout(RuntimeError):
    """A watched replay did not complete on the device within the group's timeout."""


class ReplayWatchdog:
    """Polls an event recorded after each watched replay on ``device``'s current stream, at most
    ``timeout_s`` seconds; ``ReplayTimeout`` past it."""

    def __init__(self, timeout_s: float, device: torch.device, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.timeout_s = timeout_s
        self.device = device
        self._clock, self._sleep = clock, sleep

    def watch(self, what: str) -> None:
        """Return once the work queued on the stream so far (``what``: the replay) has completed."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline, pause = self._clock() + self.timeout_s, FIRST_PAUSE_S
        while not event.query():
            if self._clock() >= deadline:
                raise ReplayTimeout(
                    f"{what} did not complete on the device within the group's timeout of {self.timeout_s:g} s (a "
                    "collective captured in the graph waits for a peer; NCCL's watchdog does not see captured "
                    "collectives); this rank's stream still waits there")
            self._sleep(pause)
            pause = min(2 * pause, LONGEST_PAUSE_S)


__all__ = ["ReplayTimeout", "ReplayWatchdog", "group_timeout_s"]
