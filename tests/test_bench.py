"""scripts/bench.py end to end with tiny settings: JSON fields, emulated label, verification gate;
the noise rule for costs and the busy-machine verdict on made-up samples."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TIMED = ("eager", "graph", "replay", "hook", "trivial")
# graphrt's own cost at the floor, per decode batch size: GraphRunner one-op with and without value checks,
# debug mode, validate() alone each way
FLOOR_COSTS = {"runner", "runner_metadata_only", "debug", "validate", "validate_metadata_only", "guards"}
TARGETS = {"runner": 6, "runner_metadata_only": 6, "wrap": 3, "piecewise": 9, "piecewise_metadata_only": 9}
WRAP_COSTS = {"1 layout", "4 layouts, the same one called", "2 layouts called in turn (per call)", "guards"}


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("bench")


def run_bench(bench, out: Path, *flags: str) -> dict:
    """Tiny settings; generate()'s torch.compile peer (~10 s on CPU) is left out (--no-compile)."""
    assert bench.main(["--model", "tiny", "--batch-sizes", "1,3", "--iters", "3", "--floor-iters", "3", "--quick",
                       "--no-compile", "--out", str(out), *flags]) == 0
    paths = list(out.glob("bench_*_tiny.json"))
    assert len(paths) == 1
    def strict(name: str) -> None:
        raise AssertionError(f"{name} in the JSON: not valid JSON for other readers")

    return json.loads(paths[0].read_text(), parse_constant=strict)


