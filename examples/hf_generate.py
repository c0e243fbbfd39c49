"""Hugging Face ``generate()`` with its decode steps replayed from graphs, in one line.

    PYTHONPATH=. python examples/hf_generate.py      # needs `pip install transformers`

``graphrt.hf.graph_generate(model, max_batch_size=8)`` wraps ``model.forward``, makes the static
cache the default and reuses it across ``generate()`` calls. A left-padded batch of 3 prompts
(not a capture size) is generated twice; the first call warms up and records, the second replays
every step. Exits non-zero when the tokens differ from eager ``generate()`` or nothing replayed.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from graphrt.hf import graph_generate


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5, pad_token_id=0)  # larger than the default so greedy tokens vary
    model = LlamaForCausalLM(config).to(device).eval()
    eager_model = copy.deepcopy(model)
    prompts = torch.randint(1, config.vocab_size, (3, 8), device=device)
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0  # the first prompt is shorter: left-padded
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)

    fast = graph_generate(model, max_batch_size=8)
    same = True
    for call in range(2):
        expected = eager_model.generate(prompts, cache_implementation="static", **options)
        before = fast.stats()["graph_runs"], fast.stats()["eager_runs"]
        got = model.generate(prompts, **options)
        stats = fast.stats()
        print(f"generate() call {call + 1}: {stats['graph_runs'] - before[0]} forward calls replayed, "
              f"{stats['eager_runs'] - before[1]} eager")
        same = same and torch.equal(got, expected)
    print(f"eager reasons: {stats['eager_reasons']}; graphs: {stats['captured_keys']}")
    print("tokens:", got[0].tolist())
    print(f"same tokens: {same}")
    if stats["backend"] != "eager" and stats["graph_runs"] == 0:
        return 1
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
