"""Tiny random Hugging Face models for the wrap() and generate() tests (no checkpoint download).

``FAMILIES`` names a tiny config per model family (2 layers, hidden 32, vocab 128); sliding-window
families get a window of ``WINDOW`` tokens, shorter than prompt + new tokens, so the window really
slides while graphs replay. ``scripts/hf_families.py`` measures docs/MANUAL.md's table on the same models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from graphrt.hf.cache_keyword import accepted_cache_keyword

VOCAB = 128
WINDOW = 4  # sliding window of the sliding-window families
GENERATE_MODELS = ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"]
# initializer_range=0.5: with the default 0.02 the logits are nearly flat and greedy decoding
# collapses into one repeated token, hiding cache errors.
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.5, bos_token_id=1,
               eos_token_id=1, pad_token_id=0)
HYBRID = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, init_std=0.5, pad_token_id=0)
IMAGE_TOKEN, IMAGE_TOKENS = VOCAB - 1, 4  # a 8x8 image in 4x4 patches: 4 image tokens (CLIP's class token dropped)
LLAVA = dict(
    text_config=dict(DECODER, model_type="llama"), image_token_id=IMAGE_TOKEN, image_seq_length=IMAGE_TOKENS,
    vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16),
    vision_feature_layer=-1, vision_feature_select_strategy="default")
T5GEMMA_STACK = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, initializer_range=0.5, **HYBRID)


@dataclass(frozen=True)
class Family:
    """A model family's tiny config: transformers' config and model class names, the config's fields."""

    config: str
    model: str
    fields: Dict[str, Any] = field(default_factory=dict)
    sliding: bool = False  # has sliding-window layers (window WINDOW)
    # "tokens" (input_ids + attention_mask), "image" (tokens whose first IMAGE_TOKENS are an image's, and its
    # pixel_values) or "audio" (Whisper's input_features)
    inputs: str = "tokens"
    # The prefill runs eagerly on every call, its capture refused (named in failed_keys); the decode steps replay.
    # State-space and linear-attention hybrids: the prefill sets their layers' has_previous_state flags (Python,
    # RebindError); a VLM given an image: it counts the image's placeholder tokens on the host (HostSyncError).
    eager_prefill: bool = False
    # The first transformers release on which the family replays (of those the suite ran on: 5.17 and 5.24); before
    # it, its modeling code reads a device value on the host inside the step (HostSyncError) and every step runs
    # eagerly, with eager's tokens.
    replays_from: Optional[str] = None


FAMILIES: Dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", DECODER),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", DECODER),
    "qwen2-sliding": Family("Qwen2Config", "Qwen2ForCausalLM",
                            dict(DECODER, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), True),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, head_dim=8)),
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(DECODER, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", DECODER, True),  # default sliding_window=4096
    "mistral-window": Family("MistralConfig", "MistralForCausalLM", dict(DECODER, sliding_window=WINDOW), True),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(DECODER, **MOE)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=8)),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(DECODER, head_dim=8, **HYBRID), True),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(DECODER, head_dim=8, **HYBRID), True),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", DECODER),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", dict(DECODER, **HYBRID), True),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", dict(DECODER, **HYBRID), True),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", dict(DECODER, **HYBRID), True),
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", dict(DECODER, head_dim=8, **HYBRID, **MOE), True),
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        DECODER, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, initializer_range=0.5, bos_token_id=1,
        eos_token_id=1)),
    "gpt-neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", DECODER),
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32, init_std=0.5, bos_token_id=1, eos_token_id=1,
        pad_token_id=0)),
    "falcon": Family("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.5,
        bos_token_id=1, eos_token_id=1, pad_token_id=0)),
    "bloom": Family("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, initializer_range=0.5, bos_token_id=1,
        eos_token_id=1, pad_token_id=0)),
    "bamba": Family("BambaConfig", "BambaForCausalLM", dict(
        DECODER, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
        mamba_chunk_size=8), eager_prefill=True),
    "mamba": Family("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, initializer_range=0.5, bos_token_id=1,
        eos_token_id=1, pad_token_id=0), eager_prefill=True),
    "qwen3-next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        DECODER, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        eager_prefill=True),
    "llava": Family("LlavaConfig", "LlavaForConditionalGeneration", LLAVA),  # text only
    "llava-image": Family("LlavaConfig", "LlavaForConditionalGeneration", LLAVA, inputs="image", eager_prefill=True),
    "t5": Family("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, initializer_factor=16.0,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)),
    "bart": Family("BartConfig", "BartForConditionalGeneration", dict(
        SEQ2SEQ, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None), replays_from="5.24"),
    "t5gemma": Family("T5GemmaConfig", "T5GemmaForConditionalGeneration", dict(
        encoder=T5GEMMA_STACK, decoder=T5GEMMA_STACK, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        decoder_start_token_id=2), True, replays_from="5.24"),
    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration", dict(
        SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=64, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None), inputs="audio"),
}

