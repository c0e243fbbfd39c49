"""The engine's decode steps on the device: host and device ms per step, with graphs and eagerly (issue 47, item 6).

``step_events`` times each decode step of ``generate()`` calls: the host's ms (the step's wall time but its
waits for the device) and, on CUDA, the device's ms between CUDA events recorded at the start and the end of
each step's device work, beside one replay of the decode graph alone. ``scripts/bench_hf_engine.py
--step-events`` prints them for the engine bench's 4-layer model (the GPU session's engine row).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from bench_engine_step import DecodeSteps

import graphrt.hf
from graphrt.hf.serve import ServeLoop


@dataclass
class StepEvents:
    """One path's decode steps (``graphs`` or eager) on the device: the host's ms per step (the step's wall time
    but its waits for the device), the device's ms per step between CUDA events recorded at the start and
    the end of each step's device work (a device kept busy: the step's device time; a starved one: the
    host's pace), and, with graphs, the ms of one replay of the decode graph alone (back to back)."""

    path: str
    steps: int
    host_ms: float
    device_ms: Optional[float]
    graph_ms: Optional[float]


def step_events(engine: graphrt.hf.HFEngine, prompts: List[List[int]], new_tokens: int, graphs: bool,
                repeats: int = 3) -> StepEvents:
    """``StepEvents`` of ``engine.generate(prompts)`` decode steps (medians over ``repeats`` calls after one that
    captures); device times only where CUDA is present."""
    from graphrt.hf.engine_step import EngineSteps
    from graphrt.host.arena import InputBuffers

    cuda = torch.cuda.is_available() and engine.device.type == "cuda"
    samples: List[Tuple[float, Optional[Any]]] = []
    waited = [0.0]
    marks: List[Any] = []
    launch, read_back, step = EngineSteps.launch, InputBuffers.read_back, ServeLoop.step

    def timed_launch(executor: EngineSteps, work: Any) -> Any:
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        result = launch(executor, work)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            marks.append((start, end))
        return result

    def timed_read_back(buffers: InputBuffers, copied: Any) -> List[int]:
        begin = time.perf_counter()
        try:
            return read_back(buffers, copied)
        finally:
            waited[0] += time.perf_counter() - begin

    decoded = DecodeSteps()

    def timed_step(loop: ServeLoop) -> Any:
        waited[0], marks[:] = 0.0, []
        begin = time.perf_counter()
        result = step(loop)
        host = time.perf_counter() - begin - waited[0]
        if decoded(loop):
            samples.append((host, marks[0] if marks else None))
        return result

    def call() -> Any:
        return engine.generate(prompts, max_new_tokens=new_tokens, eos_token_id=None, graphs=graphs)

    with torch.no_grad():
        call()
        EngineSteps.launch, InputBuffers.read_back, ServeLoop.step = timed_launch, timed_read_back, timed_step
        try:
            for _ in range(repeats):
                call()
        finally:
            EngineSteps.launch, InputBuffers.read_back, ServeLoop.step = launch, read_back, step
        if cuda:
            torch.cuda.synchronize()
    device = statistics.median(start.elapsed_time(end) for _, (start, end) in samples) if cuda else None
    graph = graph_replay_ms(engine, len(prompts)) if cuda and graphs else None
    return StepEvents("graphs" if graphs else "eager", len(samples),
                      1e3 * statistics.median(host for host, _ in samples), device, graph)


def graph_replay_ms(engine: graphrt.hf.HFEngine, rows: int, replays: int = 50) -> Optional[float]:
    """One replay of the engine's decode graph of ``rows`` requests, replayed back to back (CUDA events)."""
    for runner in engine.runners.all().values():
        for key, entry in runner.registry.entries.items():
            if key.mode.is_decode() and key.num_reqs == rows and key.steps == 1 and entry.graph is not None:
                entry.graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    entry.graph.replay()
                end.record()
                torch.cuda.synchronize()
                return start.elapsed_time(end) / replays
    return None


def format_events(rows: Sequence[StepEvents]) -> List[str]:
    """A Markdown table of ``StepEvents`` rows."""
    def cell(value: Optional[float]) -> str:
        return "n/a (no CUDA)" if value is None else f"{value:.3f}"

    lines = ["| path | decode steps | host ms/step | device ms/step (events) | graph replay ms |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {row.path} | {row.steps} | {row.host_ms:.3f} | {cell(row.device_ms)} | "
              f"{cell(row.graph_ms) if row.path == 'graphs' else ''} |" for row in rows]
    return lines


__all__ = ["StepEvents", "format_events", "graph_replay_ms", "step_events"]
