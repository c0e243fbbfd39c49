"""Multi-step decode tests' helpers: a model reading its cache through a request-to-slot table on
the device, an engine that maps the slots of a launch ahead, and the eager oracle (K steps written
out by hand, not through graphrt's own step builder)."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from conftest import pad_batch

from graphrt import ForwardBatch, ForwardMode

VOCAB, HIDDEN, CONTEXT, REQUESTS, SLOTS = 61, 16, 40, 12, 512


class TableAttentionModel(torch.nn.Module):
    """Token ``t`` of request ``r`` writes its state at ``out_cache_loc[t]`` and attends the slots
    ``req_to_token[r, :seq_lens[r]]`` (gathered through the table on the device, masked by length);
    row 0 of the table is the dummy request (every slot the scratch slot 0)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))
        self.pos = torch.nn.Parameter(torch.randn(CONTEXT, HIDDEN, generator=generator))
        self.proj = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=generator) / HIDDEN**0.5)
        self.kv = torch.zeros(SLOTS, HIDDEN)
        self.req_to_token = torch.zeros(REQUESTS, CONTEXT, dtype=torch.int64)
        self.arange = torch.arange(CONTEXT)
        self.requires_grad_(False)

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed[input_ids] + self.pos[positions]
        self.kv[forward_batch.out_cache_loc] = hidden
        keys = self.kv[self.req_to_token[forward_batch.req_pool_indices]]  # [bs, CONTEXT, HIDDEN]
        scores = (keys @ hidden.unsqueeze(-1)).squeeze(-1)
        scores = scores.masked_fill(self.arange >= forward_batch.seq_lens.unsqueeze(1), float("-inf"))
        context = (scores.softmax(-1).unsqueeze(-1) * keys).sum(1)
        return (hidden + 4 * context) @ self.proj  # the cache weighs: other contents, other tokens


class TableEngine:
    """Requests of the table model with random cached prefixes; ``launch`` maps the slots of the next
    ``steps`` positions of each request ahead (table and step-major ``out_cache_loc``)."""

    def __init__(self, model: TableAttentionModel, batch_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.model = model
        self.reqs = [int(r) + 1 for r in torch.randperm(REQUESTS - 1, generator=generator)[:batch_size]]
        self.lens = [int(n) for n in torch.randint(2, 12, (batch_size,), generator=generator)]
        self.free = [int(s) + 1 for s in torch.randperm(SLOTS - 1, generator=generator)]
        for req, length in zip(self.reqs, self.lens):
            slots = self._take(length)
            model.req_to_token[req, :length] = slots
            model.kv[slots] = torch.randn(length, HIDDEN, generator=generator)
        self.ids = torch.randint(0, VOCAB, (batch_size,), generator=generator)

    def _take(self, count: int) -> torch.Tensor:
        taken, self.free = self.free[:count], self.free[count:]
        return torch.tensor(taken)

    def launch(self, steps: int) -> ForwardBatch:
        """The next launch's batch (step 0): the slots of its ``steps`` steps mapped ahead."""
        bs = len(self.reqs)
        slots = self._take(steps * bs).view(steps, bs)
        for row, (req, length) in enumerate(zip(self.reqs, self.lens)):
            self.model.req_to_token[req, length:length + steps] = slots[:, row]
        seq_lens = [length + 1 for length in self.lens]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.ids.clone(),
            req_pool_indices=torch.tensor(self.reqs), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            out_cache_loc=slots.reshape(-1), seq_lens_sum=sum(seq_lens),
            positions=torch.tensor(self.lens), seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )
        self.lens = [length + steps for length in self.lens]
        return batch

    def advance(self, tokens: torch.Tensor) -> None:
        """The next launch continues from the last tokens chosen."""
        self.ids = tokens[-1].clone()


def eager_steps(forward: Callable[[ForwardBatch], object], batch: ForwardBatch, steps: int,
                next_tokens: Optional[Callable] = None) -> torch.Tensor:
    """The oracle: ``steps`` eager steps of ``batch`` written out field by field."""
    next_tokens = next_tokens or (lambda output, step: output.argmax(-1))
    bs = batch.batch_size
    ids, chosen = batch.input_ids, []
    for step in range(steps):
        seq_lens = batch.seq_lens + step
        step_batch = dataclasses.replace(
            batch, input_ids=ids, positions=batch.positions + step, seq_lens=seq_lens,
            out_cache_loc=batch.out_cache_loc[step * bs:(step + 1) * bs],
            seq_lens_sum=batch.seq_lens_sum + step * bs,
            seq_lens_cpu=None if batch.seq_lens_cpu is None else batch.seq_lens_cpu + step)
        ids = next_tokens(forward(step_batch), step)
        chosen.append(ids)
    return torch.stack(chosen)


def pad_launch(batch: ForwardBatch, padded: int, steps: int) -> ForwardBatch:
    """A launch padded as the runner pads it: each step's padding rows write the scratch slot 0."""
    bs = batch.batch_size
    single = pad_batch(dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc[:bs], seq_lens_cpu=None), padded)
    slots = torch.zeros(steps, padded, dtype=torch.int64)
    slots[:, :bs] = batch.out_cache_loc.view(steps, bs)
    return dataclasses.replace(single, out_cache_loc=slots.reshape(-1))


def sample(output: torch.Tensor, step: int) -> torch.Tensor:
    """Seeded sampling from torch's default generator (temperature 0.7)."""
    return torch.multinomial(F.softmax(output / 0.7, dim=-1), 1).squeeze(-1)


def state(model: torch.nn.Module) -> List[torch.Tensor]:
    """Copies of what a step writes: the KV cache (and the table, read only)."""
    return [model.kv.clone(), model.req_to_token.clone()]
