"""Any Hugging Face decoder on graphrt's engine path: ``engine_model(model)`` and ``HFEngine.generate``.

The engine is a GraphRunner model callable ``engine(input_ids, positions, forward_batch)`` made of the
model's own modules and weights: it calls the model on the packed step (``[1, num_tokens]`` with one
``position_ids`` per token, no cache object) with its attention implementation switched to graphrt's
paged attention (``graphrt.hf.paged_attention``) for the call, so the keys and values live in graphrt's
KV pool and every request's history is read through the request table. Models must declare
transformers' modeling-backend contract (``_supports_attention_backend``) and have attention in every
layer; others are refused by name. ``generate`` serves prompts with continuous batching
(``graphrt.hf.serve``) through a GraphRunner: decode steps replay full graphs, prefill and mixed steps
piecewise graphs split at the attention, and ``steps_per_launch`` > 1 multi-step keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.host.sampling import SamplingMetadata
from graphrt.hf.paged_attention import (ATTENTION_NAME, PAGED_ATTENTION_OP, PagedAttnBackend,
                                        register_paged_attention)
from graphrt.hf.serve import ServeConfig, held_rows, serve
from graphrt.reference import (CachePools, KVPool, ReqToTokenPool, graph_runner_kwargs, make_decode_batch,
                               make_extend_batch)
from graphrt.config import RunnerConfig
from graphrt.runner import GraphRunner
from graphrt.sizes import default_capture_sizes, default_piecewise_sizes

logger = logging.getLogger(__name__)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
PROBE_NAME = "graphrt_probe"  # the attention implementation that reads each layer's KV shapes


class _Implementations:
    """While entered: the model's attention implementation is ``attention`` (graphrt's paged attention);
    restored on exit, so the model's own ``generate()`` is unchanged. Its other modules (MoE experts
    included) run as the model chose."""

    def __init__(self, config: Any, attention: str) -> None:
        self.config = config
        self.attention = attention
        self._saved: Any = None

    def __enter__(self) -> None:
        self._saved = self.config._attn_implementation
        self.config._attn_implementation = self.attention

    def __exit__(self, *exc_info: Any) -> None:
        self.config._attn_implementation = self._saved


class _LayerShapes:
    """The attention function of the probe step: each layer's KV heads, key and value head dims, dtype."""

    def __init__(self) -> None:
        self.layers: Dict[int, Tuple[int, int, int, torch.dtype]] = {}

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, **kwargs: Any) -> Tuple[torch.Tensor, None]:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(f"model: its attention module {type(module).__name__} has no int layer_idx; graphrt's "
                             "paged attention keeps each layer's keys and values by that index")
        self.layers[layer] = (key.shape[1], key.shape[-1], value.shape[-1], key.dtype)
        return query.new_zeros((*query.shape[:1], query.shape[2], query.shape[1], value.shape[-1])), None


def refusal(model: Any) -> Optional[str]:
    """Why ``model`` cannot run on the engine path (None when it can): it does not declare transformers'
    modeling-backend contract, or some of its layers are not attention layers."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{name} does not declare transformers' modeling-backend contract (_supports_attention_backend); "
                "its attention cannot be replaced by graphrt's paged attention")
    text = model.config.get_text_config()
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        return (f"{name} has layers of type {', '.join(other)}: only {' and '.join(ATTENTION_LAYER_TYPES)} layers "
                "can keep their state in graphrt's paged KV pool")
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's MLA: run as per-head keys and values (docs/MANUAL.md)
        logger.info("%s: multi-head latent attention runs as per-head keys and values in the KV pool", name)
    return None


def _probe_layers(model: Any) -> Dict[int, Tuple[int, int, int, torch.dtype]]:
    """Each layer's KV shape, read by running the model on one token with a recording attention."""
    from transformers import AttentionInterface

    shapes = _LayerShapes()
    AttentionInterface.register(PROBE_NAME, shapes)
    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
    with _Implementations(model.config, PROBE_NAME), torch.no_grad():
        model(input_ids=ids, position_ids=ids, use_cache=False)
    return shapes.layers