def test_emulated_run_records_every_figure(bench, tmp_path, capsys):
    doc = run_bench(bench, tmp_path, "--backend", "emulated", "--device", "cpu")
    printed = capsys.readouterr().out
    assert "backend: EMULATED" in printed and "not a CUDA-graph speedup" in printed and "eager/raw replay" in printed
    assert doc["backend"] == "emulated" and doc["emulated"] is True and "EMULATED" in doc["backend_note"]
    assert doc["verified"] is True
    settings = doc["settings"]
    assert settings["batch_sizes"] == [1, 3] and settings["iters"] == 3 and settings["quick"] is True
    assert settings["backend"] == "emulated" and settings["threads"] == 1
    machine = doc["machine"]
    assert machine["torch"] == torch.__version__ and machine["device_name"] and machine["cpu_cores"] >= 1
    try:
        import transformers
    except ImportError:  # the GPU image has no transformers
        transformers = None
    assert machine["transformers"] == getattr(transformers, "__version__", None)
    model = doc["model"]
    assert model["preset"] == "tiny" and model["parameters"] > 0 and model["config"]["num_layers"] == 2
    assert doc["trivial_op_us"]["median"] > 0
    assert [b["batch_size"] for b in doc["batches"]] == [1, 3]
    for batch in doc["batches"]:
        assert batch["verification"]["ok"] is True
        assert batch["padded_size"] == batch["verification"]["padded_size"] >= batch["batch_size"]
        for name in TIMED:
            spread = batch["times_us"][name]
            assert all(math.isfinite(spread[key]) for key in ("median", "p10", "p90"))
        assert spread["median"] > 0  # the trivial op
        assert set(batch["costs"]) == {"overhead", "rest"}
        check_costs(batch["costs"].values())
        floor = batch["floor"]
        assert set(floor["costs"]) == FLOOR_COSTS
        check_costs(floor["costs"].values())
        assert {"runner", "runner_replay", "runner_metadata_only", "runner_metadata_only_replay", "validate",
                "validate_metadata_only", "trivial"} <= set(floor["times_us"])
        assert batch["replay_speedup"] == pytest.approx(
            batch["times_us"]["eager"]["median"] / batch["times_us"]["replay"]["median"])
    check_floor_and_load(doc, printed)
    check_multistep(doc["multistep"], printed)
    capture = doc["capture"]
    assert capture["keys"] >= 2 and capture["seconds"] > 0 and not capture["failed"]
    assert capture["pool_bytes"] > 0 and "output bytes" in capture["pool_bytes_label"]
    throughput = doc["throughput"]
    assert throughput["same_tokens"] is True and throughput["runner_eager_steps"] == 0
    assert throughput["eager_tokens_per_s"] > 0 and throughput["graph_tokens_per_s"] > 0
    assert doc["compile"]["enabled"] is False and doc["compile"]["skipped"]
    assert doc["runner_stats"]["eager_runs"] == 0 and doc["runner_stats"]["graph_runs"] > 0
    for result in doc["ubatch"]:  # sizes above the largest batch size replay as micro-batches
        assert result["batch_size"] > 3 and result["eager_runs_per_call"] == 0 and sum(result["pieces"].values()) >= 2
        assert result["max_abs_diff"] <= 1e-4
    piecewise = doc["piecewise"]
    assert piecewise["sizes"] == [16, 32, 64, 128] and [s["num_tokens"] for s in piecewise["steps"]] == [12, 40]
    for step in piecewise["steps"]:  # varlen attention between 3 pieces, equal to eager at the padded size
        assert step["pieces"] == 3 and step["bitwise_equal_padded_eager"] is True and step["mode"] == "MIXED"
        assert step["padded_size"] == min(size for size in piecewise["sizes"] if size >= step["num_tokens"])
        assert all(math.isfinite(step["times_us"][name]["median"]) for name in ("eager", "piecewise", "raw_replay"))
        assert set(step["floor"]["costs"]) == {"runner", "runner_metadata_only"}
        check_costs(step["floor"]["costs"].values())
    within, above = piecewise["traces"]  # budget = the largest piecewise size, then twice it
    assert (within["token_budget"], above["token_budget"]) == (128, 256)
    for trace in (within, above):
        assert trace["tokens"] > 0 and sum(trace["shares"].values()) == pytest.approx(1.0)
    assert within["shares"]["eager"] == 0 and within["shares"]["piecewise"] > 0 and within["eager_reasons"] == {}
    assert set(above["eager_reasons"]) <= {"batch_too_large"}
    assert "prefill/mixed steps, varlen attention as the splitting op" in printed and "chunked-prefill trace" in printed
    study = doc["capture_sizes_study"]
    assert [row["trace"] for row in study] == ["uniform 1..64", "Poisson mean 12", "bursty 1-4 / 48-64"]
    assert all(row["tuned_waste"] <= row["default_waste"] for row in study), "tuned sizes never pad more"
    assert "graphs for <= 5%" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench_cpu_tiny.png").stat().st_size > 0
    if importlib.util.find_spec("transformers") is not None:
        check_hf_section(doc["hf_generate"], printed)


def check_costs(costs) -> None:
    """Every cost has its spreads in µs and trivial ops, and says whether it rises above noise."""
    for cost in costs:
        assert isinstance(cost["above_noise"], bool)
        for unit in ("us", "trivial_ops"):
            assert all(math.isfinite(cost[unit][key]) for key in ("median", "p10", "p90"))


