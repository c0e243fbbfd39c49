"""Was the machine busy? The load average against the core count at the start and end of a run,
and the CPU time other processes took during it.

A figure taken while other processes compete for the cores says little about graphrt: the bench
prints the load at its start and end, a WARNING when the machine was busy, and records both in
the JSON. The rule: the machine is busy when other processes keep more than ``BUSY_SHARE`` of
the cores busy, by any of three readings:

- the 1-minute load average at the start (the bench has not run yet);
- the 1-minute load average at the end, less the bench's own share of it (its CPU time over the
  run, decayed as the kernel's 1-minute average decays: about one thread for a run of several
  minutes, less for a short run);
- where Linux's ``/proc/stat`` is readable, the CPU seconds every process spent busy during the
  run less the bench's own CPU seconds, over the run's wall time: the cores other processes
  used on average (exact, where the load average is a smoothed count of runnable threads).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

BUSY_SHARE = 0.5  # of the cores, taken by other processes
LOAD_WINDOW_S = 60.0  # the time constant of the 1-minute load average


@dataclass
class LoadSample:
    """One reading: the load averages, and CPU seconds spent busy by every process and by this one."""

    wall_s: float  # time.monotonic()
    load_average: Tuple[float, float, float]  # 1, 5, 15 minutes
    cores: int
    busy_cpu_s: Optional[float]  # every process, since boot (/proc/stat); None where unreadable
    own_cpu_s: float  # this process, every thread (time.process_time)


def busy_cpu_seconds() -> Optional[float]:
    """CPU seconds every process has spent busy since boot, summed over cores (the first line of
    /proc/stat: user, nice, system, irq, softirq, steal; idle and iowait left out); None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def sample_load() -> LoadSample:
    """The load now."""
    return LoadSample(time.monotonic(), os.getloadavg(), os.cpu_count() or 1, busy_cpu_seconds(), time.process_time())


def load_verdict(start: LoadSample, end: Optional[LoadSample] = None) -> Dict[str, Any]:
    """The readings of the module docstring for the run from ``start`` to ``end`` (``start`` alone:
    the start reading only), which of them say busy, and the WARNING line when any does."""
    threshold = BUSY_SHARE * start.cores
    verdict: Dict[str, Any] = {"cores": start.cores, "busy_threshold": threshold, "start": asdict(start)}
    readings = {"1-minute load at the start": start.load_average[0]}
    if end is not None:
        elapsed = max(end.wall_s - start.wall_s, 1e-9)
        own_cores = (end.own_cpu_s - start.own_cpu_s) / elapsed
        own_load = own_cores * (1.0 - math.exp(-elapsed / LOAD_WINDOW_S))
        verdict.update(end=asdict(end), seconds=elapsed, own_cores=own_cores, own_load_end=own_load)
        readings["1-minute load at the end, less this bench's share"] = max(0.0, end.load_average[0] - own_load)
        if start.busy_cpu_s is not None and end.busy_cpu_s is not None:
            others = (end.busy_cpu_s - start.busy_cpu_s - (end.own_cpu_s - start.own_cpu_s)) / elapsed
            readings["cores other processes used during the run"] = max(0.0, others)
    busy = {name: value for name, value in readings.items() if value > threshold}
    verdict.update(readings=readings, busy=bool(busy), warning=None)
    if busy:
        why = "; ".join(f"{name} {value:.2f}" for name, value in busy.items())
        verdict["warning"] = (
            f"WARNING: machine BUSY ({why}; busy above {threshold:.2f} = {BUSY_SHARE:g} x {start.cores} cores): "
            f"other processes competed for the cores, so the figures of this run are not reliable. "
            f"Rerun on an idle machine before quoting them.")
    return verdict


def format_load(verdict: Dict[str, Any]) -> List[str]:
    """Report lines: the load averages at the start (and end), the other processes' share, the WARNING."""
    cores = verdict["cores"]
    start = verdict["start"]["load_average"]
    lines = [f"load average at the start: {start[0]:.2f} {start[1]:.2f} {start[2]:.2f} (1/5/15 min) on {cores} cores "
             f"({start[0] / cores:.2f} per core; busy above {BUSY_SHARE:g} per core)"]
    if "end" in verdict:
        end = verdict["end"]["load_average"]
        readings = verdict["readings"]
        others = readings.get("cores other processes used during the run")
        lines.append(
            f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} after {verdict['seconds']:.0f} s, "
            f"of which this bench about {verdict['own_load_end']:.2f}"
            + ("" if others is None else f"; other processes used {others:.2f} of the {cores} cores during the run"))
    lines.append(verdict["warning"] or "machine: not busy by these readings")
    return lines
