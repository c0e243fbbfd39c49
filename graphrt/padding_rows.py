"""Padding rows must write no state a real row's step would not: found from the write journal.

A padded call runs the step on ``padded`` rows of which only ``real`` are the caller's; the rest
hold pad values. Comparing the padded replay with a padded eager run cannot see a padding row that
writes a live request's KV slot (``index_copy_`` at slot 0, the pad value). ``find_padding_write``
runs the step at the real size and at the padded size on the same static slots, both under one
StateJournal (every write undone), and compares what they did to the state (memory that existed
before, outside the step's own argument slots and the caller's declared scratch). In wrap()
(``PaddingCheck``) the padded-size run is the key's first capture warm-up and the real-size run is
its verification's eager run, against which the replay is verified through the warm-up: the check
adds no run of the step. It compares:

* where they wrote: the rows of every region the padded step wrote (the index values of an
  ``index_put_``/``index_copy_``/``scatter_`` into a view, or the view a ``copy_``, an ``add_`` or an
  opaque op wrote whole) must be among those the real step wrote into the same view; a padding row
  that writes another row is found whatever values it writes (a view written in another form than
  the real step's counts as other rows: exact sizes, the safe side);
* what they left: the values of every region either wrote, after each step, must agree (within
  rounding: the two sizes may take other kernels). This finds padding rows writing the real rows'
  positions (a duplicate index) and state reduced over the batch;
* where they left the random generators (wrap(): ``draws``): a step that draws for every row (dropout,
  sampling) moves a generator as for the padded rows, so a padded key's replays would depart from
  eager's sequence after its first call; such a layout records each call size exactly instead.
* what they returned (wrap(): ``outputs``): the real rows of each output the front cuts (the one dim that
  grew from the real to the padded size) must agree within rounding; a step that mixes rows (``x -
  x.mean(0)``, a softmax over the batch, experts whose capacity the padding rows take) returns other
  values for the real rows when padded, which neither state nor verification (padded against padded)
  shows; such a layout records each call size exactly too.

Both runs see the same values in the real rows, so a difference is the padding rows' doing. The
step is also run with ``ArgumentTaint``, which says which arguments' values the offending write
was computed from (the index that addressed it first), to name the argument whose pad value to
change. A custom op that skips rows (a store kernel skipping slot ``-1``) is opaque: its whole
target counts as written by both runs, and its values decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from graphrt.backends import CapturedGraph
from graphrt.backends.compiled import eager_stance
from graphrt.backends.source_lines import SourceLine
from graphrt.backends.state_journal import (
    StateJournal, WrittenRegion, allocated_storages, storage_key, view_key, written_tensors,
)
from graphrt.capture import WHOLE_SAVE_BUDGET
from graphrt.guards import python_state_kept
from graphrt.layout.tensor_tree import flatten, same_value
from graphrt.verify import owned, replay_matches, rounding_tolerance

_aten = torch.ops.aten
Storage = Tuple[torch.device, int]


@dataclass(frozen=True)
class PaddingWrite:
    """A write of the padded step into state that the real-size step leaves otherwise."""

    op: str
    source: Optional[SourceLine]
    target: str  # shape and dtype of the tensor written
    elements: int  # elements of the state the padding rows write or change
    arguments: Tuple[str, ...]  # the arguments whose values the write was computed from (its index first)
    real: int
    padded: int
    written: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)  # the tensor written, to name it

    def describe(self) -> str:
        """What was found, in words, for the warning, the failed key's reason and graphrt.check."""
        where = f" at {self.source}" if self.source is not None else ""
        whose = f"; it is computed from {', '.join(self.arguments)}" if self.arguments else ""
        return (f"padded from {self.real} to {self.padded} rows, the padding rows' {self.op}{where} writes "
                f"{self.elements} elements of a {self.target} tensor that the real rows' step leaves as they "
                f"were{whose}")


@dataclass(frozen=True)
class PaddingDraw:
    """The padded step leaves a random generator elsewhere than the real-size step: it draws for the
    padding rows too, so a padded key's replay would move it as for the padded rows."""

    generator: str  # which: the default CPU generator, cuda:0's, a generator the step holds
    real: int
    padded: int
    op: str = "random draws"
    source: Optional[SourceLine] = None
    written: Optional[torch.Tensor] = None

    def describe(self) -> str:
        return (f"padded from {self.real} to {self.padded} rows, the step draws random numbers for the padding rows "
                f"too: {self.generator} ends elsewhere than the real rows' step leaves it, so every later draw would "
                "depart from eager's")


