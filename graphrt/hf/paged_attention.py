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
producer's buffers (KV-shared layers). Decode steps attend through static-shape metadata refreshed by
the replay hook, ``width`` table columns per request (the backend of one decode runner serves steps whose
requests hold at most ``width`` tokens: the engine keeps a runner per width bucket), and a sliding layer
reads only its window's ring slots; so a full graph records them and a step's attention reads what its
requests hold, not ``max_context`` per row. Prefill and mixed steps call the ``paged_attention`` custom
op (``ring_attention`` for a sliding layer's ring, whose writes it does too), which plans on the host per
request from ``current_batch()`` and is therefore a splitting op of piecewise graphs (``splitting_ops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.forward_context import current_batch
from graphrt.hf.kv_layout import KVLayout, LayerKV
from graphrt.reference import CachePools
from graphrt.reference.varlen import request_layout

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
                    ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's keys and values in ``k_cache``/``v_cache``
    [slots, Hkv, D] for the current batch, planned on the host per request (its chunk and cached
    prefix): found through the request table, or (``ring`` > 0) in the request row's ring of that many
    slots; ``window`` > 0 sees the last ``window`` positions only. Returns [T, H, Dv]; rows past the
    batch's tokens are zeros. This step's keys and values must already be in the caches."""
    return _attend_requests(q, k_cache, v_cache, scale, window, ring, softcap, sinks)


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
    write belongs to the op, which plans on the host."""
    batch = current_batch()
    if batch is None:
        raise RuntimeError("ring_attention: no current batch; call it inside a graphrt step")
    requests = batch.req_pool_indices.to(torch.int64)
    for request, (start, q_len, prefix) in enumerate(request_layout(batch)):
        if q_len:
            slots = requests[request] * ring + torch.arange(prefix, prefix + q_len, device=q.device) % ring
            k_cache[slots] = k[start: start + q_len].to(k_cache.dtype)
            v_cache[slots] = v[start: start + q_len].to(v_cache.dtype)
    return _attend_requests(q, k_cache, v_cache, scale, window, ring, softcap, sinks)


@ring_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
      window: int, ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


def _attend_requests(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int,
                     ring: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Both ops' attention, request by request of ``current_batch()``."""
    batch = current_batch()
    if batch is None:
        raise RuntimeError("paged_attention: no current batch; call it inside a graphrt step")
    requests = batch.req_pool_indices.to(torch.int64)
    layout = [(start, q_len, prefix) for start, q_len, prefix in request_layout(batch) if q_len]
    longest = max((prefix + q_len for _, q_len, prefix in layout), default=1)
    table = None if ring else batch.req_to_token_pool.req_to_token[:, :longest].index_select(0, requests)
    out = q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[-1]))
    num_kv_heads = k_cache.shape[1]
    for request, (start, q_len, prefix) in enumerate(request_layout(batch)):
        if not q_len:
            continue
        first = max(0, prefix + 1 - window) if window > 0 else 0  # the oldest position any query sees
        positions = torch.arange(first, prefix + q_len, device=q.device)
        if ring:
            slots = requests[request] * ring + positions % ring
        else:  # a capture's padding request may run past the table (a step budget above max_context): scratch there
            slots = table[request].index_select(0, positions.clamp(max=table.shape[1] - 1))
        keys, values = k_cache[slots], v_cache[slots]
        visible = positions[None, :] <= positions[prefix - first:, None]
        if window > 0:
            visible &= positions[None, :] > positions[prefix - first:, None] - window
        grouped = _grouped(q[start: start + q_len], num_kv_heads, keys.dtype)
        scores = torch.einsum("qkgd,lkd->qkgl", grouped, keys).float() * scale
        probs = _softmax(scores, visible, softcap, sinks).to(values.dtype)
        chunk = torch.einsum("qkgl,lkd->qkgd", probs, values)
        out[start: start + q_len] = chunk.reshape(q_len, q.shape[1], -1).to(q.dtype)
    return out


PAGED_ATTENTION_OP = torch.ops.graphrt_hf.paged_attention
RING_ATTENTION_OP = torch.ops.graphrt_hf.ring_attention


def splitting_ops(layout: KVLayout) -> List[Any]:
    """The ops a prefill or mixed step of ``layout``'s model calls (its piecewise graphs split at each):
    ``RING_ATTENTION_OP`` for sliding layers keeping a ring of their own, ``PAGED_ATTENTION_OP`` for the rest."""
    ring = [bool(layer.ring) and layout.stores(index) for index, layer in enumerate(layout.layers)]
    return [op for op, used in ((PAGED_ATTENTION_OP, not all(ring)), (RING_ATTENTION_OP, any(ring))) if used]


@dataclass
class DecodeMetadata:
    """What a decode step's attention reads through the request table: ``width`` slots per request
    (``kv_indices`` [rows, width]), which of them it sees (``mask``), and ``arange(width)``."""

    kv_indices: torch.Tensor
    mask: torch.Tensor
    columns: torch.Tensor


class PagedAttnBackend:
    """graphrt's KV pools as the attention of a Hugging Face model, for one runner: decode steps through
    static metadata of ``width`` table columns per request (full graphs; ``advance_step`` between the
    steps of a multi-step key; ``width=None``: eager only, as wide as each step's longest request), prefill
    and mixed steps through ``PAGED_ATTENTION_OP`` (piecewise graphs split there). Each runner has its
    own backend over the shared pools, so no runner's capture reallocates state another's graphs read."""

    graph_modes = frozenset({ForwardMode.DECODE})

    def __init__(self, pools: CachePools, layout: KVLayout, width: Optional[int] = None) -> None:
        self.req_to_token_pool = pools.req_to_token
        self.kv_pool = pools.kv
        self.layout = layout
        self.width = width
        self.device = pools.req_to_token.device
        self.forward_metadata: Optional[DecodeMetadata] = None
        self.static_metadata: Optional[DecodeMetadata] = None
        self._static_views: Dict[int, DecodeMetadata] = {}

    # ---- metadata (the runner's attention-backend protocol) ---------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager path: a decode step's metadata as wide as its longest request (prefill plans in the op)."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            return
        lengths = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        width = max(1, int(lengths.max())) if forward_batch.batch_size else 1
        rows = forward_batch.batch_size
        metadata = DecodeMetadata(torch.empty((rows, width), dtype=self.req_to_token_pool.req_to_token.dtype,
                                              device=self.device),
                                  torch.empty((rows, width), dtype=torch.bool, device=self.device),
                                  torch.arange(width, device=self.device))
        self.forward_metadata = self._fill(forward_batch, metadata)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The static metadata, allocated once: ``max_bs`` rows (a decode step has a token per request)
        of ``width`` columns; none for an eager-only backend."""
        if self.width is None:
            return
        shape = (max_bs, self.width)
        self.static_metadata = DecodeMetadata(
            torch.zeros(shape, dtype=self.req_to_token_pool.req_to_token.dtype, device=self.device),
            torch.zeros(shape, dtype=torch.bool, device=self.device), torch.arange(self.width, device=self.device))
        self._static_views = {}

    def init_forward_metadata_capture(self, forward_batch: ForwardBatch) -> None:
        """Before warm-up and capture of a decode graph: fill the static metadata (allocated first)."""
        if self.static_metadata is None:
            raise RuntimeError("init_graph_state(max_bs, max_num_tokens) must run before capture")
        if forward_batch.batch_size > self.static_metadata.kv_indices.shape[0]:
            raise ValueError(f"batch_size: expected at most {self.static_metadata.kv_indices.shape[0]} "
                             f"(init_graph_state), got {forward_batch.batch_size}")
        self.init_forward_metadata_replay(forward_batch)

    def init_forward_metadata_replay(self, forward_batch: ForwardBatch) -> None:
        """Before each replay: the static metadata's rows of this batch, refilled in place."""
        rows = forward_batch.batch_size
        view = self._static_views.get(rows)
        if view is None:
            static = self.static_metadata
            view = self._static_views[rows] = DecodeMetadata(static.kv_indices[:rows], static.mask[:rows],
                                                             static.columns)
        self.forward_metadata = self._fill(forward_batch, view)

    def advance_step(self, forward_batch: ForwardBatch) -> None:
        """Between the decode steps of one multi-step graph (recorded there): the next step's metadata,
        with device ops only (the engine mapped every step's slots ahead in the request table)."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise ValueError(f"forward_mode: advance_step runs between decode steps, got {forward_batch.forward_mode.name}")
        self.init_forward_metadata_replay(forward_batch)

    def _fill(self, forward_batch: ForwardBatch, out: DecodeMetadata) -> DecodeMetadata:
        """``out`` filled for a decode batch: each request's first ``width`` table slots and which it sees."""
        width = out.columns.shape[0]
        table = self.req_to_token_pool.req_to_token[:, :width]
        torch.index_select(table, 0, forward_batch.req_pool_indices, out=out.kv_indices)
        torch.lt(out.columns.unsqueeze(0), forward_batch.seq_lens.unsqueeze(1), out=out.mask)
        return out

    # ---- attention --------------------------------------------------------------------------------

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
        slots, visible = self._decode_reads(forward_batch, layer)
        keys, values = k_buffer[slots], v_buffer[slots]  # [T, L, Hkv, D]: L the width, or the window
        grouped = _grouped(q, k_buffer.shape[1], keys.dtype)
        scores = torch.einsum("tkgd,tlkd->tkgl", grouped, keys).float() * scale
        probs = _softmax(scores, visible, softcap, sinks).to(values.dtype)
        out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
        return out.reshape(q.shape[0], q.shape[1], -1).to(q.dtype)

    def _decode_reads(self, forward_batch: ForwardBatch, layer: LayerKV) -> Tuple[torch.Tensor, torch.Tensor]:
        """The slots a decode step's token reads and which of them it sees: its request's table slots
        (and its window), or the ring slots of the last ``min(window, width)`` positions."""
        meta = self.forward_metadata
        seq_lens = forward_batch.seq_lens.to(torch.int64).unsqueeze(1)
        if not layer.ring:
            if not layer.window:
                return meta.kv_indices, meta.mask
            return meta.kv_indices, meta.mask & (meta.columns.unsqueeze(0) >= seq_lens - layer.window)
        count = min(layer.window, meta.columns.shape[0])
        positions = seq_lens - count + meta.columns[:count].unsqueeze(0)
        requests = forward_batch.req_pool_indices.to(torch.int64).unsqueeze(1)
        return requests * layer.ring + positions.clamp(min=0) % layer.ring, positions >= 0

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


__all__ = ["ATTENTION_NAME", "DecodeMetadata", "PAGED_ATTENTION_OP", "PagedAttnBackend", "RING_ATTENTION_OP",
           "paged_attention", "paged_attention_forward", "register_paged_attention", "ring_attention",
           "splitting_ops"]
