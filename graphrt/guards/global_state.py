"""The global state a recorded step depends on and a replay cannot see: autocast.

Under ``torch.autocast`` the casts are recorded ops: a replay under another autocast state would
silently compute the captured one. ``StateWatch.token()`` names the state of one call in a value
that compares equal exactly when a graph captured under one may serve the other: one C call while
no autocast is on. A front that keeps graphs per Python state (``wrap()``: one set of layouts per
adapter, per train/eval mode, ...) adds the number of the state its calls are in (``variant``).
The Python state itself (``training`` flags, attributes, hooks) is the keys' own
(graphrt.guards.python_state), read again only after the state epoch moved.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from graphrt.guards import epoch

# Device types whose autocast state is read (torch.amp's own list of autocast-capable devices).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")
_any_autocast = torch._C._is_any_autocast_enabled


def autocast_state() -> Optional[Tuple[Any, ...]]:
    """None while no autocast is on (the common case, one C call), else per enabled device type
    its dtype, and whether autocast caches casts."""
    if not _any_autocast():
        return None
    enabled = tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST_DEVICES
                    if _autocast_enabled(device))
    return enabled, torch.is_autocast_cache_enabled()


def _autocast_enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build does not know
        return False


def describe_autocast(state: Optional[Tuple[Any, ...]]) -> str:
    if state is None:
        return "autocast off"
    devices = ", ".join(f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in state[0])
    return f"autocast {devices or 'on'}"


class StateWatch:
    """The state token of each call of one front: ``(autocast_state(), variant)``. The token object
    is reused while autocast is off, so equal states usually compare by identity."""

    def __init__(self) -> None:
        epoch.install()
        self.variant = 0
        self._token: Tuple[Any, ...] = (None, 0)

    def token(self) -> Tuple[Any, ...]:
        """The token of the call about to run."""
        if not _any_autocast():
            return self._token
        return autocast_state(), self.variant

    def set_variant(self, variant: int) -> None:
        """Calls from now on are in Python state number ``variant`` (the front's numbering)."""
        self.variant = variant
        self._token = (None, variant)

    @staticmethod
    def difference(captured: Tuple[Any, ...], now: Tuple[Any, ...]) -> Tuple[str, str]:
        """``("autocast", words)``: what differs between two tokens, for the eager reason and
        ``stats()["guard_failures"]``."""
        if captured[0] != now[0]:
            return "autocast", f"{describe_autocast(now[0])} (captured under {describe_autocast(captured[0])})"
        return "python_state", f"Python state {now[1]} (captured in state {captured[1]})"
