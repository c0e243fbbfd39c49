"""The packed integer arena behind host-built batches.

Every integer field of a step lives in one host tensor (pinned when the batch goes to a CUDA
device) and one device tensor of the same layout, so a step is staged with a single copy. There are
two host arenas, used in turn (as vLLM double-buffers its staging): the host fills the next step's
while the copy of the last one may still read it, and waits only for the copy of two steps ago.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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
    ago) only; ``copy_events`` (CUDA) mark each arena's last copy.
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
    ) -> "InputBuffers":
        """Allocate both arenas once; ``embed_dim`` adds an ``inputs_embeds`` [max_num_tokens, embed_dim] buffer."""
        for name, value, low in (("max_num_reqs", max_num_reqs, 1), ("max_num_tokens", max_num_tokens, 1),
                                 ("max_blocks_per_req", max_blocks_per_req, 0), ("block_size", block_size, 1)):
            if type(value) is not int or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        device = torch.device(device)
        sizes = {"query_start_loc": max_num_reqs + 1, **dict.fromkeys(REQUEST_REGIONS, max_num_reqs),
                 **dict.fromkeys(TOKEN_REGIONS, max_num_tokens), "block_table": max_num_reqs * max_blocks_per_req}
        pin = device.type == "cuda" and torch.cuda.is_available()
        host_arenas = [torch.zeros(sum(sizes.values()), dtype=ARENA_DTYPE, pin_memory=pin) for _ in range(2)]
        device_arena = torch.zeros_like(host_arenas[0], device=device)
        host_views_each = [_views(arena.numpy(), sizes, max_num_reqs, max_blocks_per_req) for arena in host_arenas]
        device_views = _views(device_arena, sizes, max_num_reqs, max_blocks_per_req)
        embeds = None if embed_dim is None else torch.zeros(max_num_tokens, embed_dim, dtype=dtype, device=device)
        logger.debug("InputBuffers: %d-entry arenas on %s (pinned=%s)", device_arena.numel(), device, pin)
        events = [torch.cuda.Event() if device.type == "cuda" else None for _ in range(2)]
        return cls(max_num_reqs, max_num_tokens, max_blocks_per_req, block_size, host_arenas[0], device_arena,
                   host_views_each[0], device_views, SamplingMetadata.from_defaults(max_num_reqs), embeds,
                   host_arenas, host_views_each, events)

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
