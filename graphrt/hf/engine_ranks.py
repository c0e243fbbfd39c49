"""The ranks of a tensor-parallel engine, and what they agree on beyond each step's lockstep agreement.

Every rank of the group runs the same engine on its shard of the model, so every rank must serve the
same steps: the same calls with the same arguments (``agree_call``: one gather per call, before any
step, so a call one rank refuses is refused on every rank and ranks called differently raise together)
and the same tokens (``share_tokens``: rank 0's chosen tokens broadcast after each step, so a request's
next input, and whether it stops, never differ between ranks). Both run on the gloo group the runners'
lockstep agreements use (``cpu_group``): host tensors and objects, never a device wait. A peer that died
or does not come within that group's timeout makes them raise ``PeerLostError``. A peer lost inside a
step's replay is the runners' (``Lockstep.replayed``: on CUDA graphrt's watchdog waits for the replay up to
the model group's timeout), so the host read of a step's tokens before ``share_tokens`` never waits on a
collective that cannot complete.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from graphrt.parallel.lockstep import PeerLostError, agreement_group


@dataclass
class EngineRanks:
    """The model's process group, the gloo group of the engine's agreements, this rank in them."""

    group: Any
    cpu_group: Any
    rank: int
    world_size: int

    @classmethod
    def create(cls, group: Any, cpu_group: Optional[Any], timeout_s: float) -> "EngineRanks":
        """The engine's ranks over ``group``: agreements on ``cpu_group`` if given, on ``group`` if it is gloo,
        else on a gloo group created over its ranks (collective: every rank builds its engine at the same
        point) whose collectives give up after ``timeout_s`` seconds."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialized (call init_process_group first)")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        agreed = agreement_group(group, cpu_group, datetime.timedelta(seconds=timeout_s))
        return cls(group, agreed, dist.get_rank(group), dist.get_world_size(group))

    def agree_call(self, call: str, error: Optional[Exception], arguments: Any) -> None:
        """Before any step of ``call``: this rank's refusal (``error``) and a digest of its ``arguments``,
        gathered from every rank. Raises this rank's own error, else ValueError when another rank refused
        the call or was called with other arguments; returns when every rank may serve it."""
        digest = hashlib.sha256(repr(arguments).encode()).hexdigest()
        mine = (None if error is None else f"{type(error).__name__}: {error}", digest)
        gathered: List[Any] = [None] * self.world_size
        with torch.inference_mode(False):  # gloo's worker threads may not see inference mode (pytorch#126032)
            try:
                dist.all_gather_object(gathered, mine, group=self.cpu_group)
            except RuntimeError as lost:
                raise PeerLostError(f"{call}: rank {self.rank} lost its peers agreeing on the call: {lost}") from lost
        if error is not None:
            raise error
        refused = [f"rank {self._global(index)}: {text}" for index, (text, _) in enumerate(gathered) if text]
        if refused:
            raise ValueError(f"{call}: refused on {'; '.join(refused)} (every rank refuses what one rank refuses)")
        if len({digest for _, digest in gathered}) > 1:
            raise ValueError(f"{call}: ranks were called with different arguments; every rank of a tensor-parallel "
                             "engine must make the same calls with the same arguments")

    def share_tokens(self, tokens: List[int]) -> List[int]:
        """Rank 0's tokens of a step, on every rank (one broadcast of a host int64 tensor; alone: its own)."""
        if self.world_size == 1:
            return tokens
        with torch.inference_mode(False):
            shared = torch.tensor(tokens, dtype=torch.int64)
            try:
                dist.broadcast(shared, src=self._global(0), group=self.cpu_group)
            except RuntimeError as lost:
                raise PeerLostError(f"rank {self.rank} lost its peers sharing a step's tokens: {lost}") from lost
        return shared.tolist()

    def _global(self, index: int) -> int:
        return dist.get_global_rank(self.cpu_group, index)


__all__ = ["EngineRanks"]
