"""TorchNativeAttnBackend: paged attention in plain torch ops with static shapes.

Every token ``t`` of a batch belongs to a request ``r(t)`` and sits at absolute
position ``p(t)``; it attends the KV slots ``req_to_token[req_pool_indices[r(t)], 0..p(t)]``.
Metadata is one gather of slot indices ``[num_tokens, max_context_len]`` and a
boolean mask from a fixed arange, so the attention itself has no data-dependent
shape and no host synchronization: a CUDA graph can capture it, and the replay
hook refreshes the metadata in place before each replay (SGLang's flow).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.reference.kv_cache import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)


@dataclass
class AttnMetadata:
    """What attention reads for one batch: per-token KV slot indices and a validity mask."""

    kv_indices: torch.Tensor  # [num_tokens, max_context_len] KV slots (the req_to_token dtype)
    mask: torch.Tensor  # [num_tokens, max_context_len] bool, True where the slot is attended


class TorchNativeAttnBackend:
    """Paged GQA attention over a KVPool, with SGLang-style eager and graph metadata hooks."""

    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED})

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, scale: Optional[float] = None) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.scale = scale
        self.device = req_to_token_pool.device
        self.max_context_len = req_to_token_pool.max_context_len
        self._context_arange = torch.arange(self.max_context_len, device=self.device)
        self.forward_metadata: Optional[AttnMetadata] = None
        self.static_metadata: Optional[AttnMetadata] = None
        self._max_bs = 0
        self._static_views: Dict[int, AttnMetadata] = {}

    # ---- metadata -------------------------------------------------------------------------

    def _compute_metadata(self, forward_batch: ForwardBatch, out: Optional[AttnMetadata] = None) -> AttnMetadata:
        """Metadata for a batch, written into ``out`` when given (fresh tensors otherwise); no host reads.

        DECODE takes two ops (token t is request t and sees its first seq_lens[t] slots);
        EXTEND/MIXED first map tokens to their requests and positions.
        """
        kv_out, mask_out = (out.kv_indices, out.mask) if out is not None else (None, None)
        arange = self._context_arange.unsqueeze(0)
        if forward_batch.forward_mode.is_decode_or_idle():
            rows = forward_batch.req_pool_indices
            mask = torch.lt(arange, forward_batch.seq_lens.unsqueeze(1), out=mask_out)
        else:
            token_req, last_pos = token_requests(forward_batch)
            rows = forward_batch.req_pool_indices[token_req]
            mask = torch.le(arange, last_pos.unsqueeze(1), out=mask_out)
        kv_indices = torch.index_select(self.req_to_token_pool.req_to_token, 0, rows, out=kv_out)
        return AttnMetadata(kv_indices, mask)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager path: build fresh metadata tensors for this batch."""
        self.forward_metadata = self._compute_metadata(forward_batch)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers once, sized for the largest graph."""
        shape = (max_num_tokens, self.max_context_len)
        self.static_metadata = AttnMetadata(
            kv_indices=torch.zeros(shape, dtype=self.req_to_token_pool.req_to_token.dtype, device=self.device),
            mask=torch.zeros(shape, dtype=torch.bool, device=self.device),
        )
        self._max_bs = max_bs
        self._static_views = {}
        logger.debug("static attention metadata: %d requests, %d x %d slots", max_bs, *shape)

    def init_forward_metadata_capture(self, forward_batch: ForwardBatch) -> None:
        """Before warm-up/capture of one graph: fill the static buffers and point at their views."""
        if self.static_metadata is None:
            raise RuntimeError("init_graph_state(max_bs, max_num_tokens) must run before capture")
        static_tokens = self.static_metadata.kv_indices.shape[0]
        if forward_batch.batch_size > self._max_bs or forward_batch.num_tokens > static_tokens:
            raise ValueError(
                f"batch_size/num_tokens: expected at most {self._max_bs}/{static_tokens} "
                f"(init_graph_state), got {forward_batch.batch_size}/{forward_batch.num_tokens}"
            )
        self.init_forward_metadata_replay(forward_batch)

    def init_forward_metadata_replay(self, forward_batch: ForwardBatch) -> None:
        """Before each replay: refill the static buffers in place and re-point at their views."""
        num_tokens = forward_batch.num_tokens
        view = self._static_views.get(num_tokens)
        if view is None:
            view = AttnMetadata(
                self.static_metadata.kv_indices[:num_tokens], self.static_metadata.mask[:num_tokens]
            )
            self._static_views[num_tokens] = view
        self.forward_metadata = self._compute_metadata(forward_batch, out=view)

    def advance_step(self, forward_batch: ForwardBatch) -> None:
        """Between the decode steps of one multi-step graph (recorded there): the static metadata of
        the next step, ``forward_batch`` (its ``seq_lens`` one longer per step), in place with device
        ops only, as the replay hook fills it. The request rows are gathered whole, so the slots the
        engine mapped ahead for the later positions are already in ``kv_indices``; the mask admits
        one more of them."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise ValueError(f"forward_mode: advance_step runs between decode steps, got {forward_batch.forward_mode.name}")
        self.init_forward_metadata_replay(forward_batch)

    # ---- attention ------------------------------------------------------------------------

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k/v [T, Hkv, D] at ``out_cache_loc`` of layer ``layer_id``; returns its K and V buffers."""
        k_buffer = self.kv_pool.k_buffers[layer_id]
        v_buffer = self.kv_pool.v_buffers[layer_id]
        loc = forward_batch.out_cache_loc
        k_buffer[loc] = k.to(k_buffer.dtype)
        v_buffer[loc] = v.to(v_buffer.dtype)
        return k_buffer, v_buffer

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Store k/v at ``out_cache_loc`` for ``layer_id``, then attend; q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]."""
        k_buffer, v_buffer = self.store_kv(k, v, layer_id, forward_batch)
        meta = self.forward_metadata
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_buffer.shape[1]
        keys = k_buffer[meta.kv_indices]  # [T, L, Hkv, D]
        values = v_buffer[meta.kv_indices]
        # GQA: query head h reads KV head h // group (the same as repeat_interleave of KV heads).
        grouped_q = q.to(keys.dtype).view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
        scores = torch.einsum("tkgd,tlkd->tkgl", grouped_q, keys).float() * scale
        scores = scores.masked_fill(~meta.mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # softmax math in float32
        out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
        return out.reshape(num_tokens, num_heads * head_dim).to(q.dtype)


def token_requests(forward_batch: ForwardBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token: its row in the batch and the last position it may attend (inclusive).

    DECODE: token t is request t at position seq_lens[t] - 1. EXTEND/MIXED: the request is
    the last one whose ``extend_start_loc`` is <= t, and the position is its prefix length
    plus the offset of t in its chunk, clamped to seq_lens - 1 so that padding tokens past
    the last request never look beyond that request's cache.
    """
    seq_lens = forward_batch.seq_lens.to(torch.int64)
    if forward_batch.forward_mode.is_decode_or_idle():
        return torch.arange(forward_batch.batch_size, device=seq_lens.device), seq_lens - 1
    start_loc = forward_batch.extend_start_loc.to(torch.int64)
    tokens = torch.arange(forward_batch.num_tokens, device=start_loc.device)
    token_req = (torch.searchsorted(start_loc, tokens, right=True) - 1).clamp_(min=0)
    offset = tokens - start_loc[token_req]
    last_pos = forward_batch.extend_prefix_lens.to(torch.int64)[token_req] + offset
    return token_req, torch.minimum(last_pos, seq_lens[token_req] - 1)
