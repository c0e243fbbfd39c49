"""Lockstep across ranks: every rank of a process group runs each step at the same padded size.

Collectives inside the model (tensor- or expert-parallel all-reduce, all-gather) need equal
shapes on every rank, and a rank must never replay a graph while another runs eagerly. Before
each step the ranks therefore agree, with one all-reduce MAX of a small preallocated int64
tensor, on the padded size (the maximum over ranks of real tokens and requests), the forward
mode, whether some rank must run eagerly, and which graph keys are not ready on some rank.
Ranks with no work take part with an all-padding step of the agreed size.

Every agreement runs on a CPU (gloo) group, whatever backend the model's collectives use: a host
tensor reduced on the host never waits for the device's queue, so a step never synchronizes with
the previous replay. At capture, the ranks agree after each phase of each key
(``Lockstep.agree_capture``), so a key that fails on one rank fails on every rank and no rank runs
the collectives of a phase the others skip.

Tensor layout: ``[tokens, requests, must_eager, mode, -mode, steps, -steps, not_ready(key) for each
key]``. An idle rank sends mode 0 and ``-mode`` = ``NO_MODE``, so after the MAX ``mode`` is the largest
and ``-(-mode)`` the smallest mode among working ranks: they differ only if working ranks disagree.
``steps`` is the call's decode steps (1 for a single step, ``K`` for ``decode(batch, K)`` or
``idle_step(K)``), sent by idle ranks too: ranks making different calls disagree on it and raise.

A collective of an agreement that fails (a peer died, or did not reach it within the group's
timeout) raises ``PeerLostError`` naming the rank and the agreement, instead of the backend's words only.
So does a replay (``replayed``) whose collectives fail on the host (gloo), or that does not complete on
the device within the model group's timeout (CUDA: graphrt's watchdog, graphrt/parallel/watchdog.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from graphrt.backends.base import CollectiveError
from graphrt.batch import REQUEST_FIELDS, TOKEN_FIELDS, ForwardBatch, ForwardMode
from graphrt.entry import EagerReason, GraphEntry, GraphKey, GraphStatus
from graphrt.parallel.watchdog import ReplayTimeout, ReplayWatchdog, group_timeout_s
from graphrt.registry import Decision

logger = logging.getLogger(__name__)

HEADER = 7  # tokens, requests, must_eager, mode, -mode, steps, -steps
NO_MODE = -(1 << 30)
TOKEN_PADDED = tuple(spec.name for spec in TOKEN_FIELDS)
REQUEST_PADDED = tuple(spec.name for spec in REQUEST_FIELDS)
# Local reasons that hold whatever the agreed size: one such rank makes every rank run eagerly.
SIZE_INDEPENDENT = frozenset({
    EagerReason.GRAPHS_DISABLED, EagerReason.UNSUPPORTED_FIELD,
    EagerReason.CONTEXT_MISMATCH, EagerReason.MODE_NOT_CAPTURED,
    # Guards: this rank's call differs from the state its keys were captured under, whatever the size.
    EagerReason.AUTOCAST, EagerReason.TRAINING, EagerReason.PYTHON_STATE, EagerReason.HOOKS,
    EagerReason.MODULE_MOVED, EagerReason.REBOUND_STATE, EagerReason.ALIASED_INPUTS,
})


def pad_forward_batch(
    batch: ForwardBatch, num_tokens: int, num_reqs: int, pad_values: Mapping[str, int]
) -> ForwardBatch:
    """``batch`` padded eagerly to ``num_tokens``/``num_reqs`` rows the way graph staging pads.

    ``pad_values`` gives the fill of each of ``TOKEN_PADDED`` and ``REQUEST_PADDED``; ``seq_lens_sum`` and ``seq_lens_cpu``
    include the padding requests; extend padding requests have no tokens and start where the real
    tokens end, so start offsets never decrease. Other fields are kept as they are.
    """
    real_tokens, real_reqs = batch.num_tokens, batch.batch_size
    if type(num_tokens) is not int or num_tokens < real_tokens:
        raise ValueError(f"num_tokens: expected an int >= the batch's {real_tokens} tokens, got {num_tokens!r}")
    if type(num_reqs) is not int or num_reqs < real_reqs:
        raise ValueError(f"num_reqs: expected an int >= the batch's {real_reqs} requests, got {num_reqs!r}")
    missing = [name for name in TOKEN_PADDED + REQUEST_PADDED if name not in pad_values]
    if missing:
        raise ValueError(f"pad_values: missing {missing}")

    def pad(tensor: Optional[torch.Tensor], rows: int, value: int) -> Optional[torch.Tensor]:
        if tensor is None or tensor.shape[0] == rows:
            return tensor
        filler = torch.full((rows - tensor.shape[0],), value, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, filler])

    extra_reqs = num_reqs - real_reqs
    fields = {name: pad(getattr(batch, name), num_tokens, pad_values[name]) for name in TOKEN_PADDED}
    fields.update({name: pad(getattr(batch, name), num_reqs, pad_values[name]) for name in REQUEST_PADDED})
    fields["seq_lens_cpu"] = pad(batch.seq_lens_cpu, num_reqs, pad_values["seq_lens"])
    fields["seq_lens_sum"] = batch.seq_lens_sum + extra_reqs * pad_values["seq_lens"]
    if batch.forward_mode.is_extend():
        fields.update(
            extend_num_tokens=num_tokens,
            extend_seq_lens=pad(batch.extend_seq_lens, num_reqs, 0),
            extend_prefix_lens=pad(batch.extend_prefix_lens, num_reqs, 0),
            extend_start_loc=pad(batch.extend_start_loc, num_reqs, real_tokens),
            extend_seq_lens_cpu=None if batch.extend_seq_lens_cpu is None
            else list(batch.extend_seq_lens_cpu) + [0] * extra_reqs,
            extend_prefix_lens_cpu=None if batch.extend_prefix_lens_cpu is None
            else list(batch.extend_prefix_lens_cpu) + [0] * extra_reqs,
        )
    return dataclasses.replace(batch, batch_size=num_reqs, **fields)


def empty_batch(mode: ForwardMode, device: torch.device) -> ForwardBatch:
    """A batch of ``mode`` with no rows: what an idle rank pads to the agreed size."""

    def empty(dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=device)

    extend = mode.is_extend()
    return ForwardBatch(
        forward_mode=mode, batch_size=0, input_ids=empty(), req_pool_indices=empty(),
        seq_lens=empty(torch.int32), out_cache_loc=empty(), seq_lens_sum=0, positions=empty(),
        extend_num_tokens=0 if extend else None,
        extend_seq_lens=empty(torch.int32) if extend else None,
        extend_prefix_lens=empty(torch.int32) if extend else None,
        extend_start_loc=empty(torch.int32) if extend else None,
    )


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on for one step (identical on all ranks)."""

    mode: Optional[ForwardMode]  # None: every rank is idle, nothing runs
    num_tokens: int
    num_reqs: int
    any_eager: bool  # some rank must run eagerly whatever the size
    unready: FrozenSet[GraphKey]  # keys not replayable on some rank
    steps: int = 1  # decode steps of the call (decode() launches: more than one)

    def decide(
        self, lookup: Callable[[ForwardMode, int, int], Decision], local_reason: Optional[EagerReason]
    ) -> Decision:
        """Graph or eager at the agreed size: the same answer on every rank (reasons may differ)."""
        if self.any_eager:
            return Decision(None, local_reason or EagerReason.PEER_EAGER)
        decision = lookup(self.mode, self.num_tokens, self.num_reqs)
        if decision.reason is None and decision.entry.key in self.unready:
            return Decision(decision.entry, EagerReason.PEER_EAGER)
        return decision


