"""Eager vs graph decode latency of graphrt's reference model, per batch size: table, JSON, PNG.

    PYTHONPATH=. python3 scripts/bench.py                      # small model on CPU, realistic on CUDA
    PYTHONPATH=. python3 scripts/bench.py --model tiny --quick  # under a minute on a 2-core CPU

For each batch size: eager step (run_eager), GraphRunner(...)(batch), raw replay of the same
graph (no staging), the runtime's overhead (runner - raw replay) and the attention replay hook
alone; graphrt's own cost at the floor (bench_floor: a one-op model through GraphRunner with and
without value checks, batch.validate() alone each way, debug mode) in trivial eager ops of the
same rounds; then wrap()'s floor, greedy-generation throughput eager vs runner, capture time and
graph pool memory; several decode steps per launch (bench_multistep: graphrt's host cost per token
for K = 1, 2, 4, 8, capture per multi-step key, tokens/s per K). Every graph is checked against
eager before it is timed. Without CUDA the
backend is emulated and the graph column measures graphrt's overhead, not a speedup. Last,
Hugging Face generate() on a tiny random Llama and a tiny random Gemma3 (sliding-window and full
attention layers): eager vs graphrt.hf.graph_generate vs torch.compile(mode="reduce-overhead")
(scripts/bench_hf.py; --no-hf skips it, --no-compile skips its torch.compile peers, ~10 s each).
The load average is printed at the start and the end, with a WARNING when other processes kept
the machine busy (bench_load).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import logging
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from bench_floor import (
    RUNNER_VARIANTS,
    decode_floor,
    floor_targets,
    format_targets,
    one_op_model,
    one_op_runners,
    wrap_floor,
)
from bench_guards import (DEPTHS, REREAD_DEPTHS, format_guards, format_reread, guard_scaling, guard_summary,
                          reread_scaling, reread_summary)
from bench_hf import format_hf, measure_hf_generate
from bench_lib import (
    PRESETS,
    TOLERANCE,
    BatchResult,
    Workload,
    measure_batch,
    measure_throughput,
    model_config,
    parameter_count,
)
import bench_engine_step
from bench_load import LoadSample, format_load, load_verdict, sample_load
from bench_multistep import format_multistep, measure_multistep
from bench_peer import compiled_step, warm_compiled
from bench_piecewise import (
    PIECEWISE_SIZES,
    TRACE_REQUESTS,
    TRACE_TOKEN_BUDGETS,
    chunked_prefill_trace,
    format_piecewise,
    measure_piecewise,
    piecewise_runners,
    varlen_workload,
)
from bench_report import (
    BACKEND_NOTES,
    POOL_LABELS,
    format_report,
    machine_info,
    plot_latency,
    write_json,
)
from bench_timing import Clock, Spread
from bench_ubatch import UBatchResult, format_ubatch, measure_ubatch
from capture_sizes_study import format_study, study

from graphrt import GraphRunner, UBatchConfig
from graphrt.reference import graph_runner_kwargs
from graphrt.capture import CaptureReport

logger = logging.getLogger("bench")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_OVERRIDES = {  # flag -> ReferenceConfig field
    "layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
    "intermediate": "intermediate_size", "vocab": "vocab_size", "context": "max_context_len",
}


@dataclasses.dataclass
class Settings:
    """Every resolved setting of one run (recorded in the JSON)."""

    model: str
    overrides: Dict[str, Optional[int]]
    dtype: torch.dtype
    device: torch.device
    backend: str
    batch_sizes: List[int]
    ubatch_sizes: List[int]
    piecewise_tokens: List[int]
    iters: int
    warmup: int
    floor_iters: int
    sample_ms: float
    prompts: int
    new_tokens: int
    repeats: int
    compile: bool
    hf: bool
    hf_compile: bool
    plot: bool
    quick: bool
    seed: int
    threads: Optional[int]
    out: Path


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The command line; defaults that depend on --quick or the device stay None here."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("auto", *PRESETS), default="auto",
                        help="model preset (auto: realistic on CUDA, small otherwise)")
    for flag in MODEL_OVERRIDES:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"override the preset's {MODEL_OVERRIDES[flag]}")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated decode batch sizes")
    parser.add_argument("--ubatch-sizes",
                        help="sizes above the largest batch size, run micro-batched (default 1.25x and 2x-3 of it, "
                             "--quick 1.5x; '' to skip)")
    parser.add_argument("--piecewise-tokens",
                        help="token counts of the prefill/mixed steps timed eager vs piecewise (default 12,40,100, "
                             "--quick 12,40; '' to skip the piecewise section)")
    parser.add_argument("--iters", type=int, help="timed samples per batch size (default 50, --quick 5)")
    parser.add_argument("--warmup", type=int, help="discarded warm-up samples per batch size (default 3, --quick 1)")
    parser.add_argument("--floor-iters", type=int,
                        help="timed samples of graphrt's own cost at the floor, per batch size or token count "
                             "(default 50, --quick 20)")
    parser.add_argument("--sample-ms", type=float, help="target length of one sample, ms (default 5, --quick 1)")
    parser.add_argument("--prompts", type=int, help="prompts for the throughput run (default 8, --quick 4)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per prompt (default 32, --quick 8)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for the JSON and PNG")
    parser.add_argument("--backend", choices=("auto", "cuda", "emulated"), default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="fewer samples and tokens: under a minute on a 2-core CPU")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile peers (the reference model's: GPU only; generate()'s: ~10 s on CPU)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate() section")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads (default on CPU: 1, steady on a shared machine; on CUDA: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace) -> Settings:
    """Fill the defaults that depend on --quick and on the device; reject impossible combinations."""
    cuda = torch.cuda.is_available()
    if "cuda" in (args.backend, args.device) and not cuda:
        raise SystemExit("--backend/--device cuda: torch.cuda.is_available() is False on this machine")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    if args.backend == "cuda" and device.type != "cuda":
        raise SystemExit("--backend cuda needs --device cuda (or auto)")
    try:
        batch_sizes = sorted({int(size) for size in args.batch_sizes.split(",")})
    except ValueError:
        raise SystemExit(f"--batch-sizes: expected comma-separated ints, got {args.batch_sizes!r}") from None
    if batch_sizes[0] < 1:
        raise SystemExit(f"--batch-sizes: expected sizes >= 1, got {batch_sizes}")
    for flag, least in (("iters", 1), ("warmup", 0), ("floor_iters", 1), ("prompts", 1), ("new_tokens", 1),
                        ("threads", 1)):
        if getattr(args, flag) is not None and getattr(args, flag) < least:
            raise SystemExit(f"--{flag.replace('_', '-')}: expected >= {least}, got {getattr(args, flag)}")
    threads = args.threads if args.threads is not None or device.type == "cuda" else 1
    prompts = args.prompts if args.prompts is not None else (4 if args.quick else 8)
    largest = max(batch_sizes[-1], prompts)  # the runner's largest graph
    default_ubatch = f"{largest + largest // 2}" if args.quick else f"{largest + largest // 4},{2 * largest - 3}"
    ubatch_text = default_ubatch if args.ubatch_sizes is None else args.ubatch_sizes
    try:
        ubatch_sizes = sorted({int(size) for size in ubatch_text.split(",") if size.strip()})
    except ValueError:
        raise SystemExit(f"--ubatch-sizes: expected comma-separated ints, got {ubatch_text!r}") from None
    if ubatch_sizes and ubatch_sizes[0] <= largest:
        raise SystemExit(f"--ubatch-sizes: expected sizes above the largest graph ({largest}), got {ubatch_sizes}")

    def pick(value: Any, default: Any, quick: Any) -> Any:
        return value if value is not None else (quick if args.quick else default)

    piecewise_text = pick(args.piecewise_tokens, "12,40,100", "12,40")
    try:
        piecewise_tokens = sorted({int(size) for size in piecewise_text.split(",") if size.strip()})
    except ValueError:
        raise SystemExit(f"--piecewise-tokens: expected comma-separated ints, got {piecewise_text!r}") from None
    if piecewise_tokens and not 3 <= piecewise_tokens[0] <= piecewise_tokens[-1] <= PIECEWISE_SIZES[-1]:
        raise SystemExit(f"--piecewise-tokens: expected ints in [3, {PIECEWISE_SIZES[-1]}], got {piecewise_tokens}")

    return Settings(
        model=args.model if args.model != "auto" else ("realistic" if device.type == "cuda" else "small"),
        overrides={field: getattr(args, flag) for flag, field in MODEL_OVERRIDES.items()},
        dtype=DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32),
        device=device,
        backend=args.backend,
        batch_sizes=batch_sizes,
        ubatch_sizes=ubatch_sizes,
        piecewise_tokens=piecewise_tokens,
        iters=pick(args.iters, 50, 5),
        warmup=pick(args.warmup, 3, 1),
        floor_iters=pick(args.floor_iters, 50, 20),
        sample_ms=pick(args.sample_ms, 5.0, 1.0),
        prompts=prompts,
        new_tokens=pick(args.new_tokens, 32, 8),
        repeats=1 if args.quick else 3,
        compile=not args.no_compile and device.type == "cuda",
        hf=not args.no_hf,
        hf_compile=not args.no_compile,
        plot=not args.no_plot,
        quick=args.quick,
        seed=args.seed,
        threads=threads,
        out=args.out,
    )


@contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[], None]]:
    """A tqdm bar's ``update`` when tqdm is installed, else a no-op."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield lambda: None
        return
    with tqdm(total=total, desc=desc) as bar:
        yield bar.update


