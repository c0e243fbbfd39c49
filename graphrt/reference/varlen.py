"""Varlen attention as a ``torch.library`` custom op that reads host metadata from ``graphrt.current_batch()``.

Like FlashAttention's ``flash_attn_varlen_func`` (``cu_seqlens`` plus a host ``max_seqlen``) or
FlashInfer's plan, it needs each request's query and prefix lengths on the host: it loops over
requests with Python ints, so it is not graph-safe as a whole. ``VarlenAttnBackend`` runs it for
prefill and mixed steps (decode keeps the graph-safe static path), which is what piecewise graphs
are for: ``GraphRunner(..., splitting_ops=[VARLEN_OP])`` replays everything around it.
"""

from __future__ import annotations

import itertools
import math
from typing import List, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.forward_context import current_batch
from graphrt.reference.attention import TorchNativeAttnBackend


@torch.library.custom_op("graphrt_reference::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention of q [T, H, D] over the cache of each request of the current batch.

    Rows past the batch's real tokens (graph padding) come out as zeros. K/V of this step's tokens
    must already be in ``k_cache``/``v_cache`` [slots, Hkv, D].
    """
    batch = current_batch()
    if batch is None:
        raise RuntimeError("varlen_attention: no current batch; call it inside a graphrt step "
                           "(GraphRunner, or graphrt.reference.run_eager)")
    rows = batch.req_to_token_pool.req_to_token.index_select(0, batch.req_pool_indices.to(torch.int64))
    out = torch.zeros_like(q)
    for request, (start, q_len, prefix) in enumerate(request_layout(batch)):
        if q_len:
            slots = rows[request, : prefix + q_len]
            out[start : start + q_len] = _attend(q[start : start + q_len], k_cache[slots], v_cache[slots], prefix, scale)
    return out


@varlen_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


VARLEN_OP = torch.ops.graphrt_reference.varlen_attention


def request_layout(batch: ForwardBatch) -> List[Tuple[int, int, int]]:
    """(first token row, query length, cached prefix length) per request, from host values only."""
    if batch.forward_mode.is_extend():
        q_lens, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        if q_lens is None or prefixes is None:
            raise ValueError("extend_seq_lens_cpu/extend_prefix_lens_cpu: varlen_attention needs the host "
                             "mirrors of the request lengths, got None")
    else:
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        if seq_lens.device.type != "cpu":
            raise ValueError("seq_lens_cpu: varlen_attention needs the host mirror of seq_lens, got None")
        q_lens = [1] * batch.batch_size
        prefixes = [length - 1 for length in seq_lens.tolist()]
    starts = itertools.accumulate(q_lens, initial=0)
    return list(zip(starts, q_lens, prefixes))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """One request: q [Q, H, D] at positions prefix.. over keys/values [L, Hkv, D], causal; GQA by head groups."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.to(keys.dtype).view(q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("qkgd,lkd->qkgl", grouped, keys).float() * scale
    query_pos = torch.arange(prefix, prefix + q_len, device=q.device)[:, None]
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= query_pos
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.einsum("qkgl,lkd->qkgd", probs, values).reshape(q_len, num_heads, head_dim).to(q.dtype)


class VarlenAttnBackend(TorchNativeAttnBackend):
    """Decode through the graph-safe static path; prefill and mixed through ``varlen_attention``."""

    graph_modes = frozenset({ForwardMode.DECODE})

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Decode: static-shape metadata; prefill/mixed: none (the op plans from current_batch())."""
        if forward_batch.forward_mode.is_decode_or_idle():
            super().init_forward_metadata(forward_batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Store k/v, then attend: [T, H, D] queries -> [T, H*D]."""
        if forward_batch.forward_mode.is_decode_or_idle():
            return super().forward(q, k, v, layer_id, forward_batch)
        k_buffer, v_buffer = self.store_kv(k, v, layer_id, forward_batch)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out = VARLEN_OP(q, k_buffer, v_buffer, scale)
        return out.reshape(q.shape[0], -1)
