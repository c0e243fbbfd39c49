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
from typing import FrozenSet, List, Optional, Sequence

import numpy as np
import torch

from graphrt.hf.logits_rules import GenerationRules, RowIds
from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata, apply_penalties, sampling_distribution

PENALTIES = ("repetition_penalties", "presence_penalties", "frequency_penalties")
# The float parameters of a chosen row, in the columns of ``TokenChooser.params`` (top_ks apart: int64).
FLOAT_PARAMETERS = ("temperatures", "top_ps", "min_ps", *PENALTIES)


@dataclass
class RequestTokens:
    """What one request's choice of tokens reads: its prompt and output, its generator, its sampling row, its
    stop ids and how many new tokens hold them back (None: the generation config's ``min_new_tokens``). The
    sampling row is read into host values once, when the request is made (a step reads no tensor of it)."""

    prompt: List[int]
    output: List[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    sampling: Optional[SamplingMetadata] = None  # its row of the call's sampling (None: greedy)
    stops: FrozenSet[int] = frozenset()
    min_new_tokens: Optional[int] = None
    top_logprobs: int = -1  # -1: no log-probabilities; k >= 0: the chosen token's and the k most likely tokens'

    def __post_init__(self) -> None:
        sampling = self.sampling
        defaults = [SAMPLING_DEFAULTS[name] for name in FLOAT_PARAMETERS]
        self.parameters = defaults if sampling is None else [float(getattr(sampling, name)[0])
                                                             for name in FLOAT_PARAMETERS]
        self.top_k = SAMPLING_DEFAULTS["top_ks"] if sampling is None else int(sampling.top_ks[0])
        # drawn (a temperature above 0), not the argmax; penalties other than neutral
        self.draws = sampling is not None and self.parameters[0] != 0
        self.has_penalties = sampling is not None and any(
            self.parameters[FLOAT_PARAMETERS.index(name)] != SAMPLING_DEFAULTS[name] for name in PENALTIES)


@dataclass(frozen=True)
class ChosenRows:
    """A step's chosen rows as the chooser reads them on the device: ``ids`` (None unless the call's rules
    or penalties read them), ``params`` [rows, len(FLOAT_PARAMETERS)] float32 and ``top_ks`` [rows] int64
    (None for greedy calls), and which request row each is (``requests``: rows of the request table)."""

    ids: Optional[RowIds]
    params: Optional[torch.Tensor]
    top_ks: Optional[torch.Tensor]
    requests: Sequence[int]


class TokenChooser:
    """The token choice over logits of ``vocab`` columns on ``device`` for ``rows`` request rows: the rules,
    and per request row (``admit``: when a request takes its row) its sampling row, generator, prompt length
    and the stop ids it holds back (``holds`` [rows, hold_width] on the host: its minimum of new tokens, then
    its stop ids, -1 past them; staged per step with the chosen rows). ``greedy``: every token is the argmax of
    its logits; ``needs_ids``: rules, penalties or held stop ids read the rows' ids; ``sampled``: rows carry
    sampling parameters (``params``, ``top_ks``). ``requests`` known up front set these flags at once; a
    request admitted later that needs more turns them on (never off: the general path chooses the same tokens
    for the rows that need less)."""

    def __init__(self, rules: GenerationRules, requests: Sequence[RequestTokens], vocab: int,
                 device: torch.device, rows: int, hold_width: int) -> None:
        rules.prepare(vocab, device)  # the rules' constants on the device before the first step
        self.rules = rules
        self.sampled = self.penalties = self.draws = self.holding = False
        self.top_logprobs = -1  # the most asked for by a request (every chosen row gets as many, when >= 0)
        self.hold_width = hold_width
        self.holds = np.zeros((rows, hold_width), dtype=np.int64)
        self.generators: List[Optional[torch.Generator]] = [None] * rows
        self.prompt_lengths = np.zeros(rows, dtype=np.int64)
        self.params = np.zeros((rows, len(FLOAT_PARAMETERS)), dtype=np.float32)
        self.top_ks = np.zeros(rows, dtype=np.int64)
        for request in requests:
            self._note(request)

    @property
    def greedy(self) -> bool:
        return not self.rules.names and not self.penalties and not self.draws and not self.holding

    @property
    def needs_ids(self) -> bool:
        return self.rules.needs_ids or self.penalties or self.holding

    def min_new_tokens(self, request: RequestTokens) -> int:
        return self.rules.min_new_tokens if request.min_new_tokens is None else request.min_new_tokens

    def check_stops(self, request: RequestTokens) -> None:
        """ValueError when ``request`` has more stop ids than a row holds back."""
        if len(request.stops) > self.hold_width - 1:
            raise ValueError(f"stop_token_ids: at most {self.hold_width - 1} stop ids per request (EOS ids "
                             f"included), got {len(request.stops)}")

    def admit(self, row: int, request: RequestTokens) -> None:
        """``request`` takes request row ``row``: what its tokens are chosen from, written there (host values:
        its stop ids held back while it has fewer new tokens than its minimum, or fewer tokens than the rules'
        minimum length)."""
        self._note(request)
        self.generators[row] = request.generator if request.draws else None
        self.prompt_lengths[row] = len(request.prompt)
        self.params[row] = request.parameters
        self.top_ks[row] = request.top_k
        stops = sorted(request.stops)
        self.holds[row] = [self.min_new_tokens(request), *stops] + [-1] * (self.hold_width - 1 - len(stops))

    def _note(self, request: RequestTokens) -> None:
        self.check_stops(request)
        self.holding = self.holding or bool(request.stops and (self.min_new_tokens(request) > 0
                                                               or self.rules.min_length))
        self.top_logprobs = max(self.top_logprobs, request.top_logprobs)
        self.sampled = self.sampled or request.sampling is not None
        self.penalties = self.penalties or request.has_penalties
        self.draws = self.draws or request.draws

    def choose(self, logits: torch.Tensor, out: torch.Tensor, rows: ChosenRows) -> None:
        """Write the token of each row of ``logits`` [rows, vocab] into ``out`` [rows] (int64, on the device)."""
        if self.greedy:
            torch.argmax(logits, dim=-1, out=out)
            return
        scores = logits.float()
        if self.rules.names or self.holding:
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
        drawing = [(position, generator) for position, generator in
                   ((position, self.generators[row]) for position, row in enumerate(rows.requests)) if generator]
        if not drawing:
            out.copy_(greedy_tokens)
            return
        probs, sorted_ids = sampling_distribution(scores, meta)
        choice = torch.zeros((scores.shape[0], 1), dtype=torch.int64, device=scores.device)
        for position, generator in drawing:
            torch.multinomial(probs[position: position + 1], 1, generator=generator,
                              out=choice[position: position + 1])
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
