"""Per-request sampling: parameters, penalties, and one sampling step."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

# Neutral value of each sampling parameter (no effect on the distribution).
SAMPLING_DEFAULTS: Dict[str, float] = {
    "temperatures": 1.0,
    "top_ks": -1,
    "top_ps": 1.0,
    "min_ps": 0.0,
    "repetition_penalties": 1.0,
    "presence_penalties": 0.0,
    "frequency_penalties": 0.0,
}
# Allowed values per parameter; presence/frequency penalties accept any float.
SAMPLING_RULES: Dict[str, Tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    "temperatures": (lambda x: x >= 0, ">= 0 (0 means greedy)"),
    "top_ks": (lambda x: (x == -1) | (x >= 1), "-1 (disabled) or >= 1"),
    "top_ps": (lambda x: (x > 0) & (x <= 1), "in (0, 1]"),
    "min_ps": (lambda x: (x >= 0) & (x <= 1), "in [0, 1]"),
    "repetition_penalties": (lambda x: x > 0, "> 0"),
}


def check_sampling_values(name: str, values: Any) -> None:
    """Raise ValueError naming the parameter when any value (scalar or array) is outside its range."""
    rule = SAMPLING_RULES.get(name)
    if rule is None:
        return
    if isinstance(values, (int, float)):  # per-request hot path: plain Python, no numpy
        if rule[0](values) and math.isfinite(values):
            return
        bad = values
    else:
        array = np.asarray(values)
        ok = rule[0](array) & np.isfinite(array)
        if ok.all():
            return
        bad = array[~ok].flat[0].item()
    raise ValueError(f"{name}: expected values {rule[1]}, got {bad!r}")


@dataclass
class SamplingMetadata:
    """Per-request sampling parameters: 1-D host (CPU) tensors, float32 except ``top_ks`` (int64)."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    repetition_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor

    @classmethod
    def from_defaults(cls, num_reqs: int) -> "SamplingMetadata":
        """Neutral parameters (temperature 1, no top-k/top-p/min-p, no penalties) for ``num_reqs`` rows."""
        return cls(**{n: torch.full((num_reqs,), v, dtype=_sampling_dtype(n)) for n, v in SAMPLING_DEFAULTS.items()})

    @classmethod
    def from_params(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        min_ps: Optional[Sequence[float]] = None,
        repetition_penalties: Optional[Sequence[float]] = None,
        presence_penalties: Optional[Sequence[float]] = None,
        frequency_penalties: Optional[Sequence[float]] = None,
    ) -> "SamplingMetadata":
        """Build from per-request sequences; omitted ones default, lengths and ranges are validated."""
        given = dict(zip(SAMPLING_DEFAULTS, (temperatures, top_ks, top_ps, min_ps, repetition_penalties,
                                             presence_penalties, frequency_penalties)))
        metadata = cls.from_defaults(len(temperatures))
        for name, values in given.items():
            if values is None:
                continue
            tensor = torch.as_tensor(values, dtype=_sampling_dtype(name))
            if tensor.shape != (metadata.num_reqs,):
                raise ValueError(f"{name}: expected {metadata.num_reqs} entries (one per temperature), got shape "
                                 f"{list(tensor.shape)}")
            check_sampling_values(name, tensor.numpy())
            setattr(metadata, name, tensor)
        return metadata

    @property
    def num_reqs(self) -> int:
        """Number of requests (rows)."""
        return self.temperatures.shape[0]

    def slice(self, start: int, end: int) -> "SamplingMetadata":
        """Views of rows ``[start, end)``, lining up with ``InputBatch`` request indices."""
        return self.map(lambda t: t[start:end])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "SamplingMetadata":
        """A new metadata with ``fn`` applied to every parameter tensor (slicing, moving)."""
        return SamplingMetadata(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def is_greedy(self) -> torch.Tensor:
        """Bool per request: temperature 0 means argmax decoding."""
        return self.temperatures == 0


def _sampling_dtype(name: str) -> torch.dtype:
    return torch.int64 if name == "top_ks" else torch.float32


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata, token_counts: torch.Tensor,
                    repeated: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Repetition (HF-style), presence and frequency penalties from per-request output token counts;
    ``repeated`` ([num_reqs, vocab] bool, default: the output's tokens) is where the repetition
    penalty applies (a request's prompt and output, as vLLM and ``generate()`` count it)."""
    counts = token_counts.to(logits.device, logits.dtype)
    seen = counts > 0
    rep = meta.repetition_penalties[:, None]
    logits = torch.where(seen if repeated is None else repeated, torch.where(logits > 0, logits / rep, logits * rep),
                         logits)
    return logits - meta.presence_penalties[:, None] * seen - meta.frequency_penalties[:, None] * counts


def sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    generator: Optional[torch.Generator] = None,
    token_counts: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, else temperature -> top-k -> top-p -> min-p sampling.

    Each row uses its own parameters. min-p is relative to the most likely token after
    top-k. Penalties apply only when ``token_counts`` ([num_reqs, vocab] counts of each
    request's output tokens so far) is given.
    """
    if logits.dim() != 2 or logits.shape[0] != metadata.num_reqs:
        raise ValueError(f"logits: expected shape [num_reqs={metadata.num_reqs}, vocab], got {list(logits.shape)}")
    greedy_host = metadata.is_greedy()
    meta = metadata.map(lambda t: t.to(logits.device, non_blocking=True))
    logits = logits.float()
    if token_counts is not None:
        logits = apply_penalties(logits, meta, token_counts)
    greedy_tokens = logits.argmax(dim=-1)
    if bool(greedy_host.all()):
        return greedy_tokens
    probs, sorted_ids = sampling_distribution(logits, meta)
    choice = torch.multinomial(probs, 1, generator=generator)
    return torch.where(meta.is_greedy(), greedy_tokens, sorted_ids.gather(1, choice).squeeze(1))


def sampling_distribution(logits: torch.Tensor, meta: SamplingMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the sampled rows of float32 ``logits`` [rows, vocab] draw from, row by row: the probabilities
    sorted from the most likely token down, after temperature, top-k, top-p and min-p (``meta`` on the
    logits' device; a greedy row's is unused), and the token ids in that order."""
    greedy = meta.is_greedy()
    scaled = logits / torch.where(greedy, 1.0, meta.temperatures)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where(meta.top_ks > 0, meta.top_ks.clamp(max=vocab), vocab)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    outside_top_p = ((probs.cumsum(dim=-1) - probs) >= meta.top_ps[:, None]) & (meta.top_ps < 1)[:, None]
    below_min_p = probs < meta.min_ps[:, None] * probs[:, :1]
    sorted_logits.masked_fill_(outside_top_p | below_min_p, float("-inf"))
    return sorted_logits.softmax(dim=-1), sorted_ids
