"""Check a plain callable the way ``wrap()`` would graph it, from example arguments.

The callable runs once as a warm-up (``wrap()`` warms each size up on a real call before it
records), then is recorded on the example, on variants of the example (rolled values, or the
caller's ``variants``) and on the example padded to the next capture size. Everything runs
under the state journal: afterwards every tensor, binding and random generator is as before.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from graphrt.check.inputs import Arguments, CallTree, argument_names, padded_size, wrap_signature
from graphrt.check.names import callable_roots
from graphrt.check.recording import Step, preserved_random_state, preserved_state, raising_line
from graphrt.check.report import CheckReport
from graphrt.check.session import CheckSession


def check_callable(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                   variants: Optional[Sequence[Arguments]] = None, pad_values: Mapping[str, float] = {},  # noqa: B006
                   scratch: FrozenSet[Tuple[torch.device, int]] = frozenset()) -> CheckReport:
    """Report what breaks or differs when ``fn`` is graphed (see ``graphrt.check``); ``pad_values`` and
    ``scratch`` (storages) are wrap()'s options, when ``fn`` came wrapped."""
    names = argument_names(fn, len(args))
    tree = CallTree(args, kwargs, names)
    roots = list(zip(names, args)) + list(kwargs.items()) + callable_roots(fn)
    session = CheckSession(f"{_name(fn)}({', '.join(names + list(kwargs))})", roots, _step_device(fn, tree))
    signature = wrap_signature(tree, args, kwargs)
    session.report.arguments = signature.arguments
    if signature.problem is not None:
        session.report.add(signature.problem)

    def step(label: str, call: Arguments) -> Step:
        call_args, call_kwargs = tuple(call[0]), dict(call[1])
        return Step(label, lambda: fn(*call_args, **call_kwargs), CallTree(call_args, call_kwargs, names).tensors())

    with preserved_random_state(), preserved_state(session.graph):
        try:
            fn(*args, **kwargs)  # the warm-up call; its effects stay until the check ends
        except Exception as error:
            session.add_error("warm-up call", error, raising_line(error))
            return session.finish()
        example = session.record(step("example", (args, kwargs)))
        if not session.analyze(example):
            return session.finish()
        for label, variant in _labelled(variants, tree):
            session.compare(example, session.record(step(label, variant)))
        if any(axis is not None for axis in signature.axes):
            size = padded_size(signature.rows)
            padded = session.record(step(f"example padded to {size} rows", signature.padded(tree, pad_values)))
            session.compare_padding(example, padded, {size: signature.rows})
            if padded.error is None:
                session.compare_padding_writes(example.step, padded.step, signature.rows, size, scratch)
    return session.finish()


def _labelled(variants: Optional[Sequence[Arguments]], tree: CallTree) -> List[Tuple[str, Arguments]]:
    """The variants to compare the example with, each checked to have the example's shapes."""
    if variants is None:
        return [("rolled variant of the example", tree.rolled())]
    expected = {path: tensor.shape for path, tensor in tree.tensors().items()}
    for number, (args, kwargs) in enumerate(variants, start=1):
        shapes = {path: tensor.shape for path, tensor in CallTree(tuple(args), dict(kwargs), tree.names).tensors().items()}
        if shapes != expected:
            raise ValueError(f"variants[{number - 1}]: expected tensors of the example's shapes {expected}, got {shapes}")
    return [(f"variant {number}", variant) for number, variant in enumerate(variants, start=1)]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _step_device(fn: Callable[..., Any], tree: CallTree) -> torch.device:
    """Where the step runs: its first input tensor's device, else its module's, else the CPU."""
    for tensor in tree.tensors().values():
        return tensor.device
    for _, root in callable_roots(fn):
        if isinstance(root, torch.nn.Module):
            for parameter in root.parameters():
                return parameter.device
    return torch.device("cpu")
