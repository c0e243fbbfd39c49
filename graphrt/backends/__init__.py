"""Graph backends behind one protocol: ``cuda`` (torch.cuda.CUDAGraph) and ``emulated`` (CPU), whole or in pieces."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from graphrt.backends.base import CapturedGraph, CollectiveError, GraphBackend, PieceSink, SplitPoint
from graphrt.backends.compiled import refuse_compiled_cudagraphs
from graphrt.backends.emulated import EmulatedBackend
from graphrt.backends.session import another_capture_error, no_recording, step_lock
from graphrt.backends.state_journal import StateJournal

BACKEND_NAMES = ("auto", "cuda", "emulated", "eager")
DISABLE_ENV = "GRAPHRT_DISABLE"


def graphs_disabled_by_env() -> bool:
    """True when ``GRAPHRT_DISABLE=1`` asks every step to run eagerly (A/B debugging)."""
    return os.environ.get(DISABLE_ENV, "0") not in ("", "0")


def resolve_device(backend_name: str, device: Optional[Union[str, torch.device]]) -> torch.device:
    """The device static tensors live on; ``cuda`` without an index becomes the current device."""
    if device is None:
        device = "cuda" if backend_name == "cuda" else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} asked for, but this machine has no CUDA device "
                         "(torch.cuda.is_available() is False); leave device unset to use the CPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_backend_name(name: str, device: Optional[Union[str, torch.device]] = None) -> str:
    """Map ``auto`` to ``cuda`` when CUDA is available and ``device`` (where the step's tensors
    live, when known) is a CUDA device, else ``emulated``; reject unknown names."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        on_cuda = device is None or torch.device(device).type == "cuda"
        return "cuda" if on_cuda and torch.cuda.is_available() else "emulated"
    return name


def make_backend(name: str, device: Optional[torch.device] = None) -> Optional[GraphBackend]:
    """The backend object for a resolved name (None for ``eager``: no graphs at all)."""
    if name == "eager":
        return None
    if name == "cuda":
        from graphrt.backends.cuda import CudaGraphBackend

        return CudaGraphBackend(device)
    return EmulatedBackend(device)


__all__ = [
    "CapturedGraph", "CollectiveError", "GraphBackend", "PieceSink", "SplitPoint", "StateJournal", "EmulatedBackend", "BACKEND_NAMES", "DISABLE_ENV",
    "graphs_disabled_by_env", "resolve_backend_name", "resolve_device", "make_backend", "refuse_compiled_cudagraphs",
    "another_capture_error", "no_recording", "step_lock",
]
