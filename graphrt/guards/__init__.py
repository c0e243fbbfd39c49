"""Guards: a graph replays only under the state it was captured for (docs/ARCHITECTURE.md, "Guards").

``observe`` sees what a step runs at capture; ``KeyGuard`` keeps the state of what it ran (modules,
their attributes and hooks, the bindings to its tensors, the globals and closure cells it read)
and checks it per call at one integer compare (the state ``epoch``) while nothing changed;
``StateWatch`` reads autocast; ``AssignmentJournal`` refuses a step that changes Python state.
"""

from graphrt.guards.assignments import AssignmentJournal, observed_run, python_state_kept
from graphrt.guards.bindings import Bindings, find_bindings
from graphrt.guards.global_state import StateWatch, autocast_state
from graphrt.guards.key_guard import RECURRING, GuardFailure, GuardSpec, KeyGuard, Sources, StaleStateError, memory_of
from graphrt.guards.observe import Observation, observe

__all__ = ["RECURRING", "AssignmentJournal", "Bindings", "GuardFailure", "GuardSpec", "KeyGuard", "Observation",
           "Sources", "StaleStateError", "StateWatch", "autocast_state", "find_bindings", "memory_of", "observe",
           "observed_run", "python_state_kept"]
