"""ReferenceConfig: the shape of the reference Llama-style decoder, with two presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class ReferenceConfig:
    """Hyper-parameters of the reference decoder; ``head_dim`` defaults to hidden_size // num_heads."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None
    intermediate_size: int = 128
    vocab_size: int = 128
    max_context_len: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size: expected a multiple of num_heads={self.num_heads}, got {self.hidden_size}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even size for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}"
            )

    @classmethod
    def tiny(cls, **overrides: Any) -> "ReferenceConfig":
        """A model small enough for CPU unit tests (2 layers, hidden 64, vocab 128)."""
        return cls(**overrides)

    @classmethod
    def realistic(cls, **overrides: Any) -> "ReferenceConfig":
        """A ~250M-parameter Llama-like shape whose decode step is launch-bound on a GPU."""
        shape = dict(
            num_layers=16,
            hidden_size=1024,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=2816,
            vocab_size=32000,
            max_context_len=1024,
        )
        return cls(**{**shape, **overrides})