class HFEngine:
    """A transformers causal LM as a GraphRunner model callable over graphrt's paged KV pool, and
    ``generate`` serving prompts with continuous batching through that runner. Build with ``engine_model``."""

    def __init__(self, model: Any, max_requests: int, max_context: int, max_step_tokens: int,
                 kv_slots: Optional[int], backend: str, runner_options: Dict[str, Any]) -> None:
        for name, value in (("max_requests", max_requests), ("max_context", max_context),
                            ("max_step_tokens", max_step_tokens)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"model: {reason}")
        register_paged_attention()
        layers = _probe_layers(model)
        num_layers = model.config.get_text_config().num_hidden_layers
        if sorted(layers) != list(range(num_layers)):
            missing = sorted(set(range(num_layers)) - set(layers))
            raise ValueError(f"model: {type(model).__name__} layers {missing} do not attend through transformers' "
                             "AttentionInterface; their state cannot live in graphrt's paged KV pool")
        shapes = set(layers.values())
        if len(shapes) != 1:
            raise ValueError(f"model: {type(model).__name__} layers differ in KV heads/head dims {sorted(shapes)}; "
                             "graphrt's KV pool holds one shape for every layer")
        (num_kv_heads, k_dim, v_dim, dtype), = shapes
        device = next(model.parameters()).device
        slots = kv_slots if kv_slots is not None else max_requests * max_context + 1
        self.model = model
        self.max_requests = max_requests
        self.max_step_tokens = max_step_tokens
        self.graph_backend = backend
        self.runner_options = dict(runner_options)
        self.device = device
        self.pools = CachePools(ReqToTokenPool(max_requests + 1, max_context, device),
                                KVPool(slots, num_layers, num_kv_heads, k_dim, dtype, device, v_head_dim=v_dim))
        self.attn_backend = PagedAttnBackend(self.pools.req_to_token, self.pools.kv)
        self._implementations = _Implementations(model.config, ATTENTION_NAME)
        self._runners: Dict[Tuple[bool, int], GraphRunner] = {}
        self._last: Optional[GraphRunner] = None
        self._last_counts: Dict[str, Any] = {}
        self._model_calls = 0
        logger.info("engine: %s, %d layers of %d KV heads (k %d, v %d), %d KV slots", type(model).__name__,
                    num_layers, num_kv_heads, k_dim, v_dim, slots)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_tokens, vocab] (float32) of the packed step: the model on ``[1, num_tokens]``."""
        self._model_calls += 1
        with self._implementations:
            output = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                use_cache=False)
        return output.logits[0].float()

    def runner(self, graphs: bool = True, steps_per_launch: int = 1) -> GraphRunner:
        """The GraphRunner of this engine (captured on first use): full decode graphs, piecewise prefill and
        mixed graphs split at the paged attention, and ``steps_per_launch`` multi-step keys; eager with
        ``graphs=False``."""
        key = (graphs, steps_per_launch)
        runner = self._runners.get(key)
        if runner is None:
            options = dict(
                max_batch_size=self.max_requests, capture_sizes=default_capture_sizes(self.max_requests),
                modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED),
                backend=self.graph_backend if graphs else "eager", device=self.device, progress=False,
                splitting_ops=[PAGED_ATTENTION_OP], piecewise_sizes=default_piecewise_sizes(self.max_step_tokens),
                decode_steps=(steps_per_launch,) if steps_per_launch > 1 else (),
                **graph_runner_kwargs(self.attn_backend, self.pools))
            runner = GraphRunner(self, RunnerConfig(**{**options, **self.runner_options}))
            with torch.no_grad():
                report = runner.capture()
            logger.info("engine runner %s: %s", key, report)
            self._runners[key] = runner
        return runner

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, graphs: bool = True,
                 arrivals: Optional[Sequence[int]] = None, steps_per_launch: int = 1,
                 sampling: Optional[SamplingMetadata] = None, seed: int = 0,
                 eos_token_id: Union[None, int, Sequence[int], str] = "model") -> List[List[int]]:
        """Every prompt's generated token ids, served with continuous batching: at most ``max_requests``
        at once (the rest queue), request ``i`` arriving at step ``arrivals[i]`` (default: all at 0),
        prompts prefilled in chunks of the step budget. Greedy unless ``sampling`` (one row per prompt)
        samples; request ``i`` draws from a generator seeded ``seed + i``. A request stops after
        ``max_new_tokens`` or an EOS id (default: the model's ``generation_config``; None: never).
        ``steps_per_launch`` > 1 runs that many greedy decode steps per launch (multi-step keys)."""
        prompts = [list(prompt) for prompt in prompts] if isinstance(prompts, (list, tuple)) else prompts
        arrivals = self._checked(prompts, max_new_tokens, arrivals, steps_per_launch, sampling)
        config = ServeConfig(max_running=self.max_requests, max_step_tokens=self.max_step_tokens,
                             max_new_tokens=max_new_tokens, steps_per_launch=steps_per_launch,
                             eos_token_ids=self._eos_ids(eos_token_id))
        runner = self.runner(graphs, steps_per_launch)
        self._last = runner

        in_runner = [0.0]

        def step(batch: ForwardBatch) -> Tuple[torch.Tensor, int]:
            calls, start = self._model_calls, time.perf_counter()
            logits = runner(batch)
            in_runner[0] += time.perf_counter() - start
            return logits, self._model_calls - calls

        def launch(batch: ForwardBatch, steps: int) -> Tuple[torch.Tensor, int]:
            calls, start = self._model_calls, time.perf_counter()
            tokens = runner.decode(batch, steps)
            in_runner[0] += time.perf_counter() - start
            return tokens, self._model_calls - calls

        start = time.perf_counter()
        with torch.no_grad():
            tokens, counts = serve(self.pools, self.attn_backend, step, launch, prompts, arrivals, config, sampling,
                                   seed)
        self._last_counts = {**asdict(counts), "seconds": time.perf_counter() - start, "runner_seconds": in_runner[0]}
        return tokens

    def prompt_logits(self, prompts: Sequence[Sequence[int]], graphs: bool = True) -> List[torch.Tensor]:
        """Each prompt's logits [length, vocab], as ``model(prompt).logits``, on the engine path: all but
        the last tokens in one packed prefill step (piecewise graphs), the last tokens in one decode step
        (full graphs). For checking the engine against the model; prompts of at least 2 tokens, at most
        ``max_requests`` of them."""
        if not prompts or len(prompts) > self.max_requests or not all(len(prompt) >= 2 for prompt in prompts):
            raise ValueError(f"prompts: expected 1 to {self.max_requests} prompts of at least 2 tokens each")
        runner = self.runner(graphs)
        pools, device = self.pools, self.device
        context = dict(pools=pools, attn_backend=self.attn_backend)
        heads = [list(prompt[:-1]) for prompt in prompts]
        lengths = [len(head) for head in heads]
        with held_rows(pools, len(prompts)) as (rows, cached), torch.no_grad():
            loc = pools.assign(rows, cached, lengths)
            cached[:] = lengths
            head_logits = runner(make_extend_batch(heads, rows, [0] * len(rows), loc, device, **context)).clone()
            loc = pools.assign(rows, lengths, [1] * len(rows))
            cached[:] = [length + 1 for length in lengths]
            last = runner(make_decode_batch([prompt[-1] for prompt in prompts], rows, cached, loc, device, **context))
            return [torch.cat((head, last[index: index + 1])) for index, head in enumerate(head_logits.split(lengths))]

    def stats(self) -> Dict[str, Any]:
        """The stats of the GraphRunner the last ``generate`` ran on (graph_runs, piecewise_runs,
        eager_reasons, ...), with ``serve``: that call's step counts (decode steps, how many replayed,
        prefill tokens, how many in piecewise graphs), its ``seconds`` and the ``runner_seconds`` spent
        in the runner's calls (the rest is scheduling, batch building and sampling)."""
        if self._last is None:
            raise RuntimeError("stats(): no generate() call yet")
        return {**self._last.stats(), "serve": dict(self._last_counts)}

    def _eos_ids(self, eos_token_id: Union[None, int, Sequence[int], str]) -> Tuple[int, ...]:
        if isinstance(eos_token_id, str):
            if eos_token_id != "model":
                raise ValueError(f"eos_token_id: expected None, an int, a list of ints or 'model', "
                                 f"got {eos_token_id!r}")
            config = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return ()
        ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        if not all(isinstance(token, int) for token in ids):
            raise TypeError(f"eos_token_id: expected ints, got {eos_token_id!r}")
        return ids

    def _checked(self, prompts: Any, max_new_tokens: Any, arrivals: Any, steps_per_launch: Any,
                 sampling: Any) -> List[int]:
        """The arrivals of a valid ``generate`` call (all 0 by default); ValueError/TypeError naming the field."""
        if not isinstance(prompts, list) or not prompts or not all(
                prompt and all(isinstance(token, int) for token in prompt) for prompt in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty lists of token ids (ints)")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if type(steps_per_launch) is not int or steps_per_launch < 1:
            raise ValueError(f"steps_per_launch: expected an int >= 1, got {steps_per_launch!r}")
        context = self.pools.req_to_token.max_context_len
        longest = max(len(prompt) for prompt in prompts)
        if longest + max_new_tokens > context:
            raise ValueError(f"max_new_tokens: the longest prompt ({longest}) plus {max_new_tokens} new tokens "
                             f"exceed max_context={context}")
        if sampling is not None:
            if not isinstance(sampling, SamplingMetadata):
                raise TypeError(f"sampling: expected a SamplingMetadata, got {type(sampling).__name__}")
            if sampling.num_reqs != len(prompts):
                raise ValueError(f"sampling: expected one row per prompt ({len(prompts)}), got {sampling.num_reqs}")
            if steps_per_launch > 1 and not bool(sampling.is_greedy().all()):
                raise ValueError("steps_per_launch: multi-step launches choose tokens greedily inside the graph; "
                                 "sampling needs steps_per_launch=1")
        if arrivals is None:
            return [0] * len(prompts)
        arrivals = list(arrivals)
        if len(arrivals) != len(prompts) or not all(type(step) is int and step >= 0 for step in arrivals):
            raise ValueError(f"arrivals: expected one step index (int >= 0) per prompt ({len(prompts)}), "
                             f"got {arrivals!r}")
        return arrivals


def engine_model(model: Any, max_requests: int = 8, max_context: int = 256, max_step_tokens: int = 64,
                 kv_slots: Optional[int] = None, backend: str = "auto", **runner_options: Any) -> HFEngine:
    """The engine of a transformers causal LM: its modules and weights, its attention replaced by graphrt's
    paged attention over a KV pool of ``kv_slots`` slots (default: every request at full context) for
    ``max_requests`` requests of up to ``max_context`` tokens, and ``max_step_tokens`` tokens per step
    (the chunk budget of prefill). ``runner_options`` (RunnerConfig fields: ``capture_sizes``,
    ``piecewise_sizes``, ``warmup_iters``, ...) replace the engine's choices for its runners. ValueError
    names why a model cannot be served (no modeling-backend contract, layers that are not attention)."""
    unknown = set(runner_options) - {field.name for field in fields(RunnerConfig)}
    if unknown:
        raise TypeError(f"runner_options: expected RunnerConfig fields, got {sorted(unknown)}")
    return HFEngine(model, max_requests, max_context, max_step_tokens, kv_slots, backend, runner_options)


__all__ = ["HFEngine", "engine_model", "refusal"]