@dataclass(frozen=True)
class PaddingOutput:
    """The padded step's real rows of an output differ from what the real-size step returns: the step mixes
    rows, so a padded replay would return other values than eager for the caller's rows."""

    output: str  # which: "output leaf 0"
    elements: int  # of the real rows, those that differ by more than rounding
    real: int
    padded: int
    op: str = "outputs"
    source: Optional[SourceLine] = None
    written: Optional[torch.Tensor] = None

    def describe(self) -> str:
        rows = f"{self.real} row{'' if self.real == 1 else 's'}"
        return (f"padded from {self.real} to {self.padded} rows, {self.elements} elements of the real rows of "
                f"{self.output} differ from what the step returns for {rows}: the step mixes rows (a reduction over "
                "the batch such as x - x.mean(0), a softmax over it, experts whose capacity the padding rows take), "
                "so a padded replay would return other values than eager's")


Finding = Union[PaddingWrite, PaddingDraw, PaddingOutput]


def fix_for(write: Finding) -> str:
    """The remedy that works for the op that wrote: a pad value its writes skip or land harmlessly at."""
    if isinstance(write, PaddingOutput):
        return "each call size gets a graph of its own, whose rows are all the caller's"
    if isinstance(write, PaddingDraw):
        return "each call size gets a graph of its own, which moves the generator as eager's step does"
    if not write.arguments:
        return "capture exactly the batch sizes you run (capture_sizes=[...]): no argument's pad value decides it"
    argument = write.arguments[0]
    scratch = (f"a row no request owns: wrap(..., pad_values={{'{argument}': R}}, scratch_state=[the {write.target} "
               "tensor]), R an extra row of that tensor")
    if write.op.startswith("aten."):  # index_copy_ refuses -1, index_put_ takes it as the last row
        return f"pad {argument} with {scratch} (aten ops do not skip -1)"
    return (f"pad {argument} with -1 if {write.op} skips negative slots, as vLLM's and nano-vllm's store kernels do: "
            f"wrap(..., pad_values={{'{argument}': -1}}); else with {scratch}")


class ArgumentTaint(TorchDispatchMode):
    """Which arguments each tensor of the step was computed from (``sources``: storage -> argument
    path), and, per in-place write into memory the step did not allocate, the arguments the op's
    other inputs were computed from: ``writes`` lists ``(target storage, op, index arguments, value
    arguments)`` in order."""

    def __init__(self, sources: Mapping[Storage, str]) -> None:
        super().__init__()
        self.sources = sources
        self._taint = WeakIdKeyDictionary()  # the step's own tensors -> arguments (keeps none alive)
        self._fresh: Set[Storage] = set()
        self.writes: List[Tuple[Storage, str, FrozenSet[str], FrozenSet[str]]] = []

    def _of(self, value: Any) -> FrozenSet[str]:
        found: Set[str] = set()
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found |= self._taint.get(leaf, frozenset())
                source = self.sources.get(storage_key(leaf)) if leaf.numel() else None
                if source is not None:
                    found.add(source)
        return frozenset(found)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        for position, target in written_tensors(func, args, kwargs):
            key = storage_key(target)
            if key not in self._fresh and key not in self.sources:
                named = [(argument.name, args[index] if index < len(args) else kwargs.get(argument.name))
                         for index, argument in enumerate(func._schema.arguments) if index != position]
                index_arguments = self._of([value for name, value in named if name in _INDEX_NAMES])
                self.writes.append((key, str(func), index_arguments, self._of([value for _, value in named])))
        output = func(*args, **kwargs)
        self._fresh.update(allocated_storages(func, args, kwargs, output))
        taint = self._of([args, kwargs])
        if taint:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor):
                    self._taint[leaf] = taint
        return output


_INDEX_NAMES = ("index", "indices")  # the schema arguments that address an indexed write


