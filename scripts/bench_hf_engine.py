"""transformers' continuous batching against graphrt's engine path, on the same prompts; the engine's KV
bytes per token; its decode step against ``max_context``.

    PYTHONPATH=. python scripts/bench_hf_engine.py [--family llama] [--hidden 256] [--prompts 8] [--new-tokens 32]
        [--contexts 1024,4096,16384] [--real-tokens 256]
    PYTHONPATH=. python scripts/bench_hf_engine.py --device cuda --step-events   # the GPU session's engine row

The same model and prompts (greedy, stopping at the model's EOS) go through ``model.generate_batch`` (transformers'
continuous batching, paged attention, with its own CUDA graphs where it has them) and through
``graphrt.hf.engine_model(...).generate`` eagerly (``graphs=False``) and with graphs (full decode
graphs, piecewise prefill), then through the online engine (``engine.online()``: requests arriving while
others decode, issue 50) eagerly and with graphs. Each path runs once to warm up (capture included) and
is then timed on a second run. Printed per path: whether its tokens equal ``model.generate()``'s per prompt, generated
tokens per second, engine steps, and graphrt's own cost per step (the time of a step spent outside the
runner: scheduling, batch building, sampling; and inside it). On CPU graphrt's graphs are the emulated
backend, which replays the recorded ops one by one: it checks the CUDA-graph contract, it is not a
CUDA-graph speedup, and its numbers say nothing about a GPU. ``--threads`` (default 1) sets torch's
CPU threads: on a shared machine more threads than free cores make every op spin-wait.

Then: the bytes a cached token takes per layer in the engine's KV pools against the model's minimum
(multi-head latent attention's latent; see graphrt.hf.kv_layout); what capturing the engine took (its
runners, graphs, seconds and graph-pool growth, ``stats()["capture"]``: every runner a call may use is
captured before its first step, into one pool); and the time of one graphed decode step of
``--max-requests`` requests holding about ``--real-tokens`` tokens each, for each ``max_context`` of
``--contexts``: the time in the runner per decode step of a call generating 1 + ``DECODE_STEPS`` tokens
(``stats()["serve"]["decode_runner_seconds"]``), the least of ``REPEATS`` calls after one that captures,
on one engine per context, beside that engine's capture (a decode runner per width bucket).

``--step-events`` measures only this instead (issue 47): ``--max-requests`` prompts of 4 tokens decoding
``--new-tokens`` tokens each on the 4-layer model, with graphs and eagerly, host ms per decode step (the
step's wall time but its waits for the device) and, on CUDA, device ms per step between CUDA events
recorded around each step's device work, and one replay of the decode graph alone
(scripts/bench_engine_events.py). A device-bound step has host ms below the graph's; on CPU the replays run
on the host, so its host ms include them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_engine_events import StepEvents, format_events, step_events  # noqa: E402
from hf_engine_helpers import generate_alone, ragged_prompts  # noqa: E402
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402

Run = Callable[[], List[List[int]]]
DECODE_STEPS = 8
REPEATS = 3
ARRIVAL_EVERY = 3  # the online path: a new request every this many steps while the others decode


def timed(run: Run) -> Tuple[List[List[int]], float]:
    """The tokens of a second run of ``run`` (the first warms up) and its seconds."""
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def generate_batch_run(model: torch.nn.Module, prompts: List[List[int]], new_tokens: int,
                       max_requests: int) -> Optional[Run]:
    """``model.generate_batch`` on ``prompts`` (None where this transformers has no continuous batching)."""
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return None
    eos = model.generation_config.eos_token_id
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    page = "page_size" if "page_size" in {field.name for field in dataclasses.fields(ContinuousBatchingConfig)} \
        else "block_size"  # transformers 5.17 calls it block_size
    batching = ContinuousBatchingConfig(**{page: 16}, num_blocks=max_requests * 16, max_batch_tokens=64,
                                        max_requests_per_batch=max_requests)

    def run() -> List[List[int]]:
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching,
                                   progress_bar=False)
        return [list(out[f"req_{index}"].generated_tokens) for index in range(len(prompts))]

    return run


def online_run(engine: graphrt.hf.HFEngine, prompts: List[List[int]], new_tokens: int, graphs: bool,
               stats: Dict[str, Dict]) -> Run:
    """The online path (issue 50): the first ``max_requests`` prompts added at once, then one more every
    ``ARRIVAL_EVERY`` steps while the others decode; stepped until all ended. Keeps the session's stats()."""
    def run() -> List[List[int]]:
        params = graphrt.hf.RequestParams(max_new_tokens=new_tokens)
        with engine.online(graphs=graphs) as online:
            ids = [online.add_request(prompt, params) for prompt in prompts[:engine.max_requests]]
            step = 0
            while len(ids) < len(prompts) or online.busy:
                if len(ids) < len(prompts) and step % ARRIVAL_EVERY == 0:
                    ids.append(online.add_request(prompts[len(ids)], params))
                online.step()
                step += 1
            stats.update(online.stats())
            return [online.output(request_id).tokens for request_id in ids]

    return run


