"""graphrt.hf.logits_rules against transformers' own processor classes: every rule, on a batch of rows of
different lengths and prompt lengths, gives each row exactly the scores transformers' processors give that
row alone (as ``generate()`` would call them on that request's ids)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation import logits_process as hf  # noqa: E402

from graphrt.hf.logits_rules import GenerationRules, RowIds  # noqa: E402

VOCAB = 12
EOS = (2, 5)
MAX_NEW = 6


def transformers_processors(config: GenerationConfig, prompt_length: int, stops=EOS):
    """What generate() builds for one request of ``prompt_length`` tokens whose stop ids are ``stops`` (given to
    generate() as ``eos_token_id``), in its order."""
    made = []
    if config.repetition_penalty not in (None, 1.0):
        made.append(hf.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        made.append(hf.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        made.append(hf.NoBadWordsLogitsProcessor(config.bad_words_ids, list(EOS)))
    if config.min_length:
        made.append(hf.MinLengthLogitsProcessor(config.min_length, list(stops)))
    if config.min_new_tokens:
        made.append(hf.MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, list(stops)))
    if config.forced_bos_token_id is not None:
        made.append(hf.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        made.append(hf.ForcedEOSTokenLogitsProcessor(prompt_length + MAX_NEW, config.forced_eos_token_id))
    if config.remove_invalid_values:
        made.append(hf.InfNanRemoveLogitsProcessor())
    if config.suppress_tokens is not None:
        made.append(hf.SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        begin = prompt_length if prompt_length > 1 or config.forced_bos_token_id is None else prompt_length + 1
        made.append(hf.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin))
    return made


CONFIGS = {
    "repetition_penalty": dict(repetition_penalty=1.7),
    "no_repeat_ngram_size=1": dict(no_repeat_ngram_size=1),
    "no_repeat_ngram_size=2": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_size=3": dict(no_repeat_ngram_size=3),
    "bad_words_ids": dict(bad_words_ids=[[7], [3, 4], [4, 4, 9], [5], [1, 8]]),
    "min_length": dict(min_length=5),
    "min_new_tokens": dict(min_new_tokens=2),
    "forced_bos_token_id": dict(forced_bos_token_id=3),
    "forced_eos_token_id": dict(forced_eos_token_id=2),
    "remove_invalid_values": dict(remove_invalid_values=True),
    "suppress_tokens": dict(suppress_tokens=[0, 6]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[1, 9], forced_bos_token_id=3),
    "all of them": dict(repetition_penalty=0.8, no_repeat_ngram_size=2, bad_words_ids=[[3, 4], [10]], min_length=4,
                        min_new_tokens=1, forced_eos_token_id=[2, 5], remove_invalid_values=True,
                        suppress_tokens=[11], begin_suppress_tokens=[4]),
}
# (prompt length, output length): ids of length 1 (a forced BOS) and the step after a 1-token prompt (where
# generate() begins suppressing), a row at the forced EOS step, rows short of an n-gram or holding exactly a
# bad word's prefix, rows with repeats
ROWS = [(1, 0), (2, 0), (3, 1), (3, MAX_NEW - 1), (5, 2), (2, 1), (6, 4), (1, 1)]
# each row's stop ids: the EOS ids, and for some rows stop ids of their own (held back beside EOS)
STOPS = [EOS, EOS + (7,), EOS, EOS + (3, 9), EOS, EOS + (0,), EOS, EOS + (11,)]


def row_stops(config: GenerationConfig) -> dict:
    """What the engine's chooser gathers for the rows: each one's minimum of new tokens and stop ids (-1 past)."""
    width = max(len(stops) for stops in STOPS)
    return dict(min_new=torch.full((len(ROWS),), config.min_new_tokens or 0),
                stops=torch.tensor([list(stops) + [-1] * (width - len(stops)) for stops in STOPS]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_row_gets_what_transformers_gives_it_alone(name):
    config = GenerationConfig(**CONFIGS[name])
    rules = GenerationRules.from_config(config, EOS, MAX_NEW, VOCAB)
    generator = torch.Generator().manual_seed(len(name))
    lengths = [prompt + output for prompt, output in ROWS]
    ids = torch.randint(0, 6, (len(ROWS), max(lengths) + 3), generator=generator)  # small ids: repeats, n-grams
    ids[1, :2] = torch.tensor([4, 4])  # exactly the prefix of the bad word [4, 4, 9]: releases differ here
    ids[2, :4] = torch.tensor([0, 3, 3, 4])  # ends with the prefix [3] of [3, 4]... and repeats 3
    scores = torch.randn((len(ROWS), VOCAB), generator=generator) * 3
    scores[1, 4], scores[2, 7], scores[4, 0] = float("nan"), float("inf"), -float("inf")
    rows = RowIds(ids, torch.tensor(lengths), torch.tensor([prompt for prompt, _ in ROWS]), **row_stops(config))
    batched = rules.apply(scores.clone(), rows if rules.needs_ids else None)
    for row, (prompt, output) in enumerate(ROWS):
        alone = scores[row: row + 1].clone()
        for processor in transformers_processors(config, prompt, STOPS[row]):
            alone = processor(ids[row: row + 1, : prompt + output], alone)
        assert torch.equal(batched[row].isnan(), alone[0].isnan()), (name, row)
        assert torch.equal(batched[row].nan_to_num(), alone[0].nan_to_num()), (name, row, batched[row], alone[0])


def test_a_bad_word_outside_the_vocabulary_and_refused_fields_are_named():
    with pytest.raises(ValueError, match=r"bad_words_ids: tokens \[40\]"):
        GenerationRules.from_config(GenerationConfig(bad_words_ids=[[40]]), EOS, MAX_NEW, VOCAB)
    with pytest.raises(ValueError, match="generation_config.sequence_bias"):
        GenerationRules.from_config(GenerationConfig(sequence_bias={(3,): -1.0}), EOS, MAX_NEW, VOCAB)
    with pytest.raises(ValueError, match="penalty"):
        GenerationRules.from_config(GenerationConfig(repetition_penalty=-1.0), EOS, MAX_NEW, VOCAB)
    assert GenerationRules.from_config(None, EOS, MAX_NEW, VOCAB).names == ()


def test_rules_read_no_device_value_and_loop_over_no_row():
    """The rules run the same ops whatever the rows hold: a row count of 1 and of 7 call the same torch
    functions the same number of times (no Python per row), and no op reads a value to the host."""
    config = GenerationConfig(**CONFIGS["all of them"])
    rules = GenerationRules.from_config(config, EOS, MAX_NEW, VOCAB)
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (1, 7):
        ids = torch.randint(0, 6, (rows, 9))
        row_ids = RowIds(ids, torch.full((rows,), 7), torch.full((rows,), 3), torch.full((rows,), 1),
                         torch.tensor([[2, 5, 8]] * rows))
        rules.apply(torch.randn(rows, VOCAB), row_ids)  # the static masks, made once
        calls.clear()
        with Count():
            rules.apply(torch.randn(rows, VOCAB), row_ids)
        counts.append(list(calls))
    assert counts[0] == counts[1]
    assert not {"item", "tolist", "__bool__", "__int__", "nonzero"} & set(counts[0])
    assert math.isfinite(len(counts[0]))