def _positions(region: WrittenRegion) -> Tuple[Any, FrozenSet[Any]]:
    """Where a region was written, as (what it indexes, which of its rows): the view and the index
    values of an indexed writer (negative ones as the rows they stand for), else the view, whole.
    Memory in proportion to the rows written, never to the tensor written into."""
    target = region.target
    view = view_key(target)
    if region.write is _aten.index_copy_.default:
        return (view, "dim", region.where[1]), frozenset(region.where[2].tolist())
    if region.write is _aten.index_put_.default:
        indices = region.where[1]
        dims = [(dim, index) for dim, index in enumerate(indices) if index is not None]
        if not dims:
            return (view, "whole"), frozenset([()])
        rows = [(index.nonzero().flatten() if index.dtype == torch.bool else index) % target.shape[dim]
                for dim, index in dims]
        stacked = torch.stack([row.flatten() for row in torch.broadcast_tensors(*rows)], dim=1)
        return (view, "index", tuple(index is None for index in indices)), frozenset(map(tuple, stacked.tolist()))
    if region.write is _aten.scatter_.src:
        dim, index = region.where[1], region.where[2]
        coordinates = list(torch.meshgrid(*(torch.arange(size) for size in index.shape), indexing="ij"))
        coordinates[dim] = index.cpu()
        return (view, "element"), frozenset(map(tuple, torch.stack([c.flatten() for c in coordinates], 1).tolist()))
    return (view, "whole"), frozenset([()])  # a whole view (copy_, an in-place op on a view, an opaque op)


def _differs(padded: torch.Tensor, real: torch.Tensor) -> int:
    """Elements of two readings of one region that differ by more than rounding (0 if none)."""
    if padded.shape != real.shape:
        return padded.numel()
    try:
        torch.testing.assert_close(padded, real, equal_nan=True, **rounding_tolerance(real))
    except AssertionError:
        if padded.is_floating_point() or padded.is_complex():
            tolerance = rounding_tolerance(real)
            close = torch.isclose(padded, real, rtol=tolerance.get("rtol", 0), atol=tolerance.get("atol", 0),
                                  equal_nan=True)
            return int((~close).sum())
        return int((padded != real).sum())
    return 0


@dataclass
class Reading:
    """What one eager run of the step did: the regions of state it wrote (each holding what was there
    before), their contents after it, where it left the random generators, and its output leaves (owned)."""

    regions: List[WrittenRegion]
    values: List[torch.Tensor]
    generators: Dict[int, Tuple[torch.Generator, torch.Tensor]]
    outputs: List[Any]

    def contents_after(self, regions: Sequence[WrittenRegion]) -> List[torch.Tensor]:
        """The contents of ``regions`` with the state as this run left it (from the state before it, where
        it is now), put back after."""
        for region, values in zip(self.regions, self.values):
            region.write(*region.where, values)
        try:
            return [region.current() for region in regions]
        finally:
            for region in reversed(self.regions):
                region.put_back()


def read_run(step: Callable[[], Any], journal: StateJournal, exempt: Set[Storage]) -> Reading:
    """Run ``step`` under ``journal``, a fresh one (each region it wrote is then saved from before this run),
    read what it did to the state outside ``exempt`` and put the state back (the journal restored)."""
    try:
        with journal:
            outputs = _leaves(step())
        regions = [region for region in journal.regions if storage_key(region.target) not in exempt]
        return Reading(regions, [region.current() for region in regions], journal.generators.current(), outputs)
    finally:
        journal.restore()


def find_padding_write(real_step: Callable[[], Any], padded_step: Callable[[], Any], real: int, padded: int,
                       exempt: Set[Storage], arguments: Mapping[Storage, str],
                       draws: bool = False, outputs: bool = False) -> Optional[Finding]:
    """The first write of ``padded_step`` into state (memory outside ``exempt``) that ``real_step``,
    the same step on the first ``real`` of its ``padded`` rows, does not make, or None. Both run
    eagerly under one journal; every write and random draw is undone. ``arguments`` names the
    storages of the step's argument slots (to say which argument a write was computed from). A write
    that cannot be narrowed to rows into a tensor too large to copy raises CaptureMemoryError, as
    capture does. ``draws``, ``outputs``: as ``compare_runs``."""
    taint = ArgumentTaint(arguments)
    with torch.no_grad(), eager_stance():  # a compiled step called under a dispatch mode would stay uncompiled
        real_run = read_run(real_step, StateJournal(budget=WHOLE_SAVE_BUDGET), exempt)
        with taint:
            padded_run = read_run(padded_step, StateJournal(budget=WHOLE_SAVE_BUDGET), exempt)
        return compare_runs(padded_run, real_run, taint, real, padded, draws, outputs)


