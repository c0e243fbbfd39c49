"""One minute that tells whether this GPU's torch behaves as graphrt's CUDA backend assumes (issue 33).

    PYTHONPATH=. python3 scripts/gpu_probe.py                 # every probe, each in a process of its own
    PYTHONPATH=. python3 scripts/gpu_probe.py --probe NAME    # one probe, in this process

Each probe runs plain ``torch.cuda`` calls (and, where graphrt has a remedy, the remedy), prints one
JSON line with what it saw, what graphrt's model of this torch (tests/fake_cuda.py) expects, and
``agrees``. The mechanisms come from PyTorch's sources, not from a run: a line with ``agrees: false``
means the model, and the fix resting on it, must be revisited (docs/RELIABILITY.md, issue 33).

- ``rng_after_invalidated_capture``: a capture invalidated by ``.item()``; does an eager draw then
  raise "Offset increment outside graph capture" (torch <= 2.11: yes), and does one empty capture
  with the default generator (graphrt's remedy) end it?
- ``reset_frees_cublas_workspace``: two graphs with a matmul captured on one stream; does deleting
  the first free memory (the stream's cuBLAS workspace, pytorch#175276: after 2.11) that the second
  still uses, and does clearing the workspaces around each capture (graphrt's remedy) prevent it?
- ``capture_executes_nothing``: an output read between ``capture_end`` and the first replay.
- ``second_capture_in_another_thread``: a capture begun while another thread captures.
- ``empty_cache_during_capture``: ``torch.cuda.empty_cache()`` while a capture is under way.
- ``segment_rounding``: the pool bytes a 7.8 MiB and a 1 KiB output reserve (20 MiB, 2 MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from graphrt.backends.cuda_pool import CAPTURE_ERROR_MODE, clear_cublas_workspaces, empty_capture, private_binding

PROBE_TIMEOUT_S = 60
MIB = 1 << 20
DEVICE = "cuda"  # tests/test_gpu_probe.py runs the probes over the fake torch.cuda, on CPU tensors


def torch_after_2_11() -> bool:
    """Whether this torch is a release after 2.11 (the fixes pytorch#176752 and #175276 are in)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) > (2, 11)


def _invalidated_capture(stream: "torch.cuda.Stream") -> str:
    """Begin a capture on ``stream``, invalidate it with a host read, end it; the error it ended with."""
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    x = torch.ones(4, device=DEVICE)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        try:
            (x * 2).sum().item()
        except RuntimeError:
            pass
        try:
            graph.capture_end()
            error = ""
        except RuntimeError as caught:
            error = str(caught).splitlines()[0]
        end = private_binding("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
        if end is not None:
            try:
                end(torch.cuda.current_device(), pool)
            except RuntimeError:
                pass  # torch ended the routing itself
    return error


def _draw() -> str:
    """An eager draw from the default CUDA generator: "" when it works, else the error's first line."""
    try:
        torch.rand(2, device=DEVICE)
        return ""
    except RuntimeError as error:
        return str(error).splitlines()[0]


def probe_rng_after_invalidated_capture() -> Dict[str, Any]:
    stream = torch.cuda.Stream()
    torch.rand(1, device=DEVICE)  # the default generator exists before the capture
    end_error = _invalidated_capture(stream)
    draw_error = _draw()
    with torch.cuda.stream(stream):
        empty_capture(None).reset()
    after_remedy = _draw()
    expected_stuck = not torch_after_2_11()
    return {"capture_end_error": end_error, "draw_error": draw_error, "draw_error_after_remedy": after_remedy,
            "expected_stuck": expected_stuck,
            "agrees": bool(draw_error) == expected_stuck and after_remedy == ""}


def _two_matmul_graphs(clear: bool) -> Dict[str, Any]:
    """Two graphs with a matmul on one stream in one pool; the allocator bytes freed by deleting the
    first, and whether the second still replays right."""
    stream = torch.cuda.Stream()
    a = torch.randn(512, 512, device=DEVICE)
    with torch.cuda.stream(stream):
        a @ a  # warm-up: cuBLAS's handle on this stream
    torch.cuda.synchronize()
    if clear:
        clear_cublas_workspaces()
    pool, graphs, outputs = torch.cuda.graph_pool_handle(), [], []
    with torch.cuda.stream(stream):
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
            outputs.append(a @ a)
            graph.capture_end()
            if clear:
                clear_cublas_workspaces()
            graphs.append(graph)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    first = graphs.pop(0)
    first.reset()
    del first
    gc.collect()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    graphs[0].replay()
    torch.cuda.synchronize()
    return {"freed_bytes": freed, "second_replays_right": bool(torch.allclose(outputs[1], a @ a, atol=1e-3, rtol=1e-3))}


def probe_reset_frees_cublas_workspace() -> Dict[str, Any]:
    plain = _two_matmul_graphs(clear=False)
    remedied = _two_matmul_graphs(clear=True)
    expected_frees = torch_after_2_11()
    return {"plain": plain, "with_workspaces_cleared": remedied, "expected_frees": expected_frees,
            "agrees": (plain["freed_bytes"] > 0) == expected_frees and remedied["freed_bytes"] == 0
            and remedied["second_replays_right"]}


def probe_capture_executes_nothing() -> Dict[str, Any]:
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    x = torch.full((1024,), 3.0, device=DEVICE)
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        y = x * 7 + 1
        graph.capture_end()
    torch.cuda.synchronize()
    computed_at_capture = bool((y == 22).all())
    graph.replay()
    torch.cuda.synchronize()
    return {"computed_at_capture": computed_at_capture, "computed_by_replay": bool((y == 22).all()),
            "agrees": not computed_at_capture and bool((y == 22).all())}


def probe_second_capture_in_another_thread() -> Dict[str, Any]:
    began, release, seen = threading.Event(), threading.Event(), {}

    def first() -> None:
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            began.set()
            release.wait(timeout=20)
            graph.capture_end()

    thread = threading.Thread(target=first)
    thread.start()
    began.wait(timeout=20)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            graph.capture_end()
        seen["error"] = ""
    except RuntimeError as error:
        seen["error"] = str(error).splitlines()[0]
    finally:
        release.set()
        thread.join(timeout=20)
    return {"second_capture_error": seen["error"], "agrees": bool(seen["error"])}


def probe_empty_cache_during_capture() -> Dict[str, Any]:
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        try:
            torch.cuda.empty_cache()
            error = ""
        except RuntimeError as caught:
            error = str(caught).splitlines()[0]
        try:
            graph.capture_end()
        except RuntimeError:
            pass
    return {"empty_cache_error": error, "agrees": bool(error)}


def probe_segment_rounding() -> Dict[str, Any]:
    reserved = {}
    for name, numel in (("7.8MiB", int(7.8 * MIB) // 4), ("1KiB", 256)):
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            torch.ones(numel, device=DEVICE)
            graph.capture_end()
        torch.cuda.synchronize()
        reserved[name] = torch.cuda.memory_reserved() - before
    return {"reserved_bytes": reserved, "agrees": reserved == {"7.8MiB": 20 * MIB, "1KiB": 2 * MIB}}


PROBES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "rng_after_invalidated_capture": probe_rng_after_invalidated_capture,
    "reset_frees_cublas_workspace": probe_reset_frees_cublas_workspace,
    "capture_executes_nothing": probe_capture_executes_nothing,
    "second_capture_in_another_thread": probe_second_capture_in_another_thread,
    "empty_cache_during_capture": probe_empty_cache_during_capture,
    "segment_rounding": probe_segment_rounding,
}


def run_probe(name: str) -> Dict[str, Any]:
    """One probe in this process: what it saw, or the error it raised."""
    try:
        return {"probe": name, **PROBES[name]()}
    except Exception as error:  # reported: the driver prints every probe's line
        return {"probe": name, "agrees": False, "error": f"{type(error).__name__}: {error}"}


def run_isolated(name: str) -> Dict[str, Any]:
    """One probe in a fresh process (a lost CUDA context ends only its own), with its exit code on a crash."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"probe": name, "agrees": False, "error": f"timed out after {PROBE_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"probe": name, "agrees": False, "error": f"exit code {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", choices=sorted(PROBES), help="run this probe here (default: each in a process)")
    args = parser.parse_args(argv)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}), flush=True)
    names = [args.probe] if args.probe else list(PROBES)
    results = [run_probe(name) if args.probe else run_isolated(name) for name in names]
    for result in results:
        print(json.dumps(result, default=str), flush=True)
    return 0 if all(result.get("agrees") for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
