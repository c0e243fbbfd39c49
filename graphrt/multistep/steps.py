"""The steps of one multi-step launch: the batch of step ``j`` and the tokens a step chooses.

A ``decode(batch, steps)`` batch is step 0 with the slots of every step in ``out_cache_loc``
(step-major). Step ``j`` runs at ``positions + j``, ``seq_lens + j``, ``seq_lens_sum + j * bs`` and
the ``j``-th block of slots, on the tokens step ``j - 1`` chose. The graph of a multi-step key and
the step-by-step fallback build their steps with the same function, so both run the same batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from graphrt.batch import ForwardBatch

# next_tokens(output of a step, its index) -> the tokens it chose, [batch_size] (device ops only)
NextTokens = Callable[[Any, int], torch.Tensor]


def greedy(output: torch.Tensor, step: int) -> torch.Tensor:
    """The default ``next_tokens``: the most likely token of each row (``output.argmax(-1)``)."""
    return output.argmax(-1)


def batch_at_step(batch: ForwardBatch, step: int, input_ids: torch.Tensor, out_cache_loc: torch.Tensor,
                  host_mirror: bool = True) -> ForwardBatch:
    """Step ``step`` of the launch that ``batch`` (step 0) begins: positions, sequence lengths and
    their sum ``step`` further, ``input_ids`` and ``out_cache_loc`` given. ``host_mirror``: advance
    ``seq_lens_cpu`` too (steps run one by one); inside a graph there is none (host values are frozen)."""
    if step == 0:
        return dataclasses.replace(batch, input_ids=input_ids, out_cache_loc=out_cache_loc)
    mirror = batch.seq_lens_cpu
    return dataclasses.replace(
        batch,
        input_ids=input_ids,
        out_cache_loc=out_cache_loc,
        positions=None if batch.positions is None else batch.positions + step,
        seq_lens=batch.seq_lens + step,
        seq_lens_sum=batch.seq_lens_sum + step * batch.batch_size,
        seq_lens_cpu=mirror + step if host_mirror and mirror is not None else None,
    )


def chosen_tokens(tokens: Any, batch_size: int) -> torch.Tensor:
    """What ``next_tokens`` returned, as the int64 ids of the next step; TypeError/ValueError naming
    ``next_tokens`` when it is not one integer id per row."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise TypeError(f"next_tokens: expected an integer tensor of token ids, got {kind}")
    if tokens.shape != (batch_size,):
        raise ValueError(f"next_tokens: expected shape [{batch_size}] (one token per request), got {list(tokens.shape)}")
    return tokens.to(torch.int64)


def run_steps(one_step: Callable[[ForwardBatch], Any], batch: ForwardBatch, steps: int,
              next_tokens: NextTokens) -> torch.Tensor:
    """The steps of a launch one by one (``one_step``: a single-step replay or an eager step), each
    step's tokens, kept in an owned ``[steps, batch_size]`` int64 tensor (a later replay would
    overwrite a view of a step's outputs), the next step's input ids."""
    rows = batch.batch_size
    tokens = torch.empty((steps, rows), dtype=torch.int64, device=batch.input_ids.device)
    slots = batch.out_cache_loc.view(steps, rows)
    ids = batch.input_ids
    for step in range(steps):
        tokens[step].copy_(chosen_tokens(next_tokens(one_step(batch_at_step(batch, step, ids, slots[step])), step), rows))
        ids = tokens[step]
    return tokens
