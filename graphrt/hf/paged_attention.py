"""Paged attention for Hugging Face models, registered through transformers' ``AttentionInterface``.

A transformers model that follows the modeling-backend contract calls
``attention_interface(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
softcap=..., s_aux=..., **kwargs)`` in every attention layer. ``paged_attention_forward`` is that
function for graphrt's engine path (as vLLM's Transformers backend registers its own): it reads the
live step from ``graphrt.current_batch()``, writes the layer's keys and values at ``out_cache_loc``
of graphrt's KV pool and attends over each request's slots through the request table, honouring the
module's scaling, sliding window, logit soft-capping and attention sinks. The packed layout
(``[1, num_tokens]``, one ``position_ids`` per token) is what the model is called with.

Decode steps attend through static-shape metadata (``TorchNativeAttnBackend``'s, refreshed by the
replay hook), so a full graph records them; prefill and mixed steps call the ``paged_attention``
custom op, which plans on the host per request from ``current_batch()`` and is therefore the
splitting op of piecewise graphs (``PAGED_ATTENTION_OP``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from graphrt.batch import ForwardBatch
from graphrt.forward_context import current_batch
from graphrt.reference.varlen import VarlenAttnBackend, request_layout

ATTENTION_NAME = "graphrt_paged"  # the name the attention function is registered under


def _softmax(scores: torch.Tensor, visible: torch.Tensor, softcap: float,
             sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Probabilities of float32 ``scores`` [Q, Hkv, G, L] over the ``visible`` [Q, L] keys: soft-capped
    (``softcap`` > 0: ``tanh(s / cap) * cap``, Gemma 2), with one extra logit per head that takes
    probability mass and no value (``sinks`` [H], GPT-OSS)."""
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    num_kv_heads, group = scores.shape[1], scores.shape[2]
    sink = sinks.float().view(1, num_kv_heads, group, 1).expand(scores.shape[0], -1, -1, 1)
    combined = torch.cat((scores, sink), dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _grouped(q: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Queries [T, H, D] as [T, Hkv, G, D]: query head h reads KV head h // G (GQA/MQA)."""
    num_tokens, num_heads, head_dim = q.shape
    return q.to(dtype).view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)


@torch.library.custom_op("graphrt_hf::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int,
                    softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's slots of ``k_cache``/``v_cache`` [slots, Hkv, D]
    for the current batch, planned on the host per request (its chunk and cached prefix); ``window`` > 0
    sees the last ``window`` positions only. Returns [T, H, Dv]; rows past the batch's tokens are zeros.
    This step's keys and values must already be in the caches."""
    batch = current_batch()
    if batch is None:
        raise RuntimeError("paged_attention: no current batch; call it inside a graphrt step")
    rows = batch.req_to_token_pool.req_to_token.index_select(0, batch.req_pool_indices.to(torch.int64))
    out = q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[-1]))
    num_kv_heads = k_cache.shape[1]
    for request, (start, q_len, prefix) in enumerate(request_layout(batch)):
        if not q_len:
            continue
        first = max(0, prefix + 1 - window) if window > 0 else 0  # the oldest position any query sees
        slots = rows[request, first: prefix + q_len]
        keys, values = k_cache[slots], v_cache[slots]
        query_pos = torch.arange(prefix, prefix + q_len, device=q.device)[:, None]
        key_pos = torch.arange(first, prefix + q_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if window > 0:
            visible &= key_pos > query_pos - window
        grouped = _grouped(q[start: start + q_len], num_kv_heads, keys.dtype)
        scores = torch.einsum("qkgd,lkd->qkgl", grouped, keys).float() * scale
        probs = _softmax(scores, visible, softcap, sinks).to(values.dtype)
        chunk = torch.einsum("qkgl,lkd->qkgd", probs, values)
        out[start: start + q_len] = chunk.reshape(q_len, q.shape[1], -1).to(q.dtype)
    return out


@paged_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int, softcap: float,
      sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


PAGED_ATTENTION_OP = torch.ops.graphrt_hf.paged_attention


class PagedAttnBackend(VarlenAttnBackend):
    """graphrt's paged KV pool as the attention of a Hugging Face model: decode through the static
    metadata of ``TorchNativeAttnBackend`` (full graphs, ``advance_step`` for multi-step keys), prefill
    and mixed steps through ``PAGED_ATTENTION_OP`` (piecewise graphs split there)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch,
               scale: float, window: int = 0, softcap: float = 0.0,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store k/v [T, Hkv, D] at ``out_cache_loc`` of layer ``layer_id``, then attend: q [T, H, D] -> [T, H, Dv]."""
        k_buffer, v_buffer = self.store_kv(k, v, layer_id, forward_batch)
        if not forward_batch.forward_mode.is_decode_or_idle():
            return PAGED_ATTENTION_OP(q, k_buffer, v_buffer, scale, window, softcap, sinks)
        meta = self.forward_metadata
        visible = meta.mask
        if window > 0:  # token t sits at seq_lens[t] - 1 and sees the positions after seq_lens[t] - 1 - window
            oldest = forward_batch.seq_lens.to(torch.int64).unsqueeze(1) - window
            visible = visible & (self._context_arange.unsqueeze(0) >= oldest)
        keys = k_buffer[meta.kv_indices]  # [T, L, Hkv, D]
        values = v_buffer[meta.kv_indices]
        grouped = _grouped(q, k_buffer.shape[1], keys.dtype)
        scores = torch.einsum("tkgd,tlkd->tkgl", grouped, keys).float() * scale
        probs = _softmax(scores, visible, softcap, sinks).to(values.dtype)
        out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
        return out.reshape(q.shape[0], q.shape[1], -1).to(q.dtype)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                            s_aux: Optional[torch.Tensor] = None, dropout: float = 0.0,
                            **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature over graphrt's KV pool: query [1, H, T, D], key/value
    [1, Hkv, T, D] of the packed step in, [1, T, H, Dv] out (no attention weights). The mask is
    unused: the request table and positions define what each token sees."""
    batch = current_batch()
    backend = getattr(batch, "attn_backend", None)
    if not isinstance(backend, PagedAttnBackend):
        raise RuntimeError(f"attention {ATTENTION_NAME!r}: expected a graphrt step whose attn_backend is a "
                           f"PagedAttnBackend (run the model through graphrt.hf.engine_model), got "
                           f"{type(backend).__name__}")
    if query.shape[0] != 1:
        raise ValueError(f"query: expected the packed layout [1, heads, tokens, head_dim], got {list(query.shape)}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = backend.attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                         module.layer_idx, batch, float(scale), int(sliding_window or 0), float(softcap or 0.0),
                         s_aux)
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Register ``paged_attention_forward`` as ``ATTENTION_NAME`` in transformers' AttentionInterface
    (idempotent; imports transformers)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


__all__ = ["ATTENTION_NAME", "PAGED_ATTENTION_OP", "PagedAttnBackend", "paged_attention", "paged_attention_forward",
           "register_paged_attention"]
