"""A generation config's processors, batched on the device: what ``generate()`` does to each row's scores.

``GenerationRules`` are the processors of a generation config that change greedy or seeded tokens, in
``generate()``'s order: repetition penalty (over prompt and output), no-repeat n-grams, bad words,
minimum length and minimum new tokens, forced BOS and EOS, invalid-value removal, suppressed tokens
and tokens suppressed at the first step; minimum length and minimum new tokens hold back every stop id
of a row (its request's own beside the EOS ids), as ``generate()`` given them all as ``eos_token_id``
does. ``config_sampling`` reads the config's sampling (``do_sample``: temperature, top-k, top-p, min-p)
into one request's sampling parameters. transformers' processor classes take one batch of ids of
one length; a step of the engine carries requests of any lengths, so the rules apply transformers'
arithmetic to every chosen row at once, each row with its own ids (its prompt and output, padded
to the longest), length and prompt length: device ops only, no Python per row and no read of a
device value. Each rule computes exactly what transformers' class computes for that row alone
(tests/test_hf_logits_rules.py compares them). Fields no engine step honours exactly
(``sequence_bias``, ``exponential_decay_length_penalty``, the encoder penalties, classifier-free
guidance, watermarking) are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# Generation-config fields no engine step honours: a set one is refused by name (the value that leaves it off).
REFUSED_FIELDS = {
    "sequence_bias": None, "exponential_decay_length_penalty": None, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0, "watermarking_config": None,
}
# Sampling fields (read with ``do_sample``) no engine step honours: when generate() adds its warper, and the
# value that leaves it off.
REFUSED_SAMPLING_FIELDS = {"typical_p": (lambda value: value < 1.0, 1.0),
                           "epsilon_cutoff": (lambda value: 0.0 < value < 1.0, 0.0),
                           "eta_cutoff": (lambda value: 0.0 < value < 1.0, 0.0), "top_h": (lambda value: True, None)}
# generate()'s own default of a sampling field the config leaves unset (transformers >= 5.18 keeps None there).
GENERATE_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}


@dataclass(frozen=True)
class RowIds:
    """What the rules read of each chosen row: its ids [rows, width] (prompt then output, padded past
    ``lengths``), their ``lengths`` [rows] and the ``prompt_lengths`` [rows] (int64, on the scores' device);
    where any request holds back its stop ids, each row's ``min_new`` [rows] and ``stops`` [rows, n] (its
    stop ids, padded with -1)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    min_new: Optional[torch.Tensor] = None
    stops: Optional[torch.Tensor] = None


