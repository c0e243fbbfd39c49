"""The packed integer arena behind host-built batches.

Every integer field of a step lives in one host tensor (pinned when the batch goes to a CUDA
device) and one device tensor of the same layout, so a step is staged with a single copy. There are
two host arenas, used in turn (as vLLM double-buffers its staging): the host fills the next step's
while the copy of the last one may still read it, and waits only for the copy of two steps ago.
A caller may add regions of its own: ``extra_regions`` are staged with the rest (the engine's slot
table writes, its sampling rows), ``result_regions`` lie past the staged prefix and carry what a step
computed back to the host (``copy_back``: one non-blocking copy into the arena the step was staged
from; ``read_back``: its one wait).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata

logger = logging.getLogger(__name__)

ARENA_DTYPE = torch.int64
SCRATCH_SLOT = 0  # reserved KV slot that dummy/padding tokens write to
DUMMY_REQ_POOL_INDEX = 0  # reserved ReqToTokenPool row for dummy/padding requests

TOKEN_REGIONS = ("input_ids", "positions", "out_cache_loc")
REQUEST_REGIONS = ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens", "logits_indices")


@dataclass
class CopyBack:
    """A result on its way to the host: ``count`` values of a result region of host arena ``arena``, and
    the event recorded after its copy (None off CUDA: the copy completed on the host)."""

    name: str
    arena: int
    count: int
    event: Optional[Any]


@dataclass
class InputBuffers:
    """Two packed host integer arenas (pinned on CUDA), used in turn, and one device arena of the same layout.

    Regions (each ``int64``): ``query_start_loc`` [max_num_reqs + 1]; per request
    ``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``, ``extend_prefix_lens``,
    ``logits_indices``; per token ``input_ids``, ``positions``, ``out_cache_loc``; last,
    ``block_table`` [max_num_reqs, max_blocks_per_req], so a step's single copy stops after the
    block-table rows it uses. ``sampling`` rows stay in pageable host memory: copying them to the
    device completes on the host, so the builder may rewrite them right after ``sample()``.
    ``host_arena``/``host_views`` are the arena the host writes now; after ``stage()`` the next write
    (``wait_host_free``) turns to the other one, waiting for the copy last staged from it (two steps
    ago) only, unless a result read back into that arena since ended it; ``copy_events`` (CUDA) mark
    each arena's last copy, ``result_events`` each arena's last copy back. ``regions``: each region's
    ``(offset, size)`` in the arenas.
    """

    max_num_reqs: int
    max_num_tokens: int
    max_blocks_per_req: int
    block_size: int
    host_arena: torch.Tensor
    device_arena: torch.Tensor
    host_views: Dict[str, np.ndarray]
    device_views: Dict[str, torch.Tensor]
    sampling: SamplingMetadata
    inputs_embeds: Optional[torch.Tensor] = None
    host_arenas: List[torch.Tensor] = field(default_factory=list, repr=False)  # both, the current one among them
    host_views_each: List[Dict[str, np.ndarray]] = field(default_factory=list, repr=False)
    copy_events: List[Optional[Any]] = field(default_factory=lambda: [None, None], repr=False)
    _current: int = field(default=0, repr=False)
    _staged: bool = field(default=False, repr=False)  # the current arena was copied: the next write turns
    _pending: List[bool] = field(default_factory=lambda: [False, False], repr=False)
    regions: Dict[str, Tuple[int, int]] = field(default_factory=dict, repr=False)
    result_events: List[Optional[Any]] = field(default_factory=lambda: [None, None], repr=False)

    @classmethod
    def allocate(
        cls,
        max_num_reqs: int,
        max_num_tokens: int,
        embed_dim: Optional[int] = None,
        max_blocks_per_req: int = 0,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        block_size: int = 16,
        extra_regions: Optional[Mapping[str, int]] = None,
        result_regions: Optional[Mapping[str, int]] = None,
        events: Optional[bool] = None,
    ) -> "InputBuffers":
        """Allocate both arenas once; ``embed_dim`` adds an ``inputs_embeds`` [max_num_tokens, embed_dim] buffer;
        ``extra_regions`` / ``result_regions`` (name -> entries) add regions staged with the rest / copied back;
        ``events``: mark copies with CUDA events (default: when ``device`` is a CUDA device)."""
        for name, value, low in (("max_num_reqs", max_num_reqs, 1), ("max_num_tokens", max_num_tokens, 1),
                                 ("max_blocks_per_req", max_blocks_per_req, 0), ("block_size", block_size, 1)):
            if type(value) is not int or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        device = torch.device(device)
        extra, results = dict(extra_regions or {}), dict(result_regions or {})
        for name, size in (*extra.items(), *results.items()):
            if type(size) is not int or size < 0:
                raise ValueError(f"{name}: expected a region size (an int >= 0), got {size!r}")
        sizes = {"query_start_loc": max_num_reqs + 1, **dict.fromkeys(REQUEST_REGIONS, max_num_reqs),
                 **dict.fromkeys(TOKEN_REGIONS, max_num_tokens), **extra,
                 "block_table": max_num_reqs * max_blocks_per_req, **results}
        if len(sizes) != len(REQUEST_REGIONS) + len(TOKEN_REGIONS) + 2 + len(extra) + len(results):
            raise ValueError(f"extra_regions/result_regions: names must be new, got {sorted(extra)} and {sorted(results)}")
        pin = device.type == "cuda" and torch.cuda.is_available()
        host_arenas = [torch.zeros(sum(sizes.values()), dtype=ARENA_DTYPE, pin_memory=pin) for _ in range(2)]
        device_arena = torch.zeros_like(host_arenas[0], device=device)
        host_views_each = [_views(arena.numpy(), sizes, max_num_reqs, max_blocks_per_req) for arena in host_arenas]
        device_views = _views(device_arena, sizes, max_num_reqs, max_blocks_per_req)
        embeds = None if embed_dim is None else torch.zeros(max_num_tokens, embed_dim, dtype=dtype, device=device)
        logger.debug("InputBuffers: %d-entry arenas on %s (pinned=%s)", device_arena.numel(), device, pin)
        marked = device.type == "cuda" if events is None else events
        offsets = itertools.accumulate(sizes.values(), initial=0)
        return cls(max_num_reqs, max_num_tokens, max_blocks_per_req, block_size, host_arenas[0], device_arena,
                   host_views_each[0], device_views, SamplingMetadata.from_defaults(max_num_reqs), embeds,
                   host_arenas, host_views_each, [torch.cuda.Event() if marked else None for _ in range(2)],
                   regions={name: (offset, size) for (name, size), offset in zip(sizes.items(), offsets)},
                   result_events=[torch.cuda.Event() if marked else None for _ in range(2)])

    @property
    def device(self) -> torch.device:
        """Where the batch tensors live."""
        return self.device_arena.device

    def reset(self) -> None:
        """Zero every arena and embeddings and restore neutral sampling rows."""
        for index in range(2):
            self._wait_copied(index)
            self.host_arenas[index].zero_()
        self.device_arena.zero_()
        if self.inputs_embeds is not None:
            self.inputs_embeds.zero_()
        for name, default in SAMPLING_DEFAULTS.items():
            getattr(self.sampling, name).fill_(default)

    def stage(self, num_reqs: int) -> None:
        """Copy the used prefix of the current host arena to the device: one non-blocking ``copy_``."""
        end = self.device_views["block_table"].storage_offset() + num_reqs * self.max_blocks_per_req
        self.device_arena[:end].copy_(self.host_arena[:end], non_blocking=True)
        event = self.copy_events[self._current]
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))  # the copy's stream: the arena device's
            self._pending[self._current] = True
        self._staged = True

    def copy_back(self, name: str, source: torch.Tensor) -> CopyBack:
        """Start copying ``source`` (device values, at most the region's size) into result region ``name`` of
        the host arena this step was staged from: one non-blocking copy; ``read_back`` waits for it."""
        offset, size = self.regions[name]
        count = source.shape[0]
        if count > size:
            raise ValueError(f"{name}: {count} values do not fit its {size}-entry region")
        self.host_arena[offset:offset + count].copy_(source, non_blocking=True)
        event = self.result_events[self._current]
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))  # the copy's stream: the arena device's
        return CopyBack(name, self._current, count, event)

    def read_back(self, copied: CopyBack) -> List[int]:
        """The values ``copy_back`` started copying, as Python ints: the host waits for that copy only
        (which also ends the wait for the staging copy before it from the same arena)."""
        if copied.event is not None:
            copied.event.synchronize()
        self._pending[copied.arena] = False
        return self.host_views_each[copied.arena][copied.name][:copied.count].tolist()

    def wait_host_free(self) -> None:
        """Before writing the host arena: after a ``stage()``, turn to the other arena, and wait for the
        copy last staged from it (two steps ago) to finish reading it."""
        if self._staged:
            self._current, self._staged = 1 - self._current, False
            self.host_arena, self.host_views = self.host_arenas[self._current], self.host_views_each[self._current]
        self._wait_copied(self._current)

    def _wait_copied(self, index: int) -> None:
        if self._pending[index]:
            self.copy_events[index].synchronize()
            self._pending[index] = False


def _views(arena: Any, sizes: Dict[str, int], max_num_reqs: int, max_blocks_per_req: int) -> Dict[str, Any]:
    """Each region of ``arena`` (a tensor or a numpy array) by name, the block table as a matrix."""
    views, offset = {}, 0
    for name, size in sizes.items():
        views[name] = arena[offset:offset + size]
        offset += size
    views["block_table"] = views["block_table"].reshape(max_num_reqs, max_blocks_per_req)
    return views
