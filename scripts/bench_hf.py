"""Hugging Face generate() on a tiny random Llama and a tiny random Gemma3 (sliding-window and full
attention layers): eager vs graphrt vs torch.compile (wrap()'s own per-call cost is in bench_floor,
measured whether or not transformers is installed).

Every peer generates from the same prompts, greedy, with a static cache: first the call that sets
it up (capture or compile), then warm calls whose decode steps are timed one forward call at a
time. "First steady step" is the wall time from wrapping ``forward`` to the end of the first
forward call that needed no more setup: graphrt's first replayed call, torch.compile's first call
after its last compilation, with inductor's on-disk caches off (a cold compile, as a first run
pays; a warm cache cuts it several-fold).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from bench_timing import Spread

PROMPTS, PROMPT_LEN, WARM_CALLS = 3, 8, 2  # 3 prompts: not a capture size, the batch's own size is recorded
GEMMA3_WINDOW = 6  # shorter than prompt + new tokens: the window slides while graphs replay (not PROMPTS: the
# sliding mask [batch, 1, 1, window] would have the batch size in two dims)
COMPILE_NAME = 'torch.compile(mode="reduce-overhead")'
CPU_NOTE = ("on CPU graphrt's emulated replay runs the recorded aten ops (no CUDA graph), and torch.compile's "
            "steps run inductor's fused C++ kernels (reduce-overhead uses CUDA graphs only for CUDA tensors): "
            "neither column is a CUDA-graph effect")


@dataclass
class PeerResult:
    """One way of running generate(): its setup time, warm decode steps, replays and tokens."""

    name: str
    first_steady_s: Optional[float] = None  # wrapping -> end of the first forward call needing no more setup
    decode_step_ms: Optional[Spread] = None  # per decode forward call, warm generate() calls
    forward_calls: int = 0
    replayed_calls: Optional[int] = None  # None: the peer has no notion of replay here
    same_tokens: Optional[bool] = None
    error: Optional[str] = None


@dataclass
class HfModelResult:
    """One model's generate() comparison."""

    model: str
    peers: List[PeerResult]


@dataclass
class HfResult:
    """The generate() comparison per model and wrap()'s per-call cost by number of layouts."""

    prompts: int
    new_tokens: int
    models: List[HfModelResult]
    note: str = ""


class Peer(NamedTuple):
    """What a peer's setup leaves: whether the last call needed no setup, and replays so far."""

    steady: Callable[[], bool]
    replayed: Callable[[], Optional[int]]


class ForwardTimer:
    """Stands in for ``model.forward``: times each call, and notes when the first steady one ended."""

    def __init__(self, forward: Callable[..., Any], steady: Callable[[], bool], started: float) -> None:
        self.__wrapped__ = forward  # generate() passes forward the keywords its signature accepts
        self.forward, self.steady, self.started = forward, steady, started
        self.durations: List[float] = []
        self.first_steady_s: Optional[float] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.forward(*args, **kwargs)
        end = time.perf_counter()
        self.durations.append(end - start)
        if self.first_steady_s is None and self.steady():
            self.first_steady_s = end - self.started
        return out


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.5, pad_token_id=0)


