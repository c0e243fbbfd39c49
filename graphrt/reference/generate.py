"""Batch builders and a greedy generation loop for the reference decoder.

Per-request bookkeeping (lengths, request rows) stays on the host as Python ints, so
``seq_lens_sum`` and ``seq_lens_cpu`` are filled without reading device memory, and
the decode loop feeds each step's argmax back as the next ``input_ids`` on the device:
the only device-to-host read is the final transfer of the generated tokens.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.reference.kv_cache import DUMMY_REQUEST, SCRATCH_SLOT, CachePools
from graphrt.reference.model import ReferenceDecoder, run_eager

logger = logging.getLogger(__name__)

StepFn = Callable[[ForwardBatch], torch.Tensor]
Device = Union[str, torch.device]


def _index_tensor(values: Sequence[int], device: Device) -> torch.Tensor:
    """A host list of ints as an int64 tensor on ``device`` (one host-to-device copy)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _context(pools: Optional[CachePools], attn_backend: Any) -> dict:
    """The runner-set ForwardBatch fields that point at the cache and the backend."""
    return dict(
        req_to_token_pool=pools.req_to_token if pools is not None else None,
        token_to_kv_pool=pools.kv if pools is not None else None,
        attn_backend=attn_backend,
    )


def graph_runner_kwargs(attn_backend: Any, pools: CachePools) -> dict:
    """The ``batch_context`` and ``pad_values`` a GraphRunner needs to capture the reference model."""
    return dict(
        batch_context=_context(pools, attn_backend),
        pad_values={"out_cache_loc": SCRATCH_SLOT, "req_pool_indices": DUMMY_REQUEST},
    )


def make_decode_batch(
    input_ids: Union[torch.Tensor, Sequence[int]],
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: Device,
    pools: Optional[CachePools] = None,
    attn_backend: Any = None,
) -> ForwardBatch:
    """A DECODE batch: one new token per request; ``seq_lens`` count that token."""
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    if not isinstance(input_ids, torch.Tensor):
        input_ids = _index_tensor(input_ids, device)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=input_ids,
        req_pool_indices=_index_tensor(req_pool_indices, device),
        seq_lens=seq_lens_cpu.to(device),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        positions=(seq_lens_cpu - 1).to(device),
        **_context(pools, attn_backend),
    )


def make_extend_batch(
    token_ids: Sequence[Sequence[int]],
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: Device,
    mode: ForwardMode = ForwardMode.EXTEND,
    pools: Optional[CachePools] = None,
    attn_backend: Any = None,
) -> ForwardBatch:
    """An EXTEND (or MIXED) batch: request i adds ``token_ids[i]`` after ``prefix_lens[i]`` cached tokens.

    A decode request inside a MIXED batch is a one-token chunk whose prefix is its cache.
    """
    extend_lens = [len(ids) for ids in token_ids]
    seq_lens = [prefix + extend for prefix, extend in zip(prefix_lens, extend_lens)]
    start_loc = [0, *itertools.accumulate(extend_lens)][:-1]
    positions = [pos for prefix, extend in zip(prefix_lens, extend_lens) for pos in range(prefix, prefix + extend)]
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(token_ids),
        input_ids=_index_tensor([tok for ids in token_ids for tok in ids], device),
        req_pool_indices=_index_tensor(req_pool_indices, device),
        seq_lens=seq_lens_cpu.to(device),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        positions=_index_tensor(positions, device),
        extend_num_tokens=sum(extend_lens),
        extend_seq_lens=_index_tensor(extend_lens, device),
        extend_prefix_lens=_index_tensor(prefix_lens, device),
        extend_start_loc=_index_tensor(start_loc, device),
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=extend_lens,
        **_context(pools, attn_backend),
    )


def generate_greedy(
    model: ReferenceDecoder,
    backend: Any,
    pools: CachePools,
    prompts: List[List[int]],
    max_new_tokens: int,
    step: Optional[StepFn] = None,
) -> List[List[int]]:
    """Greedy-decode ``max_new_tokens`` tokens per prompt; prefill runs eagerly, decode through ``step``.

    ``step(forward_batch) -> logits`` for the batch's real tokens defaults to ``run_eager``;
    pass a graphrt ``GraphRunner`` to decode through graphs. Pools are released on return.
    """
    if backend is not model.attn_backend:
        raise ValueError("backend: expected the attention backend the model was built with")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token lists")
    step = step if step is not None else (lambda batch: run_eager(model, batch))
    device = pools.req_to_token.device
    reqs: List[int] = []
    cached: List[int] = []  # KV slots assigned per request, for release on any exit
    try:
        for _ in prompts:
            reqs.append(pools.req_to_token.alloc())
            cached.append(0)
        lens = [len(prompt) for prompt in prompts]
        out_loc = pools.assign(reqs, cached, lens)
        cached = list(lens)
        prefill = make_extend_batch(
            prompts, reqs, [0] * len(prompts), out_loc, device, pools=pools, attn_backend=backend
        )
        last_rows = _index_tensor([end - 1 for end in itertools.accumulate(lens)], device)
        next_ids = run_eager(model, prefill)[last_rows].argmax(-1)
        generated = [next_ids]
        for _ in range(max_new_tokens - 1):
            out_loc = pools.assign(reqs, cached, [1] * len(reqs))
            cached = [n + 1 for n in cached]
            batch = make_decode_batch(next_ids, reqs, cached, out_loc, device, pools=pools, attn_backend=backend)
            next_ids = step(batch).argmax(-1)
            generated.append(next_ids)
        tokens = torch.stack(generated, dim=1).tolist()
    finally:
        for req, count in zip(reqs, cached):
            pools.release(req, count)
    logger.debug("generated %d x %d tokens", len(prompts), max_new_tokens)
    return tokens
