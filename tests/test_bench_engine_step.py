"""scripts/bench_engine_step.py and scripts/bench_engine_events.py at tiny settings: the engine's host cost per
decode step beside the anchor's, the targets read from it, and the --step-events row of the engine bench."""

from __future__ import annotations

import importlib

import pytest
import torch

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


def test_the_online_rows_of_the_engine_bench(scripts):
    """The engine bench's online path (issue 50, item 8): requests arriving while others decode, the tokens of
    generate() on the same prompts, and the row's figures."""
    engine_bench = importlib.import_module("bench_hf_engine")
    import graphrt.hf
    from hf_engine_helpers import generate_alone

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only spin-waits on a shared machine
    try:
        check_online_rows(engine_bench, graphrt.hf, generate_alone)
    finally:
        torch.set_num_threads(threads)


def check_online_rows(engine_bench, hf, generate_alone):
    model, prompts = engine_bench.workload("llama", 32, 5, "cpu")
    engine = hf.engine_model(model, max_requests=2, max_context=64, max_step_tokens=32, warmup_iters=1,
                             piecewise_sizes=[32], capture_sizes=[1, 2])
    stats = {}
    tokens, seconds = engine_bench.timed(engine_bench.online_run(engine, prompts, 4, True, stats))
    expected = generate_alone(model, prompts, 4)
    assert tokens == expected == engine.generate(prompts, max_new_tokens=4)
    row = engine_bench.online_row("graphrt online, graphs", tokens, expected, seconds, stats)
    assert row.startswith("| graphrt online, graphs | yes | ") and len(stats["requests"]) == len(prompts)
    assert stats["serve"]["max_running"] == 2 and stats["serve"]["runner_seconds"] > 0
