"""Memory probes: sane host numbers, NVML when it works, one logged reason when it does not."""

from __future__ import annotations

import logging
import sys
import types

import pynvml
import pytest
import torch

from graphrt.pools import memory
from graphrt.pools.memory import MemoryInfo, memory_pressure, probe_memory

GIB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_probe_state(monkeypatch):
    """Each test sees NVML uninitialized and no reason logged yet."""
    monkeypatch.setattr(memory, "_STATE", memory._ProbeState())


def nvml_records(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.name == "graphrt.pools.memory" and r.levelno == level and "NVML" in r.message]


def test_host_probe_is_sane():
    info = probe_memory("cpu")
    assert info.source == "host"
    assert 0 < info.free_bytes <= info.total_bytes
    assert info.used_bytes == info.total_bytes - info.free_bytes
    assert 0.0 <= info.used_fraction <= 1.0
    assert 0.0 <= memory_pressure("cpu") <= 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is a GPU here")
def test_default_device_without_cuda_is_the_host():
    assert probe_memory().source == "host"


def test_sysconf_fallback_without_proc_meminfo(monkeypatch):
    monkeypatch.setattr(memory, "MEMINFO_PATH", "/nonexistent/meminfo")
    info = probe_memory("cpu")
    assert info.source == "host"
    assert 0 < info.free_bytes <= info.total_bytes


def test_nvml_error_falls_back_with_one_logged_reason(monkeypatch, caplog):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    caplog.set_level(logging.DEBUG, logger="graphrt.pools.memory")
    first = probe_memory("cuda:0")
    second = probe_memory("cuda:0")
    assert first.source in ("torch.cuda", "host") and second.source == first.source
    assert 0 < first.free_bytes <= first.total_bytes
    reasons = nvml_records(caplog)
    assert len(reasons) == 1, [r.message for r in caplog.records]
    assert "DriverNotLoaded" in reasons[0].message


def test_missing_pynvml_falls_back(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    caplog.set_level(logging.INFO, logger="graphrt.pools.memory")
    info = probe_memory(torch.device("cuda", 0))
    assert info.source != "nvml"
    assert any("pynvml" in r.message for r in caplog.records)


def fake_pynvml(free: int, total: int, read_error: bool = False) -> types.ModuleType:
    """A pynvml stand-in reporting fixed numbers (or failing the memory read)."""
    module = types.ModuleType("pynvml")

    def get_info(handle):
        if read_error:
            raise RuntimeError("no such device")
        return types.SimpleNamespace(free=free, total=total, used=total - free)

    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda index: ("index", index)
    module.nvmlDeviceGetHandleByUUID = lambda uuid: ("uuid", uuid)
    module.nvmlDeviceGetMemoryInfo = get_info
    return module


def test_nvml_numbers_are_used_when_nvml_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(free=20 * GIB, total=80 * GIB))
    info = probe_memory("cuda")
    assert info == MemoryInfo(free_bytes=20 * GIB, total_bytes=80 * GIB, source="nvml")
    assert info.used_fraction == pytest.approx(0.75)
    assert memory_pressure(0) == pytest.approx(0.75)


def test_nvml_read_failure_falls_back(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(1, 2, read_error=True))
    caplog.set_level(logging.INFO, logger="graphrt.pools.memory")
    assert probe_memory("cuda:0").source != "nvml"
    assert any("NVML cannot read device 0" in r.message for r in caplog.records)


def test_used_fraction_is_clamped():
    assert MemoryInfo(free_bytes=0, total_bytes=0, source="host").used_fraction == 0.0
    assert MemoryInfo(free_bytes=-5, total_bytes=10, source="host").used_fraction == 1.0
