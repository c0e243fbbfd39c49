"""What the batch context (the objects every batch of a runner shares) tells graphrt about the model's state.

``batch_context`` holds the attention backend and the pools (``req_to_token_pool``,
``token_to_kv_pool``). The pools' sizes bound the indices a batch may carry, and the KV pool's
tensors are written only at ``out_cache_loc`` rows: during capture (pad values staged) only at the
scratch slot, so capture need not copy them to undo its writes.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Tuple

import torch


def table_sizes(context: Any) -> Tuple[Tuple[str, int], ...]:
    """The table sizes batch indices must stay below, where the batch context tells them: the KV
    pool's slots (``out_cache_loc``) and the request pool's rows (``req_pool_indices``). A pool
    gives its size as ``num_slots`` / ``num_requests`` (graphrt.reference) or ``size`` (SGLang's)."""
    sizes = []
    for field_name, pool_name, attribute in (("out_cache_loc", "token_to_kv_pool", "num_slots"),
                                             ("req_pool_indices", "req_to_token_pool", "num_requests")):
        pool = context.get(pool_name)
        size = getattr(pool, attribute, getattr(pool, "size", None)) if pool is not None else None
        if type(size) is int:
            sizes.append((field_name, size))
    return tuple(sizes)


def scratch_tensors(context: Mapping[str, Any]) -> List[torch.Tensor]:
    """The tensors the KV pool holds: its tensor attributes, and lists, tuples or dicts of tensors
    one level down (graphrt.reference's KVPool, SGLang's k_buffer/v_buffer)."""
    pool = context.get("token_to_kv_pool")
    found: List[torch.Tensor] = []
    for value in vars(pool).values() if hasattr(pool, "__dict__") else ():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        found.extend(item for item in items if isinstance(item, torch.Tensor))
    return found
