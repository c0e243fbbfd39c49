"""KeyGuard: a captured key replays only while the state it was captured under still holds.

Checked on every call that would replay the key, in this order, each cheap while nothing changed:

1. the global state (``StateWatch.token``): autocast, and the ``training`` flags of the model's modules;
2. the bindings (``Bindings.rebound``): the tensors the step read through object arguments and
   the model's attributes are still the ones bound there;
3. aliasing, only for a step that writes memory: no staged argument shares memory with another
   when the step writes one of its inputs, nor with state the step reads or writes (a replay
   reads each argument from its own static slot, where eager would see the write through the alias).

A failure is a ``GuardFailure`` (the eager reason's value and what differed); the front runs the
call eagerly with that reason, or, for ``wrap()``, gives it graphs of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from graphrt.guards.bindings import Bindings, count_registrations, find_bindings
from graphrt.guards.global_state import StateWatch


# The caller's tensors a call stages (None where an optional field is unset), read from the call.
Sources = Callable[[Any], Sequence[Optional[torch.Tensor]]]


class GuardFailure(NamedTuple):
    """Why a key cannot serve this call: an ``EagerReason`` value and what differed, in words."""

    reason: str  # "autocast" | "training" | "rebound_state" | "aliased_inputs"
    detail: str


class StaleStateError(RuntimeError):
    """Debug mode: a tensor a graph reads had its memory swapped (``param.data = other``) since capture."""


@dataclass
class GuardSpec:
    """What a front tells capture about its keys' guards: the state watch of its model, and the
    ``(name, object)`` roots (modules, object arguments) whose tensors the step reads through."""

    watch: StateWatch
    roots: Sequence[Tuple[str, Any]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        count_registrations()

    @classmethod
    def of(cls, watch: StateWatch, objects: Sequence[Tuple[str, Any]] = ()) -> "GuardSpec":
        """The spec of a front whose step reads ``objects`` (named by their argument paths, first) and
        runs ``watch``'s modules (named by class)."""
        return cls(watch, [*objects, *((type(root).__name__, root) for root in watch.roots)])


def memory_of(tensor: torch.Tensor) -> int:
    """The address of a tensor's allocation (its storage): views of one allocation share it."""
    return tensor.untyped_storage().data_ptr()


@dataclass(eq=False)
class KeyGuard:
    """The state one key was captured under, and the per-call check against it."""

    watch: StateWatch
    state: Any  # the StateWatch token at capture
    bindings: Bindings
    touched: FrozenSet[int]  # addresses of the state an argument must not share memory with
    check_aliases: bool  # the step writes state or its inputs: staged tensors are checked for aliases
    check_pairs: bool  # the step writes its inputs: no two staged tensors may share memory

    @classmethod
    def capture(cls, spec: GuardSpec, touched: Set[int], written: Set[int], writes_inputs: bool,
                own: Set[int]) -> "KeyGuard":
        """The guard of a key captured now: the current state, the bindings from ``spec.roots``
        to the memory the step ``touched`` (read or wrote; the graph's ``own`` memory aside: its
        static slots, which staging fills, and its outputs, which every replay overwrites), and
        aliasing checks when it ``written`` memory (pairs of arguments: ``writes_inputs``). The
        state an argument must not share memory with is what the bindings reach and what the step
        wrote: memory still held, unlike the temporaries of the capture, whose addresses come back."""
        bindings = find_bindings(spec.roots, touched - own, memory_of)
        written_state = written - own
        state_memory = frozenset(bindings.memory | written_state)
        return cls(spec.watch, spec.watch.token(), bindings, state_memory, bool(written_state) or writes_inputs,
                   writes_inputs)

    def failure(self, state: Any, sources: Sources, call: Any, check_storage: bool = False) -> Optional[GuardFailure]:
        """None when the key may serve ``call`` made under ``state`` (a ``StateWatch`` token), whose
        staged tensors are ``sources(call)`` (read only when the step writes memory); else why not.
        ``check_storage`` (debug mode): raise StaleStateError for a tensor whose memory was swapped."""
        if state is not self.state and state != self.state:
            return GuardFailure(*self.watch.difference(self.state, state))
        path = self.bindings.rebound()
        if path is not None:
            return GuardFailure("rebound_state", f"{path} is bound to another object than at capture")
        if self.check_aliases:
            failure = self._aliased(sources(call))
            if failure is not None:
                return failure
        if check_storage:
            self.check_storage()
        return None

    def _aliased(self, tensors: Sequence[Optional[torch.Tensor]]) -> Optional[GuardFailure]:
        memory = [tensor.untyped_storage().data_ptr() for tensor in tensors if tensor is not None]
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