class PeerCaptureError(RuntimeError):
    """A phase of a key's capture failed on another rank, so the key fails here too."""


class PeerLostError(RuntimeError):
    """An agreement's collective failed: a peer died, or did not reach it within the group's timeout."""


def agreement_group(group: Any, cpu_group: Optional[Any] = None, timeout: Optional[datetime.timedelta] = None) -> Any:
    """The gloo group the ranks of ``group`` agree on: ``cpu_group`` if given (same ranks, not
    NCCL), ``group`` itself if it is gloo, else a new gloo group over ``group``'s ranks (its collectives
    give up after ``timeout``; default: torch's for gloo, 30 minutes).

    Creating a group is collective: every rank of ``group`` must reach this call (build its
    runner) at the same point, after creating the same groups before it.
    """
    ranks = dist.get_process_group_ranks(group)
    if cpu_group is not None:
        if cpu_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"cpu_group: expected the ranks of process_group {ranks}, got a group without this rank")
        if dist.get_backend(cpu_group) == "nccl":
            raise ValueError("cpu_group: expected a group that reduces host tensors (gloo), got an NCCL group")
        if sorted(dist.get_process_group_ranks(cpu_group)) != sorted(ranks):
            raise ValueError(f"cpu_group: expected the ranks of process_group {ranks}, "
                             f"got {dist.get_process_group_ranks(cpu_group)}")
        return cpu_group
    if dist.get_backend(group) == "gloo":
        return group
    # Only the members call new_group (non-members of a data-parallel subgroup build no runner here).
    created = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)
    logger.info("lockstep: created a gloo group over ranks %s for the per-step agreement", ranks)
    return created