def capture_summary(report: CaptureReport, backend: str) -> Dict[str, Any]:
    """Capture time and memory, summed over keys, with what the memory figure means on this backend."""
    return {
        "keys": len(report.ok),
        "seconds": report.seconds,
        "verify_seconds": report.verify_seconds,
        "pool_bytes": report.pool_bytes,
        "pool_bytes_label": POOL_LABELS.get(backend, "bytes"),
        "failed": {str(key): reason for key, reason in report.failed.items()},
        "per_key": [{"key": str(k.key), "seconds": k.seconds, "verify_seconds": k.verify_seconds,
                     "pool_bytes": k.pool_bytes} for k in report.keys],
    }


def check_summary(runner: GraphRunner) -> Dict[str, Any]:
    """graphrt.check of the reference model on the runner's padded batches: its time and verdict."""
    start = time.perf_counter()
    report = runner.check()
    return {"seconds": time.perf_counter() - start, "ok": report.ok, "recordings": report.recordings,
            "findings": [finding.kind for finding in report.findings], "state_tensors": len(report.state_writes)}


def build_runners(settings: Settings, work: Workload, max_batch_size: int
                  ) -> Tuple[GraphRunner, Dict[str, GraphRunner], CaptureReport]:
    """The reference model's runner (captured, micro-batching above its largest size, with its
    report) and captured runners of a one-op model (bench_floor.RUNNER_VARIANTS: plain, metadata
    checks only, debug mode)."""
    runner_kwargs = graph_runner_kwargs(work.backend, work.pools)
    runner = GraphRunner(
        work.model, max_batch_size=max_batch_size, backend=settings.backend, device=settings.device,
        ubatch=UBatchConfig(), **runner_kwargs,
    )
    report = runner.capture()
    if report.failed:
        raise SystemExit(f"capture failed, nothing to benchmark:\n{report}")
    one_op = one_op_runners(one_op_model, RUNNER_VARIANTS, max_batch_size=max_batch_size, backend=settings.backend,
                            device=settings.device, pad_values=runner_kwargs["pad_values"])
    return runner, one_op, report


