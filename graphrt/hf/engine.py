"""Any Hugging Face decoder on graphrt's engine path: ``engine_model(model)`` and ``HFEngine.generate``.

The engine is a GraphRunner model callable ``engine(input_ids, positions, forward_batch)`` made of the
model's own modules and weights: it calls the model on the packed step (``[1, num_tokens]`` with one
``position_ids`` per token, no cache object) with its attention implementation switched to graphrt's
paged attention (``graphrt.hf.paged_attention``) for the call, so the keys and values live in graphrt's
KV pools and every request's history is read through the request table (or its window's ring). A probe
step (``graphrt.hf.engine_probe``) reads each layer's shapes, window, KV sharing and mask first, and
refuses by name a model whose mask says more than causal attention in its window; rotary embeddings whose
frequencies depend on the forward's length give each request its own (``graphrt.hf.request_rope``). Each
call first checks whether what the probe read changed since (the config's values, a tensor's dtype or
device: ``graphrt.hf.model_state``): then the model is probed again and, when the probe reads otherwise,
the KV pools and runners are made anew (their keys captured again). ``generate`` serves
prompts with continuous batching (``graphrt.hf.serve``) through the engine's runners
(``graphrt.hf.engine_runners``: piecewise prefill, decode graphs per width bucket, multi-step keys; prompt
prefixes computed once, ``graphrt.hf.prefix_sharing``), one
call at a time (a lock per engine), each step staged with one pinned copy and its tokens chosen on the
device and read back once (``graphrt.hf.engine_step``), per request as ``generate()`` chooses them
(``graphrt.hf.request_sampling``); on CUDA the next step is launched before this one's tokens are read.
``online`` opens a session on the same loop: requests added, stepped, streamed and aborted while it runs
(``graphrt.hf.online``).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, fields
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.config import RunnerConfig
from graphrt.guards.epoch import unbumped
from graphrt.hf.attention_plan import new_step
from graphrt.hf.engine_probe import ProbedModel, refusal
from graphrt.hf.engine_ranks import EngineRanks
from graphrt.hf.engine_runners import EngineRunners
from graphrt.hf.engine_slots import SlotTable
from graphrt.hf.engine_step import EngineCounters, EngineSteps, StepArena
from graphrt.hf.kv_layout import LayeredKVPool, minimum_bytes_per_token_per_layer
from graphrt.hf.logits_rules import GenerationRules, config_sampling
from graphrt.hf.online import OnlineEngine
from graphrt.hf.paged_attention import ATTENTION_NAME, register_paged_attention, splitting_ops
from graphrt.hf.prefix_sharing import EnginePrefixes
from graphrt.hf.request_rope import REQUEST_ROPE_OP
from graphrt.hf.request_sampling import RequestTokens, TokenChooser
from graphrt.hf.requests import Request
from graphrt.hf.serve import ServeConfig, ServeCounts, assigned_work, release, serve
from graphrt.hf.tensor_parallel import shard_model
from graphrt.host.sampling import SamplingMetadata
from graphrt.reference import CachePools, ReqToTokenPool

logger = logging.getLogger(__name__)

_SWITCH_LOCK = threading.RLock()  # one model call at a time under a switched attention implementation


@contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """While entered: ``config``'s attention implementation is ``name``, restored on every exit. Held
    under a process-wide lock, so two engines (or an engine and its probe) on one model in two threads
    never leave the model on graphrt's attention. The switch and its restore bump no state epoch: the
    config a step reads is as it was before for the next call's guard check."""
    with _SWITCH_LOCK:
        saved = config._attn_implementation
        with unbumped():
            config._attn_implementation = name
        try:
            yield
        finally:
            with unbumped():
                config._attn_implementation = saved


