"""The table of Hugging Face families in docs/MANUAL.md: the share of forward calls replayed on a repeated generate() call.

    PYTHONPATH=. python scripts/hf_families.py [--new-tokens 16] [family ...]

Each family of the tests (tests/hf_helpers.FAMILIES: tiny random configs, sliding windows of 4
tokens) goes through ``graphrt.hf.graph_generate``: for a left-padded batch of 2 prompts and for
an unpadded one, a first generate() call (warm-ups, recordings) and a repeated one, greedy. The
forward calls of the repeated call are counted beside graphrt (a wrapper around ``forward``), its
replays from ``stats()``; the tokens of both calls are compared with eager generate() on
transformers' own static cache. Prints a Markdown table; notes name the keys whose capture failed.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_helpers import FAMILIES, ForwardCalls, family_inputs, tiny_model  # noqa: E402

from graphrt.hf import graph_generate  # noqa: E402

PROMPT_LEN, BATCH = 5, 2


@dataclass
class Repeated:
    """One input style's repeated generate() call: forward calls, replays, tokens, why not replayed."""

    calls: int
    replayed: int
    same_tokens: bool
    failed: Dict[str, str]  # key -> capture failure, first clause

    @property
    def share(self) -> str:
        return f"{self.replayed}/{self.calls} ({self.replayed / self.calls:.0%})"


def measure(family: str, padded_rows: int, new_tokens: int) -> Tuple[Repeated, str]:
    """The repeated call of ``family`` for prompts with ``padded_rows`` left-padded rows, and its cache's layers."""
    model = tiny_model(family)
    inputs = family_inputs(family, BATCH, PROMPT_LEN, padded_rows=padded_rows)
    options = dict(inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    expected = copy.deepcopy(model).generate(cache_implementation="static", **options)
    fast = graph_generate(model, max_batch_size=4)
    counter = ForwardCalls(model)
    first_same = torch.equal(model.generate(**options), expected)
    calls, replays = counter.calls, fast.stats()["graph_runs"]
    same = torch.equal(model.generate(**options), expected) and first_same
    failed = {key: failure(reason) for key, reason in fast.stats()["failed_keys"].items()}
    return Repeated(counter.calls - calls, fast.stats()["graph_runs"] - replays, same, failed), cache_layers(model)


def failure(reason: str) -> str:
    """A capture failure in short: its error type, and the op and file:line where it names them."""
    kind, _, detail = reason.partition(": ")
    if " at " not in detail:
        return f"{kind}: {detail[:80]}"
    op, _, where = detail.rpartition(" at ")
    return f"{kind}: {op.split(': ')[-1].split(' (in ')[0]} at {Path(where.split()[0]).name}"


def cache_layers(model: torch.nn.Module) -> str:
    """The layer classes of the cache graph_generate() handed generate(), counted per side."""
    caches = list(getattr(model._prepare_static_cache, "caches", {}).values())
    if not caches:
        return "not pooled"
    cache = caches[0]
    sides = [("", getattr(cache, "self_attention_cache", cache)), ("cross: ", getattr(cache, "cross_attention_cache",
                                                                                     None))]
    parts = []
    for prefix, side in sides:
        if side is not None:
            counts = Counter(type(layer).__name__ for layer in side.layers)
            parts.append(prefix + " + ".join(f"{count} {name}" for name, count in counts.items()))
    return "; ".join(parts)


def table(families: Sequence[str], new_tokens: int) -> List[str]:
    """The Markdown table, one row per family."""
    lines = ["| family | cache layers (as handed to generate()) | replayed, repeated call: left-padded | unpadded | "
             "tokens = eager's | notes |", "|---|---|---|---|---|---|"]
    for family in families:
        padded, layers = measure(family, 1, new_tokens)
        unpadded, _ = measure(family, 0, new_tokens)
        notes = "; ".join(f"{key}: {why}" for key, why in {**padded.failed, **unpadded.failed}.items())
        same = "yes" if padded.same_tokens and unpadded.same_tokens else "NO"
        lines.append(f"| {family} | {layers} | {padded.share} | {unpadded.share} | {same} | {notes} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help=f"default: all ({', '.join(FAMILIES)})")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per call (default 16)")
    args = parser.parse_args(argv)
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families: {', '.join(sorted(unknown))}")
    logging.basicConfig(level=logging.ERROR)
    with torch.no_grad():
        print("\n".join(table(args.families or list(FAMILIES), args.new_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
