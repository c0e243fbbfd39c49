"""Each request's next token as ``generate()`` would choose it, whatever else the step carries, on the device.

A step's chosen rows (one per request whose chunk ends its prompt, or that decodes) go through the
call's generation-config rules (graphrt.hf.logits_rules), then ``sampling``'s penalties (repetition over
prompt and output, presence and frequency over the output, as vLLM does) and sampling, all rows at once:
device ops only, the tokens written into a device tensor the engine reads back once per step. The one
thing done per row is the draw of a sampled (not greedy) row, from that request's own generator (as
vLLM draws seeded requests), so a request's token depends on its logits, its ids and its generator
only: the same alone or beside others, eager or through graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np
import torch

from graphrt.hf.logits_rules import GenerationRules, RowIds
from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata, apply_penalties, sampling_distribution

PENALTIES = ("repetition_penalties", "presence_penalties", "frequency_penalties")
# The float parameters of a chosen row, in the columns of ``TokenChooser.params`` (top_ks apart: int64).
FLOAT_PARAMETERS = ("temperatures", "top_ps", "min_ps", *PENALTIES)


@dataclass
class RequestTokens:
    """What one request's choice of tokens reads: its prompt and output, its generator, its sampling row."""

    prompt: List[int]
    output: List[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    sampling: Optional[SamplingMetadata] = None  # its row of the call's sampling (None: greedy)

    @property
    def draws(self) -> bool:
        """Whether its tokens are drawn (a temperature above 0), not the argmax."""
        return self.sampling is not None and not bool(self.sampling.is_greedy()[0])

    @property
    def has_penalties(self) -> bool:
        return self.sampling is not None and any(
            float(getattr(self.sampling, name)[0]) != SAMPLING_DEFAULTS[name] for name in PENALTIES)


@dataclass(frozen=True)
class ChosenRows:
    """A step's chosen rows as the chooser reads them on the device: ``ids`` (None unless the call's rules
    or penalties read them), ``params`` [rows, len(FLOAT_PARAMETERS)] float32 and ``top_ks`` [rows] int64
    (None for greedy calls), and which request each row is (``requests``: indices into the call's)."""

    ids: Optional[RowIds]
    params: Optional[torch.Tensor]
    top_ks: Optional[torch.Tensor]
    requests: Sequence[int]


class TokenChooser:
    """The token choice of one ``generate`` call over logits of ``vocab`` columns on ``device``: its rules and
    every request's sampling row and generator. ``greedy``: every token is the argmax of its logits; ``needs_ids``: rules or penalties read the rows'
    ids; ``sampled``: rows carry sampling parameters (``params``, ``top_ks``, one row per request)."""

    def __init__(self, rules: GenerationRules, requests: Sequence[RequestTokens], vocab: int,
                 device: torch.device) -> None:
        rules.prepare(vocab, device)  # the rules' constants on the device before the first step
        self.rules = rules
        self.sampled = any(request.sampling is not None for request in requests)
        self.penalties = any(request.has_penalties for request in requests)
        self.greedy = not rules.names and not self.penalties and not any(request.draws for request in requests)
        self.needs_ids = rules.needs_ids or self.penalties
        self.generators = [request.generator if request.draws else None for request in requests]
        self.prompt_lengths = np.array([len(request.prompt) for request in requests], dtype=np.int64)
        self.params = np.array([[SAMPLING_DEFAULTS[name] for name in FLOAT_PARAMETERS]] * len(requests),
                               dtype=np.float32).reshape(len(requests), len(FLOAT_PARAMETERS))
        self.top_ks = np.full(len(requests), SAMPLING_DEFAULTS["top_ks"], dtype=np.int64)
        for index, request in enumerate(requests):
            if request.sampling is not None:
                self.params[index] = [float(getattr(request.sampling, name)[0]) for name in FLOAT_PARAMETERS]
                self.top_ks[index] = int(request.sampling.top_ks[0])

    def choose(self, logits: torch.Tensor, out: torch.Tensor, rows: ChosenRows) -> None:
        """Write the token of each row of ``logits`` [rows, vocab] into ``out`` [rows] (int64, on the device)."""
        if self.greedy:
            torch.argmax(logits, dim=-1, out=out)
            return
        scores = logits.float()
        if self.rules.names:
            scores = self.rules.apply(scores, rows.ids)
        if not self.sampled:
            torch.argmax(scores, dim=-1, out=out)
            return
        params = rows.params
        meta = SamplingMetadata(*(params[:, FLOAT_PARAMETERS.index(name)] if name != "top_ks" else rows.top_ks
                                  for name in SAMPLING_DEFAULTS))
        if self.penalties:
            counts, repeated = _output_counts(rows.ids, scores.shape[1])
            scores = apply_penalties(scores, meta, counts, repeated)
        greedy_tokens = scores.argmax(dim=-1)
        drawing = [(row, generator) for row, generator in
                   ((row, self.generators[request]) for row, request in enumerate(rows.requests)) if generator]
        if not drawing:
            out.copy_(greedy_tokens)
            return
        probs, sorted_ids = sampling_distribution(scores, meta)
        choice = torch.zeros((scores.shape[0], 1), dtype=torch.int64, device=scores.device)
        for row, generator in drawing:
            torch.multinomial(probs[row: row + 1], 1, generator=generator, out=choice[row: row + 1])
        torch.where(meta.is_greedy(), greedy_tokens, sorted_ids.gather(1, choice).squeeze(1), out=out)


def _output_counts(rows: RowIds, vocab: int) -> tuple:
    """Per row: how often each token is in its output (float32 [rows, vocab]) and which tokens its prompt
    or output holds (bool [rows, vocab])."""
    positions = torch.arange(rows.ids.shape[1], device=rows.ids.device)[None, :]
    held = positions < rows.lengths[:, None]
    output = held & (positions >= rows.prompt_lengths[:, None])
    tokens = rows.ids.clamp(max=vocab)
    counts = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, torch.where(output, tokens, vocab), output.float())
    repeated = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.bool, device=tokens.device)
    repeated.scatter_(1, torch.where(held, tokens, vocab), True)
    return counts[:, :vocab], repeated[:, :vocab]


__all__ = ["ChosenRows", "FLOAT_PARAMETERS", "GenerationRules", "RequestTokens", "TokenChooser"]
