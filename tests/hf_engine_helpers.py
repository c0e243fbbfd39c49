"""Prompts and reference tokens for the engine-path tests: ragged token prompts, and each prompt's
greedy tokens from the model's own ``generate()`` with that prompt alone (no padding, no batch); the
fixtures the engine tests import (``one_thread``; a tiny ``llama`` and its ``engine``, one per module)."""

from __future__ import annotations

from typing import Any, Iterator, List, Sequence

import pytest
import torch

from hf_helpers import VOCAB, tiny_model

import graphrt.hf

ENGINE_FAMILIES = ["llama", "qwen2", "qwen2-sliding", "qwen3", "qwen3-moe", "mistral-window", "gemma2", "gemma3",
                   "phi3", "gpt-oss", "deepseek-v3", "qwen2-moe-sliding", "phimoe-window", "gemma3n"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread while a test module runs: the tiny models' ops are too small to split, and on a
    shared 2-core machine a second thread spin-waits for the first (the engine tests ran 7x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(llama: torch.nn.Module) -> graphrt.hf.HFEngine:
    """3 request rows of 32 tokens, 8 tokens per step, piecewise keys of 4 and 8 tokens."""
    return graphrt.hf.engine_model(llama, max_requests=3, max_context=32, max_step_tokens=8, warmup_iters=1,
                                   piecewise_sizes=[4, 8])


def ragged_prompts(lengths: Sequence[int], seed: int = 1) -> List[List[int]]:
    """One prompt of random token ids (never pad 0, BOS/EOS 1 or 2) per length."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def generate_alone(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int,
                   **generate_options: Any) -> List[List[int]]:
    """Each prompt's greedy continuation by ``model.generate()``, one prompt at a time (``generate_options``:
    more of generate()'s keywords)."""
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, **generate_options)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens
