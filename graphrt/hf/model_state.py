"""What an engine's probe read from its model, to tell when it may have gone stale.

The engine path probes the model once at build (graphrt.hf.engine_probe): each layer's key and value
shapes and dtype, its window, its KV sharing, its rotary frequencies. Those follow from the model's
config (Mistral reads ``config.sliding_window`` on every forward) and from its tensors' dtypes and
devices (``model.to(torch.bfloat16)``). ``ModelState`` keeps both as they were at the probe and names
what differs now: the config's values (``to_dict()``, nested values by dotted names) and the dtype and
device of every parameter and buffer, read through the tables that hold them (``_apply`` replaces a
module's buffers, so the tensors themselves would go stale).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

import torch

SHOWN = 3  # changed config values named in full; the rest counted


class ModelState:
    """``model``'s config values and tensors' dtypes and devices now; ``changes()`` names what differs later."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._tables: List[Tuple[str, Dict[str, Any], str]] = [
            (f"{path}.{name}" if path else name, table, name) for path, module in model.named_modules()
            for table in (module._parameters, module._buffers) for name in table]
        self.config = self._config()
        self.tensors = self._tensors()

    def changes(self) -> List[str]:
        """What differs from the state at construction, in words (empty: nothing)."""
        config, tensors = self._config(), self._tensors()
        found = []
        if config != self.config:
            differing = [key for key in sorted(set(config) | set(self.config))
                         if config.get(key) != self.config.get(key)]
            found += [f"config.{key}: {self.config.get(key)!r} -> {config.get(key)!r}" for key in differing[:SHOWN]]
            if len(differing) > SHOWN:
                found.append(f"{len(differing) - SHOWN} more config values")
        if tensors != self.tensors:
            moved: Counter = Counter()
            first: Dict[Any, str] = {}
            for (path, _, _), before, now in zip(self._tables, self.tensors, tensors):
                if before != now:
                    moved[(before, now)] += 1
                    first.setdefault((before, now), path)
            for (before, now), count in moved.items():
                found.append(f"{count} parameters and buffers {_where(before)} -> {_where(now)} (first "
                             f"{first[(before, now)]})")
        return found

    def accept(self) -> None:
        """Take the state of now as the state read (in place: a runner's guards bound it at capture)."""
        self.config, self.tensors = self._config(), self._tensors()

    def _config(self) -> Dict[str, Any]:
        return _flat(self._model.config.to_dict())

    def _tensors(self) -> Tuple[Any, ...]:
        return tuple(None if table.get(name) is None else (table[name].dtype, table[name].device)
                     for _, table, name in self._tables)


def _flat(values: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested dicts as one level of dotted keys (``rope_parameters.factor``)."""
    flat: Dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _where(state: Any) -> str:
    if state is None:
        return "none"
    dtype, device = state
    return f"{str(dtype).replace('torch.', '')} on {device}"


__all__ = ["ModelState"]
