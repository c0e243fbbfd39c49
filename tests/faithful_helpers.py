"""Shared by the test_faithful_* files: generator snapshots, exact comparison, batches on a device."""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import torch
from ubatch_helpers import make_batch

from graphrt import ForwardBatch


def rng_state(device: str) -> Tuple[torch.Tensor, ...]:
    """The default generators' states: CPU always, plus the current CUDA device's when ``device`` is cuda."""
    states = [torch.get_rng_state()]
    if torch.device(device).type == "cuda":
        states.append(torch.cuda.get_rng_state())
    return tuple(states)


def set_rng_state(states: Tuple[torch.Tensor, ...]) -> None:
    """Put back what ``rng_state`` returned."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def same_rng_state(first: Tuple[torch.Tensor, ...], second: Tuple[torch.Tensor, ...]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def assert_identical(actual: Any, expected: Any) -> None:
    """Bitwise equality of tensors (or tuples/lists/dicts of them): the same ops on the same inputs
    and the same random draws give the same bits, whether replayed or run eagerly."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def extend_batch(counts, device: str = "cpu", seed: int = 0) -> ForwardBatch:
    """A valid EXTEND batch with ``counts[i]`` new tokens for request i, its tensors on ``device``
    (the host mirrors stay on the CPU), no attention backend."""
    batch = make_batch(counts, seed=seed)
    moved = {field.name: getattr(batch, field.name).to(device) for field in dataclasses.fields(batch)
             if isinstance(getattr(batch, field.name), torch.Tensor) and not field.name.endswith("_cpu")}
    return dataclasses.replace(batch, attn_backend=None, **moved)


def pad_tokens(batch: ForwardBatch, num_tokens: int) -> ForwardBatch:
    """``batch`` with its token fields padded eagerly to ``num_tokens`` rows with graphrt's default
    pad values (``input_ids``, ``positions`` and ``out_cache_loc`` 0): the rows a piecewise replay
    of that size computes, for models that read token fields only."""
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(num_tokens - tensor.shape[0])])

    return dataclasses.replace(batch, input_ids=pad(batch.input_ids), positions=pad(batch.positions),
                               out_cache_loc=pad(batch.out_cache_loc))
