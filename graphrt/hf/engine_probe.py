"""What the engine learns about a model before serving it, and why it refuses one it cannot serve exactly.

``probe_layers`` runs the model once on ``PROBE_TOKENS`` tokens with a recording attention function
(and transformers' masks built as for sdpa, never skipped), and keeps per layer: the key and value
shapes, the ``sliding_window`` keyword, whether its key tensor is one an earlier layer was handed
(KV sharing), and the mask the model gave it. ``plan_layout`` turns that into each layer's
``LayerKV``: its window is the keyword, else the band the mask shows (a window shorter than the
probe), else the window the model's config gives the layer (some models, Qwen2-MoE and PhiMoE among
them, apply their window only through the mask); and the mask must be exactly the causal mask of
that window, or the model is refused by name: graphrt's paged
attention takes what a token sees from the positions and the window, never from a mask, so a bias
or any other structure that lives only in the mask (Doge's per-key bias) would be dropped.

``ProbedModel.of`` is the whole probe an engine is built from, made again when the model changed
since (its ``ModelState``, graphrt.hf.model_state): the layout, the rotary embeddings whose frequencies
depend on the forward's length (noted in the probe step, graphrt.hf.request_rope), the device and the
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from graphrt.hf.kv_layout import KVLayout, LayerKV
from graphrt.hf.model_state import ModelState
from graphrt.hf.request_rope import RequestRopes, rotary_calls

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
PROBE_NAME = "graphrt_probe"  # the attention implementation (and mask) of the probe step
PROBE_TOKENS = 16  # a window shorter than this is seen in the probe's masks


@dataclass
class ProbedLayer:
    """One layer as the probe step saw it."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    window: int  # the sliding_window keyword (0: none)
    shares: Optional[int]  # the earlier layer handed the same key tensor (KV sharing), or None
    mask: Optional[torch.Tensor]  # the mask the model gave the layer (None: none)


class _Recorder:
    """The attention function of the probe step: records each layer, returns zeros of the output's shape."""

    def __init__(self) -> None:
        self.layers: Dict[int, ProbedLayer] = {}
        self._keys: List[Tuple[torch.Tensor, int]] = []  # kept alive so identities are not reused

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, sliding_window: Optional[int] = None, **kwargs: Any) -> Tuple[torch.Tensor, None]:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(f"model: its attention module {type(module).__name__} has no int layer_idx; graphrt's "
                             "paged attention keeps each layer's keys and values by that index")
        shares = next((earlier for tensor, earlier in self._keys if tensor is key), None)
        self._keys.append((key, layer))
        mask = attention_mask.detach().clone() if isinstance(attention_mask, torch.Tensor) else None
        self.layers[layer] = ProbedLayer(key.shape[1], key.shape[-1], value.shape[-1], key.dtype,
                                         int(sliding_window or 0), shares, mask)
        return query.new_zeros((*query.shape[:1], query.shape[2], query.shape[1], value.shape[-1])), None


def refusal(model: Any) -> Optional[str]:
    """Why ``model`` cannot run on the engine path (None when it can, as far as its class and config
    tell; the probe may find more): it does not declare transformers' modeling-backend contract, or
    some of its layers are not attention layers."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{name} does not declare transformers' modeling-backend contract (_supports_attention_backend); "
                "its attention cannot be replaced by graphrt's paged attention")
    text = model.config.get_text_config()
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        return (f"{name} has layers of type {', '.join(other)}: only {' and '.join(ATTENTION_LAYER_TYPES)} layers "
                "can keep their state in graphrt's paged KV pool")
    return None


def probe_layers(model: Any, switch: Any) -> Dict[int, ProbedLayer]:
    """Each layer as seen by one step of the model on ``PROBE_TOKENS`` tokens; ``switch(name)``: the
    context manager that makes ``name`` the model's attention implementation for the step."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def full_mask(*args: Any, **kwargs: Any) -> Any:  # every mask materialized, never skipped as causal
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    recorder = _Recorder()
    AttentionInterface.register(PROBE_NAME, recorder)
    AttentionMaskInterface.register(PROBE_NAME, full_mask)
    device = next(model.parameters()).device
    ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.int64, device=device)
    positions = torch.arange(PROBE_TOKENS, device=device)[None]
    with switch(PROBE_NAME), torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    return recorder.layers


def plan_layout(model: Any, probed: Dict[int, ProbedLayer], num_request_rows: int, max_context: int,
                max_step_tokens: int, num_slots: int) -> KVLayout:
    """Each layer's ``LayerKV`` from the probe; ValueError naming the model and the layer when a layer
    does not attend through transformers' AttentionInterface, or its mask says more than its window."""
    name = type(model).__name__
    text = model.config.get_text_config()
    num_layers = text.num_hidden_layers
    if sorted(probed) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(probed))
        raise ValueError(f"model: {name} layers {missing} do not attend through transformers' AttentionInterface; "
                         "their state cannot live in graphrt's paged KV pool")
    layers: List[LayerKV] = []
    for index in range(num_layers):
        seen = probed[index]
        window = seen.window or _mask_band(seen.mask) or _configured_window(text, index)
        wrong = _mask_difference(seen.mask, window)
        if wrong is not None:
            raise ValueError(f"model: {name} layer {index}: {wrong}; graphrt's paged attention applies causal "
                             f"attention{f' with a window of {window}' if window else ''} from positions alone "
                             "and would drop it")
        if seen.shares is not None:
            producer = layers[seen.shares]
            if producer.ring and not 0 < window <= producer.window:
                raise ValueError(f"model: {name} layer {index} reads layer {seen.shares}'s keys and values, which "
                                 f"keep a window of {producer.window}, but sees {window or 'every position'}")
            layers.append(LayerKV(seen.num_kv_heads, seen.k_dim, seen.v_dim, seen.dtype, window, producer.ring,
                                  seen.shares if producer.producer < 0 else producer.producer))
            continue
        ring = window - 1 + max_step_tokens if window else 0
        layers.append(LayerKV(seen.num_kv_heads, seen.k_dim, seen.v_dim, seen.dtype, window,
                              ring if ring < max_context else 0))
    return KVLayout(layers, num_request_rows, num_slots)