def tiny_llama(device: torch.device) -> torch.nn.Module:
    """The tests' tiny random Llama (2 layers, hidden 64, vocab 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).to(device).eval()


def tiny_gemma3(device: torch.device) -> torch.nn.Module:
    """A tiny random Gemma3: a sliding-window layer (window GEMMA3_WINDOW) and a full-attention layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(**TINY, head_dim=16, sliding_window=GEMMA3_WINDOW,
                              layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(config).to(device).eval()


MODELS = {  # description -> builder
    "tiny random Llama (2 layers, hidden 64, vocab 128)": tiny_llama,
    f"tiny random Gemma3 (a sliding-window layer, window {GEMMA3_WINDOW}, and a full-attention layer; hidden 64, "
    "vocab 128)": tiny_gemma3,
}


def run_peer(name: str, model: torch.nn.Module, setup: Callable[[torch.nn.Module], Peer], prompts: torch.Tensor,
             options: Dict[str, Any], expected: Optional[torch.Tensor]) -> PeerResult:
    """Set the peer up on ``model``, generate once (setup) and WARM_CALLS times (decode steps timed)."""
    started = time.perf_counter()
    peer = setup(model)
    timer = ForwardTimer(model.forward, peer.steady, started)
    model.forward = timer
    outputs = [model.generate(prompts, **options)]
    decode_ms: List[float] = []
    for _ in range(WARM_CALLS):
        before = len(timer.durations)
        outputs.append(model.generate(prompts, **options))
        decode_ms += [seconds * 1e3 for seconds in timer.durations[before + 1:]]  # [before] is the prefill
    reference = outputs[0] if expected is None else expected
    return PeerResult(name, timer.first_steady_s, Spread.of(decode_ms), len(timer.durations), peer.replayed(),
                      all(torch.equal(out, reference) for out in outputs))


def eager_peer(model: torch.nn.Module) -> Peer:
    return Peer(lambda: False, lambda: 0)


def graphrt_peer(model: torch.nn.Module) -> Peer:
    from graphrt.hf import graph_generate

    fast = graph_generate(model, max_batch_size=8)
    return Peer(lambda: fast.stats()["graph_runs"] > 0, lambda: fast.stats()["graph_runs"])


def compile_peer(model: torch.nn.Module) -> Peer:
    """``model.forward = torch.compile(model.forward, mode="reduce-overhead")``, steady after its last compile."""
    counters = torch._dynamo.utils.counters["stats"]
    seen = {"graphs": counters["unique_graphs"], "calls": 0, "last_compile": 0}
    model.forward = torch.compile(model.forward, mode="reduce-overhead")

    def steady() -> bool:
        seen["calls"] += 1
        if counters["unique_graphs"] != seen["graphs"]:
            seen["graphs"], seen["last_compile"] = counters["unique_graphs"], seen["calls"]
            return False
        return seen["calls"] > 2 and seen["last_compile"] > 1  # past the prefill's and the decode step's compiles

    return Peer(steady, lambda: None)


def measure_hf_generate(device: torch.device, new_tokens: int, with_compile: bool) -> HfResult:
    """Per model: eager, graphrt (graph_generate) and, where asked, torch.compile on the same prompts. The
    compile peers run last, after every model's eager and graphrt peers, as with a single model: no eager or
    graphrt timing follows a compilation in the same process."""
    prompts = torch.randint(1, 128, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).to(device)
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache_implementation="static",
                   disable_compile=True)  # transformers would torch.compile the model call itself on a GPU
    bases = {name: build(device) for name, build in MODELS.items()}
    expected = {name: copy.deepcopy(base).generate(prompts, **options) for name, base in bases.items()}
    models = [HfModelResult(name, [
        run_peer("eager", copy.deepcopy(base), eager_peer, prompts, options, None),
        run_peer("graphrt graph_generate", copy.deepcopy(base), graphrt_peer, prompts, options, expected[name]),
    ]) for name, base in bases.items()]
    for model in models:
        model.peers.append(compile_result(bases[model.model], prompts, options, expected[model.model]) if with_compile
                           else PeerResult(COMPILE_NAME, error="skipped (--no-compile)"))
    return HfResult(PROMPTS, new_tokens, models, CPU_NOTE if device.type == "cpu" else "")


def compile_result(base: torch.nn.Module, prompts: torch.Tensor, options: Dict[str, Any],
                   expected: torch.Tensor) -> PeerResult:
    """The torch.compile peer on a copy of ``base``, or why it could not run here."""
    try:
        # Inductor's on-disk caches off: the compile a first run pays, not one warmed by an earlier process.
        with torch._inductor.config.patch(force_disable_caches=True):
            return run_peer(COMPILE_NAME, copy.deepcopy(base), compile_peer, prompts, options, expected)
    except Exception as error:  # no C compiler, unsupported platform...: reported, not fatal
        return PeerResult(COMPILE_NAME, error=f"could not run here: {type(error).__name__}: {error}"[:300])


def format_hf(result: Dict[str, Any]) -> List[str]:
    """Report lines of the generate() section (from the JSON form of an HfResult)."""
    lines = []
    for model in result["models"]:
        lines += ["", f"Hugging Face generate(): {model['model']}, {result['prompts']} prompts x {PROMPT_LEN} tokens, "
                  f"{result['new_tokens']} new tokens, greedy, static cache; decode steps of {WARM_CALLS} warm calls"]
        lines += format_peers(model["peers"])
    if result["note"]:
        lines.append(f"NOTE: {result['note']}.")
    return lines


def format_peers(peers: List[Dict[str, Any]]) -> List[str]:
    """One model's table: setup time, decode step, forward calls replayed (and their share), tokens."""
    header = ["peer", "first steady step s", "decode step ms: median [p10-p90]", "forward calls replayed",
              "same tokens"]
    rows = []
    for peer in peers:
        if peer["error"]:
            rows.append([peer["name"], "-", peer["error"], "-", "-"])
            continue
        spread = peer["decode_step_ms"]
        replayed, calls = peer["replayed_calls"], peer["forward_calls"]
        share = "n/a" if replayed is None else f"{replayed}/{calls} ({replayed / calls:.0%})"
        first = "-" if peer["first_steady_s"] is None else f"{peer['first_steady_s']:.2f}"
        rows.append([peer["name"], first, f"{spread['median']:.3f} [{spread['p10']:.3f}-{spread['p90']:.3f}]",
                     share, "reference" if peer["name"] == "eager" else ("yes" if peer["same_tokens"] else "NO")])
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
