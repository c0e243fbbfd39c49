"""The packed integer arena behind host-built batches.

Every integer field of a step lives in one host tensor (pinned when the batch goes to a CUDA
device) and one device tensor of the same layout, so a step is staged with a single copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

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
    """One packed host integer arena (pinned on CUDA) and one device arena of the same layout.

    Regions (each ``int64``): ``query_start_loc`` [max_num_reqs + 1]; per request
    ``req_pool_indices``, ``seq_lens``, ``extend_seq_lens``, ``extend_prefix_lens``,
    ``logits_indices``; per token ``input_ids``, ``positions``, ``out_cache_loc``; last,
    ``block_table`` [max_num_reqs, max_blocks_per_req], so a step's single copy stops after the
    block-table rows it uses. ``sampling`` rows stay in pageable host memory: copying them to the
    device completes on the host, so the builder may rewrite them right after ``sample()``.
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
    _copy_done: Optional[Any] = field(default=None, repr=False)
    _copy_pending: bool = field(default=False, repr=False)

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
        host_arena = torch.zeros(sum(sizes.values()), dtype=ARENA_DTYPE, pin_memory=pin)
        device_arena = torch.zeros_like(host_arena, device=device)
        host_np = host_arena.numpy()
        host_views, device_views, offset = {}, {}, 0
        for name, size in sizes.items():
            host_views[name] = host_np[offset:offset + size]
            device_views[name] = device_arena[offset:offset + size]
            offset += size
        host_views["block_table"] = host_views["block_table"].reshape(max_num_reqs, max_blocks_per_req)
        device_views["block_table"] = device_views["block_table"].view(max_num_reqs, max_blocks_per_req)
        embeds = None if embed_dim is None else torch.zeros(max_num_tokens, embed_dim, dtype=dtype, device=device)
        logger.debug("InputBuffers: %d-entry arena on %s (pinned=%s)", offset, device, pin)
        return cls(max_num_reqs, max_num_tokens, max_blocks_per_req, block_size, host_arena, device_arena,
                   host_views, device_views, SamplingMetadata.from_defaults(max_num_reqs), embeds,
                   torch.cuda.Event() if device.type == "cuda" else None)

    @property
    def device(self) -> torch.device:
        """Where the batch tensors live."""
        return self.device_arena.device

    def reset(self) -> None:
        """Zero both arenas and embeddings and restore neutral sampling rows."""
        self.wait_host_free()
        self.host_arena.zero_()
        self.device_arena.zero_()
        if self.inputs_embeds is not None:
            self.inputs_embeds.zero_()
        for name, default in SAMPLING_DEFAULTS.items():
            getattr(self.sampling, name).fill_(default)

    def stage(self, num_reqs: int) -> None:
        """Copy the used prefix of the host arena to the device: one non-blocking ``copy_``."""
        end = self.device_views["block_table"].storage_offset() + num_reqs * self.max_blocks_per_req
        self.device_arena[:end].copy_(self.host_arena[:end], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
            self._copy_pending = True

    def wait_host_free(self) -> None:
        """Before rewriting the host arena, wait for the last host-to-device copy to finish reading it."""
        if self._copy_pending:
            self._copy_done.synchronize()
            self._copy_pending = False