@dataclass
class GenerationRules:
    """The processors of one generation config (``names``, for messages) with their parameters; ``apply``
    runs them on a step's chosen rows."""

    names: Tuple[str, ...] = ()
    repetition_penalty: Optional[float] = None
    no_repeat_ngram_size: int = 0
    bad_words: Tuple[Tuple[int, ...], ...] = ()
    bad_word_needs_whole_length: bool = False  # the installed release's rule for a word longer than the ids
    min_length: int = 0
    min_new_tokens: int = 0
    eos: Tuple[int, ...] = ()
    forced_bos: Optional[int] = None
    forced_eos: Optional[int] = None  # max_new_tokens, when forced_eos_token_id is set
    forced_eos_ids: Tuple[int, ...] = ()
    remove_invalid_values: bool = False
    suppress: Tuple[int, ...] = ()
    begin_suppress: Tuple[int, ...] = ()
    _static: Dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # ``prepare``'s tensors

    @classmethod
    def from_config(cls, config: Any, eos_ids: Sequence[int], max_new_tokens: int, vocab_size: int) -> "GenerationRules":
        """The rules of ``config`` (a transformers GenerationConfig, or None: none) for a call stopping at
        ``eos_ids`` after at most ``max_new_tokens``; ValueError naming a field no engine step honours or a
        value transformers' processor refuses."""
        if config is None:
            return cls()
        from transformers.generation import logits_process as processors

        for name, off in REFUSED_FIELDS.items():
            value = getattr(config, name, None)
            if value is not None and value != off:
                raise ValueError(f"generation_config.{name}: {value!r} is not honoured by the engine path "
                                 f"(leave it at {off!r}, or use model.generate())")
        eos = tuple(eos_ids)
        names: List[str] = []
        found: Dict[str, Any] = {}

        def add(name: str, **parameters: Any) -> None:
            names.append(name)
            found.update(parameters)

        penalty = getattr(config, "repetition_penalty", None)
        if penalty is not None and penalty != 1.0:
            processors.RepetitionPenaltyLogitsProcessor(penalty)  # transformers' own checks, once
            add("repetition_penalty", repetition_penalty=float(penalty))
        ngram = getattr(config, "no_repeat_ngram_size", None)
        if ngram is not None and ngram > 0:
            processors.NoRepeatNGramLogitsProcessor(ngram)
            add("no_repeat_ngram_size", no_repeat_ngram_size=ngram)
        bad_words = getattr(config, "bad_words_ids", None)
        if bad_words is not None:
            kept = processors.NoBadWordsLogitsProcessor(bad_words, list(eos) or None).sequence_bias
            outside = [token for word in kept for token in word if token >= vocab_size]
            if outside:
                raise ValueError(f"generation_config.bad_words_ids: tokens {outside} are outside the model's "
                                 f"vocabulary of {vocab_size}")
            add("bad_words_ids", bad_words=tuple(tuple(word) for word in kept),
                bad_word_needs_whole_length=_bad_word_needs_whole_length(processors))
        min_length = getattr(config, "min_length", None)
        if min_length is not None and min_length > 0 and eos:
            add("min_length", min_length=min_length)
        min_new = getattr(config, "min_new_tokens", None)
        if min_new is not None and min_new > 0:  # held back: the EOS ids and each request's own stop ids
            add("min_new_tokens", min_new_tokens=min_new)
        forced_bos = getattr(config, "forced_bos_token_id", None)
        if forced_bos is not None:
            add("forced_bos_token_id", forced_bos=forced_bos)
        forced_eos = getattr(config, "forced_eos_token_id", None)
        if forced_eos is not None:
            add("forced_eos_token_id", forced_eos=max_new_tokens,
                forced_eos_ids=(forced_eos,) if isinstance(forced_eos, int) else tuple(forced_eos))
        if getattr(config, "remove_invalid_values", None) is True:
            add("remove_invalid_values", remove_invalid_values=True)
        suppress = getattr(config, "suppress_tokens", None)
        if suppress is not None:
            add("suppress_tokens", suppress=tuple(suppress))
        begin = getattr(config, "begin_suppress_tokens", None)
        if begin is not None:
            add("begin_suppress_tokens", begin_suppress=tuple(begin))
        return cls(names=tuple(names), eos=eos, **found)

    @property
    def needs_ids(self) -> bool:
        """Whether any rule reads a row's ids or lengths (every rule but invalid-value removal and suppression)."""
        return any(name not in ("remove_invalid_values", "suppress_tokens") for name in self.names)

    def prepare(self, vocab: int, device: torch.device) -> None:
        """The rules' constant tensors for scores of ``vocab`` columns on ``device``, made once (before a call's
        first step: a step copies nothing more to the device)."""
        device = torch.device(device)
        if self._static.get("for") == (vocab, device):
            return
        tokens = torch.arange(vocab, device=device)

        def mask(ids: Sequence[int]) -> torch.Tensor:
            return torch.isin(tokens, torch.tensor(list(ids), dtype=torch.int64, device=device))

        def forced(ids: Sequence[int]) -> torch.Tensor:  # the scores of a row a forced token replaces
            row = torch.full((vocab,), -math.inf, device=device)
            row[list(ids)] = 0
            return row

        bad = torch.zeros(vocab, dtype=torch.float, device=device)
        bad[[word[0] for word in self.bad_words if len(word) == 1]] = float("-inf")
        self._static.clear()
        self._static.update({
            "for": (vocab, device), "suppress": mask(self.suppress),
            "begin": mask(self.begin_suppress), "bos": forced(() if self.forced_bos is None else (self.forced_bos,)),
            "forced_eos": forced(self.forced_eos_ids), "bad": bad,
            "prefixes": [(torch.tensor(word[:-1], dtype=torch.int64, device=device), word) for word in self.bad_words
                         if len(word) > 1]})

    def apply(self, scores: torch.Tensor, rows: Optional[RowIds]) -> torch.Tensor:
        """Float32 ``scores`` [rows, vocab] after every rule, in ``generate()``'s order (``rows``: what they read;
        None when no rule reads ids)."""
        vocab = scores.shape[1]
        self.prepare(vocab, scores.device)
        static = self._static
        if self.repetition_penalty is not None:
            seen = _token_mask(vocab, rows.ids, _valid(rows))
            penalty = self.repetition_penalty
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if self.no_repeat_ngram_size:
            scores = self._no_repeat_ngram(scores, rows)
        if self.bad_words:
            scores = scores + self._bad_word_bias(scores, rows)
        if rows is not None and rows.stops is not None:  # minimum length, minimum new tokens: every stop id held
            short = (rows.lengths - rows.prompt_lengths) < rows.min_new
            if self.min_length:
                short = short | (rows.lengths < self.min_length)
            held = _token_mask(vocab, rows.stops, (rows.stops >= 0) & short[:, None])
            scores = scores.masked_fill(held, -math.inf)
        if self.forced_bos is not None:
            scores = torch.where((rows.lengths == 1)[:, None], static["bos"], scores)
        if self.forced_eos is not None:
            last = rows.lengths == rows.prompt_lengths + self.forced_eos - 1
            scores = torch.where(last[:, None], static["forced_eos"], scores)
        if self.remove_invalid_values:
            cleaned = torch.where(scores != scores, 0.0, scores)
            cleaned = torch.where(scores == float("inf"), torch.finfo(scores.dtype).max, cleaned)
            scores = torch.where(scores == -float("inf"), torch.finfo(scores.dtype).min, cleaned)
        if self.suppress:
            scores = torch.where(static["suppress"], -float("inf"), scores)
        if self.begin_suppress:
            begin = rows.prompt_lengths
            if self.forced_bos is not None:  # generate() begins one later after a forced BOS on a 1-token prompt
                begin = begin + (begin <= 1)
            first = (rows.lengths == begin)[:, None] & static["begin"]
            scores = torch.where(first, -float("inf"), scores)
        return scores

    # ---- the rules that read ids ------------------------------------------------------------------

    def _no_repeat_ngram(self, scores: torch.Tensor, rows: RowIds) -> torch.Tensor:
        """transformers' NoRepeatNGramLogitsProcessor per row: the token completing an n-gram the row's ids
        already hold after its last ``n - 1`` ids is banned."""
        size, vocab = self.no_repeat_ngram_size, scores.shape[1]
        ids, lengths = rows.ids, rows.lengths
        if ids.shape[1] < size:
            return scores
        windows = ids.unfold(1, size, 1)  # [rows, starts, size]
        starts = torch.arange(windows.shape[1], device=ids.device)
        inside = starts[None, :] + size <= lengths[:, None]
        offsets = torch.arange(size - 1, device=ids.device)
        prefix = ids.gather(1, (lengths[:, None] - (size - 1) + offsets[None, :]).clamp(min=0))
        matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1) & inside
        banned = _token_mask(vocab, windows[..., -1], matches)
        return scores.masked_fill(banned, -float("inf"))

    def _bad_word_bias(self, scores: torch.Tensor, rows: RowIds) -> torch.Tensor:
        """transformers' NoBadWordsLogitsProcessor's bias per row: -inf at every one-token bad word, and at a
        longer word's last token where the row's last ids are the word's prefix."""
        bias = torch.zeros_like(scores) + self._static["bad"]
        for prefix, word in self._static["prefixes"]:
            offsets = torch.arange(len(prefix), device=rows.ids.device)
            tail = rows.ids.gather(1, (rows.lengths[:, None] - len(prefix) + offsets[None, :]).clamp(min=0))
            least = len(word) if self.bad_word_needs_whole_length else len(word) - 1
            matching = (tail == prefix).all(dim=-1) & (rows.lengths >= least)
            bias[:, word[-1]] += torch.where(matching, float("-inf"), 0.0)
        return bias


