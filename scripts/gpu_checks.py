"""The CUDA backend's graph-pool life on a GPU: each check in a process of its own, one JSON line each.

    PYTHONPATH=. python3 scripts/gpu_checks.py                 # every check
    PYTHONPATH=. python3 scripts/gpu_checks.py --check NAME    # one check, in this process

- ``retune_after_failed_largest``: the largest key's graph differs from eager (verification drops
  it), the smaller keys capture; steps; ``retune(3)`` drops every decode graph and captures the
  new sizes in a fresh pool; replays equal eager; ``torch.cuda.empty_cache()`` is legal.
- ``invalidated_last_then_random``: the last key captured reads a value on the host, so no later
  capture succeeds; eager ``torch.rand`` works at once, and 50 steps each followed by eager sampling
  (``torch.multinomial``) run (issue 33, item 1).
- ``invalidated_then_healthy``: the largest key reads a value on the host (``.item()``), which
  invalidates its capture; the next keys capture and replay; ``empty_cache()`` is legal; the
  allocator's ``allocated_bytes.all.current`` and ``reserved_bytes.all.current`` are the same
  before and after 200 replays; eager random numbers still work.

A check raises ``CheckFailed`` naming what it saw. A process per check keeps an allocator abort
(an INTERNAL ASSERT in a destructor ends the process) to its own check, named in its line.
tests/test_cuda_pool.py runs the same checks over a fake torch.cuda on the CPU (``--device cpu``
there), so this file is exercised before it reaches a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from graphrt import ForwardBatch, GraphRunner
from graphrt.backends.cuda import stream_capturing
from graphrt.entry import GraphStatus
from graphrt.reference import make_decode_batch

TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # graph vs eager at another padded GEMM shape: rounding only
CHECK_TIMEOUT_S = 300


class CheckFailed(AssertionError):
    """What a check expected and what it saw."""


def expect(ok: bool, message: str) -> None:
    """Fail the check with ``message`` unless ``ok``."""
    if not ok:
        raise CheckFailed(message)



class Misbehaving(torch.nn.Module):
    """A decode model (embed tokens and positions, project) that, at one batch size (``at``), does
    what a CUDA graph cannot hold: ``"differ"`` takes a path only under capture (the graph's first
    replay differs from eager); ``"raise"`` raises under capture; ``"item"`` reads a value on the
    host, which invalidates a capture (and is fine eagerly)."""

    def __init__(self, misbehaviour: Optional[str] = None, at: int = 0, device: str = "cpu") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, 16, generator=generator).to(device))
        self.proj = torch.nn.Parameter((torch.randn(16, 97, generator=generator) / 4).to(device))
        self.misbehaviour, self.at = misbehaviour, at

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed[input_ids] + positions[:, None].to(self.embed.dtype) * 1e-2
        if input_ids.shape[0] == self.at:
            hidden = self.misbehave(hidden)
        return hidden @ self.proj

    def misbehave(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.misbehaviour == "item":
            return hidden / max(1.0, float(hidden.abs().max().item()))
        if self.misbehaviour == "raise" and stream_capturing():
            raise ValueError(f"this model cannot be captured at batch size {self.at}")
        if self.misbehaviour == "differ" and stream_capturing():
            return hidden + 1.0
        return hidden


def decode_batch(size: int, device: str, seed: int = 0) -> ForwardBatch:
    """A DECODE batch of ``size`` requests (slots and requests from 1: 0 is the padding's)."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 50, (size,), generator=generator).tolist()
    return make_decode_batch(torch.randint(0, 97, (size,), generator=generator).to(device), list(range(1, size + 1)),
                             seq_lens, torch.arange(1, size + 1, device=device), device)


def eager(model: torch.nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """The model on ``batch`` without graphs: the reference every replay is compared with."""
    with torch.no_grad():
        return model(batch.input_ids, batch.positions, batch)


def runner_for(model: torch.nn.Module, device: str, sizes: List[int]) -> GraphRunner:
    """A decode runner on the CUDA backend capturing ``sizes`` (static tensors on ``device``)."""
    return GraphRunner(model, max_batch_size=max(sizes), capture_sizes=sizes, backend="cuda", device=device,
                       progress=False)


def key_names(runner: GraphRunner, status: GraphStatus) -> List[str]:
    """The runner's keys in ``status``, by name."""
    return sorted(str(key) for key, entry in runner.registry.entries.items() if entry.status is status)


def pools(runner: GraphRunner) -> List[Tuple[int, int]]:
    """The pool ids of the READY full graphs (``CUDAGraph.pool()``)."""
    return sorted({tuple(entry.graph.graph.pool()) for entry in runner.registry.entries.values()
                   if entry.status is GraphStatus.READY})


def replay_equal_eager(runner: GraphRunner, model: torch.nn.Module, device: str, sizes: List[int],
                       steps: int) -> int:
    """``steps`` steps cycling through ``sizes``, each equal to eager; returns the graph runs they added."""
    runs = runner.stats()["graph_runs"]
    for step in range(steps):
        batch = decode_batch(sizes[step % len(sizes)], device, seed=step)
        got, want = runner(batch), eager(model, batch)
        expect(torch.allclose(got, want, **TOLERANCE),
               f"step {step} (bs {batch.batch_size}): graph differs from eager by {(got - want).abs().max():.3g}")
    return runner.stats()["graph_runs"] - runs


def allocator_bytes(device: str) -> Dict[str, int]:
    """The caching allocator's current allocated and reserved bytes."""
    stats = torch.cuda.memory_stats(device)
    return {name: stats.get(f"{name}_bytes.all.current", 0) for name in ("allocated", "reserved")}


def check_retune_after_failed_largest(device: str, steps: int = 100) -> Dict[str, Any]:
    """Largest key fails verification, the others replay; retune(3) recaptures in a fresh pool; replays equal eager."""
    model = Misbehaving("differ", at=8, device=device)
    runner = runner_for(model, device, [2, 4, 8])
    runner.capture()
    expect(key_names(runner, GraphStatus.VERIFY_FAILED) == ["decode/bs=8"],
           f"verify_failed keys: {key_names(runner, GraphStatus.VERIFY_FAILED)}, expected decode/bs=8")
    expect(key_names(runner, GraphStatus.READY) == ["decode/bs=2", "decode/bs=4"],
           f"ready keys after the failed largest: {key_names(runner, GraphStatus.READY)}")
    first_pools = pools(runner)
    expect(len(first_pools) == 1, f"the healthy keys share one pool, got {first_pools}")
    before = replay_equal_eager(runner, model, device, [1, 2, 3, 4, 5, 6], 12)
    runner.retune(3)
    ready = key_names(runner, GraphStatus.READY)
    expect(len(ready) == len(runner.registry.entries) == len(runner.capture_sizes),
           f"after retune to {runner.capture_sizes}: ready {ready}, failed {runner.stats()['failed_keys']}")
    retuned_pools = pools(runner)
    expect(len(retuned_pools) == 1 and retuned_pools != first_pools,
           f"retuned keys share one fresh pool: before {first_pools}, after {retuned_pools}")
    after = replay_equal_eager(runner, model, device, [1, 2, 3, 4, 5, 6], steps)
    expect(after == steps, f"{steps} steps after retune, {after} replayed: {runner.stats()['eager_reasons']}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return {"retuned_sizes": list(runner.capture_sizes), "replays_before_retune": before, "replays_after": after,
            "pools": [list(first_pools[0]), list(retuned_pools[0])]}


def check_invalidated_then_healthy(device: str, replays: int = 200) -> Dict[str, Any]:
    """The largest key's capture is invalidated by a host read; the next keys replay with flat allocator bytes."""
    model = Misbehaving("item", at=8, device=device)
    runner = runner_for(model, device, [2, 4, 8])
    runner.capture()
    failed = runner.stats()["failed_keys"]
    expect(list(failed) == ["decode/bs=8"], f"failed keys {failed}, expected decode/bs=8 only")
    expect(key_names(runner, GraphStatus.READY) == ["decode/bs=2", "decode/bs=4"],
           f"ready keys after the invalidated capture: {key_names(runner, GraphStatus.READY)}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # legal; it asserted a routing left only up to torch 2.7 (from 2.8 it skips, pytorch#158152)
    batches = [decode_batch(size, device, seed=size) for size in (2, 3, 4)]
    for batch in batches:  # each real size cuts its outputs once
        got, want = runner(batch), eager(model, batch)
        expect(torch.allclose(got, want, **TOLERANCE), f"bs {batch.batch_size}: graph differs from eager")
    runs = runner.stats()["graph_runs"]
    torch.cuda.synchronize(device)
    before = allocator_bytes(device)
    for step in range(replays):
        runner(batches[step % len(batches)])
    torch.cuda.synchronize(device)
    after = allocator_bytes(device)
    expect(runner.stats()["graph_runs"] - runs == replays, f"{replays} steps, not all replayed: {runner.stats()}")
    expect(before == after, f"allocator bytes moved over {replays} replays: {before} -> {after}")
    runner(decode_batch(8, device, seed=8))
    reasons = runner.stats()["eager_reasons"]
    expect(reasons == {"capture_failed": 1}, f"eager reasons {reasons}: only the failed key's step runs eagerly")
    expect(bool(torch.rand(4, device=device).isfinite().all()), "eager random numbers fail after the failed capture")
    return {"failed": failed, "replays": replays, "allocator_before": before, "allocator_after": after}


def check_invalidated_last_then_random(device: str, steps: int = 50) -> Dict[str, Any]:
    """The last key captured is invalidated by a host read, so no later capture ends the generator's
    capture (torch <= 2.11 left it on): eager random numbers work at once, and steps that draw them
    (a sampler) replay and run eagerly alongside."""
    model = Misbehaving("item", at=1, device=device)
    runner = runner_for(model, device, [1, 2, 4])
    runner.capture()
    expect(key_names(runner, GraphStatus.FAILED) == ["decode/bs=1"], f"failed keys {runner.stats()['failed_keys']}")
    expect(bool(torch.rand(4, device=device).isfinite().all()), "eager random numbers fail after the failed capture")
    for step in range(steps):
        batch = decode_batch((1, 2, 3)[step % 3], device, seed=step)
        logits = runner(batch)
        torch.multinomial(torch.softmax(logits.float(), -1), 1)  # eager sampling after every step
    return {"graph_runs": runner.stats()["graph_runs"], "eager_runs": runner.stats()["eager_runs"]}


CHECKS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "retune_after_failed_largest": check_retune_after_failed_largest,
    "invalidated_then_healthy": check_invalidated_then_healthy,
    "invalidated_last_then_random": check_invalidated_last_then_random,
}


def run_check(name: str, device: str, **options: int) -> Dict[str, Any]:
    """One check in this process (``options``: its step counts): its facts, or the failure it raised."""
    try:
        return {"check": name, "ok": True, **CHECKS[name](device, **options)}
    except Exception as error:  # reported, not raised: the driver prints every check's line
        return {"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"}


def run_isolated(name: str, device: str) -> Dict[str, Any]:
    """One check in a fresh process; a crash (an allocator abort) is reported with its exit code."""
    command = [sys.executable, str(Path(__file__).resolve()), "--check", name, "--device", device]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "error": f"timed out after {CHECK_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode not in (0, 1) or not lines:
        return {"check": name, "ok": False, "error": f"exit code {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=sorted(CHECKS), help="run this check here (default: each in a process)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    names = [args.check] if args.check else list(CHECKS)
    results = []
    for name in names:  # each line as soon as its check ends: a session cut short keeps the lines before
        results.append(run_check(name, args.device) if args.check else run_isolated(name, args.device))
        print(json.dumps(results[-1], default=str), flush=True)
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
