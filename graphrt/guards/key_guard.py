"""KeyGuard: a captured key replays only while the state it was captured under still holds.

What is guarded comes from what the step ran at capture (graphrt.guards.observe), not from the
wrapped object. Checked on every call that would replay the key, in this order:

1. the global state (``StateWatch.token``): autocast (one C call while it is off);
2. the state epoch (graphrt.guards.epoch): one integer compare while no API able to change the
   step's Python state ran since the last call; when it moved, the key reads again what the changes
   since name, of the state of the modules it ran (``training`` flags, Python attributes,
   submodules, hooks, parameters and their dtypes, devices and memory), of the objects it read, and
   of the links it reached its tensors and modules through (graphrt.guards.python_state,
   graphrt.guards.bindings): one attribute assigned costs one attribute's re-read, whatever the depth;
   a tensor the step only reads, rebound to one of its kind, is staged into the captured one instead
   (graphrt.guards.staged_tensors: one copy per call while it is);
3. the few values no API tells of (graphrt.guards.live_checks): the globals and closure cells the
   step's own code reads, the lists and dicts it reached tensors or modules through; the lookups through
   classes it made (graphrt.guards.class_state: one identity compare per name); and the containers it
   reads in place (graphrt.guards.in_place);
4. aliasing, only for a step that writes memory: no staged argument shares memory with another
   when the step writes one of its inputs, nor with state the step reads or writes (a replay
   reads each argument from its own static slot, where eager would see the write through the alias).

A failure is a ``GuardFailure`` (the eager reason's value and what differed); the front runs the
call eagerly with that reason, or, for ``wrap()``, gives it graphs of its own.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, FrozenSet, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from graphrt.backends.state_journal import backing_tensor
from graphrt.guards.adapters import watch_adapter_layers
from graphrt.guards.attributes import attributes, has_attributes
from graphrt.guards.bindings import Bindings, find_bindings
from graphrt.guards.class_state import ClassLookups, class_reads, step_lookups
from graphrt.guards.context_reads import ContextVariables, Environment, ThreadLocal
from graphrt.guards.epoch import EPOCH, changes_since, position, watch_class
from graphrt.guards.global_state import StateWatch
from graphrt.guards.in_place import Contents, Versioned
from graphrt.guards.live_checks import Same, global_checks
from graphrt.guards.observe import Observation, entry_functions, entry_roots, functions_that_ran
from graphrt.guards.python_state import PythonState
from graphrt.guards.read_objects import step_reads
from graphrt.guards.staged_tensors import TensorStaging

logger = logging.getLogger(__name__)

# The caller's tensors a call stages (None where an optional field is unset), read from the call.
Sources = Callable[[Any], Sequence[Optional[torch.Tensor]]]
# Reasons whose state can come back as it was (train/eval, an adapter set again, a hook removed):
# wrap() keeps graphs per such state. The others bind new objects or memory: graphs are recorded again.
RECURRING = frozenset({"training", "python_state", "hooks"})
_requires_grad = operator.attrgetter("requires_grad")


class GuardFailure(NamedTuple):
    """Why a key cannot serve this call: an ``EagerReason`` value and what differed, in words."""

    reason: str  # "autocast" | "training" | "python_state" | "hooks" | "module_moved" | "rebound_state" | ...
    detail: str


class StaleStateError(RuntimeError):
    """Debug mode: a tensor a graph reads had its memory swapped (``param.data = other``) since capture."""


@dataclass
class GuardSpec:
    """What a front tells capture about its keys' guards: its state watch, the ``(name, object)``
    object arguments of its calls, and the callable it wraps (what it holds: a bound method's
    object, a partial's arguments, closure cells, through which a call reaches the modules it runs)."""

    watch: StateWatch
    objects: Sequence[Tuple[str, Any]] = field(default_factory=tuple)
    fn: Any = None

    def roots(self) -> List[Tuple[str, Any]]:
        """The object arguments and what ``fn`` holds: the objects the step reads through."""
        return [*self.objects, *entry_roots(self.fn)]

    def rebind_roots(self) -> List[Tuple[str, Any]]:
        """What a captured step must not rebind or assign: the object arguments (and what they
        hold) and the modules ``fn`` holds. An engine object's own bookkeeping (a call counter,
        the metadata its attention backend refreshes each step) is its own business. The object
        arguments' classes are watched: an assignment reaches the capture's journal, with its line."""
        for _, obj in self.objects:
            if not isinstance(obj, torch.nn.Module) and has_attributes(obj):
                watch_class(type(obj))
        return [*self.objects, *((name, obj) for name, obj in entry_roots(self.fn) if isinstance(obj, torch.nn.Module))]


def memory_of(tensor: torch.Tensor) -> int:
    """The address of a tensor's allocation (its storage): views of one allocation share it; a DTensor
    parameter's is its local shard's."""
    return backing_tensor(tensor).untyped_storage().data_ptr()


@dataclass(eq=False)
class KeyGuard:
    """The state one key was captured under, and the per-call check against it."""

    watch: StateWatch
    state: Any  # the StateWatch token at capture
    bindings: Bindings
    python: PythonState
    live: Tuple[Any, ...]  # compared on every call: Same, Versioned, ContextVariables, ThreadLocal
    touched: FrozenSet[int]  # addresses of the state an argument must not share memory with
    storages: Optional[FrozenSet[Any]]  # their storage objects, where the bindings hold them all (held_storages)
    check_aliases: bool  # the step writes state or its inputs: staged tensors are checked for aliases
    check_pairs: bool  # the step writes its inputs: no two staged tensors may share memory
    epoch: int  # the state epoch the Python state was last seen unchanged at
    position: int  # where the changes after that begin (graphrt.guards.epoch.changes_since)
    staging: TensorStaging  # tensors rebound where the step reads them, copied into the captured ones per call
    unannounced: bool = False  # debug mode logged a change no API told of

    def __post_init__(self) -> None:
        # bound once: one call per check per call, and one tuple compare for all that compare two objects
        pairs = [check.equality() for check in self.live]
        equal = [pair for pair in pairs if pair is not None]
        self._holds = (*([functools.partial(operator.eq, tuple(live for live, _ in equal),
                                            tuple(expected for _, expected in equal))] if equal else []),
                       *(check.check() for check, pair in zip(self.live, pairs) if pair is None))
        self.failure = self._checker()  # the per-call check (``_checker``)

    @classmethod
    def capture(cls, spec: GuardSpec, observation: Optional[Observation], touched: Set[int], written: Set[int],
                writes_inputs: bool, own: Set[int]) -> "KeyGuard":
        """The guard of a key captured now: the current state; the state of what the step ran
        (``observation``); the bindings from the roots to the memory the step ``touched`` (read or
        wrote; the graph's ``own`` memory aside: its static slots, which staging fills, and its
        outputs, which every replay overwrites) and to the modules it ran; aliasing checks when it
        ``written`` memory (pairs of arguments: ``writes_inputs``). The state an argument must not
        share memory with is what the bindings reach and what the step wrote: memory still held,
        unlike the temporaries of the capture, whose addresses come back."""
        observation = observation if observation is not None else Observation()
        seen_epoch, seen_position = EPOCH[0], position()  # before anything is read: a change from now on is seen
        objects, entry = list(spec.objects), spec.roots()[len(spec.objects):]
        modules = observation.modules
        values = _values_read(spec.fn, observation)
        roots = [*objects, *((type(module).__name__, module) for module in modules)]
        bindings = find_bindings(roots, touched - own, memory_of, modules, [*entry, *values])
        plain_objects = [(name, obj) for name, obj in objects
                         if not isinstance(obj, torch.nn.Module) and has_attributes(obj)]
        ran = {id(module) for module in modules}
        holders = [module for module in bindings.modules if id(module) not in ran]  # a ModuleList the step iterated
        functions = functions_that_ran([*entry_functions(spec.fn), *_hooks(modules)], observation)
        reads = step_reads(observation, plain_objects, entry, spec.fn, functions)
        read_objects = [*plain_objects, *reads.objects]
        names = frozenset(observation.attribute_names())  # an object the step read counts for these attributes
        # what the step writes of its own (a counter, a log it appends to) is its state, frozen in replays as
        # the graph contract says: never a change between calls (graphrt.guards.step_writes)
        step_wrote = observation.written
        python = PythonState([*modules, *holders, *reads.submodules],
                             [(name, obj) for name, obj in read_objects if watch_class(type(obj))],
                             [*objects, *entry, *values],
                             {id(obj): _names_read(obj, names, reads.computed, step_wrote) for _, obj in reads.objects})
        compared = {id(check.source) for check in bindings.live if check.get is None}  # lists compared whole already
        # read in place, compared per call: the step's lookups through classes (one generated function), the
        # containers it read, and the attributes of objects whose class cannot tell of an assignment (a C type)
        lookups = [(cls, name) for cls, name in step_lookups(observation)
                   if not any((id(klass), name) in step_wrote for klass in cls.__mro__)]
        classes = ClassLookups(class_reads(lookups))
        in_place = Versioned([*(Contents(container, path) for path, container in reads.containers
                                if id(container) not in compared and (id(container), None) not in step_wrote),
                              *(Contents(vars(obj), name, _written_names(obj, step_wrote)) for name, obj in read_objects
                                if not watch_class(type(obj)) and hasattr(obj, "__dict__")),
                              *([Environment(observation.environment)] if observation.environment else [])])
        context = ContextVariables(observation.context_variables)
        live = (*global_checks(observation.globals_read()), *(Same.cells(function) for function in functions),
                *bindings.live, *([classes] if classes else []), *([in_place] if in_place else []),
                *([context] if context else []),
                *(ThreadLocal(local, path) for path, local in reads.thread_locals))
        watch_adapter_layers(modules, observation.ran)
        written_state = written - own
        state_memory = frozenset(bindings.memory | written_state)
        return cls(spec.watch, spec.watch.token(), bindings, python, live, state_memory,
                   held_storages(bindings.tensors, state_memory),
                   bool(written_state) or writes_inputs, writes_inputs, seen_epoch, seen_position,
                   TensorStaging(touched - own, written_state))

    def _checker(self) -> Callable[..., Optional[GuardFailure]]:
        """``failure(state, sources, call, debug=False)``: None when the key may serve ``call`` made
        under ``state`` (a ``StateWatch`` token), whose staged tensors are ``sources(call)`` (read only when
        the step writes memory); else why not. ``debug`` (debug mode): raise StaleStateError for a tensor
        whose memory was swapped, and read the Python state whole (``unannounced_change``). A closure over the
        key's constants: the per-call path loads no attribute but the epoch seen last."""
        captured, holds_all, staging = self.state, self._holds, self.staging
        # a staged tensor shares memory with the state when its key is among the state's: its storage object
        # where the bindings hold every state storage (one C call), else its storage's address
        state_keys, key_of = ((self.storages, torch.Tensor.untyped_storage) if self.storages is not None
                              else (self.touched, _storage_address))
        check_aliases, check_pairs, guard = self.check_aliases, self.check_pairs, self

        def failure(state: Any, sources: Sources, call: Any, debug: bool = False) -> Optional[GuardFailure]:
            if state is not captured and state != captured:
                return GuardFailure(*guard.watch.difference(captured, state))
            if EPOCH[0] != guard.epoch:
                changed = guard.state_failure()
                if changed is not None:
                    return changed
            held = True
            try:
                for holds in holds_all:
                    if not holds():
                        held = False
                        break
            except RuntimeError:  # a tensor put where a plain value was: its == raised
                held = False
            if not held:  # changed, or (a dict compared by copy) written with what it held
                changed = next((GuardFailure(*check.change()) for check in guard.live if not check.holds()), None)
                if changed is not None:
                    return changed
            if check_aliases:
                tensors = sources(call)
                shares = check_pairs
                if not shares:  # whether a staged tensor's memory is state the step reads or writes
                    for tensor in tensors:
                        if tensor is not None and key_of(tensor) in state_keys:
                            shares = True
                            break
                if shares:
                    changed = guard._aliased([_storage_address(tensor) for tensor in tensors if tensor is not None])
                    if changed is not None:
                        return changed
            if debug:
                guard.check_storage()
                changed = guard.unannounced_change()
                if changed is not None:
                    return changed
            if staging.pairs:
                staging.stage()
            return None

        return failure

    def state_failure(self) -> Optional[GuardFailure]:
        """The Python state and bindings read again (after the epoch moved), as far as the changes
        since they were last seen the same name: what differs from capture, else None (and the
        epoch is remembered: nothing is read again until it moves)."""
        now = EPOCH[0]
        end, changes = changes_since(self.position)
        change = self._reread(changes)
        if change is not None:
            return GuardFailure(*change)
        self.epoch, self.position = now, end
        return None

    def unannounced_change(self) -> Optional[GuardFailure]:
        """Debug mode, every call: the Python state and bindings read whole, past the epoch, so that a write
        no API tells of (``object.__setattr__(module, ...)``, a module's ``__dict__`` written directly) is seen;
        logged once per key, as the same call without debug mode would replay the old state."""
        change = self._reread(None)
        if change is None:
            return None
        if not self.unannounced:
            self.unannounced = True
            logger.warning("%s: %s, and no API able to change it ran (a write past Module.__setattr__: "
                           "object.__setattr__, the module's __dict__); seen only because debug=True", *change)
        return GuardFailure(*change)

    def _reread(self, changes: Optional[Set[Any]]) -> Optional[Tuple[str, str]]:
        """The bindings and the Python state read again, as far as ``changes`` name (None: whole); the first
        difference from capture, ``(reason, words)``, else None."""
        return self.bindings.rebound(changes, self.staging) or self.python.change(changes, self.staging)

    def holds_now(self) -> bool:
        """Whether the Python state of now is this key's (its state read again, its live checks),
        the call's tensors aside: a front looking for graphs of the state it is back in."""
        return self.state_failure() is None and all(check.holds() for check in self.live)

    def reads_grad(self) -> bool:
        """Whether a tensor the step read through its bindings requires grad now (grad-mode calls:
        ``requires_grad`` is set by assignment as often as by ``requires_grad_()``, so it is read)."""
        return any(map(_requires_grad, self.bindings.tensors))

    def _aliased(self, memory: List[int]) -> Optional[GuardFailure]:
        """Why staged tensors at ``memory`` (their storages' addresses) cannot be staged apart, else None."""
        if not self.touched.isdisjoint(memory):
            index = next(index for index, address in enumerate(memory) if address in self.touched)
            return GuardFailure("aliased_inputs", f"staged tensor {index} shares memory with state the step reads "
                                                  "or writes")
        if self.check_pairs:
            real = [address for address in memory if address]  # an empty tensor has no memory to share
            if len(set(real)) != len(real):
                return GuardFailure("aliased_inputs", "two staged tensors share memory, and the step writes its "
                                                      "inputs")
        return None

    def check_storage(self) -> None:
        """Debug mode: raise StaleStateError when a tensor the graph reads changed memory since capture."""
        path = self.bindings.swapped_storage()
        if path is not None:
            raise StaleStateError(
                f"{path}: its memory was swapped since capture (e.g. `.data = other`); a CUDA graph reads the "
                "captured memory, so replays would compute with the old values. Update weights in place "
                "(`copy_`, `load_state_dict`), or call recapture() after swapping them")


def _storage_address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def held_storages(tensors: Sequence[torch.Tensor], memory: AbstractSet[int]) -> Optional[FrozenSet[Any]]:
    """The storage objects of ``tensors`` when they cover every address of ``memory``, else None. Torch
    keeps one Python object per storage while it lives, so a staged tensor shares memory with these
    tensors exactly when its ``untyped_storage()`` is one of them: one C call per staged tensor, where
    the address takes two (the per-call aliasing check). The bindings hold the tensors, so the objects
    live as long as the key."""
    storages = {backing_tensor(tensor).untyped_storage() for tensor in tensors}
    return frozenset(storages) if memory <= {storage.data_ptr() for storage in storages} else None


def _names_read(obj: Any, names: FrozenSet[str], computed: bool, written: AbstractSet[Tuple[int, Any]]
                ) -> Optional[FrozenSet[str]]:
    """The attributes of a read object an assignment of which is a change: the names the step's code loads,
    or (``computed``: a name computed at run time) every attribute (None), less those the step itself wrote."""
    own = _written_names(obj, written)
    if computed:
        return None if not own else (frozenset(attributes(obj)) | names) - own
    return names - own


def _written_names(obj: Any, written: AbstractSet[Tuple[int, Any]]) -> FrozenSet[str]:
    """The attributes of ``obj`` the step itself wrote (``written``: graphrt.guards.step_writes)."""
    return frozenset(name for holder, name in written if holder == id(obj) and name is not None)


def _values_read(fn: Any, observation: Observation) -> List[Tuple[str, Any]]:
    """``(name, value)`` of the globals the step's own code reads (data: a model, a table, an
    engine), as roots the step reaches modules and tensors through."""
    return [(f"global {name}", scope[name]) for scope, names in observation.globals_read() for name in names
            if not callable(scope[name]) or isinstance(scope[name], torch.nn.Module)]


def _hooks(modules: Sequence[torch.nn.Module]) -> List[Any]:
    """The forward hooks registered on ``modules`` and globally (their closures are read per call)."""
    hooks: List[Any] = []
    for module in modules:
        hooks += [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    table = torch.nn.modules.module
    return hooks + [*table._global_forward_pre_hooks.values(), *table._global_forward_hooks.values()]
