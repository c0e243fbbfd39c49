"""graphrt's compile runs: a step that runs torch.compile'd code is compiled for each key before its recording.

The step's compiled code must compile with no dispatch mode active (under one, Dynamo skips the code
for good) and never inside a CUDA capture (compiling and autotuning there fail). So capture runs the
step once more for each key, outside every mode, after its warm-ups and before its recording, on the
key's static inputs (its writes undone by the capture's journal). Within Dynamo's limits, whatever
the number of capture sizes:

- the run first tries the code compiled before, unmarked and compiling nothing
  (``torch.compiler.set_stance("fail_on_recompile")``): a graph compiled dynamic (``dynamic=True``, a
  dimension the user marked, a graph a previous key's run compiled) serves every later size as it is.
  Marking a dim such a graph was compiled without would be a new marking, which Dynamo's guards
  treat as a recompile (issue 48: a ``dynamic=True`` model compiled once per capture size);
- only when that code does not serve (nothing compiled yet, or its guards fail) are the dims of the
  static inputs that hold the key's rows marked dynamic (``torch._dynamo.maybe_mark_dynamic``) and the
  step run normally, so one compiled graph serves every capture size, as vLLM compiles one graph,
  dynamic in the token count, for all its CUDA-graph sizes (Dynamo specializes size 1 on its own; a
  model that branches on the batch size gets a graph per branch);
- while a run compiles, Dynamo's recompile limits are ``HEADROOM`` higher, so no capture size's
  compile is lost to them (a code object that reaches its limit runs eagerly for good, the user's
  later calls of it at new shapes too); each graph a run compiled raises them for good by one, so
  the user's own calls keep the budget they had (logged at INFO).

``CompileOutcome`` says whether the key's code is compiled: the run compiled a graph or ran one
compiled before, and every frame Dynamo looked at hit compiled code or compiled; else how many
frames it ran eagerly (a limit reached before graphrt's capture, a construct Dynamo cannot
compile), or that it compiled and ran nothing at all (code it skips).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.backends.compiled import compiled_parts, refuse_nested_cudagraphs
from graphrt.backends.torchscript import nested_torchscript

logger = logging.getLogger(__name__)

HEADROOM = 8  # recompiles one compile run may add to a code object: each call site of a compiled callable may add one
SKIPPED = ("Dynamo neither compiled a graph nor ran one it had (it skips the step's compiled code: "
           "torch.compiler.disable, or a skip decided before)")


@dataclass(frozen=True)
class CompileOutcome:
    """Whether a key's compiled code runs compiled at its shapes, and if not, why."""

    compiled: bool
    graphs: int = 0  # graphs Dynamo compiled during the run (0: every frame hit a graph compiled before)
    detail: str = ""


def compiled_code(modules: Sequence[torch.nn.Module], calls: Sequence[Tuple[Any, Any]]) -> bool:
    """Whether a step that ran ``modules`` and passed through the torch.compile wrappers ``calls``
    (graphrt.guards.observe) ran compiled code; refused (``StepRefusal``) where no graph can hold
    what it ran: compiled code that captures CUDA graphs of its own, a TorchScript module."""
    error = nested_torchscript(modules)
    if error is not None:
        raise error
    parts = compiled_parts(calls, modules)
    refuse_nested_cudagraphs(parts)
    return bool(parts)


def mark_batch_dims(tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
    """Mark dynamic the dims of ``tensors`` whose size is one of ``rows`` (the key's rows, 2 or more)."""
    from torch._dynamo import maybe_mark_dynamic

    sizes = {size for size in rows if size > 1}
    for tensor in tensors:
        for dim, size in enumerate(tensor.shape):
            if size in sizes:
                maybe_mark_dynamic(tensor, dim)


@contextmanager
def _guard_results(results: List[bool]) -> Iterator[None]:
    """Dynamo's cache lookups in the block, each True (a compiled graph's guards held) or False;
    a hook set before (guard collectives across ranks) still decides."""
    from torch._C._dynamo.eval_frame import set_guard_complete_hook

    previous = None

    def hook(hit: bool) -> bool:
        if previous is not None:
            hit = previous(hit)
        results.append(bool(hit))
        return hit

    previous = set_guard_complete_hook(hook)
    try:
        yield
    finally:
        set_guard_complete_hook(previous)


def compile_run(step: Callable[[], Any], tensors: Sequence[torch.Tensor], rows: Sequence[int],
                put_back: Callable[[], None] = lambda: None) -> CompileOutcome:
    """Run ``step`` so that its compiled code compiles at these shapes (no dispatch mode may be active):
    first on the code compiled before, compiling nothing; if a frame would compile there, its writes put
    back (``put_back``), once more with the batch dims of ``tensors`` marked dynamic and Dynamo's limits
    raised for the run."""
    attempt = _without_compiling(step)
    if attempt is not None:
        return attempt
    put_back()
    import torch._dynamo
    from torch._dynamo.utils import counters

    mark_batch_dims(tensors, rows)
    config = torch._dynamo.config
    frames, graphs = counters["frames"], counters["stats"]
    total, converted, compiled = frames["total"], frames["ok"], graphs["unique_graphs"]
    lookups: List[bool] = []
    with config.patch(recompile_limit=config.recompile_limit + HEADROOM,
                      accumulated_recompile_limit=config.accumulated_recompile_limit + HEADROOM), \
            _guard_results(lookups):
        step()
    attempted, converted = frames["total"] - total, frames["ok"] - converted
    compiled = graphs["unique_graphs"] - compiled
    if compiled:
        config.recompile_limit += compiled
        config.accumulated_recompile_limit += compiled
        logger.info("graphrt compiled %d graph(s) of the step's torch.compile'd code; torch._dynamo.config."
                    "recompile_limit raised by as many (now %d), so your own calls keep their budget", compiled,
                    config.recompile_limit)
    eager = (attempted - converted) + max(0, lookups.count(False) - attempted)
    if eager:
        return CompileOutcome(False, compiled, f"Dynamo ran {eager} frame(s) of the step's compiled code eagerly "
                                               "(a recompile limit reached before, or code it cannot compile: "
                                               "TORCH_LOGS=recompiles,graph_breaks says which)")
    if not compiled and True not in lookups:
        return CompileOutcome(False, 0, SKIPPED)
    return CompileOutcome(True, compiled)


def _without_compiling(step: Callable[[], Any]) -> Optional[CompileOutcome]:
    """``step`` run on the graphs Dynamo compiled before, its inputs unmarked, under the
    ``fail_on_recompile`` stance: None when a frame would compile there (the stance raises before it
    compiles), else the outcome (every frame Dynamo looked at hit a graph, or it looked at none)."""
    lookups: List[bool] = []
    try:
        with torch.compiler.set_stance("fail_on_recompile"), _guard_results(lookups):
            step()
    except RuntimeError as error:
        if "fail_on_recompile" not in str(error):
            raise
        return None
    if True in lookups:
        return CompileOutcome(True, 0)
    return CompileOutcome(False, 0, SKIPPED)
