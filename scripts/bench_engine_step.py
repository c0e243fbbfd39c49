"""The engine's host cost per decode step, at growing depths and request counts, beside the nano-vllm-shaped anchor.

    PYTHONPATH=. python scripts/bench_engine_step.py [--layers 1,4,16,32] [--requests 1,4,16] [--repeats 3]

"Host" is a decode step's time minus the time spent inside graph replays: what graphrt's engine adds to
the graph it replays (scheduling, batch building and staging, the runner's call, sampling, reading the
tokens, stop checks). Each decode step of ``generate()`` calls (prompts of 4 tokens, ``NEW_TOKENS`` new
tokens each, ``eos_token_id=None``) is timed on its own (``ServeLoop.step``), the replays inside it
subtracted, and the figure is the median over every decode step of ``--repeats`` calls after one that
warms up (captures). Two clocks: this thread's CPU time (``time.thread_time``: what the step costs the
host, unmoved by other processes on a shared machine; torch runs on one thread here), the figure the
targets read, and wall time. The model is a tiny random Llama (hidden 64, intermediate 128, head_dim 16)
at each depth of ``--layers``; the engine captures decode graphs at the request count only
(``capture_sizes``) and one piecewise size for the prefill.

Each figure is taken twice: with the replays run, and with them stubbed (the timed calls' replays do
nothing; the tokens go unchecked): the host's work alone. On this CPU the emulated replay of a deep model
runs on the host's core and evicts its caches, so the host code after it runs slower than it would
beside a GPU, whose work runs elsewhere: "alone" is the host's cost as a GPU would see it.

The anchor is the nano-vllm-shaped engine of tests/client_helpers.py (``ModelRunner``, mode ``runner``:
its own host-built decode batches through a GraphRunner, ``argmax().tolist()`` per step) on its own
Qwen3-shaped model of the same depth, its ``decode()`` timed the same way (its loop's own bookkeeping
around ``decode()`` left out). On CPU every graph is the emulated backend; the replay time it excludes
is not a GPU's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from client_helpers import ModelRunner, Qwen3ForCausalLM  # noqa: E402
from hf_engine_helpers import ragged_prompts  # noqa: E402
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.backends.emulated import EmulatedGraph  # noqa: E402
from graphrt.hf.serve import ServeLoop  # noqa: E402

PROMPT_TOKENS = 4
NEW_TOKENS = 33
DEPTHS = (1, 4, 16, 32)
REQUESTS = (1, 4, 16)
QUICK_DEPTHS, QUICK_REQUESTS = (1, 4), (4,)


@dataclass
class HostCost:
    """One path's cost per decode step (ms, medians over the steps): this thread's CPU time outside
    replays, wall time outside replays, and the CPU time inside them; how many steps were timed."""

    cpu_ms: float
    wall_ms: float
    replay_ms: float
    steps: int


@dataclass
class StepRow:
    """The engine and the anchor at one depth and request count, with the replays run, and with them stubbed
    (``*_alone``: the host's work alone; None when not measured)."""

    layers: int
    requests: int
    engine: HostCost
    anchor: HostCost
    engine_alone: Optional[HostCost] = None
    anchor_alone: Optional[HostCost] = None


class StepClock:
    """Each timed step's CPU and wall time outside the replays inside it: ``replay`` (emulated graphs; CUDA
    graphs' replay calls where CUDA is present) and ``step`` (the step functions ``timed`` installs) patched
    while ``installed``."""

    def __init__(self, stub_replays: bool = False) -> None:
        self.stub_replays = stub_replays
        self.in_replay = [0.0, 0.0]  # CPU, wall of the step under way
        self.samples: List[Tuple[float, float, float]] = []  # per step: CPU, wall outside replays, CPU inside

    @contextmanager
    def installed(self, steps: Sequence[Tuple[type, str, Callable[[object], bool]]]) -> Iterator["StepClock"]:
        """``steps``: (class, method, whether a call of it was a decode step, read after it returned)."""
        classes = [EmulatedGraph] + ([torch.cuda.CUDAGraph] if torch.cuda.is_available() else [])
        originals = [(cls, "replay", cls.replay) for cls in classes] + [(cls, name, getattr(cls, name))
                                                                         for cls, name, _ in steps]
        for cls in classes:
            cls.replay = self._replay(cls.replay)
        for cls, name, is_decode in steps:
            setattr(cls, name, self._step(getattr(cls, name), is_decode))
        try:
            yield self
        finally:
            for cls, name, original in originals:
                setattr(cls, name, original)

    def _replay(self, original: Callable[..., None]) -> Callable[..., None]:
        clock = self
        if self.stub_replays:
            return lambda graph: None

        def replay(graph: object) -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                original(graph)
            finally:
                clock.in_replay[0] += time.thread_time() - cpu
                clock.in_replay[1] += time.perf_counter() - wall
        return replay

    def _step(self, original: Callable[..., object], is_decode: Callable[[object], bool]) -> Callable[..., object]:
        clock = self

        def step(owner: object, *args: object) -> object:
            clock.in_replay = [0.0, 0.0]
            wall, cpu = time.perf_counter(), time.thread_time()
            result = original(owner, *args)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if is_decode(owner):
                clock.samples.append((cpu - clock.in_replay[0], wall - clock.in_replay[1], clock.in_replay[0]))
            return result
        return step


def host_cost(call: Callable[[], object], steps: Sequence[Tuple[type, str, Callable[[object], bool]]],
              repeats: int, after_warmup: Callable[[], None] = lambda: None, stub_replays: bool = False) -> HostCost:
    """The median cost of the decode steps of ``repeats`` calls of ``call`` after one untimed call
    (``after_warmup`` runs after it; ``stub_replays``: the timed calls' replays do nothing)."""
    call()  # warm-up: captures, and every decode width the timed calls read
    after_warmup()
    clock = StepClock(stub_replays)
    with clock.installed(steps):
        for _ in range(repeats):
            call()
    parts = [statistics.median(sample[part] for sample in clock.samples) for part in range(3)]
    return HostCost(*(1e3 * part for part in parts), len(clock.samples))


class DecodeSteps:
    """Whether the last ServeLoop.step of a loop launched a decode step (its decode count moved)."""

    def __init__(self) -> None:
        self.seen: Dict[int, int] = {}

    def __call__(self, loop: object) -> bool:
        count = loop.counts.decode_steps
        before, self.seen[id(loop)] = self.seen.get(id(loop), 0), count
        return count > before


def engine_call(layers: int, requests: int, device: str) -> Tuple[Callable[[], object], graphrt.hf.HFEngine]:
    """``generate`` of ``requests`` prompts on an engine over a tiny Llama of ``layers`` layers, and the engine."""
    model = tiny_model("llama", device, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16)
    budget = PROMPT_TOKENS * requests
    engine = graphrt.hf.engine_model(model, max_requests=requests, max_context=64, max_step_tokens=budget,
                                     capture_sizes=[requests], piecewise_sizes=[budget])
    prompts = ragged_prompts([PROMPT_TOKENS] * requests)
    return lambda: engine.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=None), engine