def check_multistep(section: dict, printed: str) -> None:
    """Several decode steps per launch: host cost per token for K = 1, 2, 4, 8 against K=1 / K + 1 at
    the smallest and largest batch size, host calls per token, capture per multi-step key, tokens/s per K."""
    assert section["k_values"] == [1, 2, 4, 8] and section["emulated"] is True
    assert [floor["batch_size"] for floor in section["floor"]] == [1, 3]
    for floor in section["floor"]:
        costs = floor["timed"]["costs"]
        assert set(costs) == {f"{name}/K={k}" for name in ("runner", "runner_metadata_only") for k in (1, 2, 4, 8)}
        check_costs(costs.values())
        for name in ("runner", "runner_metadata_only"):
            single = costs[f"{name}/K=1"]["trivial_ops"]["median"]
            for k in (2, 4, 8):
                assert floor["targets"][f"{name}/K={k}"] == pytest.approx(single / k + 1)
                assert floor["verdicts"][f"{name}/K={k}"] in {"yes", "NO", "unclear"}
        calls = floor["host_calls_per_token"]
        assert set(calls) == {"K=1", "K=2", "K=4", "K=8"}
        assert calls["K=8"] < calls["K=4"] < calls["K=2"] < calls["K=1"], calls  # one staging and launch per K tokens
    assert isinstance(section["within_target"], bool)
    keys = {key["key"]: key for key in section["capture"]}
    assert {"decode/bs=4,steps=2", "decode/bs=4,steps=4", "decode/bs=4,steps=8", "decode/bs=4"} == set(keys)
    assert all(key["ok"] and key["seconds"] > 0 and key["output_bytes"] > 0 for key in keys.values())
    assert keys["decode/bs=4,steps=8"]["output_bytes"] == 8 * 4 * 8  # [steps, rows] int64 tokens
    throughput = {row["steps_per_launch"]: row for row in section["throughput"]}
    assert set(throughput) == {1, 2, 4, 8} and all(row["same_tokens"] and row["tokens_per_s"] > 0
                                                   for row in throughput.values())
    assert all(throughput[k]["multi_step_runs"] > 0 and throughput[k]["fallbacks"] == {} for k in (2, 4, 8))
    assert "several decode steps per launch" in printed and "EMULATED backend" in printed


def check_floor_and_load(doc: dict, printed: str) -> None:
    """The floor figures against their targets, wrap()'s floor, and the load at start and end."""
    floor = doc["floor"]
    assert set(floor["wrap"]["costs"]) == WRAP_COSTS
    check_costs(floor["wrap"]["costs"].values())
    targets = floor["targets"]
    guards = doc["guards"]
    if "skipped" in guards:  # no transformers: the guards-by-depth line is skipped, saying why
        assert f"guards by depth: skipped, {guards['skipped']}" in printed
        assert {name: summary["target"] for name, summary in targets.items()} == TARGETS
    else:  # --quick: 2 and 8 layers, each front; one figure against 0.5 per front and depth
        assert list(guards["costs"]) == [f"{front}, {layers} layers" for layers in (2, 8)
                                         for front in ("graph_generate", "wrap()")]
        check_costs(guards["costs"].values())
        assert {name: summary["target"] for name, summary in targets.items()} == {**TARGETS, "guards": 0.5,
                                                                                   "guards_reread": 10.0}
        assert len(targets["guards"]["medians"]) == 4 and "as the model deepens" in printed
        assert list(guards["reread"]["costs"]) == [f"graph_generate, 2 layers, after an assignment to {where}" for
                                                   where in ("the model", "the last layer's attention")]
        check_costs(guards["reread"]["costs"].values())
        assert len(targets["guards_reread"]["medians"]) == 2 and "after one attribute assignment" in printed
    assert len(targets["runner"]["medians"]) == len(targets["runner_metadata_only"]["medians"]) == 2  # batch sizes
    for summary in targets.values():
        assert summary["within_target"] == all(each == "yes" for each in summary["verdicts"])
        assert set(summary["verdicts"]) <= {"yes", "NO", "unclear"}
    for label in ("with value checks (CPU default)", "metadata only (as on a GPU)", "validate() alone",
                  "wrap(): a one-op function", "against the targets"):
        assert label in printed
    load = doc["load"]
    assert load["cores"] == doc["machine"]["cpu_cores"] and len(load["start"]["load_average"]) == 3
    assert len(load["end"]["load_average"]) == 3 and load["seconds"] > 0
    assert load["busy"] == any(value > load["busy_threshold"] for value in load["readings"].values())
    assert (load["warning"] is not None) == load["busy"]
    assert printed.count("load average at the start") == 3  # at the start, in the report's header, at the end
    assert "load average at the end" in printed
    assert ("WARNING: machine BUSY" in printed) == load["busy"]