@dataclass
class ProbedModel:
    """What an engine serves its model from: the KV layout, the length-dependent rotary embeddings, where
    the model is, its vocabulary, and the ``ModelState`` they were read from."""

    layout: KVLayout
    ropes: RequestRopes
    device: torch.device
    vocab_size: int
    state: ModelState

    @classmethod
    def of(cls, model: Any, switch: Callable[[str], Any], num_request_rows: int, max_context: int,
           max_step_tokens: int, num_slots: int) -> "ProbedModel":
        """The probe step (``probe_layers``, its rotary calls noted), its layout and rotary embeddings;
        ValueError naming why the model cannot be served."""
        state = ModelState(model)
        with rotary_calls(model) as calls:
            probed = probe_layers(model, switch)
        layout = plan_layout(model, probed, num_request_rows, max_context, max_step_tokens, num_slots)
        return cls(layout, RequestRopes.build(model, calls, max_context), next(model.parameters()).device,
                   model.get_input_embeddings().num_embeddings, state)

    def serves_like(self, other: "ProbedModel") -> bool:
        """Whether ``other`` (a probe again) read what this one did: then what was built from this one serves."""
        return (self.layout.layers == other.layout.layers and self.device == other.device
                and self.vocab_size == other.vocab_size and self.ropes.same_as(other.ropes))


def _configured_window(text_config: Any, index: int) -> int:
    """The window the config gives layer ``index`` (0: none), as transformers' continuous batching reads
    it: ``sliding_window`` for the layers ``layer_types`` calls sliding, or for every layer without
    ``layer_types``."""
    window = getattr(text_config, "sliding_window", None) or 0
    types = getattr(text_config, "layer_types", None)
    return window if types is None or types[index] == "sliding_attention" else 0


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """[rows, PROBE_TOKENS, PROBE_TOKENS] bool: which keys each query of the mask sees (bool: True; additive:
    not the dtype's minimum or -inf)."""
    flat = mask.reshape(-1, PROBE_TOKENS, PROBE_TOKENS)
    if mask.dtype == torch.bool:
        return flat
    return flat > (torch.finfo(mask.dtype).min / 2 if mask.dtype.is_floating_point else -1)


def _mask_band(mask: Optional[torch.Tensor]) -> int:
    """The window a probe mask shows when it is narrower than the probe step (the keys its last query
    sees), else 0; the mask's full check is ``_mask_difference``."""
    if mask is None or mask.dim() < 2 or mask.shape[-2:] != (PROBE_TOKENS, PROBE_TOKENS):
        return 0
    seen = int(_visible(mask)[0, -1].sum())
    return seen if 0 < seen < PROBE_TOKENS else 0


def _mask_difference(mask: Optional[torch.Tensor], window: int) -> Optional[str]:
    """How the probe's ``mask`` differs from the causal mask of ``window`` (0: none), or None (None: no mask)."""
    if mask is None:
        return None
    if mask.dim() < 2 or mask.shape[-2:] != (PROBE_TOKENS, PROBE_TOKENS):
        return f"its attention mask has shape {list(mask.shape)}, not [..., {PROBE_TOKENS}, {PROBE_TOKENS}] for a " \
               f"step of {PROBE_TOKENS} tokens"
    visible = _visible(mask)
    if mask.dtype != torch.bool and bool((mask.reshape(visible.shape).masked_fill(~visible, 0) != 0).any()):
        return "its attention mask adds a bias to the scores of the keys it shows"
    if not bool((visible == visible[:1]).all()):
        return "its attention mask differs between heads or rows"
    query = torch.arange(PROBE_TOKENS, device=mask.device)[:, None]
    key = torch.arange(PROBE_TOKENS, device=mask.device)[None, :]
    expected = (key <= query) & ((key > query - window) if window else True)
    if not bool((visible[0] == expected).all()):
        shown = int(visible[0].sum())
        return f"its attention mask shows {shown} of the {PROBE_TOKENS * PROBE_TOKENS} query-key pairs of a " \
               f"{PROBE_TOKENS}-token step where causal attention{f' with a window of {window}' if window else ''} " \
               f"shows {int(expected.sum())}"
    return None


__all__ = ["ATTENTION_LAYER_TYPES", "PROBE_NAME", "PROBE_TOKENS", "ProbedLayer", "ProbedModel", "plan_layout",
           "probe_layers", "refusal"]
