"""Prompts and reference tokens for the engine-path tests: ragged token prompts, and each prompt's
greedy tokens from the model's own ``generate()`` with that prompt alone (no padding, no batch)."""

from __future__ import annotations

from typing import List, Sequence

import torch

from hf_helpers import VOCAB

ENGINE_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3-moe", "mistral-window", "gemma2", "phi3", "gpt-oss",
                   "deepseek-v3"]


def ragged_prompts(lengths: Sequence[int], seed: int = 1) -> List[List[int]]:
    """One prompt of random token ids (never pad 0, BOS/EOS 1 or 2) per length."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def generate_alone(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> List[List[int]]:
    """Each prompt's greedy continuation by ``model.generate()``, one prompt at a time."""
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens
