"""The capture sequence both backends share: warm up, capture, and leave no trace in the model.

Warm-up runs and (on backends whose capture executes the step, like the emulated one) the
recording run write the model's state: KV caches, counters, running statistics. All of it
runs under a StateJournal and is undone before the graph is handed out, so capturing a key
changes no tensor the model can reach. On CUDA the capture itself executes nothing, so it
runs after the undo. ``verify_graph`` then compares the graph's first replay with eager on the
same inputs, outputs and state writes, and undoes both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Sequence

import torch

from graphrt.backends.base import CapturedGraph, GraphBackend
from graphrt.backends.state_journal import StateJournal


def capture_graph(backend: GraphBackend, fn: Callable[[], Any], warmup_iters: int) -> CapturedGraph:
    """``warmup_iters`` warm-up calls of ``fn``, then one capture; every in-place write undone."""
    journal = StateJournal()
    graph = None
    with torch.no_grad():
        try:
            with journal:
                with backend.warmup_context():
                    for _ in range(warmup_iters):
                        fn()
                if backend.capture_executes:
                    graph = backend.capture(fn)
        finally:
            journal.restore()
        if graph is None:
            graph = backend.capture(fn)
    return graph


class VerifyError(RuntimeError):
    """A graph's first replay differs from eager on the same inputs: the key must not serve."""


def verify_graph(graph: CapturedGraph, fn: Callable[[], Sequence[Any]], same_leaf: Callable[[Any, Any], bool]) -> None:
    """Run ``fn`` eagerly, then replay ``graph``, on the same inputs and state; raise VerifyError
    naming the first output or state region that differs beyond ``torch.testing.assert_close``'s
    per-dtype tolerance. Every write of both runs is undone. ``fn`` returns the output leaves;
    ``same_leaf(replayed, eager)`` compares its non-tensor leaves (the caller's rule for constants).

    This catches what no recording sees: kernels outside the dispatcher, random ops (eager and
    replay draw other numbers), a model whose path differs under capture."""
    journal = StateJournal()
    with torch.no_grad(), _random_state_kept():
        try:
            with journal:
                expected = [_owned(leaf) for leaf in fn()]
            regions = list(journal.regions)  # what eager wrote; the replay must write the same
            expected_state = [region.current() for region in regions]
            journal.put_back()
            with journal:  # the emulated replay's writes are journaled; a CUDA replay writes the regions above
                graph.replay()
            _compare(expected, list(graph.outputs), [f"output leaf {i}" for i in range(len(expected))], same_leaf)
            _compare(expected_state, [region.current() for region in regions],
                     [f"state written by {region.op} at {region.source} ({_describe(region.target)})"
                      for region in regions], same_leaf)
        finally:
            journal.restore()


def _random_state_kept() -> AbstractContextManager:
    """Leave torch's random generators as they were: verifying draws numbers no step would."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _owned(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _describe(tensor: torch.Tensor) -> str:
    return f"tensor {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _compare(expected: Sequence[Any], actual: Sequence[Any], names: Sequence[str],
             same_leaf: Callable[[Any, Any], bool]) -> None:
    """Raise VerifyError at the first pair that differs (tensors within tolerance, others by ``same_leaf``)."""
    for name, want, got in zip(names, expected, actual):
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            try:
                torch.testing.assert_close(got, want, equal_nan=True)
            except AssertionError as error:
                detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
                raise VerifyError(f"{name} differs from eager: {detail}") from None
        elif not same_leaf(got, want):
            raise VerifyError(f"{name} differs from eager: {got!r} != {want!r}")
