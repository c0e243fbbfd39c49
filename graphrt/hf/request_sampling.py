"""Each request's next token as ``generate()`` would choose it, whatever else the step carries.

``GenerationRules`` are the processors of a generation config that change greedy or seeded tokens,
made with transformers' own processor classes in ``generate()``'s order: repetition penalty (over
prompt and output), no-repeat n-grams, bad words, minimum length and minimum new tokens, forced BOS
and EOS, invalid-value removal, suppressed tokens and tokens suppressed at the first step. They run
per request on that request's own ids (its prompt and output) after the runner's step; the config's
fields that no engine step can honour exactly (``sequence_bias``, ``exponential_decay_length_penalty``,
the encoder penalties, classifier-free guidance, watermarking) are refused by name. ``TokenChooser``
then applies ``sampling``'s penalties (repetition over prompt and output, presence and frequency over
the output, as vLLM does) and samples from the request's own generator, row by row, so a request's
token depends on its logits, its ids and its generator only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata, apply_penalties, sample

PENALTIES = ("repetition_penalties", "presence_penalties", "frequency_penalties")
# Generation-config fields no engine step honours: a set one is refused by name (the value that leaves it off).
REFUSED_FIELDS = {
    "sequence_bias": None, "exponential_decay_length_penalty": None, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0, "watermarking_config": None,
}

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, length], scores [1, vocab]) -> scores


@dataclass
class GenerationRules:
    """The processors of one generation config (``names``, for messages), made per request from its
    prompt length (``make(prompt_length)``)."""

    names: Tuple[str, ...] = ()
    makers: Tuple[Callable[[int], Processor], ...] = ()

    def make(self, prompt_length: int) -> List[Processor]:
        """The processors of a request whose prompt has ``prompt_length`` tokens."""
        return [maker(prompt_length) for maker in self.makers]

    @classmethod
    def from_config(cls, config: Any, eos_ids: Sequence[int], max_new_tokens: int,
                    device: torch.device) -> "GenerationRules":
        """The rules of ``config`` (a transformers GenerationConfig, or None: none) for a call stopping at
        ``eos_ids`` after at most ``max_new_tokens``; ValueError naming a field no engine step honours."""
        if config is None:
            return cls()
        from transformers.generation import logits_process as processors

        for name, off in REFUSED_FIELDS.items():
            value = getattr(config, name, None)
            if value is not None and value != off:
                raise ValueError(f"generation_config.{name}: {value!r} is not honoured by the engine path "
                                 f"(leave it at {off!r}, or use model.generate())")
        eos = list(eos_ids) or None
        found: List[Tuple[str, Callable[[int], Processor]]] = []

        def add(name: str, maker: Callable[[int], Processor]) -> None:
            found.append((name, maker))

        penalty = getattr(config, "repetition_penalty", None)
        if penalty is not None and penalty != 1.0:
            add("repetition_penalty", lambda length: processors.RepetitionPenaltyLogitsProcessor(penalty))
        ngram = getattr(config, "no_repeat_ngram_size", None)
        if ngram is not None and ngram > 0:
            add("no_repeat_ngram_size", lambda length: processors.NoRepeatNGramLogitsProcessor(ngram))
        bad_words = getattr(config, "bad_words_ids", None)
        if bad_words is not None:
            add("bad_words_ids", lambda length: processors.NoBadWordsLogitsProcessor(bad_words, eos))
        min_length = getattr(config, "min_length", None)
        if min_length is not None and min_length > 0 and eos:
            add("min_length", lambda length: processors.MinLengthLogitsProcessor(min_length, eos, device=device))
        min_new = getattr(config, "min_new_tokens", None)
        if min_new is not None and min_new > 0 and eos:
            add("min_new_tokens", lambda length: processors.MinNewTokensLengthLogitsProcessor(length, min_new, eos,
                                                                                             device=device))
        forced_bos = getattr(config, "forced_bos_token_id", None)
        if forced_bos is not None:
            add("forced_bos_token_id", lambda length: processors.ForcedBOSTokenLogitsProcessor(forced_bos))
        forced_eos = getattr(config, "forced_eos_token_id", None)
        if forced_eos is not None:
            add("forced_eos_token_id", lambda length: processors.ForcedEOSTokenLogitsProcessor(
                length + max_new_tokens, forced_eos, device=device))
        if getattr(config, "remove_invalid_values", None) is True:
            add("remove_invalid_values", lambda length: processors.InfNanRemoveLogitsProcessor())
        suppress = getattr(config, "suppress_tokens", None)
        if suppress is not None:
            add("suppress_tokens", lambda length: processors.SuppressTokensLogitsProcessor(suppress, device=device))
        begin = getattr(config, "begin_suppress_tokens", None)
        if begin is not None:
            add("begin_suppress_tokens", lambda length: processors.SuppressTokensAtBeginLogitsProcessor(
                begin, length if length > 1 or forced_bos is None else length + 1, device=device))
        return cls(tuple(name for name, _ in found), tuple(maker for _, maker in found))


@dataclass
class RequestTokens:
    """What one request's choice of tokens reads: its prompt and output, its processors, its generator."""

    prompt: List[int]
    output: List[int] = field(default_factory=list)
    processors: List[Processor] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    sampling: Optional[SamplingMetadata] = None  # its row of the call's sampling (None: greedy)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the step's logits: no processor, no penalty, temperature 0 (or no sampling)."""
        if self.processors:
            return False
        if self.sampling is None:
            return True
        return bool(self.sampling.is_greedy()[0]) and not self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.sampling is not None and any(
            float(getattr(self.sampling, name)[0]) != SAMPLING_DEFAULTS[name] for name in PENALTIES)


def choose_tokens(logits: torch.Tensor, requests: Sequence[RequestTokens]) -> List[int]:
    """One token per row of ``logits`` [rows, vocab]; row ``i`` ends a step of ``requests[i]``: one argmax
    of every row when each request is plainly greedy, else request by request."""
    if all(request.plain_greedy for request in requests):
        return logits.argmax(-1).tolist()
    return [_choose(logits[row: row + 1].float(), request) for row, request in enumerate(requests)]


def _choose(scores: torch.Tensor, request: RequestTokens) -> int:
    """One request's token from its row of scores [1, vocab]."""
    if request.processors:
        ids = torch.tensor([request.prompt + request.output], dtype=torch.int64, device=scores.device)
        for processor in request.processors:
            scores = processor(ids, scores)
    meta = request.sampling
    if meta is None:
        return int(scores.argmax(-1))
    if request.has_penalties:
        vocab = scores.shape[-1]
        output = torch.bincount(torch.tensor(request.output, dtype=torch.int64), minlength=vocab)[None, :vocab]
        repeated = torch.zeros((1, vocab), dtype=torch.bool)
        repeated[0, request.prompt + request.output] = True
        scores = apply_penalties(scores, meta.map(lambda tensor: tensor.to(scores.device)), output,
                                 repeated.to(scores.device))
    return int(sample(scores, meta, request.generator)[0])


__all__ = ["GenerationRules", "REFUSED_FIELDS", "RequestTokens", "choose_tokens"]
