"""Verification: a captured graph's first replay against eager on the same inputs, within rounding.

This catches what no recording sees: kernels outside the dispatcher, a model whose path differs
under capture, draws from a generator the graph does not advance as eager does. Every capture
front runs it after each recording; the padding-row check compares with the same tolerance.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from graphrt.backends import CapturedGraph, StateJournal
from graphrt.backends.compiled import eager_stance
from graphrt.backends.state_journal import WrittenRegion


class VerifyError(RuntimeError):
    """A graph's first replay differs from eager on the same inputs: the key must not serve."""


def verify_graph(graph: CapturedGraph, fn: Callable[[], Sequence[Any]], same_leaf: Callable[[Any, Any], bool],
                 journal: Optional[StateJournal] = None) -> None:
    """Run ``fn`` eagerly, then replay ``graph``, on the same inputs, state and generator states;
    raise VerifyError naming the first output or state region that differs by more than rounding
    (``rounding_tolerance``). Every write and random draw of both runs is undone. ``fn`` returns
    the output leaves; ``same_leaf(replayed, eager)`` compares its non-tensor leaves (the caller's
    rule for constants). ``journal``: the StateJournal to use, for a caller that reads what the
    step wrote.

    This catches what no recording sees: kernels outside the dispatcher, a model whose path
    differs under capture, draws from a generator the graph does not advance as eager does."""
    journal = StateJournal() if journal is None else journal
    with torch.no_grad(), eager_stance():
        try:
            with journal:
                expected = [owned(leaf) for leaf in fn()]
            regions = list(journal.regions)  # what eager wrote; the replay must write the same
            expected_state = [region.current() for region in regions]
            journal.put_back()  # the state and generators the eager run started from
            replay_matches(graph, expected, regions, expected_state, same_leaf, journal)
        finally:
            journal.restore()


def replay_matches(graph: CapturedGraph, expected: Sequence[Any], regions: Sequence[WrittenRegion],
                   expected_state: Sequence[torch.Tensor], same_leaf: Callable[[Any, Any], bool],
                   journal: StateJournal) -> None:
    """Replay ``graph`` from the state an eager run started from and raise VerifyError at the first output
    leaf or written region (``regions``, what that run wrote) whose contents differ from that run's
    (``expected``, ``expected_state``) by more than rounding. The emulated replay's writes are journaled
    in ``journal``; a CUDA replay writes ``regions``: the caller puts them back."""
    with journal:
        graph.replay()
    _compare(expected, list(graph.outputs), [f"output leaf {i}" for i in range(len(expected))], same_leaf)
    _compare(expected_state, [region.current() for region in regions],
             [f"state written by {region.op} at {region.source} ({_describe(region.target)})"
              for region in regions], same_leaf)


# ulps of a tensor's largest magnitude that rounding explains (see rounding_tolerance)
ROUNDING_ULPS = 8
# torch.testing.assert_close's default (rtol, atol) per floating dtype (its documented table)
DEFAULT_TOLERANCES = {
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
}


def rounding_tolerance(expected: torch.Tensor) -> Dict[str, float]:
    """``assert_close`` tolerances that accept what rounding explains and nothing more.

    A graph can differ from eager only by rounding: under capture a library may pick another kernel
    (transformers builds an explicit mask instead of SDPA's ``is_causal`` shortcut, another
    accumulation order). Each element then differs by a few units in the last place (ulps) of
    the magnitudes it was computed from, which torch's per-element relative tolerance misses for
    elements near zero. So the absolute tolerance is ``ROUNDING_ULPS`` ulps of the tensor's largest
    finite magnitude (float32: 9.5e-7 of it; bfloat16: 6.3%; float16: 0.8%), or torch's default when
    larger. A graph that computes something else (a capture-only path, a write no recording saw)
    differs by a large fraction of the values and still fails."""
    rtol, atol = DEFAULT_TOLERANCES.get(expected.dtype, (None, None))
    if rtol is None or not expected.numel():
        return {}
    finite = expected.detach().nan_to_num(0.0, 0.0, 0.0)
    magnitude = float(finite.abs().max())
    eps = torch.finfo(computed_dtype(finite)).eps
    return {"rtol": rtol, "atol": max(atol, ROUNDING_ULPS * eps * magnitude)}


def computed_dtype(values: torch.Tensor) -> torch.dtype:
    """The dtype ``values`` were computed in: a float32 tensor whose every value is a bfloat16 (or a
    float16), not all whole numbers, is a half-precision result cast up (a bfloat16 model's
    ``logits.float()``): its rounding is that dtype's, which the cast hides (the first H200 session: a
    bfloat16 model's piecewise keys differed from eager by one bfloat16 ulp, 2**-6 at logits of 2 to 4,
    against float32's 1e-5)."""
    if values.dtype != torch.float32 or torch.equal(values, values.round()):
        return values.dtype
    for half in (torch.bfloat16, torch.float16):  # bfloat16 first: its 7-bit mantissa is the coarser
        if torch.equal(values.to(half).to(values.dtype), values):
            return half
    return values.dtype


def owned(leaf: Any) -> Any:
    """A leaf a run returned, kept apart from the memory a journal puts back: a tensor cloned, else itself."""
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _describe(tensor: torch.Tensor) -> str:
    return f"tensor {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _compare(expected: Sequence[Any], actual: Sequence[Any], names: Sequence[str],
             same_leaf: Callable[[Any, Any], bool]) -> None:
    """Raise VerifyError at the first pair that differs (tensors within tolerance, others by ``same_leaf``)."""
    for name, want, got in zip(names, expected, actual):
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            try:
                torch.testing.assert_close(got, want, equal_nan=True, **rounding_tolerance(want))
            except AssertionError as error:
                detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
                raise VerifyError(f"{name} differs from eager: {detail}") from None
        elif not same_leaf(got, want):
            raise VerifyError(f"{name} differs from eager: {got!r} != {want!r}")
