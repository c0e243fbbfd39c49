"""Tiny random Hugging Face causal LMs for the wrap() and generate() tests (no checkpoint download)."""

from __future__ import annotations

import torch

VOCAB = 128
GENERATE_MODELS = ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"]


def tiny_causal_lm(kind: str, device: str = "cpu") -> torch.nn.Module:
    """A 2-layer random causal LM. initializer_range=0.5: with the default 0.02 the logits are
    nearly flat and greedy decoding collapses into one repeated token, hiding cache errors."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        # GPT-2 supports StaticCache in transformers 5.x (learned positions from position_ids).
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                         initializer_range=0.5, bos_token_id=1, eos_token_id=1)
        return transformers.GPT2LMHeadModel(config).to(device).eval()
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.5, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if kind == "mistral":
        # No sliding window: a sliding-window StaticCache layer keeps a Python int counter, which a
        # graph cannot advance (its capture fails with RebindError and the steps run eagerly).
        common["sliding_window"] = None
    if kind == "gemma":
        common["head_dim"] = 16
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    return model_cls(config_cls(**common)).to(device).eval()
