"""A CPU GEMM whose rounding depends on the batch size, for auditing the suite (issue 48, item 8).

GEMM kernels may round differently per batch size (MKL and oneDNN choose their blocking from the
row count), so graph execution at a padded size agrees with eager at the real size only within
rounding, and bitwise only at the same size (docs/RELIABILITY.md). On one machine kind a kernel may
happen to round alike for every size and hide a test that compares bitwise across sizes; another
kind then fails it. With ``GRAPHRT_TEST_GEMM_ROUNDING=1`` the suite runs with ``aten::mm`` and
``aten::addmm`` on CPU summing the reduction in 1 to 3 chunks chosen by the row count: the same rows
round alike at one size (replays stay bitwise equal to eager at their own size), and across sizes
they differ in the last bits, as on the machine kinds that showed it.

    GRAPHRT_TEST_GEMM_ROUNDING=1 python -m pytest -q -n 2 --dist loadfile
"""

from __future__ import annotations

import os
import warnings

import torch

ENV = "GRAPHRT_TEST_GEMM_ROUNDING"
_library = None  # the aten implementations registered (kept alive for the session)


def chunks_for(rows: int) -> int:
    """How many chunks the reduction of a ``rows``-row product is summed in (1 to 3, by size)."""
    return 1 + (rows + rows.bit_length()) % 3


def chunked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D) through ``bmm``, the reduction split into ``chunks_for(rows)`` partial products."""
    rows, depth = a.shape
    count = min(chunks_for(rows), max(depth, 1))
    if count == 1 or not a.is_floating_point() or b.dim() != 2 or b.shape[0] != depth:  # bmm names a bad shape
        return torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)
    bounds = [depth * index // count for index in range(count + 1)]
    parts = [torch.bmm(a[:, start:end].unsqueeze(0), b[start:end].unsqueeze(0)).squeeze(0)
             for start, end in zip(bounds, bounds[1:])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def chunked_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)`` with ``chunked_mm`` (``beta`` 0 ignores ``bias``, as addmm does)."""
    product = chunked_mm(a, b)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product.expand(a.shape[0], b.shape[1]).clone()
    return product + (bias if beta == 1 else bias * beta)


def install() -> bool:
    """Replace the CPU ``mm``/``addmm`` kernels for the process when ``GRAPHRT_TEST_GEMM_ROUNDING`` is set."""
    global _library
    if os.environ.get(ENV, "0") in ("", "0") or _library is not None:
        return False
    _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        _library.impl("mm", chunked_mm, "CPU")
        _library.impl("addmm", chunked_addmm, "CPU")
    return True