def time_batches(settings: Settings, work: Workload, runner: GraphRunner, one_op: Dict[str, GraphRunner],
                 rng: random.Random) -> Tuple[List[BatchResult], Dict[str, Any]]:
    """Verify and time every batch size (with the torch.compile peer where enabled)."""
    compile_info: Dict[str, Any] = {"enabled": settings.compile, "skipped": None, "per_batch": {}}
    if not settings.compile:
        compile_info["skipped"] = "--no-compile" if settings.device.type == "cuda" else "CPU run (GPU-only peer)"
    step = compiled_step(work.model) if settings.compile else None
    clock = Clock(settings.device, settings.sample_ms / 1e3)
    results: List[BatchResult] = []
    rounds = len(settings.batch_sizes) * (settings.warmup + settings.iters)
    with progress(rounds, "timing decode steps") as on_round:
        for batch_size in settings.batch_sizes:
            with work.decode_batch(batch_size, rng) as batch:
                peer = None
                if step is not None:
                    try:
                        warm = warm_compiled(step, work, batch, clock)
                        compile_info["per_batch"][batch_size], peer = dataclasses.asdict(warm), step
                    except Exception as error:  # the peer is optional: record why and go on without it
                        compile_info["per_batch"][batch_size] = {"error": f"{type(error).__name__}: {error}"}
                        logger.warning("torch.compile peer failed at batch size %d: %s", batch_size, error)
                results.append(measure_batch(
                    work, runner, batch, clock, settings.iters, settings.warmup,
                    lambda batch: decode_floor(one_op, batch, clock, settings.floor_iters, settings.warmup),
                    peer, on_round,
                ))
    return results, compile_info


