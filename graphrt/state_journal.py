"""StateJournal: undo every in-place write a block makes to tensors that existed before it.

Capture must not change the model's state: warm-up runs (and, on the emulated backend, the
recording run) execute the step, and a step writes KV caches, counters and running stats in
place. The journal sees every aten op of the block; before an op writes into memory that
was not allocated inside the block, it saves just the region about to be written (the rows
an ``index_put_``/``index_copy_``/``scatter_`` touches, the view a ``copy_`` fills), so the
extra memory is proportional to what the block writes, not to the tensors written into.
``restore()`` puts the saved regions back, newest first, leaving every tensor bitwise as
before. Writes into memory the block allocated itself need no undo and are not saved.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# Ops that change a tensor's metadata (shape, strides, storage) but no values: nothing to save.
_METADATA_ONLY = frozenset({
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
    "swapdims_", "swapaxes_", "detach_", "requires_grad_", "_coalesced_", "_resize_output_",
})

Undo = Tuple[Callable[..., Any], Tuple[Any, ...]]


def _index_put_region(target: torch.Tensor, args: Tuple[Any, ...]) -> Undo:
    indices = [None if index is None else index.clone() for index in args[1]]
    return _aten.index_put_.default, (target, indices, _aten.index.Tensor(target, indices))


def _index_dim_region(target: torch.Tensor, args: Tuple[Any, ...]) -> Undo:
    dim, index = args[1], args[2].clone()
    return _aten.index_copy_.default, (target, dim, index, _aten.index_select.default(target, dim, index))


def _scatter_region(target: torch.Tensor, args: Tuple[Any, ...]) -> Undo:
    dim, index = args[1], args[2].clone()
    return _aten.scatter_.src, (target, dim, index, _aten.gather.default(target, dim, index))


# Writers that touch only indexed rows of ``self``: save those rows, not the whole tensor.
_REGION_SAVERS: Dict[str, Callable[[torch.Tensor, Tuple[Any, ...]], Undo]] = {
    "index_put_": _index_put_region,
    "_index_put_impl_": _index_put_region,
    "index_copy_": _index_dim_region,
    "index_fill_": _index_dim_region,
    "index_add_": _index_dim_region,
    "index_reduce_": _index_dim_region,
    "scatter_": _scatter_region,
    "scatter_add_": _scatter_region,
    "scatter_reduce_": _scatter_region,
}


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class StateJournal(TorchDispatchMode):
    """Use as ``with journal: ...`` then ``journal.restore()``; ``saved_bytes`` is its extra memory."""

    def __init__(self) -> None:
        super().__init__()
        self.saved_bytes = 0
        self._undo: List[Undo] = []
        self._fresh: Set[int] = set()  # storages allocated inside the block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable and schema.name.split("::")[-1] not in _METADATA_ONLY:
            self._save_written(func, schema, args, kwargs)
        output = func(*args, **kwargs)
        self._mark_fresh(schema, args, output)
        return output

    def _save_written(self, func: Any, schema: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            targets = value if isinstance(value, (list, tuple)) else (value,)
            for target in targets:
                if isinstance(target, torch.Tensor) and target.numel() and _storage_key(target) not in self._fresh:
                    self._save(func, position, target, args)

    def _save(self, func: Any, position: int, target: torch.Tensor, args: Tuple[Any, ...]) -> None:
        saver = _REGION_SAVERS.get(func._schema.name.split("::")[-1]) if position == 0 else None
        if saver is not None:
            undo = saver(target, args)
        else:
            undo = _aten.copy_.default, (target, target.clone())
        saved = undo[1][-1]
        self.saved_bytes += saved.numel() * saved.element_size()
        self._undo.append(undo)

    def _mark_fresh(self, schema: Any, args: Tuple[Any, ...], output: Any) -> None:
        outputs = output if isinstance(output, (list, tuple)) else (output,)
        if all(result.alias_info is not None for result in schema.returns):
            return  # views and in-place results share an input's memory
        inputs = {_storage_key(arg) for arg in args if isinstance(arg, torch.Tensor)}
        for result in outputs:
            if isinstance(result, torch.Tensor) and result.numel():
                key = _storage_key(result)
                if key not in inputs:
                    self._fresh.add(key)

    def restore(self) -> None:
        """Put back every saved region, newest first, and forget them."""
        with torch.no_grad():
            while self._undo:
                func, args = self._undo.pop()
                func(*args)
        if self.saved_bytes:
            logger.debug("capture undid %d bytes of in-place writes", self.saved_bytes)
        self._fresh.clear()