def config_sampling(config: Any) -> Optional[Dict[str, float]]:
    """One request's sampling parameters (``SamplingMetadata.from_params`` keywords, one value each) as
    ``generate()`` samples with ``config`` (a transformers GenerationConfig or None), or None when it does not
    sample (``do_sample`` unset or False). ValueError naming a sampling field no engine step honours or a
    value transformers' warper refuses."""
    if config is None or not getattr(config, "do_sample", None):
        return None
    from transformers.generation import logits_process as processors

    for name, (applied, off) in REFUSED_SAMPLING_FIELDS.items():
        value = getattr(config, name, None)
        if value is not None and applied(value):
            raise ValueError(f"generation_config.{name}: {value!r} is not honoured by the engine path "
                             f"(leave it at {off!r}, or use model.generate())")
    values = {name: getattr(config, name, None) for name in GENERATE_SAMPLING_DEFAULTS}
    values = {name: default if values[name] is None else values[name]
              for name, default in GENERATE_SAMPLING_DEFAULTS.items()}
    temperature, top_k, top_p, min_p = (values[name] for name in GENERATE_SAMPLING_DEFAULTS)
    processors.TemperatureLogitsWarper(temperature)  # transformers' own checks of each value
    if top_k:
        processors.TopKLogitsWarper(top_k)
    processors.TopPLogitsWarper(top_p)
    if min_p is not None:
        processors.MinPLogitsWarper(min_p)
    return {"temperatures": float(temperature), "top_ks": int(top_k) if top_k else -1, "top_ps": float(top_p),
            "min_ps": 0.0 if min_p is None else float(min_p)}


