"""Half a minute that tells whether this GPU's torch behaves as graphrt's CUDA backend assumes (issues 33, 40, 48).

    PYTHONPATH=. python3 scripts/gpu_probe.py                 # every probe, in one child process
    PYTHONPATH=. python3 scripts/gpu_probe.py --probe NAME    # one probe, in this process
    PYTHONPATH=. python3 scripts/gpu_probe.py --here          # every probe, in this process

Every probe runs in one interpreter (one torch import, one CUDA context: issue 48 measured 13 cold
interpreters at 60 to 110 s), in an order that keeps them apart: the process's first capture first
(``first_capture_generator_segment`` measures it), memory measured from an emptied cache, the default
generator's capture ended between two probes (``settle``), and last the probes that may leave the
process unfit for others (the default generator stuck after a failed
``grouped_mm`` capture, an allocator assertion, freed memory a replay reads on a torch after 2.11). If
that process dies, the probe it was running is reported with its exit code and the ones after it run in
a new process. ``GPU_SESSION_LAUNCHER`` (a script put before the child's command line) and
``GRAPHRT_PROBE_DEVICE`` (``cpu`` over the fake torch.cuda) serve the session's rehearsal on a CPU.

Each probe runs plain ``torch.cuda`` calls (and, where graphrt has a remedy, the remedy), prints one
JSON line with what it saw, what graphrt's model of this torch (tests/fake_cuda.py) expects, and
``agrees``. The mechanisms come from PyTorch's sources, not from a run: a line with ``agrees: false``
means the model, and the fix resting on it, must be revisited (docs/RELIABILITY.md).

Issue 33's rules:

- ``rng_after_invalidated_capture``: a capture invalidated by ``.item()``; does an eager draw then
  raise "Offset increment outside graph capture" (torch <= 2.11: yes), and does one empty capture
  with the default generator (graphrt's remedy) end it?
- ``reset_frees_cublas_workspace``: two graphs with a matmul captured on one stream; does deleting
  the first free memory (the stream's cuBLAS workspace, pytorch#175276: after 2.11) that the second
  still uses, and does clearing the workspaces around each capture (graphrt's remedy) prevent it?
- ``capture_executes_nothing``: an output read between ``capture_end`` and the first replay.
- ``empty_cache_during_capture``: ``torch.cuda.empty_cache()`` while a capture is under way: an
  INTERNAL ASSERT up to torch 2.7; from 2.8 (pytorch#158152; the H200 session on 2.11) no error, a block
  cached in the default pool stays reserved, and the capture ends and replays right.
- ``segment_rounding``: the pool bytes a 7.8 MiB and a 1 KiB output reserve (20 MiB, 2 MiB), the
  default generator registered already.

Issue 40's predictions, one probe each (the number is the issue's item):

- 1 ``replay_during_another_capture``: while another thread captures, does an eager draw and the
  replay of a graph that drew random numbers raise "Offset increment outside graph capture" (torch
  <= 2.11: the generator's flag is the process's), does the replay of a graph that drew nothing work
  (every release: ``replay_prologue`` returns before ``increase()`` when the graph drew nothing,
  pytorch#143777; issue 48), and do both replay once that capture ended?
- 2 ``grouped_mm_fallback``: a ``grouped_mm`` with offsets captured in float32 and bfloat16: does
  each capture fail exactly where graphrt's ``grouped_mm_fallback_reason`` says it syncs (every
  dtype but bfloat16; bfloat16 off compute capability 9.x/10.x)?
- 3 ``cublas_workspace_in_pool``: the workspaces cleared, a capture of one matmul: does the pool
  grow by the output's segment plus ``cublas_workspace_bytes`` (32 MiB from Hopper on)?
- 4 ``second_capture_in_another_thread``: is a capture begun while another thread captures legal
  (``thread_local`` mode: yes)? ``first_capture_generator_segment``: does the process's first
  capture reserve a 2 MiB segment (the default generator's seed and offset; torch <= 2.11)?
- 5 ``warmup_activations_reserved``: a step's warm-up, then its capture: without ``empty_cache()``
  between them, is the pool's growth added to the warm-up's cached activations (about twice
  them), and with it (graphrt's remedy, before each capture) about once?
- 6 ``failed_capture_pool_released``: a capture invalidated after allocating 32 MiB in its pool, the
  graph reset: does that memory stay reserved through ``empty_cache()`` (torch <= 2.11), and does
  ``_cuda_releasePool`` (graphrt's remedy there) free it?
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_cuda_allocator import block_size, segment_size  # noqa: E402 - the caching allocator's rounding

from graphrt.backends.cuda_pool import (  # noqa: E402
    CAPTURE_ERROR_MODE, clear_cublas_workspaces, cublas_workspace_bytes, empty_capture, private_binding,
)
from graphrt.backends.op_graph import grouped_mm_fallback_reason  # noqa: E402
from graphrt.backends.session import torch_release  # noqa: E402

PROBE_TIMEOUT_S = 60  # one probe at most (each takes a second or two on a GPU)
MIB = 1 << 20
# tests/test_gpu_probe.py runs the probes over the fake torch.cuda, on CPU tensors; so does the session's rehearsal
DEVICE = os.environ.get("GRAPHRT_PROBE_DEVICE", "cuda")


def torch_after_2_11() -> bool:
    """Whether this torch is a release after 2.11 (the fixes pytorch#176752 and #175276 are in)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) > (2, 11)


def _error_of(call: Callable[[], Any]) -> str:
    """"" when ``call()`` works, else its error's first line."""
    try:
        call()
        return ""
    except RuntimeError as error:
        return str(error).splitlines()[0]


def _capture_errors(step: Callable[[], Any], graph: Optional["torch.cuda.CUDAGraph"] = None,
                    pool: Any = None) -> Tuple[str, str]:
    """Capture ``step`` on a side stream (``graph`` into ``pool``; fresh ones by default): the errors of
    the step and of ``capture_end`` ("" when none). After one, the pool routing torch <= 2.11 left on
    is ended."""
    graph = torch.cuda.CUDAGraph() if graph is None else graph
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        step_error = _error_of(step)
        end_error = _error_of(graph.capture_end)
        end = private_binding("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
        if (step_error or end_error) and end is not None:
            _error_of(lambda: end(torch.cuda.current_device(), pool))  # raises where torch ended it itself
    return step_error, end_error


def _invalidated_capture(graph: Optional["torch.cuda.CUDAGraph"] = None, pool: Any = None,
                         step: Callable[[], Any] = lambda: None) -> str:
    """A capture of ``step`` invalidated by a host read: the error ``capture_end`` raised."""
    x = torch.ones(4, device=DEVICE)
    return _capture_errors(lambda: (step(), (x * 2).sum().item()), graph, pool)[1]


def _draw() -> str:
    """An eager draw from the default CUDA generator: "" when it works, else the error's first line."""
    return _error_of(lambda: torch.rand(2, device=DEVICE))


def _captured(step: Callable[[], Any], pool: Any = None) -> "torch.cuda.CUDAGraph":
    """``step`` captured on a side stream (into ``pool``; None: a pool of its own)."""
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)
        step()
        graph.capture_end()
    return graph


def _reserved_growth(run: Callable[[], Any]) -> int:
    """The bytes ``run()`` adds to ``memory_reserved()``, from an emptied cache (what earlier probes of the
    process left cached is not counted, nor freed by ``run``)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    run()
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before


def probe_rng_after_invalidated_capture() -> Dict[str, Any]:
    stream = torch.cuda.Stream()
    torch.rand(1, device=DEVICE)  # the default generator exists before the capture
    end_error = _invalidated_capture()
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


def _while_another_thread_captures(run: Callable[[], Any]) -> Any:
    """``run()``'s result, called while another thread's capture (``thread_local``) is under way."""
    began, release = threading.Event(), threading.Event()

    def capture() -> None:
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            began.set()
            release.wait(timeout=20)
            graph.capture_end()

    thread = threading.Thread(target=capture)
    thread.start()
    began.wait(timeout=20)
    try:
        return run()
    finally:
        release.set()
        thread.join(timeout=20)


def probe_second_capture_in_another_thread() -> Dict[str, Any]:
    error = _while_another_thread_captures(lambda: _error_of(lambda: _captured(lambda: None)))
    return {"second_capture_error": error, "expected_legal": True, "agrees": error == ""}


def probe_replay_during_another_capture() -> Dict[str, Any]:
    x = torch.ones(4, device=DEVICE)
    plain = _captured(lambda: x * 2)
    drawing = _captured(lambda: x * torch.rand(4, device=DEVICE))  # its whole-graph increment is above 0
    plain_error, drawing_error, draw_error = _while_another_thread_captures(
        lambda: (_error_of(plain.replay), _error_of(drawing.replay), _draw()))
    after = {"plain": _error_of(plain.replay), "drawing": _error_of(drawing.replay)}
    expected_raise = not torch_after_2_11()
    return {"plain_replay_error": plain_error, "drawing_replay_error": drawing_error, "draw_error": draw_error,
            "replay_errors_after": after, "expected_raise": expected_raise,
            "agrees": plain_error == "" and bool(drawing_error) == expected_raise and bool(draw_error) == expected_raise
            and after == {"plain": "", "drawing": ""}}


def probe_first_capture_generator_segment() -> Dict[str, Any]:
    kept: List[Any] = []
    grown = _reserved_growth(lambda: kept.append(_captured(lambda: None)))
    expected = 0 if torch_after_2_11() else 2 * MIB
    return {"first_capture_reserved_bytes": grown, "expected": expected, "agrees": grown == expected}


def probe_cublas_workspace_in_pool() -> Dict[str, Any]:
    anchor = _captured(lambda: None)  # the default generator's seed and offset, outside the measurement
    a = torch.randn(256, 256, device=DEVICE)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a @ a  # cuBLAS's handle and a workspace outside any pool
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    kept: List[Any] = []
    grown = _reserved_growth(lambda: kept.append(_captured(lambda: a @ a, torch.cuda.graph_pool_handle())))
    workspace = cublas_workspace_bytes(torch.cuda.get_device_capability())
    expected = segment_size(block_size(256 * 256 * 4)) + segment_size(block_size(workspace))
    del anchor
    return {"pool_growth_bytes": grown, "workspace_bytes": workspace, "expected": expected,
            "agrees": grown == expected}


def probe_empty_cache_during_capture() -> Dict[str, Any]:
    """Up to 2.7 an INTERNAL ASSERT (``synchronize_and_free_events``: ``captures_underway.empty()``); from 2.8
    (pytorch#158152) no error and the default pools left as they are while a capture routes (a block cached
    there stays reserved), the capture ending and replaying as if the call had not been made."""
    cached = torch.empty(4 * MIB, dtype=torch.uint8, device=DEVICE)
    del cached  # a block cached in the default pool: empty_cache() outside a capture would free it
    torch.cuda.synchronize()
    x = torch.ones(4, device=DEVICE)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        y = x * 2
        reserved_before = torch.cuda.memory_reserved()
        error = _error_of(torch.cuda.empty_cache)
        reserved_after = torch.cuda.memory_reserved()
        end_error = _error_of(graph.capture_end)
    replay_error = "" if end_error else _error_of(graph.replay)
    torch.cuda.synchronize()
    replays_right = not (end_error or replay_error) and bool(torch.equal(y, x * 2))
    expected_raise = torch_release() <= (2, 7)
    kept = reserved_after >= reserved_before
    agrees = bool(error) if expected_raise else (not error and kept and replays_right)
    return {"empty_cache_error": error, "reserved_before": reserved_before, "reserved_after": reserved_after,
            "capture_end_error": end_error, "replay_error": replay_error, "replays_right": replays_right,
            "expected_raise": expected_raise, "agrees": agrees}


def probe_segment_rounding() -> Dict[str, Any]:
    anchor = _captured(lambda: None)  # the default generator's seed and offset (issue 40, item 4)
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
    del anchor
    return {"reserved_bytes": reserved, "agrees": reserved == {"7.8MiB": 20 * MIB, "1KiB": 2 * MIB}}


def probe_grouped_mm_fallback() -> Dict[str, Any]:
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    seen = {}
    for dtype in (torch.bfloat16, torch.float32):  # the one expected to fail last: it leaves the generator stuck
        a = torch.randn(16, 64, device=DEVICE, dtype=dtype)
        b = torch.randn(4, 64, 32, device=DEVICE, dtype=dtype)
        offs = torch.tensor([4, 8, 12, 16], device=DEVICE, dtype=torch.int32)
        grouped(a, b, offs=offs)  # warm-up
        error = " / ".join(filter(None, _capture_errors(lambda: grouped(a, b, offs=offs))))
        seen[str(dtype).removeprefix("torch.")] = {"capture_error": error,
                                                   "graphrt_names_a_sync": grouped_mm_fallback_reason(a, b) is not None}
    return {"capability": list(torch.cuda.get_device_capability()), **seen,
            "agrees": all(bool(each["capture_error"]) == each["graphrt_names_a_sync"] for each in seen.values())}


def _capture_after_warmup(empty_cache_first: bool, activation_bytes: int) -> int:
    """Reserved growth of a warm-up and a capture of a step with ``activation_bytes`` of activations."""
    x = torch.randn(activation_bytes // 4, device=DEVICE)
    stream, kept = torch.cuda.Stream(), []
    torch.cuda.empty_cache()

    def warm_up_and_capture() -> None:
        with torch.cuda.stream(stream):
            (x * 2).sum()
        torch.cuda.synchronize()
        if empty_cache_first:
            torch.cuda.empty_cache()
        kept.append(_captured(lambda: (x * 2).sum(), torch.cuda.graph_pool_handle()))

    grown = _reserved_growth(warm_up_and_capture)
    del kept, x
    torch.cuda.empty_cache()
    return grown


def probe_warmup_activations_reserved() -> Dict[str, Any]:
    activations = 128 * MIB
    anchor = _captured(lambda: None)
    plain, remedied = _capture_after_warmup(False, activations), _capture_after_warmup(True, activations)
    del anchor
    return {"activation_bytes": activations, "plain_growth": plain, "with_empty_cache_growth": remedied,
            "agrees": plain >= 2 * activations and activations <= remedied < activations + 4 * MIB}


def _failed_capture_reserved(release: bool) -> int:
    """Reserved bytes left after a capture invalidated with 32 MiB allocated in its pool, its graph
    reset (and with ``release``, the pool reference given back) and the cache emptied."""
    graph, pool, kept = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), []

    def fail_and_clean() -> None:
        _invalidated_capture(graph, pool, lambda: kept.append(torch.empty(8 * MIB, device=DEVICE)))
        kept.clear()
        graph.reset()
        if release:
            private_binding("_cuda_releasePool")(torch.cuda.current_device(), pool)
        torch.cuda.empty_cache()

    return _reserved_growth(fail_and_clean)


def probe_failed_capture_pool_released() -> Dict[str, Any]:
    anchor = _captured(lambda: None)
    plain = _failed_capture_reserved(False)
    if torch_after_2_11():  # reset() may release it itself (pytorch#190348): a second release could abort
        return {"left_reserved": plain, "expected": None, "agrees": True}
    remedied = _failed_capture_reserved(True)
    del anchor
    expected = 32 * MIB + segment_size(block_size(16))  # the 32 MiB block, and the host read's small tensors
    return {"left_reserved": plain, "left_reserved_after_release": remedied, "expected_left": expected,
            "agrees": plain == expected and remedied == 0}


# In the order one process runs them (module docstring): the process's first capture first, the probes
# that may leave it unfit for the others last.
PROBES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "first_capture_generator_segment": probe_first_capture_generator_segment,
    "capture_executes_nothing": probe_capture_executes_nothing,
    "segment_rounding": probe_segment_rounding,
    "cublas_workspace_in_pool": probe_cublas_workspace_in_pool,
    "second_capture_in_another_thread": probe_second_capture_in_another_thread,
    "replay_during_another_capture": probe_replay_during_another_capture,
    "warmup_activations_reserved": probe_warmup_activations_reserved,
    "rng_after_invalidated_capture": probe_rng_after_invalidated_capture,
    "failed_capture_pool_released": probe_failed_capture_pool_released,
    "empty_cache_during_capture": probe_empty_cache_during_capture,  # an allocator assertion up to torch 2.7
    "grouped_mm_fallback": probe_grouped_mm_fallback,  # leaves the default generator stuck where a capture fails
    "reset_frees_cublas_workspace": probe_reset_frees_cublas_workspace,  # after 2.11: a replay reads freed memory
}


def run_probe(name: str) -> Dict[str, Any]:
    """One probe in this process: what it saw, or the error it raised."""
    try:
        return {"probe": name, **PROBES[name]()}
    except Exception as error:  # reported: the driver prints every probe's line
        return {"probe": name, "agrees": False, "error": f"{type(error).__name__}: {error}"}


def settle() -> None:
    """Between two probes of one process: the default generator's capture ended (a probe whose capture
    failed leaves it on up to torch 2.11: graphrt's remedy, one empty capture) and the cache emptied."""
    gc.collect()
    _error_of(lambda: _captured(lambda: None).reset())
    _error_of(torch.cuda.empty_cache)


def child_command(*args: str) -> List[str]:
    """This script in a new interpreter (after ``GPU_SESSION_LAUNCHER``'s script, when set)."""
    launcher = os.environ.get("GPU_SESSION_LAUNCHER")
    return [sys.executable, *([launcher] if launcher else []), str(Path(__file__).resolve()), *args]


def run_in_children(names: List[str]) -> Iterator[Dict[str, Any]]:
    """Each probe's line as it ends, from one child process running ``names`` in order (``--here``); when a
    child dies or overruns, the probe it was on is reported so and the rest run in a new child."""
    while names:
        budget = PROBE_TIMEOUT_S * len(names)
        process = subprocess.Popen(child_command("--here", *names), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        timer = threading.Timer(budget, process.kill)
        timer.start()
        done, other = 0, []
        for line in process.stdout:
            if line.startswith('{"probe"'):
                done += 1
                yield json.loads(line)
            else:
                other.append(line)
        process.wait()
        overran = not timer.is_alive()
        timer.cancel()
        names = names[done:]
        if names:
            why = (f"timed out: {len(names) + done} probes did not end within {budget} s" if overran
                   else f"exit code {process.returncode}: {''.join(other)[-2000:]}")
            yield {"probe": names[0], "agrees": False, "error": why}
            names = names[1:]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", choices=sorted(PROBES), help="run this probe here")
    parser.add_argument("--here", nargs="*", choices=sorted(PROBES), metavar="NAME",
                        help="run these probes (default: every probe) here, in order")
    args = parser.parse_args(argv)
    if args.here is not None or args.probe:  # here: one line per probe as it ends
        names = [args.probe] if args.probe else (args.here or list(PROBES))
        results = []
        for name in names:
            results.append(run_probe(name))
            print(json.dumps(results[-1], default=str), flush=True)
            settle()
        return 0 if all(result.get("agrees") for result in results) else 1
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}), flush=True)
    results = []
    for result in run_in_children(list(PROBES)):  # each line as soon as its probe ends: a cut session keeps them
        results.append(result)
        print(json.dumps(result, default=str), flush=True)
    return 0 if all(result.get("agrees") for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