def key_id(key: GraphKey) -> int:
    """A number naming ``key`` identically in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(str(key).encode())


class Lockstep:
    """The agreements of one runner's ranks, on a CPU (gloo) group: configuration at build/retune,
    one per phase of each key's capture, one all-reduce per step."""

    def __init__(self, group: Any, cpu_group: Optional[Any] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialized (call init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.cpu_group = agreement_group(group, cpu_group)
        self._cpu_rank = dist.get_rank(self.cpu_group)
        self.watchdog: Optional[ReplayWatchdog] = None  # armed for replays on the device (``watch_replays``)
        self.bind_keys(())

    def watch_replays(self, device: torch.device) -> None:
        """Replays on CUDA ``device``: each one's completion is awaited up to the model group's timeout
        (graphrt/parallel/watchdog.py), since NCCL's watchdog does not see captured collectives."""
        self.watchdog = ReplayWatchdog(group_timeout_s(self.group), device)

    def replayed(self, replay: Callable[[], Any], what: str) -> Any:
        """``replay()``'s result, once it completed (watched); a collective of it failing on the host, or the
        replay not completing on the device within the timeout, is ``PeerLostError``."""
        try:
            result = replay()
            if self.watchdog is not None:
                self.watchdog.watch(what)
        except (CollectiveError, ReplayTimeout) as error:
            raise self._lost(what, error) from error
        return result

    def agree_sizes(self, sizes: Sequence[int], config: Any) -> List[int]:
        """Rank 0's capture sizes, adopted by every rank; ValueError on all ranks if ``config`` differs.

        ``config`` is everything else that shapes the graph keys and the collectives of their
        capture (max batch size, modes, extend sizes, warm-up calls, verification). One
        ``all_gather_object`` on the CPU group, at build and retune time only.
        """
        gathered: List[Any] = [None] * self.world_size
        with torch.inference_mode(False):  # gloo's worker threads may not see inference mode (pytorch#126032)
            dist.all_gather_object(gathered, (list(sizes), config), group=self.cpu_group)
        configs = [item[1] for item in gathered]
        if any(item != configs[0] for item in configs):
            raise ValueError("process_group: ranks disagree on max_batch_size/modes/extend_capture_sizes/"
                             f"warmup_iters/verify: {configs}")
        chosen = list(gathered[0][0])
        if chosen != list(sizes):
            logger.warning("rank %d: capture sizes %s replaced by rank 0's %s", self.rank, list(sizes), chosen)
        return chosen

    def bind_keys(self, keys: Sequence[GraphKey]) -> None:
        """Preallocate the per-step host tensor for these graph keys (same keys, same order, on every
        rank), outside inference mode so that gloo may write it from its worker threads."""
        self._keys: Tuple[GraphKey, ...] = tuple(sorted(keys))
        with torch.inference_mode(False):
            self._host = torch.zeros(HEADER + len(self._keys), dtype=torch.int64)
        self._values = self._host.numpy()

    def agree_step(
        self, batch: Optional[ForwardBatch], must_eager: bool, entries: Mapping[GraphKey, GraphEntry],
        steps: int = 1,
    ) -> StepAgreement:
        """The one collective of a step (or of a ``decode()`` launch of ``steps`` steps): all-reduce MAX,
        on the CPU group, of sizes, mode, eager flag, steps and key readiness. No device tensor, no
        copy, no wait for the device."""
        values = self._values
        if batch is None:
            values[:HEADER] = (0, 0, 0, 0, NO_MODE, steps, -steps)
        else:
            mode = int(batch.forward_mode)
            values[:HEADER] = (batch.num_tokens, batch.batch_size, int(must_eager), mode, -mode, steps, -steps)
        values[HEADER:] = [entries[key].status is not GraphStatus.READY for key in self._keys]
        self._all_reduce(self._host, "the step agreement")
        num_tokens, num_reqs, any_eager, high, low, most, fewest = (int(value) for value in values[:HEADER])
        if most != -fewest:
            raise ValueError(f"steps: ranks disagree ({-fewest} and {most} decode steps in one call); in lockstep every "
                             "rank makes the same call: runner(batch) or idle_step() for one step, "
                             "decode(batch, steps) or idle_step(steps) for a launch")
        if high == 0:
            return StepAgreement(None, 0, 0, False, frozenset(), steps)
        if high != -low:
            raise ValueError(
                f"forward_mode: ranks disagree ({ForwardMode(-low).name} and {ForwardMode(high).name}); "
                "in lockstep every rank with work must run the same mode"
            )
        unready = frozenset(self._keys[i] for i in np.flatnonzero(values[HEADER:]))
        return StepAgreement(ForwardMode(high), num_tokens, num_reqs, bool(any_eager), unready, steps)

    def _all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """All-reduce MAX of a host tensor on the CPU group (alone: the tensor is its own maximum);
        PeerLostError naming ``what`` if it fails."""
        if self.world_size == 1:
            return
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.cpu_group)
        except RuntimeError as error:
            raise self._lost(what, error) from error

    def _lost(self, what: str, error: BaseException) -> PeerLostError:
        return PeerLostError(
            f"lockstep: rank {self.rank} lost its peers at {what}: {type(error).__name__}: {error}. A peer died, "
            "hangs (the wait ends at the group's timeout) or stopped making the calls every rank must make")

    def agree_capture(self, entry: GraphEntry, phase: str, error: Optional[Exception]) -> Optional[Exception]:
        """After one phase of ``entry``'s capture (every rank calls it, ``error`` is this rank's):
        the error to fail the key with because the phase failed on another rank, else None.

        One all-reduce MAX of ``[failed, key, -key]``: the ranks also check that they are at the
        same key (else RuntimeError on every rank: their captures are out of step). Only when some
        rank failed, one ``all_gather_object`` of the errors, so the reason names each failed rank
        (its global rank) and its error.
        """
        ident = key_id(entry.key)
        with torch.inference_mode(False):
            flags = torch.tensor([error is not None, ident, -ident], dtype=torch.int64)
            self._all_reduce(flags, f"the {phase} agreement of {entry.key}")
        failed, high, low = flags.tolist()
        if high != -low:
            raise RuntimeError(f"capture: rank {self.rank} is at {entry.key} ({phase}) and another rank at another "
                               "key; every rank must capture the same keys in the same order")
        if not failed:
            return None
        errors: List[Optional[str]] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        with torch.inference_mode(False):
            dist.all_gather_object(errors, mine, group=self.cpu_group)
        peers = [f"rank {dist.get_global_rank(self.cpu_group, index)}: {text}"
                 for index, text in enumerate(errors) if text is not None and index != self._cpu_rank]
        if not peers:
            return None
        return PeerCaptureError(f"{phase} of {entry.key} failed on " + "; ".join(peers))
