"""OutsideReads: the tensors a step reads that it neither was handed nor made, op by op.

A graph keeps the tensors its step read (on CUDA, their addresses). For the step's arguments that
is what staging refills, and the model's state is the same tensors every call; but a step can
also read tensors through a global forward context (nano-vllm's ``get_context()``, vLLM's
``get_forward_context()``), set anew before every call. A replay then reads the tensors of the
recorded call forever: every sequence goes wrong, silently.

``OutsideReads`` lists, in op order, the storages each op reads that the block did not allocate
and that are not ``given`` (the call's arguments or static slots). Run over a real call and
over the capture of the next one (with the first list as ``expected``), a read of another
storage at the same op marks a tensor that changes from call to call outside the arguments: another
address, or the same address in another storage (a weak reference to each read storage tells: the
caching allocator hands a tensor made anew each call the block the last call's freed; issue 48); the
caller drops those the model or an argument object holds (their rebinding is the guards' job)
and refuses the rest (``OutsideTensorError``), naming the op and the model line.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphrt.backends.source_lines import SourceLine, model_source_line
from graphrt.backends.state_journal import allocated_storages, has_storage, storage_key
from graphrt.guards import find_bindings, memory_of

Storage = Tuple[torch.device, int]
_aten = torch.ops.aten
# A tensor the step's Python built from host values (torch.tensor(...)): a constant of the step, not a read.
_LIFTS = frozenset({_aten.lift_fresh.default, _aten.lift_fresh_copy.default})


class OutsideTensorError(RuntimeError):
    """The step reads a tensor, outside its arguments and its objects' state, that changes every call."""


@dataclass(frozen=True)
class ChangedRead:
    """An op that read another outside tensor than at the same op of the call before."""

    op: str
    source: Optional[SourceLine]
    tensor: torch.Tensor


Read = Tuple[Any, Storage, StorageWeakRef]  # the op, the storage's address, the storage itself (weakly)


class OutsideReads(TorchDispatchMode):
    """``reads``: ``(op, storage, weak reference)`` per outside read, in order. With ``expected`` (the
    reads of an earlier call), ``changed`` lists the reads of another storage at the same op (another
    address, or the same address in a storage made since), with the model line, while the two calls
    ran the same ops."""

    def __init__(self, given: Set[Storage], expected: Optional[Sequence[Read]] = None) -> None:
        super().__init__()
        self.given = given
        self.expected = expected
        self.reads: List[Read] = []
        self.changed: List[ChangedRead] = []
        self._fresh: Set[Storage] = set()
        self._aligned = expected is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func in _LIFTS:
            self._fresh.update(storage_key(leaf) for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor))
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.numel() and has_storage(leaf):  # a sparse tensor: its parts
                key = storage_key(leaf)
                if key not in self._fresh and key not in self.given:
                    self._read(func, key, leaf)
        output = func(*args, **kwargs)
        self._fresh.update(allocated_storages(func, args, kwargs, output))
        return output

    def _read(self, func: Any, key: Storage, tensor: torch.Tensor) -> None:
        position = len(self.reads)
        storage = StorageWeakRef(tensor.untyped_storage())
        self.reads.append((func, key, storage))
        if not self._aligned:
            return
        if position >= len(self.expected) or self.expected[position][0] is not func:
            self._aligned = False  # the calls ran other ops from here: nothing more to compare
        elif self.expected[position][1] != key or self.expected[position][2] != storage:
            self.changed.append(ChangedRead(str(func).removesuffix(".default"), model_source_line(), tensor))


def changed_outside_read(changed: Sequence[ChangedRead], held: Set[int]) -> Optional[ChangedRead]:
    """The first changed read of a tensor whose memory is not in ``held`` (the addresses the model
    and the argument objects hold), or None."""
    return next((read for read in changed if read.tensor.untyped_storage().data_ptr() not in held), None)


def outside_tensor_error(read: ChangedRead) -> OutsideTensorError:
    """The refusal of a step that reads a per-call tensor from outside its arguments."""
    where = f" at {read.source}" if read.source is not None else ""
    shape = f"{list(read.tensor.shape)} {str(read.tensor.dtype).removeprefix('torch.')}"
    return OutsideTensorError(
        f"{read.op}{where} reads a {shape} tensor that is neither an argument nor state of the model or of the "
        "objects passed in, and the call before read another tensor there (a global forward context, as "
        "nano-vllm's get_context() or vLLM's get_forward_context()); a graph would read the captured one on every "
        "replay. Pass it as an argument of the wrapped function, or use GraphRunner and build the context inside "
        "the step from graphrt.current_batch() (docs/MANUAL.md, 'Tensors from outside the arguments')")


@contextmanager
def refuse_changed_reads(given: Set[Storage], expected: Sequence[Read],
                         roots: Sequence[Tuple[str, Any]]) -> Iterator[None]:
    """Around a recording's warm-up: raise OutsideTensorError (naming the op and line) when the step
    reads, at an op where the ``expected`` call read another tensor, one that is neither ``given``
    (its static slots) nor held by ``roots`` (the model, the argument objects)."""
    reads = OutsideReads(given, expected)
    with reads:
        yield
    if reads.changed:
        addresses = {read.tensor.untyped_storage().data_ptr() for read in reads.changed}
        read = changed_outside_read(reads.changed, find_bindings(roots, addresses, memory_of).memory)
        if read is not None:
            raise outside_tensor_error(read)


__all__ = ["ChangedRead", "OutsideReads", "OutsideTensorError", "changed_outside_read", "outside_tensor_error",
           "refuse_changed_reads"]
