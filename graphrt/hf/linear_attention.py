"""Linear-attention and state-space cache layers (Mamba, Bamba, Jamba, Qwen3-Next, LFM2, ...) in graphs.

transformers' ``LinearAttentionLayer`` keeps fixed-size conv and recurrent states per state index,
allocated on the first update and written in place after (``copy_``): a graph reads and writes the
same tensors on every replay, and ``reset()`` zeroes them in place, so a cache is reused across
``generate()`` calls as a StaticCache is. Its Python state is a flag per state, ``has_previous_state``,
that ``update_conv_state()`` sets on the first step after a ``reset()`` and the model branches on
(prefill or single-token update). Decode steps leave it as it is and replay; the prefill sets it, so
its capture fails (``RebindError`` naming the flag) and it runs eagerly on every call, setting the
flag as eager does: 15 of 16 forward calls of a 16-token ``generate()`` replay.

While ``record_past`` is on (assisted decoding), the conv states grow by ``torch.cat`` and are
rebound: such a layer is not graph-safe.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


def linear_attention_kinds() -> Tuple[type, ...]:
    """The linear-attention layer classes of the installed transformers whose state is all fixed-size tensors
    (the plain layer, and the one that also holds a full-attention StaticLayer); none before transformers had them."""
    from transformers import cache_utils

    names = ("LinearAttentionLayer", "LinearAttentionAndStaticFullAttentionLayer")
    return tuple(getattr(cache_utils, name) for name in names if hasattr(cache_utils, name))


def linear_attention_unsafe(layer: Any) -> Optional[str]:
    """Why a linear-attention layer cannot replay (its conv states grow and are rebound), or None."""
    if getattr(layer, "record_past", False):
        return "it records past states (assisted decoding): its conv states grow and are rebound on every step"
    return None


__all__ = ["linear_attention_kinds", "linear_attention_unsafe"]