class HFEngine:
    """A transformers causal LM as a GraphRunner model callable over graphrt's paged KV pools, and
    ``generate`` serving prompts with continuous batching through the engine's runners. Build with
    ``engine_model``."""

    def __init__(self, model: Any, max_requests: int, max_context: int, max_step_tokens: int,
                 kv_slots: Optional[int], backend: str, runner_options: Dict[str, Any], timeout_s: float = 600.0,
                 prefix_sharing: bool = True) -> None:
        for name, value in (("max_requests", max_requests), ("max_context", max_context),
                            ("max_step_tokens", max_step_tokens)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"model: {reason}")
        _refuse_training(model)
        self.ranks: Optional[EngineRanks] = None
        if runner_options.get("process_group") is not None:  # tensor parallel: shard, then probe the shard
            self.ranks = EngineRanks.create(runner_options["process_group"], runner_options.get("cpu_group"), timeout_s)
            runner_options = {**runner_options, "cpu_group": self.ranks.cpu_group}
            shard_model(model, self.ranks.group)
        register_paged_attention()
        self.model = model
        self.max_requests = max_requests
        self.max_context = max_context
        self.max_step_tokens = max_step_tokens
        self._slots = kv_slots if kv_slots is not None else max_requests * max_context + 1
        self._backend = backend
        self._runner_options = runner_options
        self._prefix_sharing = prefix_sharing
        self._lock = threading.RLock()
        self._counters = EngineCounters()  # what changes per step: never an attribute of the engine (guards read it)
        self._serve_probed(self._probe())

    def _probe(self) -> ProbedModel:
        reason = refusal(self.model)
        if reason is not None:
            raise ValueError(f"model: {reason}")
        return ProbedModel.of(self.model, lambda name: attention_implementation(self.model.config, name),
                              self.max_requests + 1, self.max_context, self.max_step_tokens, self._slots)

    def _serve_probed(self, probed: ProbedModel) -> None:
        """Make what serving takes from ``probed``: KV pools of its layout (a previous build's dropped first),
        its rotary embeddings attached to them, runners (captured by a call's ``prepare``, before its first
        step)."""
        self.runners = self.pools = self.slots = self._arena = None  # type: ignore[assignment]  # old buffers go first
        self.probed, self.layout, self.device, self.vocab_size = probed, probed.layout, probed.device, probed.vocab_size
        self.logits_width = getattr(self.model.config.get_text_config(), "vocab_size", None) or self.vocab_size
        self.pools = CachePools(ReqToTokenPool(self.max_requests + 1, self.max_context, self.device),
                                LayeredKVPool(probed.layout, self.device))
        self.prefixes = EnginePrefixes(self._prefix_sharing, probed.layout, bool(probed.ropes.ropes))
        self.slots = SlotTable(self.pools.req_to_token, self._slots, self.prefixes.cache)
        # CUDA graphs: copies marked with events, and by default the next step launched before a step's tokens are read
        self.asynchronous = self.device.type == "cuda" or self._backend == "cuda"
        self._arena = StepArena(self.pools, self.device, self.max_requests, self.max_step_tokens, self.asynchronous)
        probed.ropes.attach(self.pools.req_to_token)
        options = dict(self._runner_options)
        if probed.ropes.ropes:  # each request's rotary frequencies are planned on the host in prefill steps
            options["splitting_ops"] = [*(options.get("splitting_ops") or splitting_ops(probed.layout)),
                                        REQUEST_ROPE_OP]
        self.runners = EngineRunners(self, self.pools, probed.layout, self._backend, self.device, self.max_requests,
                                     self.max_step_tokens, options, self._lock)
        logger.info("engine: %s, %d KV slots, %.1f MiB of KV buffers; %s; length-dependent rotary embeddings: %s; "
                    "prefix sharing %s", type(self.model).__name__, self._slots, probed.layout.pool_bytes() / 2**20,
                    probed.layout.describe(), probed.ropes.describe(), self.prefixes.describe())

    def _follow_model(self, changes: List[str]) -> None:
        """After ``changes`` (what differs from what the probe read, ``ModelState.changes``): the model probed
        again and, when the probe reads otherwise, KV pools and runners made anew. ValueError naming the
        changes when the changed model cannot be served."""
        if not changes:
            return
        self.slots.clear_prefixes()  # computed by the model as it was
        try:
            probed = self._probe()
        except ValueError as error:
            raise ValueError(f"model: changed since the engine was built ({'; '.join(changes)}) and can no longer "
                             f"be served: {str(error).removeprefix('model: ')}") from error
        if self.probed.serves_like(probed):
            self.probed.state.accept()
            return
        logger.warning("engine: the model changed since it was probed (%s): probed again, KV pools and runners made "
                       "anew (their keys are captured again)", "; ".join(changes))
        self._serve_probed(probed)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_tokens, vocab] (float32) of the packed step: the model on ``[1, num_tokens]``."""
        self._counters.model_calls += 1
        new_step()  # this call plans its own attention (a capture's warm-ups and recording each run one)
        with attention_implementation(self.model.config, ATTENTION_NAME):
            output = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                use_cache=False)
        return output.logits[0].float()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, graphs: bool = True,
                 arrivals: Optional[Sequence[int]] = None, steps_per_launch: int = 1,
                 sampling: Optional[SamplingMetadata] = None, seed: int = 0,
                 eos_token_id: Union[None, int, Sequence[int], str] = "model",
                 stop_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 generation_config: Any = "model", overlap: Optional[bool] = None) -> List[List[int]]:
        """Every prompt's generated token ids, served with continuous batching: at most ``max_requests``
        at once (the rest queue), request ``i`` arriving at step ``arrivals[i]`` (default: all at 0),
        prompts prefilled in chunks of the step budget. Greedy unless ``sampling`` (one row per prompt)
        samples, or else the generation config samples (``do_sample``: its temperature, top-k, top-p and min-p,
        as ``generate()`` reads them); request ``i`` draws from a generator seeded ``seed + i``. A request stops after
        ``max_new_tokens``, an EOS id (default: the model's ``generation_config``; None: never) or one of
        its ``stop_token_ids[i]``. The processors of ``generation_config`` (default: the model's; None:
        none) that change greedy or seeded tokens apply per request, as ``generate()`` applies them; its
        ``min_new_tokens`` and ``min_length`` hold back every stop id of the request, EOS and its own alike.
        ``steps_per_launch`` > 1 runs that many greedy decode steps per launch (multi-step keys).
        ``overlap`` (default: on where the graphs are CUDA graphs) launches each step before the host reads
        the last one's tokens; the tokens are the same either way (tensor parallelism and multi-step
        launches read each step's first). A request that would grow past the length at which the model's
        ``generate()`` computes its cache again (Phi-3's long rotary factors) is refused by name. Calls from
        several threads run one at a time."""
        def prepare() -> Tuple[Tuple[List[Request], ServeConfig, TokenChooser], Any]:
            _refuse_training(self.model)
            checked = [list(prompt) for prompt in prompts] if isinstance(prompts, (list, tuple)) else prompts
            arrived = self._checked(checked, max_new_tokens, arrivals, steps_per_launch, sampling)
            self.probed.ropes.check_requests(checked, max_new_tokens)
            eos = self._eos_ids(eos_token_id)
            stops = self._stops(stop_token_ids, len(checked))
            config_used = getattr(self.model, "generation_config", None) if generation_config == "model" \
                else generation_config
            rules = GenerationRules.from_config(config_used, eos, max_new_tokens, self.vocab_size)
            config_row = None if sampling is not None else config_sampling(config_used)
            names = (*rules.names, *(["do_sample"] if config_row is not None and config_row["temperatures"] else []))
            if steps_per_launch > 1 and names:
                raise ValueError(f"steps_per_launch: multi-step launches choose tokens by argmax inside the graph; "
                                 f"the generation config's {', '.join(names)} need steps_per_launch=1 "
                                 f"(or generation_config=None)")
            rows = sampling if config_row is None else SamplingMetadata.from_params(  # the config samples: seeded
                **{name: [value] * len(checked) for name, value in config_row.items()})  # as sampling= is
            requests = [Request(index, arrived[index], self._request_tokens(prompt, index, rows, seed,
                                                                            frozenset(eos) | stops[index]),
                                eos=frozenset(eos)) for index, prompt in enumerate(checked)]
            config = ServeConfig(max_running=self.max_requests, max_step_tokens=self.max_step_tokens,
                                 max_new_tokens=max_new_tokens, max_context=self.max_context,
                                 steps_per_launch=steps_per_launch)
            sampled = None if rows is None else rows.map(lambda tensor: tensor.tolist())
            named = ([(request.prompt, request.arrival, sorted(request.stops)) for request in requests], config,
                     graphs, seed, sampled, repr(config_used))
            chooser = TokenChooser(rules, [request.tokens for request in requests], self.logits_width, self.device,
                                   self.max_requests + 1, 1 + max(len(request.stops) for request in requests))
            return (requests, config, chooser), named

        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"overlap: expected None or a bool, got {overlap!r}")
        with self._lock:
            requests, config, chooser = self._agreed("generate", prepare)
            counts = ServeCounts()
            with self._call(counts, requests), torch.no_grad(), self.probed.ropes.serving(
                    lambda: {request.row: len(request.prompt) for request in requests if request.row}):
                self.runners.prepare(graphs, steps_per_launch)  # every runner captured before the first step
                executor = EngineSteps(self._arena, self.runners, self._counters, graphs, steps_per_launch, chooser)
                share = None if self.ranks is None else self.ranks.share_tokens
                prefixes = self.prefixes.for_call(self.model, self.slots, counts, executor.write_prompt_ids)
                return serve(self.slots, executor, requests, config, counts, share,
                             self.asynchronous if overlap is None else overlap, prefixes)

    def prompt_logits(self, prompts: Sequence[Sequence[int]], graphs: bool = True) -> List[torch.Tensor]:
        """Each prompt's logits [length, vocab], as ``model(prompt).logits``, on the engine path: all but
        the last tokens in packed prefill steps of at most ``max_step_tokens`` tokens (piecewise graphs),
        the last tokens in one decode step (full graphs). For checking the engine against the model;
        prompts of at least 2 tokens, at most ``max_requests`` of them."""
        def prepare() -> Tuple[List[List[int]], Any]:
            if not prompts or len(prompts) > self.max_requests or not all(len(prompt) >= 2 for prompt in prompts):
                raise ValueError(f"prompts: expected 1 to {self.max_requests} prompts of at least 2 tokens each")
            checked = [list(prompt) for prompt in prompts]
            self._check_tokens(checked)
            return checked, (checked, graphs)

        with self._lock:
            prompts = self._agreed("prompt_logits", prepare)
            requests = [Request(index, 0, RequestTokens(prompt)) for index, prompt in enumerate(prompts)]
            logits: List[List[torch.Tensor]] = [[] for _ in prompts]
            with self._call(ServeCounts()), torch.no_grad(), self.probed.ropes.serving(
                    lambda: {request.row: len(request.prompt) for request in requests if request.row}):
                self.runners.prepare(graphs, 1)
                executor = EngineSteps(self._arena, self.runners, self._counters, graphs, 1, None)
                try:
                    for request in requests:
                        request.row = self.slots.take_row()
                    while any(request.cached < len(request.prompt) - 1 for request in requests):
                        room, picked, chunks = self.max_step_tokens, [], []
                        for request in requests:
                            chunk = request.prompt[request.cached: min(len(request.prompt) - 1, request.cached + room)]
                            if chunk:
                                picked.append(request)
                                chunks.append(chunk)
                                room -= len(chunk)
                        work = assigned_work(self.slots, ForwardMode.EXTEND, picked, [len(chunk) for chunk in chunks],
                                             chunks)
                        out = executor.run(work)[0]
                        for request, part in zip(picked, out.split(work.counts)):
                            logits[request.index].append(part.clone())
                    work = assigned_work(self.slots, ForwardMode.DECODE, requests, [1] * len(requests),
                                         [(request.prompt[-1],) for request in requests])
                    last = executor.run(work)[0]
                    return [torch.cat((*parts, last[index: index + 1])) for index, parts in enumerate(logits)]
                finally:
                    for request in requests:
                        release(self.slots, request)

    def stats(self) -> Dict[str, Any]:
        """What the last ``generate`` (or ``prompt_logits``) call did, a failed one included: the runners it
        used (``runners``; decode runners named by the width their attention reads, ``decode_widths``),
        their counts during the call summed (graph_runs, piecewise_runs, eager_runs, eager_reasons, ...),
        their captured and failed keys (``runner:key``), and ``serve``: its step counts (decode steps, how
        many replayed, prefill tokens, how many in piecewise graphs), ``seconds``, ``runner_seconds`` (the
        time in the runners' calls; the rest is scheduling, batch building and sampling) and, of that,
        ``decode_runner_seconds`` (decode steps and launches), ``prefix_tokens_reused``; ``requests``: per request of
        ``generate`` its ``queue_s``, ``ttft_s``, ``tpot_s`` (graphrt.hf.requests.RequestTimes), ``tokens`` and
        ``finish_reason``; ``ranks``: the tensor-parallel ranks (1 alone); ``prefix_cache``: whether prefixes are
        shared (or why not) and the cache's sizes."""
        with self._lock:
            if self._counters.stats is None:
                raise RuntimeError("stats(): no generate() call yet")
            return dict(self._counters.stats)

    def recapture(self) -> None:
        """Capture every runner's graphs again under the state of now (after weights were rebound, or a
        key was disabled by replay faults); the KV pools and what they hold stay, unless what the probe read
        changed (a dtype, a window): then the model is probed again first, as every call does."""
        with self._lock:
            _refuse_training(self.model)
            runners = self.runners
            self._agreed("recapture", lambda: (None, ()))
            if self.runners is runners:  # not made anew for a changed model
                runners.recapture()
                self.slots.clear_prefixes()  # rebound weights: the cached prefixes were computed with the old ones

    def reset_prefix_cache(self) -> None:
        """Drop every cached prompt prefix (after changing the model in a way its parameters' identity, memory
        and version counters do not show: writes through ``.data``, switching a PEFT adapter)."""
        with self._lock:
            self.slots.clear_prefixes()

    def online(self, graphs: bool = True, overlap: Optional[bool] = None,
               eos_token_id: Union[None, int, Sequence[int], str] = "model",
               generation_config: Any = "model") -> OnlineEngine:
        """An online session (graphrt.hf.online.OnlineEngine): requests added at any time, also from other threads
        (``add_request(prompt, RequestParams)``), ``step()``, ``abort(id)``, ``stream(id)``; ``eos_token_id`` and
        ``generation_config`` as ``generate`` reads them. While it is open, the engine serves it alone."""
        _refuse_training(self.model)
        return OnlineEngine(self, graphs, overlap, eos_token_id, generation_config)

    def kv_bytes(self) -> Dict[str, float]:
        """The KV pools' size: ``pool_bytes`` (every layer's buffers), ``per_token_per_layer`` (bytes a cached
        token takes per layer) and the model's ``minimum_per_token_per_layer`` (see graphrt.hf.kv_layout)."""
        return {"pool_bytes": float(self.layout.pool_bytes()),
                "per_token_per_layer": self.layout.bytes_per_token_per_layer(),
                "minimum_per_token_per_layer": minimum_bytes_per_token_per_layer(self.model.config, self.layout)}

    # ---- one call ---------------------------------------------------------------------------------

    def _agreed(self, call: str, prepare: Callable[[], Tuple[Any, Any]]) -> Any:
        """The checked inputs ``prepare()`` returns beside what names the call's arguments; in tensor
        parallel, every rank's refusal and arguments are agreed on first (``EngineRanks.agree_call``: a
        call one rank refuses is refused on every rank, before any step). What the probe read is checked first
        (``_follow_model``; in tensor parallel its changes are agreed on with the arguments, then every rank
        probes again together)."""
        if self._counters.session is not None:
            raise RuntimeError(f"{call}(): an online session holds the engine (engine.online()); close it first")
        changes = self.probed.state.changes()
        if self.ranks is None:
            self._follow_model(changes)
            return prepare()[0]
        checked, arguments, error = None, None, None
        try:
            checked, arguments = prepare()
        except (TypeError, ValueError) as caught:
            error = caught
        self.ranks.agree_call(call, error, (arguments, changes))
        self._follow_model(changes)
        return checked

    @contextmanager
    def _call(self, counts: ServeCounts, requests: Sequence[Request] = ()) -> Iterator[None]:
        """Around one call: its statistics (``stats()``) kept whatever way the call ends, with ``requests``' times
        and finish reasons."""
        before = self.runners.snapshot()
        counters = self._counters
        counters.runner_seconds = counters.decode_seconds = 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            counters.stats = {**self.runners.call_stats(before),
                              "ranks": 1 if self.ranks is None else self.ranks.world_size,
                              "prefix_cache": self.prefixes.stats(),
                              "serve": {**asdict(counts), "seconds": seconds, "runner_seconds": counters.runner_seconds,
                                        "decode_runner_seconds": counters.decode_seconds},
                              "requests": [{**request.times.summary(len(request.output)), "tokens": len(request.output),
                                            "finish_reason": request.finish_reason} for request in requests]}

    def _request_tokens(self, prompt: List[int], index: int, sampling: Optional[SamplingMetadata],
                        seed: int, stops: FrozenSet[int]) -> RequestTokens:
        """What request ``index``'s tokens are chosen from: its sampling row, its generator, its stop ids."""
        if sampling is None:
            return RequestTokens(prompt, stops=stops)
        return RequestTokens(prompt, sampling=sampling.slice(index, index + 1), stops=stops,
                             generator=torch.Generator(device=self.device).manual_seed(seed + index))

    # ---- checks -----------------------------------------------------------------------------------

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

    @staticmethod
    def _stops(stop_token_ids: Optional[Sequence[Sequence[int]]], count: int) -> List[frozenset]:
        """Each request's own stop ids (``stop_token_ids``: one list per prompt, or None)."""
        if stop_token_ids is None:
            return [frozenset()] * count
        stops = list(stop_token_ids)
        if len(stops) != count or not all(isinstance(ids, (list, tuple)) and all(type(token) is int for token in ids)
                                          for ids in stops):
            raise ValueError(f"stop_token_ids: expected one list of token ids (ints) per prompt ({count}), "
                             f"got {stop_token_ids!r}")
        return [frozenset(ids) for ids in stops]

    def _check_tokens(self, prompts: List[List[int]]) -> None:
        """ValueError naming the first prompt and position whose token id is outside the vocabulary."""
        for index, prompt in enumerate(prompts):
            for position, token in enumerate(prompt):
                if not 0 <= token < self.vocab_size:
                    raise ValueError(f"prompts[{index}][{position}]: token id {token} is outside the model's "
                                     f"vocabulary (0 to {self.vocab_size - 1})")

    def _checked(self, prompts: Any, max_new_tokens: Any, arrivals: Any, steps_per_launch: Any,
                 sampling: Any) -> List[int]:
        """The arrivals of a valid ``generate`` call (all 0 by default); ValueError/TypeError naming the field."""
        if not isinstance(prompts, list) or not prompts or not all(
                prompt and all(type(token) is int for token in prompt) for prompt in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty lists of token ids (ints)")
        self._check_tokens(prompts)
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if type(steps_per_launch) is not int or steps_per_launch < 1:
            raise ValueError(f"steps_per_launch: expected an int >= 1, got {steps_per_launch!r}")
        longest = max(len(prompt) for prompt in prompts)
        if longest + max_new_tokens > self.max_context:
            raise ValueError(f"max_new_tokens: the longest prompt ({longest}) plus {max_new_tokens} new tokens "
                             f"exceed max_context={self.max_context}")
        if sampling is not None:
            if not isinstance(sampling, SamplingMetadata):
                raise TypeError(f"sampling: expected a SamplingMetadata, got {type(sampling).__name__}")
            if sampling.num_reqs != len(prompts):
                raise ValueError(f"sampling: expected one row per prompt ({len(prompts)}), got {sampling.num_reqs}")
            rows = [RequestTokens([], sampling=sampling.slice(row, row + 1)) for row in range(sampling.num_reqs)]
            if steps_per_launch > 1 and any(row.draws or row.has_penalties for row in rows):
                raise ValueError("steps_per_launch: multi-step launches choose tokens by argmax inside the graph; "
                                 "sampling and its penalties need steps_per_launch=1")
        if arrivals is None:
            return [0] * len(prompts)
        arrivals = list(arrivals)
        if len(arrivals) != len(prompts) or not all(type(step) is int and step >= 0 for step in arrivals):
            raise ValueError(f"arrivals: expected one step index (int >= 0) per prompt ({len(prompts)}), "
                             f"got {arrivals!r}")
        return arrivals


def _refuse_training(model: Any) -> None:
    """ValueError when any module of ``model`` is in train mode: the engine's attention has no dropout,
    so its tokens would be neither train mode's nor eval mode's."""
    training = [name or type(model).__name__ for name, module in model.named_modules() if module.training]
    if training:
        raise ValueError(f"model: {training[0]} is in train mode (dropout on); the engine path serves eval mode "
                         f"only: call model.eval()")


def engine_model(model: Any, max_requests: int = 8, max_context: int = 256, max_step_tokens: int = 64,
                 kv_slots: Optional[int] = None, backend: str = "auto", timeout_s: float = 600.0,
                 prefix_sharing: bool = True, **runner_options: Any) -> HFEngine:
    """The engine of a transformers causal LM: its modules and weights, its attention replaced by graphrt's
    paged attention over KV pools for ``max_requests`` requests of up to ``max_context`` tokens, and
    ``max_step_tokens`` tokens per step (the chunk budget of prefill): ``kv_slots`` slots for its
    full-attention layers (default: every request at full context), a ring of a window plus a step per
    request for its sliding-window layers, none for KV-shared layers. ``prefix_sharing`` (default on) keeps
    computed prompt prefixes in a radix tree and starts a request with the same prefix after them
    (graphrt.hf.prefix_sharing; off by name for models with a sliding window ring). ``runner_options`` (RunnerConfig
    fields: ``capture_sizes``, ``piecewise_sizes``, ``warmup_iters``, ...) replace the engine's choices for
    its runners. With ``process_group`` (tensor parallel; every rank of the group calls it on the same
    unsharded model, then makes the same calls) the model is sharded in place by its tensor-parallel plan
    (graphrt.hf.tensor_parallel), every step runs in lockstep and every rank returns rank 0's tokens; the
    ranks' agreements run on ``cpu_group``, or a gloo group created over the ranks whose collectives give
    up after ``timeout_s`` seconds (docs/DISTRIBUTED.md). ValueError names why a model cannot be served (no
    modeling-backend contract, layers that are not attention, a mask that says more than causal attention
    in a window, train mode, a plan graphrt cannot run, heads the ranks do not divide)."""
    unknown = set(runner_options) - {field.name for field in fields(RunnerConfig)}
    if unknown:
        raise TypeError(f"runner_options: expected RunnerConfig fields, got {sorted(unknown)}")
    return HFEngine(model, max_requests, max_context, max_step_tokens, kv_slots, backend, runner_options, timeout_s,
                    prefix_sharing)


__all__ = ["HFEngine", "attention_implementation", "engine_model", "refusal"]
