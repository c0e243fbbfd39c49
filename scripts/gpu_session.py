"""The first GPU session in one call (issues 40, 48): every step in order of what it tells, under one budget.

    PYTHONPATH=. python3 scripts/gpu_session.py [--budget 540] [--out DIR]    # scripts/gpu_first_session.sh

A GPU is lent for 15 minutes of device time, the machine's start included, one command at most
10 minutes: this command gets ``--budget`` seconds (9 minutes). Steps, in order:

1. ``versions``: torch, CUDA, the GPU and its compute capability, transformers, NCCL;
2. ``probes``: scripts/gpu_probe.py, one line per rule the CUDA backend rests on, and one per
   prediction of issue 40, each saying whether it held (``agrees``); every probe in one interpreter;
3. ``fixes``: the cuda-marked tests of the last rounds' fixes (issues 33, 40, 48);
4. ``pools``: scripts/gpu_checks.py, the graph pools' life over many steps;
5. ``hf``: the Hugging Face smoke: ``graph_generate`` on Llama and Gemma 2, the engine on a tiny MoE
   in float32, bfloat16 and ``batched_mm``, the engine families' CUDA test;
6. ``engine``: scripts/bench_hf_engine.py on 4 layers and 4 requests (the engine row: ms per step in
   and outside the runner, eager and graphs; the decode step at one context; capture per engine);
7. ``engine_steps``: scripts/bench_hf_engine.py ``--device cuda --step-events`` (issue 47, item 6: host and
   device ms per decode step, CUDA events, with graphs and eagerly, 4 layers, 4 requests);
8. ``nccl``: lockstep on a one-rank NCCL group;
9. ``rest``: every other cuda-marked test, the cheap files first and the cold inductor compiles
   (tests/test_compile.py) last, in what is left.

Each step runs with at most its cap (its process group is killed there, and the step named as cut);
a step whose cap no longer fits in what is left of the budget is skipped and named. The caps add up
with ``rest``'s least share to less than the budget (``plan_line`` prints the sum in summary.txt). At
most seven files go to ``--out`` ($OUT, else gpu_out): summary.txt (written first, then a line per
step; the engine's tables go there) and one output file per step that has one. Every command runs
with ``HF_HUB_OFFLINE=1`` (the GPU image has no network). ``GPU_SESSION_LAUNCHER``: a script put before
every Python command line (tests/test_gpu_session.py rehearses the session over the fake torch.cuda with it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 540
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # no network on the GPU image: never wait on one
# The engine row: 4 layers (the bench's model), 4 requests at once, the decode step at one context; then the
# host and device ms per decode step (issue 47, item 6), on CUDA by name (no silent fall back to the CPU).
ENGINE_BENCH = ["scripts/bench_hf_engine.py", "--max-requests", "4", "--contexts", "1024"]
ENGINE_STEP_EVENTS = ["scripts/bench_hf_engine.py", "--device", "cuda", "--max-requests", "4", "--step-events"]
TEST_TIMEOUT_S = 120  # one test at most (pytest-timeout, where installed): a hang costs a test, not the session
NCCL_TEST = "tests/test_lockstep_agreement.py::test_one_rank_nccl_group_captures_the_models_all_reduce_in_the_graph"
ENGINE_FAMILIES_TEST = "tests/test_hf_engine_families.py::test_engine_on_cuda_graphs_keeps_generate_tokens"
FIXES = ["tests/test_cuda_first_run.py", "tests/test_cuda_pool.py", "tests/test_capture_memory.py",
         "tests/test_cuda_predictions.py"]
HF = ["tests/test_cuda_hf.py", ENGINE_FAMILIES_TEST]
# The other cuda-marked tests, the most telling cheap ones first (files found with cuda marks and not named
# here next), and last the files whose tests compile cold with inductor (a compile takes tens of seconds: first,
# they left every file after them cut).
REST_ORDER = ["tests/test_runner.py", "tests/test_wrap_capture.py", "tests/test_piecewise.py", "tests/test_check.py",
              "tests/test_reliability.py", "tests/test_multistep_reference.py", "tests/test_reference_model.py",
              "tests/test_sizes_autotune.py", "tests/test_ubatch_sync.py", "tests/test_bench.py"]
COLD_COMPILES = ["tests/test_compile.py"]
# tests/test_gpu_probe.py's cuda test reruns the probes: left out
ALREADY_RUN = FIXES + [path.split("::")[0] for path in HF] + ["tests/test_gpu_probe.py", "tests/test_gpu_session.py"]
RESULT_WORDS = (" passed", " failed", " error", "no tests ran", " skipped", " deselected")
VERSIONS = """
import json, subprocess, sys, torch
def get(read):
    try:
        return read()
    except Exception as error:
        return f"unknown ({type(error).__name__})"
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": get(torch.cuda.get_device_name), "capability": get(torch.cuda.get_device_capability),
        "memory_gib": get(lambda: round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)),
        "nccl": get(lambda: torch.cuda.nccl.version()),
        "transformers": get(lambda: __import__("transformers").__version__)}