def compare_runs(padded_run: Reading, real_run: Reading, taint: ArgumentTaint, real: int, padded: int,
                 draws: bool, outputs: bool) -> Optional[Finding]:
    """The first thing the padded step (run under ``taint``) did to the state otherwise than the real
    step, each from the state before it (which is the state now), or None: a write of rows (or views) the
    real step did not write, then a region both left otherwise (``PaddingWrite``); ``draws``: else, a
    generator the padded step leaves elsewhere (``PaddingDraw``), a state too; ``outputs``: else, an output
    whose real rows the padded step returns otherwise (``PaddingOutput``)."""
    found = _outside(padded_run.regions, real_run.regions)
    if found is None:
        found = _changed(padded_run, real_run)
    if found is None:
        moved = _moved_apart(padded_run.generators, real_run.generators) if draws else None
        if moved is not None:
            return PaddingDraw(moved, real, padded)
        return _output_leak(real_run.outputs, padded_run.outputs, real, padded) if outputs else None
    region, elements = found
    index_arguments, value_arguments = _arguments_of(taint, region)
    named = tuple(sorted(index_arguments)) + tuple(sorted(value_arguments - index_arguments))
    dtype = str(region.target.dtype).removeprefix("torch.")
    return PaddingWrite(region.op.removesuffix(".default"), region.source, f"{list(region.target.shape)} {dtype}",
                        elements, named, real, padded, region.target)


def _moved_apart(padded: Mapping[int, Tuple[torch.Generator, torch.Tensor]],
                 real: Mapping[int, Tuple[torch.Generator, torch.Tensor]]) -> Optional[str]:
    """The first generator whose state after the padded step differs from its state after the real step
    (a generator only one of them drew from counts)."""
    for key, (generator, state) in {**real, **padded}.items():
        seen, other = real.get(key), padded.get(key)
        if seen is None or other is None or not torch.equal(seen[1], other[1]):
            if generator is torch.default_generator:
                return "the default CPU generator"
            device = generator.device
            default = device.type == "cuda" and generator is torch.cuda.default_generators[device.index or 0]
            return f"{device}'s default generator" if default else f"a {device} generator the step draws from"
    return None


def _leaves(returned: Any) -> List[Any]:
    """The leaves of what a step returned, tensors cloned (the journal puts back memory they may view)."""
    leaves: List[Any] = []
    flatten(returned, leaves)
    return list(map(owned, leaves))


def real_part(real: torch.Tensor, padded: torch.Tensor, rows: Mapping[int, int]) -> Optional[torch.Tensor]:
    """``padded`` cut to ``real``'s rows when exactly one dimension grew, by the padding (``rows``: padded
    size -> real size); None otherwise (an output a front cannot cut: its padded calls run eagerly)."""
    if real.dim() != padded.dim():
        return None
    grown = [dim for dim in range(real.dim()) if real.shape[dim] != padded.shape[dim]]
    if len(grown) != 1 or rows.get(padded.shape[grown[0]]) != real.shape[grown[0]]:
        return None
    return padded.narrow(grown[0], 0, real.shape[grown[0]])


def _output_leak(real_returned: List[Any], padded_returned: List[Any], real: int, padded: int
                 ) -> Optional[PaddingOutput]:
    """The first output tensor whose real rows the padded step returned otherwise than the real step did."""
    for index, (want, got) in enumerate(zip(real_returned, padded_returned)):
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            continue
        part = real_part(want, got, {padded: real})
        count = 0 if part is None else _differs(part, want)
        if count:
            return PaddingOutput(f"output leaf {index}", count, real, padded)
    return None


