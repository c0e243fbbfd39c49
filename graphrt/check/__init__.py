"""graphrt.check: know on a laptop whether a model is safe to graph, before a GPU is rented.

``check(fn, *example_args, **example_kwargs)`` records the step on the CPU (or wherever its
tensors live) and reports, with the op, the tensor's name and the model's source line, what
would make a CUDA-graph capture fail or a replay differ from eager: host syncs, op graphs that
depend on input values, writes to inputs, tensors rebound between steps, Python state, CPU
tensors or several devices in a CUDA step, random ops, aliased outputs, padding rows that leak
into real rows; plus the state the step writes and how ``wrap()`` treats each argument.
``GraphRunner.check()`` does the same for a runner's model. ``python -m graphrt.check
module:factory`` is the command line. docs/CHECK.md maps every finding to graphrt's eager
reasons and torch.compile's cudagraph skip reasons.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from graphrt.check.callables import check_callable
from graphrt.check.hazards import HAZARDS, Hazard, Severity
from graphrt.backends.compiled import eager_stance
from graphrt.check.inputs import Arguments
from graphrt.check.report import ArgumentInfo, CheckReport, Finding, StateWrite
from graphrt.check.runner_check import RunnerLike, check_runner
from graphrt.graphed_callable import GraphedCallable


def check(fn: Callable[..., Any], *example_args: Any, variants: Optional[Sequence[Arguments]] = None,
          **example_kwargs: Any) -> CheckReport:
    """Report what breaks or differs when ``fn`` is graphed, from one example call.

    ``fn`` is any callable ``wrap()`` accepts (or what ``wrap()`` returned), or a ``GraphRunner``
    (then ``example_args`` are optional example ForwardBatches, see ``GraphRunner.check``).
    ``variants``: other valid ``(args, kwargs)`` with the example's structure and shapes to
    compare op graphs with (default: the example with every input tensor's values rolled by
    one). The model's tensors, Python bindings and random generators are left as they were.
    """
    if isinstance(fn, RunnerLike):
        if variants is not None or example_kwargs:
            raise TypeError("check(runner, *examples): a GraphRunner takes example ForwardBatches only")
        return fn.check(*example_args)
    pad_values, scratch = {}, frozenset()
    if isinstance(fn, GraphedCallable):  # check what wrap() graphs (with its pad values), without capturing anything
        fn, pad_values, scratch = fn.fn, fn.pad_values, frozenset(fn.scratch_storages)
    with eager_stance():  # a compiled fn called under the check's modes would never compile again
        return check_callable(fn, example_args, example_kwargs, variants, pad_values, scratch)


__all__ = ["HAZARDS", "ArgumentInfo", "CheckReport", "Finding", "Hazard", "Severity", "StateWrite", "check", "check_runner"]
