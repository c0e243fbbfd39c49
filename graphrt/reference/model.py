"""ReferenceDecoder: a small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache.

Weights are random, drawn from ``config.seed`` with a CPU ``torch.Generator`` so the
same config gives the same model on any device; nothing is downloaded. Attention goes
through the attention backend given at construction; the model never initializes
attention metadata itself (the runner or ``run_eager`` does, as in SGLang's flow).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from graphrt.batch import ForwardBatch
from graphrt.forward_context import use_batch
from graphrt.reference.attention import TorchNativeAttnBackend
from graphrt.reference.config import ReferenceConfig
from graphrt.reference.kv_cache import CachePools
from graphrt.reference.varlen import VarlenAttnBackend

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (half-rotation layout) with a precomputed cos/sin cache."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos_cache", angles.cos().float(), persistent=False)
        self.register_buffer("sin_cache", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [tokens, heads, head_dim] by the angle of each token's position."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention whose KV cache and score math live in the attention backend."""

    def __init__(self, config: ReferenceConfig, layer_id: int, rotary: RotaryEmbedding, attn_backend: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.split_sizes = (q_size, kv_size, kv_size)
        self.rotary = rotary
        self.attn_backend = attn_backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Project, rotate, store/attend through the backend, project back."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.rotary(q.view(num_tokens, self.num_heads, self.head_dim), positions)
        k = self.rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), positions)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn_backend.forward(q, k, v, self.layer_id, forward_batch))


class MLP(nn.Module):
    """SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to every token."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ReferenceConfig, layer_id: int, rotary: RotaryEmbedding, attn_backend: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.self_attn = Attention(config, layer_id, rotary, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run one block over all tokens of the batch."""
        x = x + self.self_attn(self.input_layernorm(x), positions, forward_batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceDecoder(nn.Module):
    """Llama-style decoder returning logits for every token: ``model(input_ids, positions, batch)``."""

    def __init__(
        self, config: ReferenceConfig, attn_backend: Any, device: Union[str, torch.device, None] = None
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        rotary = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_id, rotary, attn_backend) for layer_id in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(config.seed)
        # Parameters take the model dtype; the rotary cache stays float32.
        self.to(device=device)
        for param in self.parameters():
            param.data = param.data.to(config.dtype)
        self.requires_grad_(False)
        self.eval()
        logger.debug("reference decoder: %.1fM parameters", sum(p.numel() for p in self.parameters()) / 1e6)

    def _init_weights(self, seed: int) -> None:
        """Draw every weight from one seeded CPU generator, in registration order."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                continue  # RMSNorm scales stay at one
            std = 1.0 if name == "embed_tokens.weight" else 1.0 / math.sqrt(param.shape[1])
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(
        self, input_ids: torch.Tensor, positions: Optional[torch.Tensor], forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Logits [num_tokens, vocab_size] (float32); ``positions`` None means ``forward_batch.positions``."""
        if positions is None:
            positions = forward_batch.positions
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, forward_batch)
        return self.lm_head(self.norm(x)).float()


def run_eager(model: ReferenceDecoder, forward_batch: ForwardBatch) -> torch.Tensor:
    """Initialize the model's attention metadata for this batch, then run it eagerly."""
    model.attn_backend.init_forward_metadata(forward_batch)
    with use_batch(forward_batch):  # what graphrt.current_batch() serves to a varlen attention op
        return model(forward_batch.input_ids, forward_batch.positions, forward_batch)


def build_reference(
    config: ReferenceConfig,
    num_requests: int = 16,
    num_slots: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
    attention: str = "native",
) -> Tuple[ReferenceDecoder, TorchNativeAttnBackend, CachePools]:
    """Model, backend and pools wired together; ``num_slots`` defaults to every request at full context.

    ``attention``: ``"native"`` (graph-safe in every mode) or ``"varlen"`` (prefill and mixed through
    the ``varlen_attention`` custom op, which needs piecewise graphs: ``splitting_ops=[VARLEN_OP]``).
    """
    backends = {"native": TorchNativeAttnBackend, "varlen": VarlenAttnBackend}
    if attention not in backends:
        raise ValueError(f"attention: expected one of {sorted(backends)}, got {attention!r}")
    if num_slots is None:
        num_slots = num_requests * config.max_context_len + 1
    pools = CachePools.for_config(config, num_requests, num_slots, device)
    backend = backends[attention](pools.req_to_token, pools.kv)
    return ReferenceDecoder(config, backend, device), backend, pools