def _outside(padded_regions: List[WrittenRegion], real_regions: List[WrittenRegion]
             ) -> Optional[Tuple[WrittenRegion, int]]:
    """The first region of the padded step that covers rows (or views) the real step did not write."""
    written: Dict[Any, Set[Any]] = {}
    for region in real_regions:
        key, rows = _positions(region)
        written.setdefault(key, set()).update(rows)
    for region in padded_regions:
        key, rows = _positions(region)
        extra = rows - written.get(key, set())
        if extra:
            per_row = region.target.numel() if key[1] == "whole" else max(region.current().numel() // len(rows), 1)
            return region, len(extra) * per_row
    return None


def _changed(padded_run: Reading, real_run: Reading) -> Optional[Tuple[WrittenRegion, int]]:
    """The first region either run wrote whose contents after the padded step differ from those after the real step."""
    regions = padded_run.regions + real_run.regions
    after_padded, after_real = padded_run.contents_after(regions), real_run.contents_after(regions)
    for region, padded_values, real_values in zip(regions, after_padded, after_real):
        count = _differs(padded_values, real_values)
        if count:
            return region, count
    return None


def _arguments_of(taint: ArgumentTaint, region: WrittenRegion) -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """The arguments the write into ``region``'s storage was computed from: its index, then its values."""
    key = storage_key(region.target)
    for target, op, index_arguments, value_arguments in taint.writes:
        if target == key and op == region.op:
            return index_arguments, value_arguments
    return frozenset(), frozenset()


Refused = Callable[[str, Optional[Exception]], None]  # what a layout does when padding is refused: why, the error


class PaddingCheck:
    """wrap()'s padding check of a key smaller calls pad to, folded into the key's three capture runs
    (graphrt.capture.CaptureChecks): the first warm-up is the step on all ``padded`` rows of the slots,
    staged with a call's first ``real`` rows (pad values above them), read; the verification's eager run is
    the step on those ``real`` rows, off the capture path, compared with it (``compare_runs``: where both
    wrote, what they left, the generators, the real rows of the outputs); the replay is compared with the
    warm-up. The slots and ``scratch`` are not state. The real-size run puts back the Python bindings of
    ``roots`` it changed, every attribute it assigned and what the step's own code wrote (a step that
    rebinds raises RebindError, as its capture would). ``refused(why, error)`` is called when padding is
    refused: a finding (``error`` None), or a step that does not run at both sizes (state sized to the
    batch, such as a StaticCache, or a write too large to copy)."""

    def __init__(self, fn: Callable[..., Any], signature: Any, real: int, padded: int, scratch: Set[Storage],
                 roots: Sequence[Tuple[str, Any]], refused: Refused) -> None:
        self.fn, self.signature, self.real, self.padded, self.roots, self.refused = (
            fn, signature, real, padded, roots, refused)
        slots = signature.slot_paths()
        self.exempt = set(slots) | scratch
        self.taint = ArgumentTaint(slots)  # which argument a padding row's write was computed from
        self.padded_run: Optional[Reading] = None

    def warm_up(self, step: Callable[[], Any]) -> None:
        """The key's first warm-up, ``step()`` on all padded rows, read (its writes undone)."""
        try:
            with self.taint:  # in the capture's no_grad
                self.padded_run = read_run(step, StateJournal(budget=WHOLE_SAVE_BUDGET), self.exempt)
        except Exception as error:  # a failed capture would say the same: no padded graph for this layout
            self.refused(self._both_sizes(error), error)
            raise

    def verify(self, graph: CapturedGraph, journal: StateJournal, verify_eagerly: Optional[Callable[[], None]]
               ) -> None:
        """The step on the real rows, eagerly, against the warm-up; the replay against the warm-up (all rows).
        Where padding is refused, the graph is verified the plain way first (``verify_eagerly``: the real
        rows' run differing from the warm-up may be a capture-only path, not the padding rows)."""
        padded_run = self.padded_run
        error: Optional[Exception] = None
        finding: Optional[Finding] = None
        with torch.no_grad(), eager_stance():
            try:
                real_run = read_run(self._real_step, journal, self.exempt)
            except Exception as caught:
                error = caught
            else:
                finding = compare_runs(padded_run, real_run, self.taint, self.real, self.padded, draws=True,
                                       outputs=True)
            if error is None and finding is None and verify_eagerly is not None:
                try:
                    replay_matches(graph, padded_run.outputs, padded_run.regions, padded_run.values, same_value,
                                   journal)
                finally:
                    journal.restore()
                    for region in reversed(padded_run.regions):  # a CUDA replay wrote them
                        region.put_back()
        if error is None and finding is None:
            return
        if verify_eagerly is not None:
            verify_eagerly()
        self.refused(self._both_sizes(error) if error is not None else f"{finding.describe()}; {fix_for(finding)}",
                     error)

    def _real_step(self) -> Any:
        call = self.signature.static_arguments(self.real)
        with python_state_kept(self.roots, self.fn):
            return self.fn(*call.args, **call.kwargs)

    def _both_sizes(self, error: Exception) -> str:
        return f"the step does not run at both {self.real} and {self.padded} rows ({type(error).__name__}: {error})"


__all__ = ["ArgumentTaint", "PaddingCheck", "PaddingDraw", "PaddingOutput", "PaddingWrite", "Reading", "compare_runs",
           "find_padding_write", "fix_for", "read_run", "real_part"]