def test_a_cost_below_noise_is_never_printed_as_a_cost(monkeypatch):
    """Paired differences that straddle zero (or sit below zero) print as "below noise"; a clear
    cost prints its median and is judged against the target."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    timing = importlib.import_module("bench_timing")
    floor = importlib.import_module("bench_floor")
    trivial = [2.0, 2.0, 2.1, 2.0, 2.0, 2.1, 2.0, 2.0, 2.0, 2.0]
    negative = timing.Cost.of([-3.0, -2.5, -4.0, -3.2, -2.8, -3.1, -2.9, -3.3, -3.0, -2.7], trivial)
    straddling = timing.Cost.of([20.0, -15.0, 25.0, -18.0, 30.0, 22.0, -20.0, 24.0, 26.0, 19.0], trivial)
    clear = timing.Cost.of([18.0, 18.5, 19.0, 18.2, 18.8, 18.4, 18.6, 18.1, 18.9, 18.3], trivial)
    for cost in (negative, straddling):
        assert cost.above_noise is False
        assert floor.format_cost(dataclasses.asdict(cost)) == "below noise"
    assert timing.verdict(dataclasses.asdict(negative), 6.0) == "yes"  # its whole band is within the target
    assert timing.verdict(dataclasses.asdict(straddling), 6.0) == "unclear"
    tiny = timing.Cost.of([0.05] * 10, trivial)  # always positive, but below the trivial op's own spread
    assert tiny.above_noise is False and floor.format_cost(dataclasses.asdict(tiny)) == "below noise"
    assert clear.above_noise is True and clear.trivial_ops.median == pytest.approx(9.1, abs=0.1)
    assert floor.format_cost(dataclasses.asdict(clear)).startswith(f"{clear.trivial_ops.median:.1f} [")
    assert timing.verdict(dataclasses.asdict(clear), 6.0) == "NO"
    assert timing.verdict(dataclasses.asdict(clear), 10.0) == "yes"
    assert timing.stability(dataclasses.asdict(clear)) < 1.1


def test_busy_machine_is_flagged(monkeypatch):
    """A 1-minute load above half the cores at the start, or other processes' CPU time over the
    run above half the cores, makes the run busy with a WARNING; an idle reading does not."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    load = importlib.import_module("bench_load")

    def sample(wall_s, load1, busy_cpu_s, own_cpu_s):
        return load.LoadSample(wall_s, (load1, load1, load1), 4, busy_cpu_s, own_cpu_s)

    idle = load.load_verdict(sample(0.0, 0.3, 100.0, 1.0), sample(60.0, 1.0, 162.0, 61.0))  # the bench's own core
    assert idle["busy"] is False and idle["warning"] is None
    assert idle["readings"]["cores other processes used during the run"] == pytest.approx(0.0333, abs=1e-3)
    busy_start = load.load_verdict(sample(0.0, 2.5, None, 0.0))
    assert busy_start["busy"] is True and "WARNING: machine BUSY" in busy_start["warning"]
    others = load.load_verdict(sample(0.0, 0.3, 100.0, 1.0), sample(60.0, 1.0, 100.0 + 60 + 150, 61.0))
    assert others["busy"] is True and "other processes used during the run 2.50" in others["warning"]
    assert any(line.startswith("WARNING") for line in load.format_load(others))


def check_hf_section(hf: dict, printed: str) -> None:
    assert [model["model"].split(" (")[0] for model in hf["models"]] == ["tiny random Llama", "tiny random Gemma3"]
    for model in hf["models"]:
        eager, graphed, compiled = model["peers"]
        assert eager["name"] == "eager" and eager["replayed_calls"] == 0 and eager["decode_step_ms"]["median"] > 0
        assert graphed["same_tokens"] is True and graphed["first_steady_s"] > 0
        # 3 generate() calls: only the first call's prefill and first decode step run eagerly (warm-up); the
        # Gemma3's sliding window is shorter than prompt + new tokens
        assert graphed["replayed_calls"] == graphed["forward_calls"] - 2 > 0
        assert compiled["error"] == "skipped (--no-compile)"
    assert printed.count("Hugging Face generate(): tiny random") == 2
    assert "neither column is a CUDA-graph effect" in printed