def run_piecewise(settings: Settings, config: Any, max_batch_size: int, rng: random.Random) -> Optional[Dict[str, Any]]:
    """The piecewise section (bench_piecewise.py) on the same model shape with varlen attention."""
    if not settings.piecewise_tokens:
        return None
    start = time.perf_counter()
    work = varlen_workload(config, max(max_batch_size, TRACE_REQUESTS), settings.device)
    runner, one_op = piecewise_runners(work, settings.backend, max_batch_size)
    clock = Clock(settings.device, settings.sample_ms / 1e3)
    results = measure_piecewise(work, runner, one_op, clock, settings.piecewise_tokens, settings.iters,
                                settings.warmup, settings.floor_iters, rng, TOLERANCE.get(config.dtype, 2e-2))
    traces = [chunked_prefill_trace(work, runner, TRACE_REQUESTS, settings.new_tokens, budget, rng)
              for budget in TRACE_TOKEN_BUDGETS]
    return {"sizes": list(PIECEWISE_SIZES), "steps": [dataclasses.asdict(result) for result in results],
            "traces": [dataclasses.asdict(trace) for trace in traces], "seconds": time.perf_counter() - start}


def run_multistep(settings: Settings, config: Any, rng: random.Random) -> Dict[str, Any]:
    """The multi-step section (bench_multistep.py) on a workload of its own (its runner's attention
    graph state must not replace the main runner's)."""
    work = Workload.build(config, settings.prompts, settings.device)
    return measure_multistep(work, settings.backend, Clock(settings.device, settings.sample_ms / 1e3),
                             settings.batch_sizes, work.prompts(settings.prompts, settings.new_tokens, rng),
                             settings.new_tokens, settings.repeats, settings.floor_iters, settings.warmup)


