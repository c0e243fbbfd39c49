"""Paged attention for Hugging Face models, registered through transformers' ``AttentionInterface``.

A transformers model that follows the modeling-backend contract calls
``attention_interface(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
softcap=..., s_aux=..., **kwargs)`` in every attention layer. ``paged_attention_forward`` is that
function for graphrt's engine path (as vLLM's Transformers backend registers its own): it reads the
live step from ``graphrt.current_batch()``, writes the layer's keys and values at ``out_cache_loc``
of graphrt's KV pool and attends over each request's slots through the request table, honouring the
module's scaling, sliding window, logit soft-capping and attention sinks. The packed layout
(``[1, num_tokens]``, one ``position_ids`` per token) is what the model is called with.

Each layer's keys and values live where its ``LayerKV`` says (graphrt.hf.kv_layout): pool slots through
the request table, a ring of a window plus a step per request row (sliding-window layers), or its
producer's buffers (KV-shared layers). Which keys each query reads is planned once per step for
every layer (graphrt.hf.attention_plan): in a decode step, inside the step, ``width`` table columns
per request (the backend of one decode runner serves steps whose requests hold at most ``width``
tokens: the engine keeps a runner per width bucket) or a sliding layer's window, so a full graph
records the plan with the step and a replay needs no host work for it; in a prefill or mixed step,
every token at once, in the ``paged_attention`` custom op (``ring_attention`` for a sliding layer's
ring, whose writes it does too), which reads the live batch through ``current_batch()`` and is
therefore a splitting op of piecewise graphs (``splitting_ops``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.forward_context import current_batch
from graphrt.hf.attention_plan import step_plan
from graphrt.hf.kv_layout import KVLayout
from graphrt.reference import CachePools

ATTENTION_NAME = "graphrt_paged"  # the name the attention function is registered under
MAX_GATHERED_BYTES = 1 << 28  # a prefill layer gathers the keys and values of at most this many bytes at once


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
                    ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's keys and values in ``k_cache``/``v_cache``
    [slots, Hkv, D] for the current batch, every token at once with the step's plan
    (graphrt.hf.attention_plan): found through the request table, or (``ring`` > 0) in the request
    row's ring of that many slots; ``window`` > 0 sees the last ``window`` positions only. Returns
    [T, H, Dv]; rows past the batch's tokens are zeros. This step's keys and values must already be in
    the caches."""
    return _attend_tokens(q, k_cache, v_cache, scale, window, ring, softcap, sinks)


@paged_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int, ring: int,
      softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


@torch.library.custom_op("graphrt_hf::ring_attention", mutates_args=("k_cache", "v_cache"))
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   scale: float, window: int, ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """``paged_attention`` of a sliding-window layer that keeps its keys and values in a ring of ``ring``
    slots per request row, writing the step's k/v [T, Hkv, D] at their ring slots first: a ring slot
    depends on the request, which a piecewise graph (keyed by token count only) cannot read, so the
    write belongs to the op, which plans from the live batch."""
    plan = step_plan(_live_batch("ring_attention"))
    tokens = plan.num_rows
    slots = plan.rows * ring + plan.positions % ring
    k_cache[slots] = k[:tokens].to(k_cache.dtype)
    v_cache[slots] = v[:tokens].to(v_cache.dtype)
    return _attend_tokens(q, k_cache, v_cache, scale, window, ring, softcap, sinks)


@ring_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
      window: int, ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


def _live_batch(op: str) -> ForwardBatch:
    batch = current_batch()
    if batch is None:
        raise RuntimeError(f"{op}: no current batch; call it inside a graphrt step")
    return batch


