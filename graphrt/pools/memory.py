"""Device memory probes: NVML first, then ``torch.cuda``, then host memory.

NVML (nvidia-ml-py) reads a GPU's memory without creating a CUDA context, so it
is tried first for CUDA devices. Where there is no NVIDIA driver (``pynvml``
missing, or ``nvmlInit`` failing) the probe falls back, logging the reason once
per process, and never raises: a CPU-only machine reports host memory.

The host source reads ``MemAvailable``/``MemTotal`` from ``/proc/meminfo``
(``os.sysconf`` elsewhere); it does not apply container (cgroup) limits.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Set, Union

import torch

logger = logging.getLogger(__name__)

DeviceLike = Union[None, int, str, torch.device]
MEMINFO_PATH = "/proc/meminfo"


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of one device, and which probe measured them."""

    free_bytes: int
    total_bytes: int
    source: str  # "nvml" | "torch.cuda" | "host"

    @property
    def used_bytes(self) -> int:
        """Bytes in use (total minus free)."""
        return self.total_bytes - self.free_bytes

    @property
    def used_fraction(self) -> float:
        """Fraction of the device's memory in use, in [0, 1] (0 when total is unknown)."""
        if self.total_bytes <= 0:
            return 0.0
        return min(1.0, max(0.0, self.used_bytes / self.total_bytes))


@dataclass
class _ProbeState:
    """Process-wide probe state: whether NVML initialized, and which reasons were logged."""

    nvml: Any = None  # the pynvml module once nvmlInit succeeded
    nvml_failed: bool = False
    logged: Set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _ProbeState()


def _log_once(reason: str) -> None:
    """Log a fallback reason at INFO the first time it happens, then at DEBUG."""
    with _STATE.lock:
        first = reason not in _STATE.logged
        _STATE.logged.add(reason)
    logger.log(logging.INFO if first else logging.DEBUG, "memory probe: %s", reason)


def _cuda_index(device: DeviceLike) -> Optional[int]:
    """The CUDA device index asked for, or None when the request is for host memory."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _nvml_module() -> Any:
    """The initialized pynvml module, or None (with one logged reason) where NVML is unusable."""
    with _STATE.lock:
        if _STATE.nvml is not None or _STATE.nvml_failed:
            return _STATE.nvml
        try:
            import pynvml

            pynvml.nvmlInit()
            _STATE.nvml = pynvml
        except ImportError as exc:
            reason = f"nvidia-ml-py (pynvml) is not importable ({exc}); falling back"
        except Exception as exc:  # pynvml.NVMLError and its driver-specific subclasses
            reason = f"NVML unavailable ({type(exc).__name__}: {exc}); falling back"
        else:
            return pynvml
        _STATE.nvml_failed = True
    _log_once(reason)
    return None


def _probe_nvml(index: int) -> Optional[MemoryInfo]:
    """Memory of CUDA device ``index`` through NVML, or None where NVML cannot tell."""
    pynvml = _nvml_module()
    if pynvml is None:
        return None
    try:
        if torch.cuda.is_available():
            # NVML enumerates in PCI order; CUDA may not (CUDA_VISIBLE_DEVICES, device order).
            uuid = torch.cuda.get_device_properties(index).uuid
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception as exc:  # NVMLError (e.g. MIG or a UUID NVML does not know), AttributeError
        _log_once(f"NVML cannot read device {index} ({type(exc).__name__}: {exc}); falling back")
        return None
    return MemoryInfo(free_bytes=int(info.free), total_bytes=int(info.total), source="nvml")


def _probe_torch_cuda(index: int) -> Optional[MemoryInfo]:
    """Memory of CUDA device ``index`` through ``torch.cuda.mem_get_info``, or None."""
    if not torch.cuda.is_available():
        _log_once(f"torch.cuda is not available for device cuda:{index}; using host memory")
        return None
    try:
        free, total = torch.cuda.mem_get_info(index)
    except RuntimeError as exc:
        _log_once(f"torch.cuda.mem_get_info({index}) failed ({exc}); using host memory")
        return None
    return MemoryInfo(free_bytes=int(free), total_bytes=int(total), source="torch.cuda")


def _probe_host() -> MemoryInfo:
    """Host memory from /proc/meminfo (MemAvailable, MemTotal), else os.sysconf."""
    try:
        fields = {}
        with open(MEMINFO_PATH, encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    fields[name] = int(rest.split()[0]) * 1024  # values are in kB
        return MemoryInfo(fields["MemAvailable"], fields["MemTotal"], source="host")
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        total = os.sysconf("SC_PHYS_PAGES") * page
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total), source="host")


def probe_memory(device: DeviceLike = None) -> MemoryInfo:
    """Free/total memory of ``device`` (default: current CUDA device, else host), falling back when a probe fails."""
    index = _cuda_index(device)
    if index is None:
        return _probe_host()
    return _probe_nvml(index) or _probe_torch_cuda(index) or _probe_host()


def memory_pressure(device: DeviceLike = None) -> float:
    """Used fraction of ``device``'s memory in [0, 1], for sizing decisions that react to pressure."""
    return probe_memory(device).used_fraction


def unreclaimable_pressure(device: DeviceLike = None) -> float:
    """``memory_pressure`` less what PyTorch's caching allocator holds cached but unused on a CUDA device
    (``memory_reserved - memory_allocated``): that memory is handed out again without the driver, so
    an engine that ran a large step once is not under pressure for it."""
    info = probe_memory(device)
    index = _cuda_index(device)
    cached = 0
    if index is not None and info.source != "host" and torch.cuda.is_available():
        cached = max(0, torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))
    if info.total_bytes <= 0:
        return 0.0
    return min(1.0, max(0.0, (info.used_bytes - cached) / info.total_bytes))
