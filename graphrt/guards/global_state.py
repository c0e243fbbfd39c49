"""The global state a recorded step depends on and a replay cannot see: autocast and ``training`` flags.

A graph freezes what the step's Python read at capture: under ``torch.autocast`` the casts are
recorded ops, and a module's ``training`` flag picked dropout's branch. A replay under another
state would silently compute the captured one. ``StateWatch.token()`` names the state of one
call in a value that compares equal exactly when a graph captured under one may serve the other;
it is cheap enough for every call: one C call while no autocast is on, and one integer compare
while no module's ``train()``/``eval()`` ran since the last call (graphrt counts those calls
process-wide; a flag assigned directly is seen on the root modules only).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

# Device types whose autocast state is read (torch.amp's own list of autocast-capable devices).
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")
# Module.train() calls made in this process since graphrt started counting (a list: one cell, read by index).
TRAIN_CALLS = [0]
_any_autocast = torch._C._is_any_autocast_enabled


def count_train_calls() -> None:
    """Make every ``Module.train()`` (and so ``eval()``) call bump ``TRAIN_CALLS`` (idempotent):
    a graph captured in one mode must not replay in the other, and reading every module's flag
    on every call would cost more than the replay of a small model."""
    original: Callable[..., Any] = torch.nn.Module.train
    if getattr(original, "_graphrt_counts_calls", False):
        return

    @functools.wraps(original)
    def train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        if not torch.compiler.is_compiling():  # a global torch.compile traced would be guarded on
            TRAIN_CALLS[0] += 1
        return original(self, mode)

    train._graphrt_counts_calls = True  # type: ignore[attr-defined]
    torch.nn.Module.train = train  # type: ignore[method-assign]


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
    """The state token of each call of one model: autocast, then the modules under ``roots`` that
    are in training mode (by identity). A module added in eval mode (``watch_also``: a model passed
    as an argument) changes no token, so the layouts opened before it still match. The token object
    is reused while nothing changed, so equal states usually compare by identity."""

    def __init__(self, roots: Sequence[torch.nn.Module]) -> None:
        count_train_calls()
        self.roots = tuple(roots)
        self._seen_calls = -1
        self._root_flags: Tuple[bool, ...] = ()
        self._training: FrozenSet[int] = frozenset()
        self._token: Tuple[Any, ...] = (None, self._training)

    def token(self) -> Tuple[Any, ...]:
        """``(autocast_state(), ids of the modules in training mode)`` for the call about to run."""
        if TRAIN_CALLS[0] != self._seen_calls or self.roots and self._root_flag_assigned():
            self._read_training()
        if not _any_autocast():
            return self._token
        return autocast_state(), self._training

    def _root_flag_assigned(self) -> bool:
        """Whether a root's flag was assigned without ``train()`` since it was read."""
        return any([root.training is not flag for root, flag in zip(self.roots, self._root_flags)])

    def watch_also(self, modules: Sequence[torch.nn.Module]) -> Optional[Callable[[Any], Any]]:
        """Add roots (modules a call passes in): their flags join the token from the next call on.
        Returns how to re-express a token read before in the new terms (the added modules in
        training mode joined as they are now), or None when such tokens stay valid as they are."""
        known = {id(root) for root in self.roots}
        added = [module for module in modules if id(module) not in known]
        if not added:
            return None
        self.roots = (*self.roots, *added)
        self._seen_calls = -1
        training = frozenset(id(module) for root in added for module in root.modules() if module.training)
        if not training:
            return None
        return lambda token: (token[0], token[1] | training)

    def _read_training(self) -> None:
        self._seen_calls = TRAIN_CALLS[0]
        self._root_flags = tuple(root.training for root in self.roots)
        training = frozenset(id(module) for root in self.roots for module in root.modules() if module.training)
        if training != self._training:
            self._training = training
            self._token = (None, training)

    def difference(self, captured: Tuple[Any, ...], now: Tuple[Any, ...]) -> Tuple[str, str]:
        """``("autocast" | "training", words)``: what differs between two tokens, for the eager
        reason and ``stats()["guard_failures"]``."""
        if captured[0] != now[0]:
            return "autocast", f"{describe_autocast(now[0])} (captured under {describe_autocast(captured[0])})"
        flipped = captured[1] ^ now[1]
        names: Dict[int, str] = {}
        for root in self.roots:
            for name, module in root.named_modules():
                names.setdefault(id(module), name or type(root).__name__)
        changed: List[str] = [name for key, name in names.items() if key in flipped]
        mode = "train" if now[1] - captured[1] else "eval"
        where = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        return "training", f"{mode} mode ({where or 'the modules changed'}; captured in the other mode)"


def module_roots(*objects: Any) -> List[torch.nn.Module]:
    """The modules among ``objects`` and the modules behind them (a bound method's ``__self__``,
    a function's closure cells and the globals its code names, a callable object's attributes),
    each once: what a wrapped function runs, so whose ``training`` flags and bindings its graphs
    depend on."""
    found: List[torch.nn.Module] = []
    seen: set = set()

    def add(value: Any) -> None:
        if isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)

    for obj in objects:
        add(obj)
        add(getattr(obj, "__self__", None))
        if callable(obj) and not isinstance(obj, (torch.nn.Module, type)) and hasattr(obj, "__dict__") and not (
                hasattr(obj, "__code__") or hasattr(obj, "__func__")):  # a callable object: its modules
            for value in vars(obj).values():
                add(value)
        function = getattr(obj, "__func__", obj)
        for cell in getattr(function, "__closure__", None) or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        code, names = getattr(function, "__code__", None), getattr(function, "__globals__", None)
        if code is not None and names is not None:
            for name in code.co_names:
                add(names.get(name))
    nested = {id(module) for root in found for module in root.modules() if module is not root}
    return [root for root in found if id(root) not in nested]