# Families only the engine path's tests serve (graphrt.hf.engine_model; graph_generate's family table does not list them).
ENGINE_ONLY: Dict[str, Family] = {
    # Windows that live only in the mask: the attention function is not handed a sliding_window keyword.
    "qwen2-moe-sliding": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), True),
    "phimoe-window": Family("PhimoeConfig", "PhimoeForCausalLM", dict(DECODER, **MOE, sliding_window=WINDOW), True),
    "doge": Family("DogeConfig", "DogeForCausalLM", dict(DECODER, keep_window_size=WINDOW)),  # a bias in its mask
    # Its last two layers attend over the keys and values of the last earlier layer of their kind (KV sharing).
    "gemma3n": Family("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        DECODER, head_dim=8, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=WINDOW, num_kv_shared_layers=2, altup_num_inputs=2, laurel_rank=4,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, intermediate_size=[64] * 4,
        activation_sparsity_pattern=[0.0] * 4), True),
}


def replays_here(family: str) -> bool:
    """Whether the installed transformers is one on which ``family`` replays (see ``Family.replays_from``)."""
    from packaging.version import Version
    from transformers import __version__

    first = FAMILIES[family].replays_from
    return first is None or Version(__version__) >= Version(first)


def tiny_model(family: str, device: str = "cpu", **fields: Any) -> torch.nn.Module:
    """The family's tiny model with random weights (seed 0), in eval mode; ``fields`` override the config's."""
    import transformers

    spec = FAMILIES.get(family) or ENGINE_ONLY[family]
    torch.manual_seed(0)
    config = getattr(transformers, spec.config)(**{**spec.fields, **fields})
    return getattr(transformers, spec.model)(config).to(device).eval()


def family_inputs(family: str, batch: int, length: int = 5, seed: int = 1, padded_rows: int = 1) -> Dict[str, Any]:
    """generate()'s inputs: token prompts whose first ``padded_rows`` rows are left-padded (pad id 0,
    masked out), an image's placeholder tokens and pixels after the padding (VLMs: no other token is the image's),
    or Whisper's random log-mel features."""
    generator = torch.Generator().manual_seed(seed)
    if FAMILIES[family].inputs == "audio":
        return dict(input_features=torch.randn(batch, 8, 32, generator=generator))
    high = IMAGE_TOKEN if "image_token_id" in FAMILIES[family].fields else VOCAB  # text tokens only
    ids = torch.randint(3, high, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(min(padded_rows, batch - 1)):
        mask[row, : row + 1] = 0
        ids[row, : row + 1] = 0
    if FAMILIES[family].inputs == "image":
        ids[:, -IMAGE_TOKENS - 1:-1] = IMAGE_TOKEN  # after any padding, before the last text token
        return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(batch, 3, 8, 8, generator=generator))
    return dict(input_ids=ids, attention_mask=mask)


def tiny_causal_lm(kind: str, device: str = "cpu") -> torch.nn.Module:
    """The wrap() tests' 2-layer causal LMs (hidden 64). Mistral without a sliding window: the plain
    ``wrap(model.forward)`` form cannot replay transformers' sliding-window cache layer (it keeps a
    Python counter; capture fails with RebindError and the steps run eagerly)."""
    if kind == "gpt2":
        return tiny_model(kind, device, n_embd=64)
    fields: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128)
    if kind == "gemma":
        fields["head_dim"] = 16
    if kind == "mistral":
        fields["sliding_window"] = None
    return tiny_model(kind, device, **fields)


def cache_argument(model: torch.nn.Module, cache: Any) -> Dict[str, Any]:
    """``{keyword: cache}`` under the keyword the installed transformers' model takes (``cache`` from 5.24,
    ``past_key_values`` before), for ``model(...)`` and ``model.generate(...)`` alike."""
    return {accepted_cache_keyword(model.forward): cache}


def keys_at(names: Any, layout: int, batch: int) -> List[str]:
    """The keys among ``names`` for ``batch`` rows in layout ``layout`` (0: the first), whatever their kind is named
    (``decode/bs=2``, ``layout1:decode/bs=2``)."""
    prefix = f"layout{layout}:" if layout else ""
    return [name for name in names
            if name.startswith(prefix) and name.endswith(f"/bs={batch}") and (layout or ":" not in name)]


def failure_of(stats: Dict[str, Any], layout: int, batch: int) -> str:
    """Why the capture of the key for ``batch`` rows in layout ``layout`` failed (``stats()["failed_keys"]``)."""
    (key,) = keys_at(stats["failed_keys"], layout, batch)
    return stats["failed_keys"][key]


def captured_at(stats: Dict[str, Any], layout: int, batch: int) -> bool:
    """Whether layout ``layout`` has a graph recorded for ``batch`` rows."""
    return bool(keys_at(stats["captured_keys"], layout, batch))


class ForwardCalls:
    """Counts the forward calls generate() makes, apart from graphrt's own accounting."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forward, self.calls = model.forward, 0
        self.__wrapped__ = self.forward  # generate() reads forward's signature
        model.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.forward(*args, **kwargs)