def run(settings: Settings, argv: List[str], load_start: LoadSample) -> Dict[str, Any]:
    """Build, capture, verify and time everything; returns the JSON document (the load at the
    end is read when everything timed has run)."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    machine = machine_info(settings.device)
    config = model_config(settings.model, settings.dtype, settings.overrides)
    max_batch_size = max(settings.batch_sizes[-1], settings.prompts)
    work = Workload.build(config, max([max_batch_size, *settings.ubatch_sizes]), settings.device)
    runner, one_op, report = build_runners(settings, work, max_batch_size)
    with torch.no_grad():
        results, compile_info = time_batches(settings, work, runner, one_op, rng)
        prompts = work.prompts(settings.prompts, settings.new_tokens, rng)
        throughput = measure_throughput(work, runner, prompts, settings.new_tokens, settings.repeats)
        ubatch = measure_ubatch(work, runner, Clock(settings.device, settings.sample_ms / 1e3), settings.ubatch_sizes,
                                settings.iters, settings.warmup, rng, TOLERANCE.get(config.dtype, 2e-2))
        piecewise = run_piecewise(settings, config, max_batch_size, rng)
        wrap = wrap_floor(settings.device, Clock(settings.device, settings.sample_ms / 1e3), settings.floor_iters,
                          settings.warmup)
        multistep = run_multistep(settings, config, rng)
    hf = hf_summary(settings)
    guards = guards_summary(settings)
    engine_host = engine_host_summary(settings)
    load = load_verdict(load_start, sample_load())
    backend = runner.backend_name
    batches = [dataclasses.asdict(result) for result in results]
    wrap_doc = dataclasses.asdict(wrap)
    doc = {
        "benchmark": "graphrt decode step: eager vs GraphRunner vs raw replay",
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["scripts/bench.py", *argv],
        "settings": dataclasses.asdict(settings),
        "machine": machine,
        "load": load,
        "backend": backend,
        "emulated": backend == "emulated",
        "backend_note": BACKEND_NOTES.get(backend, backend),
        "model": {"preset": settings.model, "config": dataclasses.asdict(config), "parameters": parameter_count(work.model)},
        "trivial_op_us": dataclasses.asdict(Spread.of([r.times_us["trivial"].median for r in results])),
        "verified": all(r.verification.ok for r in results),
        "capture": capture_summary(report, backend),
        "batches": batches,
        "floor": {"wrap": wrap_doc,
                  "targets": {**floor_targets(batches, wrap_doc["costs"], piecewise["steps"] if piecewise else []),
                              **({"guards": guard_summary(guards["costs"]),
                                  "guards_reread": reread_summary(guards["reread"]["costs"])}
                                 if "costs" in guards else {})}},
        "guards": guards,
        "throughput": {
            **dataclasses.asdict(throughput),
            "eager_tokens_per_s": throughput.eager_tokens_per_s,
            "graph_tokens_per_s": throughput.graph_tokens_per_s,
        },
        "compile": compile_info,
        "ubatch": [dataclasses.asdict(result) for result in ubatch],
        "piecewise": piecewise,
        "multistep": multistep,
        "capture_sizes_study": study(2000 if settings.quick else 20000),
        "runner_stats": runner.stats(),
        "check": check_summary(runner),
        "hf_generate": hf,
        "engine_host": engine_host,
    }
    return doc


def hf_summary(settings: Settings) -> Dict[str, Any]:
    """The generate() section (eager vs graphrt vs torch.compile on a tiny HF Llama and Gemma3), or why it was skipped."""
    if not settings.hf:
        return {"skipped": "--no-hf"}
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed"}
    with torch.no_grad():
        result = measure_hf_generate(settings.device, settings.new_tokens, settings.hf_compile)
    return dataclasses.asdict(result)


def guards_summary(settings: Settings) -> Dict[str, Any]:
    """The guards' per-call cost on a tiny HF Llama at growing depths, and their re-read after one assignment
    (bench_guards), or why it was skipped (``--quick``: 2 and 8 layers only; the re-read at 2)."""
    if not settings.hf:
        return {"skipped": "--no-hf"}
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed"}
    depths = DEPTHS[:2] if settings.quick else DEPTHS
    clock = Clock(settings.device, settings.sample_ms / 1e3)
    timed = guard_scaling(settings.device, clock, settings.floor_iters, settings.warmup, depths)
    reread = reread_scaling(settings.device, clock, settings.floor_iters, settings.warmup,
                            REREAD_DEPTHS[:1] if settings.quick else REREAD_DEPTHS)
    return {**dataclasses.asdict(timed), "reread": dataclasses.asdict(reread)}


def engine_host_summary(settings: Settings) -> Dict[str, Any]:
    """The engine's host ms per decode step against the nano-vllm-shaped anchor at growing depths and request
    counts (bench_engine_step), or why it was skipped (``--quick``: 1 and 4 layers at 4 requests, one call each)."""
    if not settings.hf:
        return {"skipped": "--no-hf"}
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed"}
    engine = bench_engine_step
    depths, requests = (engine.QUICK_DEPTHS, engine.QUICK_REQUESTS) if settings.quick else (engine.DEPTHS, engine.REQUESTS)
    start = time.perf_counter()
    rows = engine.measure(depths, requests, 1 if settings.quick else 3)
    return {**engine.as_json(rows), "seconds": time.perf_counter() - start}


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark, print the report, write ``<out>/bench_<device>_<model>.json`` and ``.png``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    settings = resolve(parse_args(argv))
    settings.out.mkdir(parents=True, exist_ok=True)
    load_start = sample_load()
    print("\n".join(format_load(load_verdict(load_start))), flush=True)
    threads = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        doc = run(settings, argv, load_start)
    finally:
        torch.set_num_threads(threads)  # main() may run inside another program (the tests)
    print(format_report(doc))
    print("\n".join(format_ubatch([UBatchResult(**{**r, "times_us": {k: Spread(**v) for k, v in r["times_us"].items()}})
                                   for r in doc["ubatch"]], max(settings.batch_sizes[-1], settings.prompts))))
    if doc["piecewise"] is not None:
        print("\n".join(format_piecewise(doc["piecewise"])))
    print("\n".join(format_multistep(doc["multistep"])))
    engine_host = doc["engine_host"]
    print(f"\nengine host ms per decode step: skipped, {engine_host['skipped']}" if "skipped" in engine_host
          else "\n".join(bench_engine_step.format_json(engine_host)))
    check = doc["check"]
    print(f"\ngraphrt check of the reference model: {check['seconds']:.2f}s, {check['recordings']} recordings, "
          f"{'ok' if check['ok'] else 'HAZARDS: ' + ', '.join(check['findings'])}")
    hf = doc["hf_generate"]
    print(f"\nHugging Face generate(): skipped, {hf['skipped']}" if "skipped" in hf else "\n".join(format_hf(hf)))
    guards = doc["guards"]
    print(f"\nguards by depth: skipped, {guards['skipped']}" if "skipped" in guards else "\n".join(
        format_guards(guards) + format_reread(guards["reread"])))
    print("\npadded-token waste on synthetic traces (max 64): default capture sizes vs tuned from traffic")
    print("\n".join(format_study(doc["capture_sizes_study"])))
    print("\n".join(format_targets(doc["floor"]["targets"])))
    print("\n".join(format_load(doc["load"])))
    stem = settings.out / f"bench_{settings.device.type}_{settings.model}"
    if settings.plot:
        why_not = plot_latency(doc, stem.with_suffix(".png"))
        print(f"plot: skipped, {why_not}" if why_not else f"plot: {stem.with_suffix('.png')}")
    write_json(doc, stem.with_suffix(".json"))
    print(f"json: {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