def anchor_call(layers: int, requests: int) -> Callable[[], object]:
    """nano-vllm's ModelRunner (graphs through a GraphRunner) on its model of ``layers`` layers."""
    blocks_per_request = -(-(PROMPT_TOKENS + NEW_TOKENS) // 4)
    runner = ModelRunner(Qwen3ForCausalLM(block_size=4, layers=layers), "runner", num_blocks=requests * blocks_per_request,
                         max_num_seqs=requests, max_blocks_per_seq=blocks_per_request, capture_sizes=[requests])
    prompts = ragged_prompts([PROMPT_TOKENS] * requests)
    prompts = [[token % 64 for token in prompt] for prompt in prompts]  # the anchor's vocabulary
    return lambda: runner.generate(prompts, [NEW_TOKENS] * requests)


def unwatched(engine: object) -> Callable[[], None]:
    """Takes ``engine`` off the guards' watch list (graphrt.guards.epoch.WATCHED): its own attribute
    assignments then move no state epoch (issue 47's first item makes this needless)."""
    from graphrt.guards import epoch

    return lambda: epoch.WATCHED.pop(id(engine), None)


def measure(depths: Sequence[int], requests: Sequence[int], repeats: int, device: str = "cpu",
            unwatch: bool = False, alone: bool = True) -> List[StepRow]:
    """Every (depth, request count): the engine's and the anchor's cost per decode step, with the replays run
    and (``alone``) stubbed (``unwatch``: the engine taken off the guards' watch list after its first call)."""
    rows = []
    engine_steps = [(ServeLoop, "step", DecodeSteps())]
    anchor_steps = [(ModelRunner, "decode", lambda runner: True)]
    with torch.no_grad():
        for layers in depths:
            for count in requests:
                call, built = engine_call(layers, count, device)
                anchor = anchor_call(layers, count)
                row = StepRow(layers, count, host_cost(call, engine_steps, repeats,
                                                       unwatched(built) if unwatch else lambda: None),
                              host_cost(anchor, anchor_steps, repeats))
                if alone:
                    row.engine_alone = host_cost(call, engine_steps, repeats, stub_replays=True)
                    row.anchor_alone = host_cost(anchor, anchor_steps, repeats, stub_replays=True)
                rows.append(row)
    return rows


def format_rows(rows: Sequence[StepRow]) -> List[str]:
    """A Markdown table: host ms per decode step (CPU clock), the engine against the anchor, with the replays
    run (and the engine's wall clock) and stubbed (the host's work alone)."""
    def cost(value: Optional[HostCost]) -> str:
        return "" if value is None else f"{value.cpu_ms:.3f}"

    def ratio(engine: Optional[HostCost], anchor: Optional[HostCost]) -> str:
        return "" if engine is None or anchor is None or anchor.cpu_ms <= 0 else f"{engine.cpu_ms / anchor.cpu_ms:.2f}"

    lines = ["| layers | requests | engine | anchor | engine/anchor | engine wall | replay ms | engine alone | "
             "anchor alone | alone: engine/anchor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row.layers} | {row.requests} | {cost(row.engine)} | {cost(row.anchor)} | "
                     f"{ratio(row.engine, row.anchor)} | {row.engine.wall_ms:.3f} | {row.engine.replay_ms:.2f} | "
                     f"{cost(row.engine_alone)} | {cost(row.anchor_alone)} | {ratio(row.engine_alone, row.anchor_alone)} |")
    return lines


def depth_ratios(rows: Sequence[StepRow], alone: bool = False) -> Dict[int, float]:
    """Per request count: the engine's host CPU ms at the deepest model over the shallowest's."""
    ratios = {}
    for count in sorted({row.requests for row in rows}):
        by_depth = sorted((row.layers, (row.engine_alone if alone else row.engine)) for row in rows
                          if row.requests == count)
        if len(by_depth) > 1 and by_depth[0][1] is not None and by_depth[0][1].cpu_ms > 0:
            ratios[count] = by_depth[-1][1].cpu_ms / by_depth[0][1].cpu_ms
    return ratios


def targets(rows: Sequence[StepRow]) -> List[Tuple[str, str, bool]]:
    """Issue 47's targets on this machine, each (target, what was measured, met), with the replays run and
    with the host's work alone."""
    found = []
    for label, engine_of, anchor_of, alone in (("", lambda row: row.engine, lambda row: row.anchor, False),
                                               (" (alone)", lambda row: row.engine_alone,
                                                lambda row: row.anchor_alone, True)):
        measured = [row for row in rows if engine_of(row) is not None]
        if not measured:
            continue
        four = [engine_of(row).cpu_ms for row in measured if row.requests == 4]
        if four:
            found.append((f"<= 0.3 ms at 4 requests, every depth{label}", f"max {max(four):.3f} ms", max(four) <= 0.3))
        sixteen = [engine_of(row).cpu_ms for row in measured if row.requests == 16]
        if sixteen:
            found.append((f"<= 0.5 ms at 16 requests{label}", f"max {max(sixteen):.3f} ms", max(sixteen) <= 0.5))
        ratios = depth_ratios(measured, alone)
        if ratios:
            found.append((f"deepest within 1.2x of 1 layer{label}",
                          ", ".join(f"{count} requests {ratio:.2f}x" for count, ratio in ratios.items()),
                          max(ratios.values()) <= 1.2))
        over = [engine_of(row).cpu_ms / anchor_of(row).cpu_ms for row in measured if anchor_of(row).cpu_ms > 0]
        found.append((f"<= the anchor's{label}", f"max {max(over):.2f}x the anchor's", max(over) <= 1.0))
    return found


def format_targets(found: Sequence[Tuple[str, str, bool]]) -> List[str]:
    return [f"target {name}: {measured}: {'met' if met else 'NOT met'}" for name, measured, met in found]


def as_json(rows: Sequence[StepRow]) -> Dict[str, object]:
    return {"rows": [asdict(row) for row in rows], "depth_ratio": depth_ratios(rows),
            "targets": [{"target": name, "measured": measured, "met": met} for name, measured, met in targets(rows)],
            "method": f"median over decode steps (ServeLoop.step; the anchor's decode()) of generate() calls of "
                      f"{NEW_TOKENS} new tokens, prompts of {PROMPT_TOKENS}, replays subtracted (and stubbed: alone)"}


def format_json(doc: Dict[str, object]) -> List[str]:
    """``as_json``'s document as printed: the table and the targets."""
    def cost(value: Optional[Dict[str, float]]) -> Optional[HostCost]:
        return None if value is None else HostCost(**value)

    rows = [StepRow(row["layers"], row["requests"], *(cost(row[name]) for name in
                                                     ("engine", "anchor", "engine_alone", "anchor_alone")))
            for row in doc["rows"]]
    seconds = f"; {doc['seconds']:.0f} s" if "seconds" in doc else ""
    return ["", f"engine host ms per decode step (this thread's CPU time; {doc['method']}{seconds}):",
            *format_rows(rows), *format_targets(targets(rows))]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--requests", default=",".join(map(str, REQUESTS)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unwatch", action="store_true",
                        help="take the engine off the guards' watch list after its first call")
    parser.add_argument("--no-alone", action="store_true", help="skip the runs with the replays stubbed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    depths = [int(value) for value in args.layers.split(",")]
    counts = [int(value) for value in args.requests.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows = measure(depths, counts, args.repeats, unwatch=args.unwatch, alone=not args.no_alone)
    print("\n".join(format_json(as_json(rows))))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
