"""The engine-path table of docs/MANUAL.md: Hugging Face families served by ``graphrt.hf.engine_model``.

    PYTHONPATH=. python scripts/hf_engine_families.py [--new-tokens 8] [family ...]

Each family (tiny random configs of tests/hf_helpers.py, sliding windows of 4 tokens) serves the same
six ragged prompts with continuous batching: 4 request rows (two prompts queue), two prompts arriving
at later steps, a step budget of 16 tokens (the longer prompts prefill in chunks, beside running
decodes), greedy. Per family: whether every request's tokens equal ``model.generate()``'s for that
prompt alone, on single-step launches and on launches of 4 decode steps (multi-step keys); the share
of decode steps that replayed full graphs (multi-step launches count their steps); the share of prompt
tokens run in piecewise graphs; eager runs by reason. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_engine_helpers import ENGINE_FAMILIES, generate_alone, ragged_prompts  # noqa: E402
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402

PROMPT_LENGTHS = [5, 21, 3, 12, 30, 8]
ARRIVALS = [0, 0, 0, 1, 3, 6]
STEPS_PER_LAUNCH = 4


def share(part: int, whole: int) -> str:
    """``part/whole (pct)``."""
    return f"{part}/{whole} ({part / whole:.0%})" if whole else "-"


def measure(family: str, new_tokens: int) -> Dict[str, str]:
    """One table row: tokens against generate(), graph shares of the single-step run, eager reasons."""
    model = tiny_model(family)
    prompts = ragged_prompts(PROMPT_LENGTHS)
    expected = generate_alone(model, prompts, new_tokens)
    engine = graphrt.hf.engine_model(model, max_requests=4, max_context=64, max_step_tokens=16)
    single = engine.generate(prompts, max_new_tokens=new_tokens, arrivals=ARRIVALS)
    stats = engine.stats()
    serve = stats["serve"]
    multi = engine.generate(prompts, max_new_tokens=new_tokens, arrivals=ARRIVALS, steps_per_launch=STEPS_PER_LAUNCH)
    multi_stats = engine.stats()
    eager = {**stats["eager_reasons"], **{f"multi-step {k}": v for k, v in multi_stats["eager_reasons"].items()}}
    return {
        "family": family,
        "tokens equal generate()": "yes" if single == expected else "**no**",
        f"with {STEPS_PER_LAUNCH} steps per launch": "yes" if multi == expected else "**no**",
        "decode steps in full graphs": share(serve["decode_steps_graphed"], serve["decode_steps"]),
        f"({STEPS_PER_LAUNCH} steps per launch)": share(multi_stats["serve"]["decode_steps_graphed"],
                                                         multi_stats["serve"]["decode_steps"]),
        "prefill tokens in piecewise graphs": share(serve["prefill_tokens_graphed"], serve["prefill_tokens"]),
        "eager runs (reason)": ", ".join(f"{reason} {count}" for reason, count in eager.items()) or "none",
    }


def main(argv: Optional[List[str]] = None) -> None:
    """Measure the named families (default: every engine-path family of the tests) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=ENGINE_FAMILIES)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (more than free cores spin-wait)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows = []
    for family in args.families:
        try:
            rows.append(measure(family, args.new_tokens))
        except ValueError as refused:  # engine_model refuses the model by name
            rows.append({"family": family, "tokens equal generate()": f"refused: {refused}"})
    columns = list(dict.fromkeys(name for row in rows for name in row))
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(row.get(name, "") for name in columns) + " |")


if __name__ == "__main__":
    main()
