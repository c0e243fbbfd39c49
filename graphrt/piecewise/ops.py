"""Which ops split a step into graph pieces: ``splitting_ops`` resolved once to op names.

An entry is an ``OpOverload`` (that overload only), an ``OpOverloadPacket``, a function made by
``torch.library.custom_op`` or a ``"namespace::name"`` string (every overload of the op). Names
are checked against the ops torch knows, so a typo fails at construction, not as a capture that
never splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Tuple

import torch
from torch._library.custom_ops import CustomOpDef

SplittingOpSpec = Any  # OpOverload | OpOverloadPacket | CustomOpDef | "namespace::name"


@dataclass(frozen=True)
class SplittingOps:
    """Qualified op names (``ns::name``) and overloads (``ns::name.overload``) that split a step."""

    names: Tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.names)

    def match(self, func: Any) -> str:
        """The configured name ``func`` (an OpOverload) matches, or "" when it does not split."""
        schema_name = func._schema.name
        names = self.names
        if schema_name in names:
            return schema_name
        overload = f"{schema_name}.{func._overloadname}"
        return overload if overload in names else ""


def resolve_splitting_ops(specs: Iterable[SplittingOpSpec]) -> SplittingOps:
    """``SplittingOps`` for the ``splitting_ops`` option; TypeError/ValueError names the bad entry."""
    if isinstance(specs, SplittingOps):  # already resolved (dataclasses.replace of a RunnerConfig)
        return specs
    if isinstance(specs, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, CustomOpDef)):
        specs = (specs,)
    names = []
    for spec in specs:
        if isinstance(spec, torch._ops.OpOverload):
            names.append(f"{spec._schema.name}.{spec._overloadname}")
        elif isinstance(spec, torch._ops.OpOverloadPacket):
            names.append(spec._qualified_op_name)
        elif isinstance(spec, CustomOpDef):  # a function decorated with torch.library.custom_op
            names.append(spec._qualname)
        elif isinstance(spec, str):
            names.append(_checked_name(spec))
        else:
            raise TypeError("splitting_ops: expected OpOverload, OpOverloadPacket, custom op or 'namespace::name' "
                            f"entries, got {type(spec).__name__}")
    return SplittingOps(tuple(dict.fromkeys(names)))


def _checked_name(spec: str) -> str:
    namespace, _, name = spec.partition("::")
    if not namespace or not name:
        raise ValueError(f"splitting_ops: expected 'namespace::name', got {spec!r}")
    try:
        getattr(getattr(torch.ops, namespace), name.split(".")[0])
    except (AttributeError, RuntimeError):
        raise ValueError(f"splitting_ops: no op {spec!r} is registered with torch (import the module that "
                         "defines it first)") from None
    return spec
