"""tests/gemm_rounding.py, the audit of comparisons across batch sizes (issue 48, item 8): its GEMM rounds
the same rows alike at one size and differently at another, as the machine kinds that showed it."""

from __future__ import annotations

import torch
from gemm_rounding import chunked_addmm, chunked_mm, chunks_for


def test_the_audit_gemm_rounds_alike_at_one_size_and_per_size_across_sizes():
    generator = torch.Generator().manual_seed(0)
    a, b, bias = (torch.randn(4, 64, generator=generator), torch.randn(64, 64, generator=generator),
                  torch.randn(64, generator=generator))
    assert chunks_for(4) != chunks_for(3) and chunks_for(8) != chunks_for(5)
    padded, real = chunked_mm(a, b), chunked_mm(a[:3], b)
    assert torch.equal(padded, chunked_mm(a.clone(), b))  # bitwise at the same size
    assert not torch.equal(padded[:3], real)  # not across sizes
    torch.testing.assert_close(padded[:3], real, rtol=1e-5, atol=1e-5)  # within rounding
    torch.testing.assert_close(chunked_addmm(bias, a, b, beta=0.5, alpha=2.0), 0.5 * bias + 2.0 * (a @ b),
                               rtol=1e-5, atol=1e-4)
