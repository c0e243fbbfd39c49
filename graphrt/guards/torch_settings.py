"""torch's global settings a step computes under, read the way torch stores them, and where they change.

A graph keeps what a step made and the kernels it chose under the settings of its capture: the default
dtype and device (``torch.zeros(n)`` without them), the float32 precision of every backend and operator,
cuBLAS's reduced-precision reductions, deterministic algorithms (torch.compile's global-state guard reads
them too). Since torch 2.9 the precision is stored per backend and operator (``torch.backends.cuda.matmul.
fp32_precision = "tf32"``, ``torch.backends.cudnn.conv.fp32_precision``, the global
``torch.backends.fp32_precision``); the legacy getters (``torch.get_float32_matmul_precision()``,
``torch.backends.cuda.matmul.allow_tf32``) raise once the new API is in use, and the legacy setters write
the new store, so ``torch_settings`` reads the new store only (the legacy getters on older torch).

Every way of setting them reaches one of torch's own setters at call time, which ``patch_setters`` makes
bump the state epoch: the ``torch._C`` setters the Python functions look up when called (so a setter
imported before graphrt, ``from torch import set_float32_matmul_precision``, is seen too), the
``__setattr__`` of ``torch.backends``' property modules (``torch.backends.cudnn.allow_tf32 = False`` holds
its setter from import time), and the default-device context (``torch.set_default_device``,
``with torch.device(...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
import torch.backends
import torch.utils._device

# (backend, operator) of torch's float32 precision store, and how torch.backends names it.
FP32_PRECISION = (
    (("generic", "all"), "torch.backends.fp32_precision"),
    (("cuda", "all"), "torch.backends.cudnn.fp32_precision"),
    (("cuda", "matmul"), "torch.backends.cuda.matmul.fp32_precision"),
    (("cuda", "conv"), "torch.backends.cudnn.conv.fp32_precision"),
    (("cuda", "rnn"), "torch.backends.cudnn.rnn.fp32_precision"),
    (("mkldnn", "all"), "torch.backends.mkldnn.fp32_precision"),
    (("mkldnn", "matmul"), "torch.backends.mkldnn.matmul.fp32_precision"),
    (("mkldnn", "conv"), "torch.backends.mkldnn.conv.fp32_precision"),
    (("mkldnn", "rnn"), "torch.backends.mkldnn.rnn.fp32_precision"),
)
REDUCED_PRECISION = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
_fp32_precision = getattr(torch._C, "_get_fp32_precision_getter", None)  # torch >= 2.9
# torch._C's setters of these settings, looked up at call time by torch's Python setters.
C_SETTERS = ("_set_default_dtype", "_set_default_tensor_type", "_set_float32_matmul_precision",
             "_set_deterministic_algorithms", "_set_fp32_precision_setter", "_set_cublas_allow_tf32",
             "_set_cublas_allow_fp16_reduced_precision_reduction",
             "_set_cublas_allow_bf16_reduced_precision_reduction", "_set_cudnn_allow_tf32")


def torch_settings() -> Tuple[Tuple[str, Any], ...]:
    """``(name, value)`` of every setting a graph keeps what it was at capture."""
    matmul = torch.backends.cuda.matmul
    if _fp32_precision is not None:
        precision = tuple((name, _fp32_precision(*pair)) for pair, name in FP32_PRECISION)
    else:  # torch < 2.9: the legacy store
        precision = (("float32 matmul precision", torch.get_float32_matmul_precision()),
                     ("torch.backends.cuda.matmul.allow_tf32", matmul.allow_tf32),
                     ("torch.backends.cudnn.allow_tf32", torch.backends.cudnn.allow_tf32))
    return (("default dtype", torch.get_default_dtype()), ("default device", str(torch.get_default_device())),
            *precision, *((f"torch.backends.cuda.matmul.{name}", getattr(matmul, name)) for name in REDUCED_PRECISION),
            ("deterministic algorithms", (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled())))


def patch_setters(bumping: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make every setter of these settings ``bumping(setter)``: torch._C's, the property modules'
    ``__setattr__`` and the default-device context's entry and exit."""
    for name in C_SETTERS:
        if hasattr(torch._C, name):
            setattr(torch._C, name, bumping(getattr(torch._C, name)))
    torch.backends.PropModule.__setattr__ = bumping(torch.backends.PropModule.__setattr__)  # type: ignore
    device_context = torch.utils._device.DeviceContext
    for name in ("__enter__", "__exit__"):
        setattr(device_context, name, bumping(vars(device_context)[name]))