def _token_mask(vocab: int, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool: True at each row's ``tokens`` [rows, n] where ``keep`` [rows, n] (the others go to a
    spare column past the vocabulary, as transformers' processors send ids outside it)."""
    mask = torch.zeros((tokens.shape[0], vocab + 1), dtype=torch.bool, device=tokens.device)
    mask.scatter_(1, torch.where(keep, tokens.clamp(max=vocab), vocab), True)
    return mask[:, :vocab]


def _valid(rows: RowIds) -> torch.Tensor:
    """[rows, width] bool: the positions of each row's ids (before its length)."""
    return torch.arange(rows.ids.shape[1], device=rows.ids.device)[None, :] < rows.lengths[:, None]


def _bad_word_needs_whole_length(processors: Any) -> bool:
    """How the installed transformers matches a bad word longer than the ids: releases before 5.24 skip a
    word of ``k`` tokens while the ids hold fewer than ``k``, later ones only while they hold fewer than its
    ``k - 1``-token prefix. Asked of transformers' own class once (two ids, a three-token word)."""
    processor = processors.NoBadWordsLogitsProcessor([[3, 4, 5]])
    scores = processor(torch.tensor([[3, 4]]), torch.zeros((1, 6)))
    return bool(scores[0, 5] == 0)


__all__ = ["GenerationRules", "REFUSED_FIELDS", "REFUSED_SAMPLING_FIELDS", "RowIds", "config_sampling"]