print(json.dumps(info, default=str))
print(get(lambda: subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()))
"""


@dataclass(frozen=True)
class Step:
    """One step: its command lines (each after the Python executable), its cap, where its output goes."""

    name: str
    cap_s: int
    commands: Sequence[Sequence[str]]
    output: Optional[str] = None  # a file in the out directory; None: the summary
    env: Dict[str, str] = field(default_factory=dict)
    takes_rest: bool = False  # runs in whatever is left when that is at least ``cap_s`` (its least share)


def pytest_command(*args: str) -> List[str]:
    """``python -m pytest`` quiet, skips named, no cache written, each test cut at TEST_TIMEOUT_S where it can be."""
    timeout = [f"--timeout={TEST_TIMEOUT_S}"] if find_spec("pytest_timeout") is not None else []
    return ["-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *timeout, *args]


def remaining_cuda_files() -> List[str]:
    """The test files with cuda marks no earlier step runs: REST_ORDER's, the others by name, COLD_COMPILES'."""
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                    if "mark.cuda" in path.read_text() or "marks=pytest.mark.cuda" in path.read_text())
    rest = [path for path in marked if path not in ALREADY_RUN]
    named = REST_ORDER + COLD_COMPILES
    return ([path for path in REST_ORDER if path in rest] + [path for path in rest if path not in named]
            + [path for path in COLD_COMPILES if path in rest])


def session_steps() -> List[Step]:
    """The first session's steps, in order (module docstring). The caps are a cold interpreter (torch with
    CUDA: 5 to 8 s each, issue 48's reading of the 13-interpreter probes step at 60 to 110 s) per process
    plus the step's own work; ``rest`` takes what is left, at least its cap."""
    return [
        Step("versions", 20, [["-c", VERSIONS]]),  # one interpreter: 5 s on the CPU rehearsal
        Step("probes", 45, [["scripts/gpu_probe.py"]], "probes.jsonl"),  # one interpreter: about 10 s and 12 probes
        Step("fixes", 90, [pytest_command("-m", "cuda", *FIXES)], "fixes.log"),
        Step("pools", 50, [["scripts/gpu_checks.py"]], "pools.jsonl"),  # 3 checks, a process each: 17 s on the CPU
        Step("hf", 120, [pytest_command("-m", "cuda", *HF)], "hf.log"),
        Step("engine", 65, [ENGINE_BENCH]),  # its tables go to summary.txt; 41 s on the CPU rehearsal (load 10)
        Step("engine_steps", 35, [ENGINE_STEP_EVENTS]),  # its table goes to summary.txt; 30 s on the CPU (load 4)
        Step("nccl", 40, [pytest_command("-rA", NCCL_TEST)], "nccl.log", {"NCCL_DEBUG": "WARN"}),
        Step("rest", 45, [pytest_command("-m", "cuda", "--deselect", NCCL_TEST, *remaining_cuda_files())], "rest.log",
             takes_rest=True),
    ]


def plan_line(steps: Sequence[Step], budget_s: float) -> str:
    """The caps' arithmetic: each fixed step's cap, their sum, ``rest``'s least share, what is spare."""
    fixed = [step for step in steps if not step.takes_rest]
    least = sum(step.cap_s for step in steps if step.takes_rest)
    total = sum(step.cap_s for step in fixed)
    return (f"caps: {' + '.join(f'{step.name} {step.cap_s}' for step in fixed)} = {total} s, then "
            f"{', '.join(step.name for step in steps if step.takes_rest) or 'nothing'} in what is left (at least "
            f"{least} s): {total + least} s planned of {budget_s:.0f}, {budget_s - total - least:.0f} s spare")


