"""The engine path with 1 and 2 tensor-parallel ranks on CPU: tokens/s, graphrt's cost per step, steps replayed.

    PYTHONPATH=. python scripts/bench_hf_engine_tp.py [--family llama] [--hidden 256] [--prompts 8] [--new-tokens 32]
        [--device cuda]

The same model (random weights, 4 layers) and prompts go through ``graphrt.hf.engine_model(...).generate``
in fresh processes (gloo, one torch thread each): one rank alone, one rank in lockstep (a process group of
one: the agreements without a peer), and two ranks sharding the model by its tensor-parallel plan. Each
path runs once to warm up (capture included) and is timed on a second run, eagerly (``graphs=False``) and
with graphs. Printed per row (rank 0's): whether the tokens equal ``model.generate()``'s, generated
tokens/s, engine steps, the share of steps replayed (decode graphs, piecewise prefill), ms per step in the
runner (of which the lockstep step agreement: one host all-reduce, and the wait for the slower rank) and
outside it (scheduling, batch building, sampling; of which the broadcast of rank 0's tokens). On CPU the graphs
are the emulated backend (recorded ops replayed one by one) and two ranks share the machine's cores, so the
tokens/s say nothing about GPUs or about tensor parallelism's speedup: the point is graphrt's per-step cost.
``--device cuda``: NCCL for the model, gloo for the agreements, one GPU per rank (rows needing more GPUs than
the machine has are marked so); the graphs are CUDA graphs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_engine import add_workload_options, workload  # noqa: E402
from hf_engine_helpers import generate_alone  # noqa: E402
from lockstep_helpers import run_ranks  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.hf.engine_ranks import EngineRanks  # noqa: E402
from graphrt.parallel.lockstep import Lockstep  # noqa: E402

TIMEOUT_S = 1800


def timing(owner: Any, name: str, spent: List[float]) -> None:
    """Add the seconds every call of ``owner.name`` takes to ``spent[0]`` (this process only)."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(owner, name, timed)


def rank_rows(rank: int, options: Dict[str, Any], grouped: bool) -> List[Dict[str, Any]]:
    """One rank's rows (eager, graphs): the engine over WORLD when ``grouped``, else alone."""
    torch.set_num_threads(1)
    agreeing, sharing = [0.0], [0.0]
    timing(Lockstep, "agree_step", agreeing)
    timing(EngineRanks, "share_tokens", sharing)
    model, prompts = workload(options["family"], options["hidden"], options["prompts"], options["device"])
    expected = generate_alone(model, prompts, options["new_tokens"])
    group = {"process_group": dist.group.WORLD} if grouped else {}
    engine = graphrt.hf.engine_model(model, max_requests=options["max_requests"], max_context=64, max_step_tokens=32,
                                     **group)
    rows = []
    for graphs in (False, True):
        engine.generate(prompts, max_new_tokens=options["new_tokens"], graphs=graphs)  # warm-up, capture
        agreeing[0] = sharing[0] = 0.0
        start = time.perf_counter()
        tokens = engine.generate(prompts, max_new_tokens=options["new_tokens"], graphs=graphs)
        seconds = time.perf_counter() - start  # generate() returns host lists: the device has finished
        stats = engine.stats()
        serve = stats["serve"]
        steps = serve["decode_steps"] + serve["prefill_steps"]
        rows.append(dict(graphs=graphs, equal=tokens == expected, tokens_per_s=sum(map(len, tokens)) / seconds,
                         steps=steps, replayed=(serve["decode_steps_graphed"] + stats["piecewise_runs"]) / steps,
                         runner_ms=1e3 * serve["runner_seconds"] / steps,
                         outside_ms=1e3 * (serve["seconds"] - serve["runner_seconds"]) / steps,
                         agreeing_ms=1e3 * agreeing[0] / steps, sharing_ms=1e3 * sharing[0] / steps))
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(parser)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    options = vars(parser.parse_args(argv))
    gpus = torch.cuda.device_count() if options["device"] == "cuda" else 2
    where = (f"{torch.cuda.get_device_name()} x{gpus}, NCCL" if options["device"] == "cuda" else
             f"CPU, gloo, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{options['family']}, hidden {options['hidden']}, 4 layers, {options['prompts']} prompts x "
          f"{options['new_tokens']} new tokens, {options['max_requests']} requests at once, {where}, one torch "
          "thread per rank")
    print("| ranks | path | tokens equal generate() | tokens/s | steps | steps replayed | ms/step in runner "
          "| of which step agreement | ms/step outside runner | of which token broadcast |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    backend = "nccl" if options["device"] == "cuda" else "gloo"
    for label, world_size, grouped in (("1 (alone)", 1, False), ("1 (lockstep)", 1, True), ("2 (tensor parallel)", 2, True)):
        if world_size > gpus:
            print(f"| {label} | needs {world_size} GPUs | | | | | | | | |")
            continue
        rows = run_ranks(rank_rows, options, grouped, world_size=world_size, backend=backend, timeout_s=TIMEOUT_S)[0]
        for row in rows:
            print(f"| {label} | {'graphs' if row['graphs'] else 'eager'} | {'yes' if row['equal'] else '**no**'} "
                  f"| {row['tokens_per_s']:.0f} | {row['steps']} | {100 * row['replayed']:.0f}% "
                  f"| {row['runner_ms']:.2f} | {row['agreeing_ms']:.2f} | {row['outside_ms']:.2f} "
                  f"| {row['sharing_ms']:.2f} |")


if __name__ == "__main__":
    main()
