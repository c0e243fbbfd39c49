"""StateJournal: undo every in-place write a block makes to tensors that existed before it,
and every draw it makes from a random generator.

Capture must not change the model's state: warm-up runs (and, on the emulated backend, the
recording run) execute the step, and a step writes KV caches, counters and running stats in
place. The journal sees every aten op of the block; before an op writes into memory that
was not allocated inside the block, it saves just the region about to be written (the rows
an ``index_put_``/``index_copy_``/``scatter_`` touches, the view a ``copy_`` fills), so the
extra memory is proportional to what the block writes, not to the tensors written into.
``restore()`` puts the saved regions back, newest first, leaving every tensor bitwise as
before. Writes into memory the block allocated itself need no undo and are not saved.

A write the journal cannot narrow to rows (an opaque custom op with ``mutates_args``, a whole-
tensor ``copy_``) saves the whole written view, once per view, within ``budget`` bytes; past it
the block fails with ``CaptureMemoryError`` naming the op, instead of holding copies of a KV
cache. Tensors in ``scratch`` are not saved whole: the caller guarantees that the block writes
them only at rows no request owns (capture stages pad values first), as the peers capture
without undoing anything.

A generator's state is state a step advances too: the default generators (CPU, each initialized
CUDA device) are saved when the block starts and every generator an op is handed the first time
it is seen, and ``restore()`` sets them back, so a block leaves every generator as it was.
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from graphrt.backends.source_lines import SourceLine, model_source_line

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# Ops that change a tensor's metadata (shape, strides, storage) but no values: nothing to save.
METADATA_ONLY = frozenset({
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
    "swapdims_", "swapaxes_", "detach_", "requires_grad_", "_coalesced_", "_resize_output_",
})
# Writers that touch only indexed rows of ``self`` (their first argument).
INDEX_PUT_WRITERS = frozenset({"index_put_", "_index_put_impl_"})
INDEX_DIM_WRITERS = frozenset({"index_copy_", "index_fill_", "index_add_", "index_reduce_"})
SCATTER_WRITERS = frozenset({"scatter_", "scatter_add_", "scatter_reduce_"})

# A region's reader, its writer, and the arguments that locate it (the target first).
Locator = Tuple[Callable[..., Any], Callable[..., Any], Tuple[Any, ...]]


def op_base_name(func: Any) -> str:
    """``index_put_`` for ``aten::index_put_`` (overload dropped)."""
    return func._schema.name.split("::")[-1]


def backing_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory ``tensor`` is: itself, or for a wrapper subclass that holds one
    (a DTensor parameter of a tensor-parallel model: its local shard) the tensor it wraps."""
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has memory of its own layout (a sparse or nested tensor's lives in the tensors it holds)."""
    return torch._C._has_storage(tensor)


def storage_key(tensor: torch.Tensor) -> Tuple[torch.device, int]:
    """Identity of a tensor's memory: two tensors with the same key are views of one allocation."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def written_tensors(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Iterator[Tuple[int, torch.Tensor]]:
    """``(argument position, tensor)`` for every non-empty tensor the op writes values into."""
    schema = func._schema
    if not schema.is_mutable or op_base_name(func) in METADATA_ONLY:
        return
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        for target in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(target, torch.Tensor) and target.numel():
                yield position, target


def allocated_storages(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], output: Any
) -> Iterator[Tuple[torch.device, int]]:
    """Storages the op allocated: outputs that are neither views nor in-place results of an input.
    An op whose schema says its result *may* alias its input (``to``, ``reshape``, ``contiguous``,
    which run as such under ``inference_mode``) allocated memory when its result is not in an
    input's storage: a step that writes that copy in place writes a temporary, not state."""
    if all(result.alias_info is not None and result.alias_info.is_write for result in func._schema.returns):
        return  # in-place and out= results are an input's memory
    inputs = {storage_key(arg) for arg in tree_leaves((args, kwargs))
              if isinstance(arg, torch.Tensor) and has_storage(arg)}
    for result in tree_leaves(output):
        if isinstance(result, torch.Tensor) and result.numel() and has_storage(result) and (
                storage_key(result) not in inputs):
            yield storage_key(result)


@dataclass
class WrittenRegion:
    """Memory that existed before the block and that one op wrote: how to read it back, what
    it held before, and who wrote it (op and model line, to name it when it differs)."""

    op: str
    source: Optional[SourceLine]
    read: Callable[..., torch.Tensor]  # an aten reader of the region: read(*where)
    write: Callable[..., Any]  # the aten writer that puts values back: write(*where, values)
    where: Tuple[Any, ...]  # the target tensor first, then what locates the region in it
    saved: torch.Tensor

    @property
    def target(self) -> torch.Tensor:
        return self.where[0]

    def current(self) -> torch.Tensor:
        """The region's contents now (a fresh tensor)."""
        return self.read(*self.where)

    def put_back(self) -> None:
        self.write(*self.where, self.saved)


def _index_put_region(target: torch.Tensor, args: Sequence[Any]) -> Locator:
    indices = [None if index is None else index.clone() for index in args[1]]
    return _aten.index.Tensor, _aten.index_put_.default, (target, indices)


def _index_dim_region(target: torch.Tensor, args: Sequence[Any]) -> Locator:
    return _aten.index_select.default, _aten.index_copy_.default, (target, args[1], args[2].clone())


def _scatter_region(target: torch.Tensor, args: Sequence[Any]) -> Locator:
    return _aten.gather.default, _aten.scatter_.src, (target, args[1], args[2].clone())


def _whole_region(target: torch.Tensor, args: Sequence[Any]) -> Locator:
    return _aten.clone.default, _aten.copy_.default, (target,)


# Save only the rows an indexed writer touches, not the whole tensor.
_REGION_SAVERS: Dict[str, Callable[[torch.Tensor, Sequence[Any]], Locator]] = {
    **dict.fromkeys(INDEX_PUT_WRITERS, _index_put_region),
    **dict.fromkeys(INDEX_DIM_WRITERS, _index_dim_region),
    **dict.fromkeys(SCATTER_WRITERS, _scatter_region),
}


def default_generators() -> List[torch.Generator]:
    """The generators random ops use when given none: CPU's, and each initialized CUDA device's."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.extend(torch.cuda.default_generators)
    return generators


_GENERATOR_ARGUMENTS: Dict[Any, Tuple[Tuple[int, str], ...]] = {}


def passed_generators(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Iterator[torch.Generator]:
    """The generators an op is handed explicitly (its ``Generator?`` arguments that are not None)."""
    slots = _GENERATOR_ARGUMENTS.get(func)
    if slots is None:
        slots = _GENERATOR_ARGUMENTS[func] = tuple(
            (position, argument.name) for position, argument in enumerate(func._schema.arguments)
            if "Generator" in str(argument.type))
    for position, name in slots:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, torch.Generator):
            yield value


class GeneratorStates:
    """Saved states of generators, to set them back: a block's random draws undone. Python's
    ``random`` and numpy's global generator (when numpy is imported) are saved too: a step's
    Python may draw from them (LayerDrop written with ``random.random()``)."""

    def __init__(self) -> None:
        self._saved: Dict[int, Tuple[torch.Generator, torch.Tensor]] = {}
        self._host: List[Tuple[Callable[[Any], Any], Any]] = []  # (setter, state) of Python's and numpy's

    def save(self, generator: torch.Generator) -> None:
        """Remember ``generator``'s state unless it is already saved (the first state wins)."""
        if id(generator) not in self._saved:
            self._saved[id(generator)] = (generator, generator.get_state())

    def save_host(self) -> None:
        """Remember Python's and numpy's global generators, unless saved already."""
        if self._host:
            return
        self._host.append((random.setstate, random.getstate()))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            self._host.append((numpy.random.set_state, numpy.random.get_state()))

    def put_back(self) -> None:
        for generator, state in self._saved.values():
            generator.set_state(state)
        for set_state, state in self._host:
            set_state(state)

    def current(self) -> Dict[int, Tuple[torch.Generator, torch.Tensor]]:
        """Each saved generator with its state now (where the block left it so far)."""
        return {key: (generator, generator.get_state()) for key, (generator, _) in self._saved.items()}

    def explicit(self) -> List[torch.Generator]:
        """The saved generators that are not a default one (a step's own generators)."""
        defaults = {id(generator) for generator in default_generators()}
        return [generator for key, (generator, _) in self._saved.items() if key not in defaults]


class CaptureMemoryError(RuntimeError):
    """Undoing a block's writes would copy more memory than the journal's budget."""


View = Tuple[Tuple[torch.device, int], int, Tuple[int, ...], Tuple[int, ...]]


def view_key(tensor: torch.Tensor) -> View:
    """Identity of a view: its storage, offset, shape and strides."""
    return storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


class StateJournal(TorchDispatchMode):
    """Use as ``with journal: ...`` then ``journal.restore()``; ``saved_bytes`` is its extra memory.
    ``regions`` lists what was written, oldest first (capture's verify step reads them);
    ``written`` the storages written, kept after ``restore()``; ``touched`` the addresses of the
    memory ops read or wrote that existed before the block (kept too); ``generators`` the saved generator
    states; ``reads_grad`` whether an op read a tensor that requires grad (in grad mode, eager
    outputs could then carry autograd history)."""

    def __init__(self, scratch: Set[Tuple[torch.device, int]] = frozenset(), budget: Optional[int] = None) -> None:
        super().__init__()
        self.scratch = scratch  # storages written only at rows no request owns: never saved whole
        self.budget = budget  # bytes of whole-view saves allowed (None: no limit)
        self._whole_views: Set[View] = set()  # views saved whole: later writes to them need no save
        self._whole_bytes = 0
        self.saved_bytes = 0
        self.regions: List[WrittenRegion] = []
        self.written: Set[Tuple[torch.device, int]] = set()
        self.generators = GeneratorStates()
        self.reads_grad = False
        self.touched: Set[int] = set()  # addresses of memory that existed before the block and that an op read or wrote
        self._fresh: Set[Tuple[torch.device, int]] = set()  # storages allocated inside the block

    def __enter__(self) -> "StateJournal":
        for generator in default_generators():
            self.generators.save(generator)
        self.generators.save_host()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        for position, target in written_tensors(func, args, kwargs):
            if storage_key(target) not in self._fresh:
                self._save(func, position, target, args)
        for generator in passed_generators(func, args, kwargs):
            self.generators.save(generator)
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and has_storage(leaf):
                key = storage_key(leaf)
                if key not in self._fresh:
                    self.touched.add(key[1])
                self.reads_grad = self.reads_grad or leaf.requires_grad
        output = func(*args, **kwargs)
        self._fresh.update(allocated_storages(func, args, kwargs, output))
        return output

    def _save(self, func: Any, position: int, target: torch.Tensor, args: Sequence[Any]) -> None:
        self.written.add(storage_key(target))
        saver = _REGION_SAVERS.get(op_base_name(func)) if position == 0 else None
        if saver is None and not self._may_save_whole(func, target):
            return
        read, write, where = (saver or _whole_region)(target, args)
        saved = read(*where)
        self.saved_bytes += saved.numel() * saved.element_size()
        self.regions.append(WrittenRegion(str(func), model_source_line(), read, write, where, saved))

    def _may_save_whole(self, func: Any, target: torch.Tensor) -> bool:
        """Whether a write the journal cannot narrow needs a whole save of ``target``: not for
        scratch storage, nor for a view already saved whole (its oldest save restores it);
        past the budget, raise naming the op."""
        key = view_key(target)
        if key[0] in self.scratch or key in self._whole_views:
            return False
        size = target.numel() * target.element_size()
        if self.budget is not None and self._whole_bytes + size > self.budget:
            where = model_source_line()
            raise CaptureMemoryError(
                f"{func}{f' at {where}' if where else ''} writes a {list(target.shape)} "
                f"{str(target.dtype).removeprefix('torch.')} tensor ({size / 2**20:.1f} MiB) in a way capture cannot "
                f"narrow to rows, and undoing it would copy more than {self.budget / 2**20:.0f} MiB; write it with "
                "index_copy_/index_put_ (undone row by row), or, with GraphRunner, whose capture stages pad values, "
                "if its writes land only in rows the staged indices address (a KV cache written at out_cache_loc), "
                "pass it as scratch state (scratch_state=[tensor], or keep it in batch_context's token_to_kv_pool)")
        self._whole_views.add(key)
        self._whole_bytes += size
        return True

    def put_back(self) -> None:
        """Put back every saved region, newest first, and every generator's state; they stay
        saved (it can be done again: verification runs eager and the replay from one state)."""
        with torch.no_grad():
            for region in reversed(self.regions):
                region.put_back()
        self.generators.put_back()

    def restore(self) -> None:
        """Put back every saved region, newest first, and every generator's state, and forget them."""
        self.put_back()
        if self.saved_bytes:
            logger.debug("capture undid %d bytes of in-place writes", self.saved_bytes)
        self.regions.clear()
        self._fresh.clear()
        self._whole_views.clear()
        self._whole_bytes = 0
        self.generators = GeneratorStates()