def online_row(name: str, tokens: List[List[int]], expected: List[List[int]], seconds: float,
               stats: Dict[str, Dict]) -> str:
    """A row of the online table: tokens equal, tokens/s, steps, medians of the per-request times."""
    serve, requests = stats["serve"], stats["requests"].values()

    def median_ms(key: str) -> str:
        values = sorted(request[key] for request in requests if request[key] is not None)
        return f"{1e3 * values[len(values) // 2]:.1f}" if values else "-"

    generated = sum(len(row) for row in tokens)
    steps = serve["decode_steps"] + serve["prefill_steps"]
    outside = serve["seconds"] - serve["runner_seconds"]
    return (f"| {name} | {'yes' if tokens == expected else '**no**'} | {generated / seconds:.0f} | {steps} | "
            f"{1e3 * serve['runner_seconds'] / steps:.2f} | {1e3 * outside / steps:.2f} | {median_ms('queue_s')} | "
            f"{median_ms('ttft_s')} | {median_ms('tpot_s')} |")


def decode_step_ms(model: torch.nn.Module, max_context: int, real_tokens: int,
                   max_requests: int) -> Tuple[float, Dict[str, float]]:
    """One graphed decode step of ``max_requests`` requests near ``real_tokens`` tokens, in ms (see the
    docstring), and what capturing that engine took (``stats()["capture"]``)."""
    prompts = ragged_prompts([real_tokens - DECODE_STEPS] * max_requests, seed=5)
    engine = graphrt.hf.engine_model(model, max_requests=max_requests, max_context=max_context, max_step_tokens=64,
                                     kv_slots=max_requests * real_tokens + 1)
    times = []
    for _ in range(1 + REPEATS):  # the first captures
        engine.generate(prompts, max_new_tokens=1 + DECODE_STEPS, eos_token_id=None)
        serve = engine.stats()["serve"]
        times.append(serve["decode_runner_seconds"] / serve["decode_steps"])
    return 1e3 * min(times[1:]), engine.stats()["capture"]


def capture_cells(capture: Dict[str, float]) -> str:
    """An engine's capture as Markdown cells: runners, graphs, seconds, graph pools, pool MiB."""
    return (f"{capture['runners']} | {capture['graphs']} | {capture['seconds']:.2f} | {capture['graph_pools']} | "
            f"{capture['pool_bytes'] / 2**20:.1f}")


