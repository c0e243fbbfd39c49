"""Direct capture in pieces: a dispatch mode that cuts the step at every splitting op.

While the step runs once on a piecewise key's static batch, ``SplitWatcher`` sees every aten
op. At a splitting op it ends the current piece, runs the op eagerly (outside every recording
mode), keeps its arguments and output tensors (static memory from then on), and begins the
next piece: the same for both backends, only the backend's ``PieceSink`` differs (CUDA: one
CUDAGraph per piece in the shared pool; emulated: one recorded op segment per piece). It also refuses
what a token-keyed piece cannot replay: a read of a request-shaped static field, and a
splitting op whose output it cannot put in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from graphrt.backends import PieceSink
from graphrt.backends.source_lines import model_source_line
from graphrt.backends.state_journal import allocated_storages, storage_key
from graphrt.forward_context import current_batch
from graphrt.piecewise.ops import SplittingOps


class PiecewiseCaptureError(RuntimeError):
    """The step cannot be captured in pieces; the message names the op or field and why."""


@dataclass
class SplitCall:
    """One call of a splitting op at capture: replay calls it again on the same (static) arguments
    and copies its fresh result into ``outputs``, the tensors the next piece reads. An argument
    the op writes (an ``out`` tensor, as vLLM's attention takes) is static memory too: the next
    piece reads what the op wrote there."""

    func: Any
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    outputs: List[torch.Tensor]

    def run(self) -> None:
        """Call the op eagerly and put its result where the next piece reads it."""
        fresh = self.func(*self.args, **self.kwargs)
        fresh = [fresh] if isinstance(fresh, torch.Tensor) else [leaf for leaf in tree_leaves(fresh)
                                                                  if isinstance(leaf, torch.Tensor)]
        if len(fresh) != len(self.outputs) or any(new.shape != old.shape for new, old in zip(fresh, self.outputs)):
            raise ValueError(
                f"splitting op {self.func._schema.name}: returned shapes {[list(t.shape) for t in fresh]}, expected "
                f"the captured {[list(t.shape) for t in self.outputs]}: it must return the padded shape of its "
                "inputs (padding rows harmless), whatever the live batch")
        if len(fresh) == 1:
            self.outputs[0].copy_(fresh[0])
        elif fresh:
            torch._foreach_copy_(self.outputs, fresh)


class SplitWatcher(TorchDispatchMode):
    """Cuts the step at splitting ops into ``sink``; refuses request-shaped reads and unplaceable outputs.

    ``request_fields``: the storage of each request-shaped static slot -> the field's name.
    """

    def __init__(
        self, splitting: SplittingOps, request_fields: Mapping[Tuple[torch.device, int], str], sink: PieceSink
    ) -> None:
        super().__init__()
        self.splitting = splitting
        self.request_fields = request_fields
        self.sink = sink
        self.calls: List[SplitCall] = []
        self.batch: Optional[Any] = None  # graphrt.current_batch() at the first split: what the ops read
        self.made: Set[Tuple[torch.device, int]] = set()  # storages the pieces allocated (a graph pool's memory)
        self._seen: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        self._refuse_request_reads(func, args, kwargs)
        name = self.splitting.match(func)
        if not name:
            out = func(*args, **kwargs)
            self.made.update(allocated_storages(func, args, kwargs, out))
            return out
        _refuse_unplaceable(func)
        self._seen[name] = self._seen.get(name, 0) + 1
        if self.batch is None:
            self.batch = current_batch()

        def run_eagerly() -> Any:
            with _disable_current_modes():  # the op is no part of any piece
                return func(*args, **kwargs)

        result = self.sink.split(run_eagerly)
        outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        self.calls.append(SplitCall(func, tuple(args), dict(kwargs), outputs))
        return result

    def _refuse_request_reads(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                field_name = self.request_fields.get(storage_key(leaf))
                if field_name is not None:
                    where = model_source_line()
                    raise PiecewiseCaptureError(
                        f"piece {len(self.calls)} reads the request-shaped field {field_name!r} ({func}"
                        f"{f' at {where}' if where else ''}): a piecewise key is keyed by token count only and "
                        "cannot stage per-request rows; read request metadata inside a splitting op through "
                        "graphrt.current_batch()"
                    )

    def check_all_called(self) -> None:
        """Raise if a configured splitting op never ran in the step (a split that never happens)."""
        missing = [name for name in self.splitting.names if name not in self._seen]
        if missing:
            raise PiecewiseCaptureError(
                f"splitting_ops: {', '.join(missing)} never called by the step, so it cannot split there "
                "(check the op name, or that the model calls it for prefill batches)"
            )


def _refuse_unplaceable(func: Any) -> None:
    """A splitting op must return fresh tensors (or nothing): graphrt copies a result into static
    memory, and cannot re-point a piece at a view of an input. Arguments it writes in place need
    nothing: they are static tensors already, read by the next piece."""
    for result in func._schema.returns:
        if result.alias_info is not None or str(result.type) not in ("Tensor", "Tensor[]"):
            raise PiecewiseCaptureError(
                f"splitting op {func._schema.name} returns {result.type}"
                f"{' (a view of an input)' if result.alias_info else ''}: graphrt can place only fresh tensors "
                "(Tensor or Tensor[]) or arguments it writes in place between pieces"
            )
