"""Greedy decoding of a tiny random Hugging Face Llama with a StaticCache through ``graphrt.wrap``.

    PYTHONPATH=. python examples/hf_decode.py      # needs `pip install transformers`

The prefill runs eagerly; each decode step is one wrapped call. Exits non-zero when the
wrapped tokens differ from the same loop run eagerly, or when no step replayed a graph.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from graphrt import wrap
from graphrt.hf.cache_keyword import accepted_cache_keyword

BATCH, PROMPT_LEN, STEPS = 4, 8, 24


def decode(model: LlamaForCausalLM, prompt: torch.Tensor, wrapped: bool):
    """Prefill eagerly into a fresh StaticCache, then STEPS greedy decode steps."""
    cache = StaticCache(config=model.config, max_cache_len=64)
    with_cache = {accepted_cache_keyword(model.forward): cache}  # `cache` from transformers 5.24, `past_key_values` before

    def step(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, **with_cache, position_ids=position_ids, use_cache=True).logits[:, -1]

    fast = wrap(step, max_batch_size=BATCH, capture_sizes=[BATCH]) if wrapped else step
    with torch.no_grad():
        token = model(input_ids=prompt, **with_cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        for position in range(PROMPT_LEN, PROMPT_LEN + STEPS):
            token = fast(token, torch.full((BATCH, 1), position, device=prompt.device)).argmax(-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, dim=1).tolist(), fast


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5)  # larger than the default so greedy tokens vary
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(0, config.vocab_size, (BATCH, PROMPT_LEN), device=device)

    eager, _ = decode(copy.deepcopy(model), prompt, wrapped=False)
    graphed, fast = decode(model, prompt, wrapped=True)
    stats = fast.stats()
    print(f"backend {stats['backend']}: {stats['graph_runs']} graph runs, {stats['eager_runs']} eager")
    print("eager  :", eager[0])
    print("graphed:", graphed[0])
    same = graphed == eager
    print(f"same tokens: {same}")
    if stats["backend"] != "eager" and stats["graph_runs"] == 0:
        print(f"no step replayed a graph: {stats['eager_reasons']}")
        return 1
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