def python() -> List[str]:
    """The Python command line every step's commands follow (with GPU_SESSION_LAUNCHER's script, if set)."""
    launcher = os.environ.get("GPU_SESSION_LAUNCHER")
    return [sys.executable] + ([launcher] if launcher else [])


def run_command(command: Sequence[str], timeout_s: float, output, env: Dict[str, str]) -> Optional[int]:
    """``command`` in a process group of its own, its output to ``output``; its exit code, or None when it
    ran past ``timeout_s`` (the group is killed: a probe's or a check's own processes too)."""
    process = subprocess.Popen(list(command), cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **OFFLINE, **env},
                               start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def step_summary(step: Step, text: str) -> str:
    """What a step's output says in a line or a few: pytest's last line, each probe's or check's verdict."""
    lines = [line for line in text.splitlines() if line.strip()]
    if step.output is None:
        return "\n".join(f"  {line}" for line in lines)
    verdicts = []
    for line in lines:
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            name = record.get("probe") or record.get("check")
            if name:
                held = record.get("agrees", record.get("ok"))
                verdicts.append(f"  {name}: {'held' if held else 'DID NOT HOLD'}"
                                + (f" ({record['error']})" if record.get("error") else ""))
    tail = [line for line in lines if line.startswith("=") and any(word in line for word in RESULT_WORDS)][-1:]
    if not tail and any("::" in line for line in lines):  # cut before pytest's last line: count its test lines
        tests = [line for line in lines if "::" in line]
        counts = {word: sum(f" {word.upper()}" in line for line in tests) for word in ("passed", "failed", "skipped",
                                                                                       "error")}
        tail = [", ".join(f"{count} {word}" for word, count in counts.items() if count) + " (before the cut)"]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return "\n".join(verdicts + [f"  {line}" for line in failed + tail])


def run_session(steps: Sequence[Step], budget_s: float, out: Path) -> int:
    """Every step that fits in ``budget_s``, in order; summary.txt and the steps' files in ``out``.
    Returns 0 when every step ran and passed."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.txt"
    summary.write_text(f"graphrt first GPU session: {len(steps)} steps in {budget_s:.0f} s of command\n"
                       f"{plan_line(steps, budget_s)}\n")
    start, status = time.monotonic(), 0
    for step in steps:
        left = budget_s - (time.monotonic() - start)
        cap = left if step.takes_rest else step.cap_s
        if left < step.cap_s:
            line = f"step {step.name}: SKIPPED: its cap of {step.cap_s} s does not fit in the {left:.0f} s left"
            status = 1
        else:
            began = time.monotonic()
            path = out / (step.output or ".versions.tmp")
            codes = []
            with path.open("w") as output:
                for command in step.commands:
                    timeout = cap - (time.monotonic() - began)
                    codes.append(run_command(python() + list(command), timeout, output, step.env) if timeout > 0
                                 else None)
            text = path.read_text()
            if step.output is None:
                path.unlink()
            seconds = time.monotonic() - began
            if None in codes:
                verdict = f"CUT at its cap of {cap:.0f} s"
            elif any(codes):
                verdict = f"FAILED (exit {max(codes)})"
            else:
                verdict = "ok"
            status = status or int(verdict != "ok")
            line = f"step {step.name}: {verdict} in {seconds:.0f} s (cap {cap:.0f} s)\n{step_summary(step, text)}"
            line = line.rstrip()
        with summary.open("a") as file:
            file.write(line + "\n")
        print(line, flush=True)
    with summary.open("a") as file:
        file.write(f"total: {time.monotonic() - start:.0f} s of {budget_s:.0f}\n")
    return status


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_SESSION_BUDGET_S", BUDGET_S)))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    parser.add_argument("--steps", default=os.environ.get("GPU_SESSION_STEPS", ""),
                        help="comma-separated step names to run (default: every step; a rehearsal runs a few)")
    args = parser.parse_args(argv)
    steps = session_steps()
    if args.steps:
        names = args.steps.split(",")
        unknown = sorted(set(names) - {step.name for step in steps})
        if unknown:
            parser.error(f"--steps: unknown {unknown}; the steps are {[step.name for step in steps]}")
        steps = [step for step in steps if step.name in names]
    return run_session(steps, args.budget, args.out)


if __name__ == "__main__":
    sys.exit(main())