def test_hf_compile_peer_that_cannot_run_is_reported(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench_hf = importlib.import_module("bench_hf")
    # The Llama alone: compile_result() catches the failure the same way for every model (both models' peers run
    # in test_emulated_run_records_every_figure).
    monkeypatch.setattr(bench_hf, "MODELS", dict(list(bench_hf.MODELS.items())[:1]))

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(torch, "compile", no_compiler)
    with torch.no_grad():
        result = bench_hf.measure_hf_generate(torch.device("cpu"), new_tokens=3, with_compile=True)
    assert [model.model for model in result.models] == list(bench_hf.MODELS)
    for model in result.models:
        assert model.peers[-1].error == "could not run here: RuntimeError: no C compiler"
        assert model.peers[1].same_tokens is True
    assert "could not run here" in "\n".join(bench_hf.format_hf(dataclasses.asdict(result)))


def test_no_plot_writes_no_png(bench, tmp_path):
    doc = run_bench(bench, tmp_path, "--backend", "emulated", "--device", "cpu", "--no-plot", "--batch-sizes", "2",
                    "--piecewise-tokens", "", "--no-hf")
    assert not list(tmp_path.glob("*.png"))
    assert doc["guards"] == {"skipped": "--no-hf"}
    assert doc["piecewise"] is None and doc["settings"]["piecewise_tokens"] == []


def test_graph_that_disagrees_with_eager_is_not_timed(bench, monkeypatch):
    import bench_lib

    from graphrt import GraphRunner
    from graphrt.reference import graph_runner_kwargs

    import bench_timing

    config = bench_lib.model_config("tiny", torch.float32, {})
    work = bench_lib.Workload.build(config, 2, torch.device("cpu"))
    runner = GraphRunner(work.model, max_batch_size=2, progress=False, **graph_runner_kwargs(work.backend, work.pools))
    runner.capture()
    eager = bench_lib.run_eager
    monkeypatch.setattr(bench_lib, "run_eager", lambda model, batch: eager(model, batch) + 1.0)
    clock = bench_timing.Clock(torch.device("cpu"), 1e-3)

    def no_floor(batch):
        raise AssertionError("timed a graph that disagrees with eager")

    with torch.no_grad(), work.decode_batch(1, random.Random(0)) as batch:
        with pytest.raises(RuntimeError, match="differ from eager"):
            bench_lib.measure_batch(work, runner, batch, clock, iters=1, warmup=0, floor_of=no_floor)


def test_cuda_backend_refused_without_cuda(bench, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit, match="cuda"):
        bench.main(["--backend", "cuda", "--out", str(tmp_path)])


@pytest.mark.cuda
def test_cuda_run_verifies_graphs(bench, tmp_path):
    doc = run_bench(bench, tmp_path, "--backend", "cuda", "--no-compile")
    assert doc["backend"] == "cuda" and doc["emulated"] is False and doc["verified"] is True
    assert "graph pool" in doc["capture"]["pool_bytes_label"]
    assert doc["machine"]["device_name"] == torch.cuda.get_device_name()


def test_cost_samples_keep_the_fastest_part(bench):
    """A preemption only adds time: with best_of=3 each sample is the fastest of 3 parts of a third of the calls."""
    import bench_timing

    class ScriptedClock(bench_timing.Clock):
        def __init__(self) -> None:
            super().__init__(torch.device("cpu"), 1e-3)
            self.parts = iter([9.0, 4.0, 6.0, 5.0, 8.0, 7.0])

        def calibrate(self, fn, warm_calls=3):
            return 6

        def sample_us(self, fn, calls):
            assert calls == 2
            return next(self.parts)

    _, samples = bench_timing.time_rounds(ScriptedClock(), [("probe", lambda: None)], iters=2, warmup=0, best_of=3)
    assert samples["probe"] == [4.0, 5.0]
