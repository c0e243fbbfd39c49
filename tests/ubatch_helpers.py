"""Shared by the micro-batching tests: batches, a row-wise model, capture sizes (no hypothesis needed)."""

from __future__ import annotations

import torch

from graphrt.batch import ForwardBatch, ForwardMode

SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
SIZE_SETS = [SIZES, [8, 16, 32, 64], [1, 2, 4, 8, 16], [4, 12, 20]]


def make_batch(counts, seed: int = 0, mirrors: bool = True) -> ForwardBatch:
    """A valid batch with ``counts[i]`` new tokens for request i: DECODE when all are 1, else EXTEND."""
    gen = torch.Generator().manual_seed(seed)
    reqs, tokens = len(counts), sum(counts)
    new = torch.tensor(counts, dtype=torch.int32)
    decode = all(count == 1 for count in counts)
    prefix = torch.randint(0, 30, (reqs,), generator=gen, dtype=torch.int32) + (1 if decode else 0)
    seq_lens = prefix + new
    positions = torch.cat([torch.arange(int(p), int(p) + c) for p, c in zip(prefix, counts)])
    fields = dict(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=reqs,
        input_ids=torch.randint(0, 1000, (tokens,), generator=gen),
        req_pool_indices=torch.randperm(reqs, generator=gen) + 1,
        seq_lens=seq_lens,
        out_cache_loc=torch.randperm(tokens, generator=gen) + 1,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.clone() if mirrors else None,
        positions=positions - 1 if decode else positions,
        attn_backend=object(),
    )
    if not decode:
        fields.update(
            extend_num_tokens=tokens,
            extend_seq_lens=new,
            extend_prefix_lens=prefix,
            extend_start_loc=torch.cumsum(new, 0, dtype=torch.int32) - new,
            extend_seq_lens_cpu=list(counts) if mirrors else None,
            extend_prefix_lens_cpu=prefix.tolist() if mirrors else None,
        )
        fields["positions"] = positions
    return ForwardBatch(**fields)


def batch_model(batch: ForwardBatch) -> torch.Tensor:
    """Integer features of every token, read through its request's fields: exact, and wrong for a bad split."""
    batch.validate()
    assert batch.seq_lens_sum == int(batch.seq_lens.sum())
    device = batch.input_ids.device  # the helpers' own index tensors live beside the batch (cpu or cuda)
    if batch.forward_mode.is_extend():
        req = torch.repeat_interleave(torch.arange(batch.batch_size, device=device), batch.extend_seq_lens.long())
        offset = torch.arange(batch.num_tokens, device=device) - batch.extend_start_loc.long()[req]
        assert torch.equal(batch.positions.long(), batch.extend_prefix_lens.long()[req] + offset)
    else:
        req = torch.arange(batch.batch_size, device=device)
        offset = torch.zeros(batch.batch_size, dtype=torch.long, device=device)
    columns = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices[req],
               batch.seq_lens[req], offset]
    return torch.stack([column.long() for column in columns], dim=1)


def call_and_close(wrapper, batch):
    try:
        return wrapper(batch)
    finally:
        wrapper.close()


# ---- ForwardBatch splitting and output equality ----
