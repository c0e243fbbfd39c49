"""scripts/bench_engine_step.py and scripts/bench_engine_events.py at tiny settings: the engine's host cost per
decode step beside the anchor's, the targets read from it, and the --step-events row of the engine bench."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("transformers")


@pytest.fixture
def scripts(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    return importlib.import_module("bench_engine_step"), importlib.import_module("bench_engine_events")


def test_host_cost_rows_and_targets(scripts):
    steps, _ = scripts
    rows = steps.measure([1], [2], repeats=1)
    row = rows[0]
    assert (row.layers, row.requests) == (1, 2)
    for cost in (row.engine, row.anchor, row.engine_alone, row.anchor_alone):
        assert cost.steps == steps.NEW_TOKENS - 1 and cost.cpu_ms > 0 and cost.wall_ms > 0
    assert row.engine.replay_ms > 0 and row.engine_alone.replay_ms == 0  # stubbed: no time inside replays
    doc = steps.as_json(rows)
    printed = "\n".join(steps.format_json(doc))
    assert "| 1 | 2 |" in printed and "target <= the anchor's" in printed and "(alone)" in printed
    assert {target["target"] for target in doc["targets"]} >= {"<= the anchor's", "<= the anchor's (alone)"}


def test_step_events_on_the_cpu(scripts, capsys):
    _, events = scripts
    engine_bench = importlib.import_module("bench_hf_engine")
    engine_bench.main(["--step-events", "--hidden", "32", "--max-requests", "2", "--new-tokens", "3"])
    printed = capsys.readouterr().out
    assert "| graphs | 6 |" in printed and "| eager | 6 |" in printed and "n/a (no CUDA)" in printed  # 3 calls x 2 steps
