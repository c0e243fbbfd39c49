"""scripts/gpu_first_session.sh (scripts/gpu_session.py) rehearsed on the CPU, and ``make test-cuda`` on a GPU
image: the session keeps its budget and its files, and every step's command names what exists (issue 40)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def session(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("gpu_session")


def test_the_session_over_the_fake_runs_what_fits_and_names_what_it_skips(tmp_path):
    """A 30 s budget: the versions step (its cap 20 s) runs (over the fake torch.cuda); every later step's cap does not
    fit in what is left, so each is skipped and named. summary.txt is the only file, written first."""
    env = {**os.environ, "OUT": str(tmp_path), "GPU_SESSION_BUDGET_S": "30", "PYTHON": sys.executable,
           "GPU_SESSION_LAUNCHER": str(ROOT / "tests" / "fake_cuda_launch.py")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_first_session.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    summary = (tmp_path / "summary.txt").read_text()
    assert [path.name for path in tmp_path.iterdir()] == ["summary.txt"]
    assert "step versions: ok" in summary and "a Hopper faked on the CPU" in summary and '"capability": [9, 0]' in summary
    for name in ("probes", "fixes", "pools", "hf", "engine", "engine_steps", "nccl", "rest"):
        assert f"step {name}: SKIPPED: its cap of" in summary, summary
    assert done.returncode == 1 and summary.splitlines()[-1].startswith("total: ")
    assert summary.splitlines()[1].startswith("caps: versions 20 + probes 45 + ") and "s planned of 30" in summary


def test_the_probes_step_runs_every_probe_in_one_interpreter_within_its_cap(tmp_path):
    """Issue 48, item 2: the probes step started 13 interpreters (60 to 110 s of cold imports against a
    120 s cap on a GPU); now one runs the 12 probes in order (here over the fake torch.cuda), and its
    line in summary.txt says how long it took against its cap, beside the caps' arithmetic."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_SESSION_STEPS": "versions,probes",
           "GPU_SESSION_LAUNCHER": str(ROOT / "tests" / "fake_cuda_launch.py"), "GRAPHRT_PROBE_DEVICE": "cpu"}
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_first_session.sh")], env=env, capture_output=True, text=True,
                   timeout=300)
    summary = (tmp_path / "summary.txt").read_text()
    lines = (tmp_path / "probes.jsonl").read_text().splitlines()
    assert len(lines) == 13 and '"gpu": "a Hopper faked on the CPU' in lines[0], lines
    assert "step probes: " in summary and "(cap 45 s)" in summary and "CUT" not in summary, summary
    assert "capture_executes_nothing: held" in summary and "second_capture_in_another_thread: held" in summary
    assert summary.count(": held") + summary.count(": DID NOT HOLD") == 12, summary


def test_a_step_past_its_cap_is_cut_and_named_and_the_next_still_runs(session, tmp_path):
    slow = session.Step("slow", 1, [["-c", "import time; print('started', flush=True); time.sleep(30)"]], "slow.log")
    quick = session.Step("quick", 5, [["-c", "print('=== 1 passed in 0.01s ===')"]], "quick.log")
    assert session.run_session([slow, quick], budget_s=10, out=tmp_path) == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert "step slow: CUT at its cap of 1 s" in summary and "step quick: ok" in summary
    assert "1 passed" in summary and (tmp_path / "slow.log").read_text() == "started\n"


def test_the_session_writes_at_most_seven_files_and_fits_its_budget_with_margin(session):
    steps = session.session_steps()
    assert [step.name for step in steps] == ["versions", "probes", "fixes", "pools", "hf", "engine", "engine_steps",
                                             "nccl", "rest"]
    assert len({step.output for step in steps if step.output}) + 1 <= 7  # and summary.txt
    assert sum(step.cap_s for step in steps) + 30 <= session.BUDGET_S <= 9 * 60  # half a minute spare at least
    assert session.plan_line(steps, session.BUDGET_S).endswith("510 s planned of 540, 30 s spare")


def test_the_cold_compiles_come_last_and_every_command_runs_offline(session, monkeypatch):
    """Issue 48, item 2: ``rest`` began with tests/test_compile.py's cold inductor compiles, so the files after
    them were likely cut; and a step waiting on the hub would lose its cap on the GPU image (no network)."""
    rest = session.remaining_cuda_files()
    assert rest[-1] == "tests/test_compile.py" and rest[0] == "tests/test_runner.py"
    seen = {}
    monkeypatch.setattr(session.subprocess, "Popen", lambda command, **options: seen.update(options["env"]) or
                        type("Done", (), {"wait": lambda self, timeout=None: 0, "pid": 0})())
    session.run_command(["-c", "pass"], 5, None, {})
    assert seen["HF_HUB_OFFLINE"] == "1" and seen["TRANSFORMERS_OFFLINE"] == "1"
    engine = next(step for step in session.session_steps() if step.name == "engine")
    assert engine.commands == [["scripts/bench_hf_engine.py", "--max-requests", "4", "--contexts", "1024"]]


def test_the_engine_steps_row_measures_host_and_device_ms_on_cuda_into_the_summary(session):
    """Issue 47, item 6 in the session (issue 48, item 2): host and device ms per decode step, with graphs and
    eagerly, 4 layers and 4 requests, on CUDA by name (a CPU fall back would time the emulated replays), its
    table in summary.txt (no file of its own), its cap inside the budget's arithmetic."""
    steps = session.session_steps()
    names = [step.name for step in steps]
    events = steps[names.index("engine_steps")]
    assert names.index("engine_steps") == names.index("engine") + 1 and events.output is None
    assert events.commands == [["scripts/bench_hf_engine.py", "--device", "cuda", "--max-requests", "4",
                                "--step-events"]]
    assert "engine_steps 35" in session.plan_line(steps, session.BUDGET_S)


def test_every_test_and_script_a_step_names_exists(session):
    for step in session.session_steps():
        for command in step.commands:
            for argument in command:
                path, _, test = argument.partition("::")
                if path.startswith(("tests/", "scripts/")):
                    source = (ROOT / path).read_text()
                    assert not test or f"def {test}(" in source, argument
    assert "tests/test_runner.py" in session.remaining_cuda_files()
    assert not set(session.remaining_cuda_files()) & set(session.ALREADY_RUN)


def test_make_test_cuda_runs_on_the_torch_it_finds_with_a_gpu_and_installs_nothing(tmp_path):
    """On the GPU image (no network) ``make test-cuda`` must not build a venv or pip install."""
    python = tmp_path / "python3"
    python.write_text('#!/bin/sh\necho "python3 $*" >> "$(dirname "$0")/calls"\nexit 0\n')
    python.chmod(0o755)
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "test-cuda", f"PYTHON={python}"],
                          capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert done.returncode == 0 and "installing nothing" in done.stdout, done.stdout + done.stderr
    assert calls[-1] == "python3 -m pytest -q -m cuda" and not any("pip" in call or "venv" in call for call in calls)