def kv_line(engine: graphrt.hf.HFEngine) -> str:
    """The KV pools' bytes per cached token and layer against the model's minimum."""
    kv = engine.kv_bytes()
    return (f"KV bytes per cached token per layer: {kv['per_token_per_layer']:.0f} (the model's minimum "
            f"{kv['minimum_per_token_per_layer']:.0f}, ratio {kv['per_token_per_layer'] / kv['minimum_per_token_per_layer']:.2f}); "
            f"KV buffers {kv['pool_bytes'] / 2**20:.2f} MiB")


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The model and prompts options the engine benches share."""
    parser.add_argument("--family", default="llama")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (intermediate 2x, 4 layers)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=4)


def workload(family: str, hidden: int, prompts: int, device: str) -> Tuple[torch.nn.Module, List[List[int]]]:
    """The benches' model (random weights, 4 layers, ``hidden`` wide) and their prompts of 4 to 32 tokens."""
    model = tiny_model(family, device, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                       head_dim=hidden // 4)
    return model, ragged_prompts([4 + (7 * index) % 29 for index in range(prompts)])


def step_event_rows(args: argparse.Namespace) -> List[StepEvents]:
    """``--step-events``: the engine's decode steps with graphs and eagerly, printed as a table."""
    model, _ = workload(args.family, args.hidden, args.max_requests, args.device)
    prompts = ragged_prompts([4] * args.max_requests)
    engine = graphrt.hf.engine_model(model, max_requests=args.max_requests, max_context=4 + args.new_tokens + 1,
                                     max_step_tokens=4 * args.max_requests)
    rows = [step_events(engine, prompts, args.new_tokens, graphs) for graphs in (True, False)]
    print(f"engine decode steps: {args.family}, hidden {args.hidden}, 4 layers, {args.max_requests} requests x "
          f"{args.new_tokens} new tokens, device {args.device}, overlap {'on' if engine.asynchronous else 'off'}, "
          f"{torch.get_num_threads()} CPU threads, load average {os.getloadavg()[0]:.1f}")
    print("\n".join(format_events(rows)))
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    """Time every path on one model and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--contexts", default="1024,4096,16384", help="max_context values of the decode-step table")
    parser.add_argument("--real-tokens", type=int, default=256, help="tokens each request holds in that table")
    parser.add_argument("--step-events", action="store_true",
                        help="only the host and device ms per decode step, with graphs and eagerly (CUDA events)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    if args.step_events:
        step_event_rows(args)
        return

    model, prompts = workload(args.family, args.hidden, args.prompts, args.device)
    expected = generate_alone(model, prompts, args.new_tokens)
    engine = graphrt.hf.engine_model(model, max_requests=args.max_requests, max_context=64, max_step_tokens=32)
    paths: Dict[str, Optional[Run]] = {
        "transformers generate_batch": generate_batch_run(model, prompts, args.new_tokens, args.max_requests),
        "graphrt engine, eager": lambda: engine.generate(prompts, max_new_tokens=args.new_tokens, graphs=False),
        "graphrt engine, graphs": lambda: engine.generate(prompts, max_new_tokens=args.new_tokens),
    }
    print(f"{args.family}, hidden {args.hidden}, 4 layers, {args.prompts} prompts x {args.new_tokens} new tokens, "
          f"{args.max_requests} requests at once, device {args.device}, {torch.get_num_threads()} CPU threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.device == "cpu":
        print("CPU: graphrt's graphs are the emulated backend (recorded ops replayed one by one, the CUDA-graph "
              "contract checked); this is not a CUDA-graph speedup.")
    print("| path | tokens equal generate() | tokens/s | steps | ms/step in runner | ms/step outside runner |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, run in paths.items():
        if run is None:
            print(f"| {name} | not available in this transformers | | | | |")
            continue
        try:
            tokens, seconds = timed(run)
        except Exception as error:  # transformers' own path may not run here (5.17 on CPU: no memory probe)
            print(f"| {name} | failed: {type(error).__name__}: {error} | | | | |")
            continue
        generated = sum(len(row) for row in tokens)
        row = [name, "yes" if tokens == expected else "**no**", f"{generated / seconds:.0f}"]
        if name.startswith("graphrt"):
            serve = engine.stats()["serve"]
            steps = serve["decode_steps"] + serve["prefill_steps"]
            outside = serve["seconds"] - serve["runner_seconds"]
            row += [str(steps), f"{1e3 * serve['runner_seconds'] / steps:.2f}", f"{1e3 * outside / steps:.2f}"]
        else:
            row += ["", "", ""]
        print("| " + " | ".join(row) + " |")

    print()
    print(f"Online (engine.online()): {args.max_requests} requests added at once, then one more every "
          f"{ARRIVAL_EVERY} steps while the others decode; medians over the requests (host clock):")
    print("| path | tokens equal generate() | tokens/s | steps | ms/step in runner | ms/step outside runner | queue ms | "
          "time to first token ms | ms per output token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, graphs in (("graphrt online, eager", False), ("graphrt online, graphs", True)):
        stats: Dict[str, Dict] = {}
        tokens, seconds = timed(online_run(engine, prompts, args.new_tokens, graphs, stats))
        print(online_row(name, tokens, expected, seconds, stats))

    print()
    print(kv_line(engine))
    print()
    print("Capture per engine (| runners | graphs | seconds | graph pools | pool MiB |): "
          f"| {capture_cells(engine.stats()['capture'])} |")
    print()
    print(f"Decode step against max_context ({args.max_requests} requests of about {args.real_tokens} tokens, graphs):")
    print("| max_context | ms per decode step | against the smallest | runners | graphs | capture s | graph pools "
          "| pool MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    times = [(int(context), *decode_step_ms(model, int(context), args.real_tokens, args.max_requests))
             for context in args.contexts.split(",")]
    for context, ms, capture in times:
        print(f"| {context} | {ms:.2f} | {ms / times[0][1]:.2f}x | {capture_cells(capture)} |")


if __name__ == "__main__":
    main()
