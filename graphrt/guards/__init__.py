"""Guards: a graph replays only under the state it was captured for (docs/ARCHITECTURE.md, "Guards").

``StateWatch`` reads the global state of a call (autocast, ``training`` flags), ``find_bindings``
the paths a step read its tensors through, and ``KeyGuard`` checks both, and aliasing, per call.
"""

from graphrt.guards.bindings import Bindings, find_bindings
from graphrt.guards.global_state import StateWatch, autocast_state, module_roots
from graphrt.guards.key_guard import GuardFailure, GuardSpec, KeyGuard, Sources, StaleStateError, memory_of

__all__ = ["Bindings", "GuardFailure", "GuardSpec", "KeyGuard", "Sources", "StaleStateError", "StateWatch",
           "autocast_state", "find_bindings", "memory_of", "module_roots"]