def _attend_tokens(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int,
                   ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Both ops' attention: every token of ``current_batch()`` over the keys its plan reads, in chunks of
    tokens whose gathered keys and values stay within ``MAX_GATHERED_BYTES``."""
    plan = step_plan(_live_batch("paged_attention"))
    reads = plan.reads(window, ring)
    tokens, keys = reads.slots.shape
    out = q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[-1]))
    per_token = keys * (k_cache[0].numel() * k_cache.element_size() + v_cache[0].numel() * v_cache.element_size())
    chunk = max(1, MAX_GATHERED_BYTES // max(1, per_token))
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        out[start:end] = _attend_rows(q[start:end], k_cache, v_cache, reads.slots[start:end],
                                      reads.visible[start:end], scale, softcap, sinks)
    return out


def _attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 visible: torch.Tensor, scale: float, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """q [Q, H, D], each row over the keys and values at its ``slots`` [Q, L] that it sees: [Q, H, Dv]."""
    keys, values = k_cache[slots], v_cache[slots]  # [Q, L, Hkv, D]
    grouped = _grouped(q, k_cache.shape[1], keys.dtype)
    scores = torch.einsum("qkgd,qlkd->qkgl", grouped, keys).float() * scale
    probs = _softmax(scores, visible, softcap, sinks).to(values.dtype)
    out = torch.einsum("qkgl,qlkd->qkgd", probs, values)
    return out.reshape(q.shape[0], q.shape[1], -1).to(q.dtype)


PAGED_ATTENTION_OP = torch.ops.graphrt_hf.paged_attention
RING_ATTENTION_OP = torch.ops.graphrt_hf.ring_attention


def splitting_ops(layout: KVLayout) -> List[Any]:
    """The ops a prefill or mixed step of ``layout``'s model calls (its piecewise graphs split at each):
    ``RING_ATTENTION_OP`` for sliding layers keeping a ring of their own, ``PAGED_ATTENTION_OP`` for the rest."""
    ring = [bool(layer.ring) and layout.stores(index) for index, layer in enumerate(layout.layers)]
    return [op for op, used in ((PAGED_ATTENTION_OP, not all(ring)), (RING_ATTENTION_OP, any(ring))) if used]


class PagedAttnBackend:
    """graphrt's KV pools as the attention of a Hugging Face model, for one runner: decode steps read
    ``width`` table columns per request (``width=None``: eager only, as wide as each step's longest
    request), planned inside the step itself (graphrt.hf.attention_plan: device ops a full graph
    records, so a replay needs no host work for its attention), prefill and mixed steps through
    ``PAGED_ATTENTION_OP`` (piecewise graphs split there). Each runner has its own backend over the
    shared pools."""

    graph_modes = frozenset({ForwardMode.DECODE})

    def __init__(self, pools: CachePools, layout: KVLayout, width: Optional[int] = None) -> None:
        self.req_to_token_pool = pools.req_to_token
        self.kv_pool = pools.kv
        self.layout = layout
        self.width = width
        self.device = pools.req_to_token.device

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, forward_batch: ForwardBatch,
               scale: float, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store k/v [T, Hkv, D] where layer ``layer_id`` keeps them (a KV-shared layer stores nothing: it
        was handed its producer's; a prefill step's ring writes happen in the op), then attend:
        q [T, H, D] -> [T, H, Dv]."""
        layer = self.layout.layers[layer_id]
        k_buffer, v_buffer = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        stores = self.layout.stores(layer_id)
        if not forward_batch.forward_mode.is_decode_or_idle():
            if layer.ring and stores:
                return RING_ATTENTION_OP(q, k, v, k_buffer, v_buffer, scale, layer.window, layer.ring, softcap, sinks)
            if stores:
                self._store(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v)
            return PAGED_ATTENTION_OP(q, k_buffer, v_buffer, scale, layer.window, layer.ring, softcap, sinks)
        if stores:
            self._store(k_buffer, v_buffer, self._ring_writes(forward_batch, layer.ring) if layer.ring
                        else forward_batch.out_cache_loc, k, v)
        reads = step_plan(forward_batch, self.width).reads(layer.window, layer.ring)
        return _attend_rows(q, k_buffer, v_buffer, reads.slots, reads.visible, scale, softcap, sinks)

    @staticmethod
    def _store(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        k_buffer[slots] = k.to(k_buffer.dtype)
        v_buffer[slots] = v.to(v_buffer.dtype)

    @staticmethod
    def _ring_writes(forward_batch: ForwardBatch, ring: int) -> torch.Tensor:
        """The ring slot of each token of a decode step (a token per request): ``request row * ring +
        position % ring``; padding rows (the dummy request, row 0) write in row 0's ring, which no
        request reads."""
        requests = forward_batch.req_pool_indices.to(torch.int64)
        return requests * ring + forward_batch.positions.to(torch.int64) % ring


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                            s_aux: Optional[torch.Tensor] = None, dropout: float = 0.0,
                            **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature over graphrt's KV pool: query [1, H, T, D], key/value
    [1, Hkv, T, D] of the packed step in, [1, T, H, Dv] out (no attention weights). The mask and the
    ``sliding_window`` keyword are not read here: the engine's probe checked that the mask was the
    causal mask of the layer's window, which the layer's ``LayerKV`` holds (graphrt.hf.engine_probe)."""
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
                         module.layer_idx, batch, float(scale), float(softcap or 0.0), s_aux)
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Register ``paged_attention_forward`` as ``ATTENTION_NAME`` in transformers' AttentionInterface
    (idempotent; imports transformers)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


__all__ = ["ATTENTION_NAME", "PAGED_ATTENTION_OP", "PagedAttnBackend", "RING_ATTENTION_OP",
           "paged_attention", "paged_attention_forward", "register_paged_attention", "ring_attention",
           "splitting_ops"]
