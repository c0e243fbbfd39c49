"""The engine served online: requests added, stepped, streamed and aborted while it runs.

``OnlineEngine`` (``HFEngine.online()``) keeps one ``ServeLoop`` (graphrt.hf.serve, the loop ``generate``
runs) and its executor for its lifetime, as vLLM's ``EngineCore`` keeps its scheduler: ``add_request``
checks a request and queues it in an inbox (any thread, at any time, even while another thread is inside
``step()``; a request that is not valid is rejected alone, ended at once with its reason); ``step()``
takes the inbox into the loop and advances every running request by one scheduled step (the loop's
host-floor step: one pinned copy in, one read out, the next step launched before the last one's tokens
are read where the engine overlaps), and returns what each request produced; ``abort(id)`` ends a
request now, its request row and KV slots back to the pools at once; ``stream(id)`` yields a request's
new tokens as they are chosen, stepping the loop itself. While a session is open the engine serves it
alone (``generate`` and the other calls are refused until ``close()``); the model is followed (what the
probe read checked, graphrt.hf.model_state) when the session opens, not at each step. Not covered: tensor
parallelism, multi-step launches, a generation config's ``forced_eos_token_id`` (refused by name). A session
captures every runner when it opens and shares prompt prefixes as ``generate`` does (graphrt.hf.prefix_sharing).
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.hf.engine_step import EngineSteps
from graphrt.hf.logits_rules import GenerationRules, config_sampling
from graphrt.hf.request_sampling import RequestTokens, TokenChooser
from graphrt.hf.requests import FinishReason, Request, RequestOutput, RequestParams
from graphrt.hf.serve import ServeConfig, ServeCounts, ServeLoop
from graphrt.host.sampling import SamplingMetadata

MAX_STOP_IDS = 16  # stop ids a request holds back under min_new_tokens (EOS ids included)


class OnlineEngine:
    """One online session of an ``HFEngine`` (``engine``; make it with ``engine.online()``; a context manager)."""

    def __init__(self, engine: Any, graphs: bool = True, overlap: Optional[bool] = None,
                 eos_token_id: Any = "model", generation_config: Any = "model") -> None:
        if engine.ranks is not None:
            raise ValueError("process_group: the online engine serves one rank (tensor parallelism: generate())")
        self.engine = engine
        config_used = getattr(engine.model, "generation_config", None) if generation_config == "model" \
            else generation_config
        self.eos = frozenset(engine._eos_ids(eos_token_id))
        self.rules = GenerationRules.from_config(config_used, sorted(self.eos), engine.max_context, engine.vocab_size)
        if self.rules.forced_eos is not None:
            raise ValueError("generation_config.forced_eos_token_id: forced at the call's last step, which an online "
                             "session's per-request max_new_tokens do not share; use generate() (or "
                             "generation_config=None)")
        self.config_sampling = config_sampling(config_used)
        self.config = ServeConfig(max_running=engine.max_requests, max_step_tokens=engine.max_step_tokens,
                                  max_new_tokens=1, max_context=engine.max_context)
        self.counts = ServeCounts()
        self._inbox: List[Request] = []  # added, not yet in the loop (any thread appends, under _inbox_lock)
        self._inbox_lock = threading.Lock()
        self._requests: Dict[int, Request] = {}
        self._streamed: Dict[int, int] = {}  # tokens ``stream`` yielded per request
        self._errors: Dict[int, str] = {}
        self._next_id = 0
        self._exits = ExitStack()
        with engine._lock:
            engine._agreed("online", lambda: (None, ()))  # the model followed first, as every call does
            engine._counters.session = self  # the engine refuses its other calls until close()
            engine._counters.runner_seconds = engine._counters.decode_seconds = 0.0
            self._step_seconds = 0.0
            try:
                self.chooser = TokenChooser(self.rules, [], engine.logits_width, engine.device, engine.max_requests + 1,
                                            1 + MAX_STOP_IDS)
                engine.runners.prepare(graphs, 1)  # every runner captured before the session's first step
                self.executor = EngineSteps(engine._arena, engine.runners, engine._counters, graphs, 1, self.chooser)
                prefixes = engine.prefixes.for_call(engine.model, engine.slots, self.counts,
                                                    self.executor.write_prompt_ids)
                self.loop = ServeLoop(engine.slots, self.executor, [], self.config, self.counts, None,
                                      engine.asynchronous if overlap is None else bool(overlap), prefixes)
                self._exits.enter_context(engine.probed.ropes.serving(
                    lambda: {request.row: len(request.prompt) for request in self.loop.running if request.row}))
            except BaseException:
                engine._counters.session = None
                raise

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], params: Optional[RequestParams] = None) -> int:
        """Queue a request (any thread, at any time): its id. A request that is not valid (a prompt too long for
        the engine, ids outside the vocabulary, parameters out of range) is rejected alone: it ends at once,
        ``finish_reason`` ``rejected`` and ``error`` saying why."""
        params = RequestParams() if params is None else params
        with self._inbox_lock:
            request_id = self._next_id
            self._next_id += 1
        try:
            request = self._request(request_id, prompt, params)
        except (TypeError, ValueError) as error:
            request = Request(request_id, 0, RequestTokens(list(prompt) if isinstance(prompt, (list, tuple)) else []))
            request.finish_reason = FinishReason.REJECTED
            request.times.finished = request.times.added
            self._errors[request_id] = str(error)
            with self._inbox_lock:
                self._requests[request_id] = request
            return request_id
        with self._inbox_lock:
            self._requests[request_id] = request
            self._inbox.append(request)
        return request_id

    def abort(self, request_id: int) -> bool:
        """End request ``request_id`` now (``abort``), waiting, prefilling or decoding: its request row and KV
        slots back to the pools at once (after the step another thread is running, if any). False when it had
        ended already."""
        request = self._get(request_id)
        with self.engine._lock:
            with self._inbox_lock:
                if request in self._inbox:
                    self._inbox.remove(request)
                    self.loop.waiting.append(request)
            if request.finish_reason is not None:
                return False
            self.loop.abort(request)
            return True

    def step(self) -> List[RequestOutput]:
        """One scheduled step of every running request (requests added since join first): an output for each
        request that got tokens or ended in it (``new``: the tokens it got in this step, ``logprobs``: theirs;
        ``tokens``: the request's own list, which later steps grow)."""
        with self.engine._lock, torch.no_grad():
            start = time.perf_counter()
            self._take_inbox()
            loop = self.loop
            finished = loop.step()
            self._step_seconds += time.perf_counter() - start
            touched = dict(loop.produced)
            loop.produced.clear()
            for request in finished:
                touched.setdefault(request.index, (request, len(request.output)))
            return [self._output(request, before) for request, before in touched.values()]

    def stream(self, request_id: int) -> Iterator[List[int]]:
        """Request ``request_id``'s new tokens as they are chosen (a list per step that chose some), stepping the
        loop while it runs (every running request advances: other threads may stream or step too)."""
        request = self._get(request_id)
        while True:
            with self.engine._lock:
                if len(request.output) == self._streamed.get(request_id, 0) and request.finish_reason is None:
                    self.step()
                yielded = self._streamed.get(request_id, 0)
                new, self._streamed[request_id] = request.output[yielded:], len(request.output)
                ended = request.finish_reason is not None
            if new:
                yield new
            if ended:
                return

    def run(self, prompts: Sequence[Sequence[int]], params: Optional[Sequence[RequestParams]] = None
            ) -> List[RequestOutput]:
        """Add every prompt (``params``: one per prompt, or None) and step until they all ended: their outputs."""
        if params is not None and len(params) != len(prompts):
            raise ValueError(f"params: expected one RequestParams per prompt ({len(prompts)}), got {len(params)}")
        ids = [self.add_request(prompt, None if params is None else params[index])
               for index, prompt in enumerate(prompts)]
        while not all(self._get(request_id).finish_reason for request_id in ids):
            self.step()
        return [self.output(request_id) for request_id in ids]

    def output(self, request_id: int) -> RequestOutput:
        """Request ``request_id``'s tokens so far (a copy), their log-probabilities, whether it ended and why
        (``new``: empty)."""
        request = self._get(request_id)
        return self._output(request, None)

    @property
    def busy(self) -> bool:
        """Whether any request waits, runs, or has tokens not read yet."""
        return bool(self._inbox) or self.loop.busy

    def stats(self) -> Dict[str, Any]:
        """``serve``: the session's step counts (ServeCounts), ``seconds`` in ``step()``, of those
        ``runner_seconds`` in the runners' calls (``decode_runner_seconds``: decode steps); ``requests``: per request id its ``queue_s`` (added
        to admitted), ``ttft_s`` (added to its first token), ``tpot_s`` (per output token after the first),
        ``tokens`` and ``finish_reason`` (None while running)."""
        with self._inbox_lock:
            requests = dict(self._requests)
        counters = self.engine._counters
        return {"serve": {**vars(self.counts), "seconds": self._step_seconds, "runner_seconds": counters.runner_seconds,
                          "decode_runner_seconds": counters.decode_seconds},
                "requests": {request_id: {**request.times.summary(len(request.output)), "tokens": len(request.output),
                                          "finish_reason": request.finish_reason}
                             for request_id, request in requests.items()}}

    def close(self) -> None:
        """End the session: every request still running aborted, its rows and slots back; the engine free again."""
        with self.engine._lock:
            if self.engine._counters.session is not self:
                return
            try:
                with self._inbox_lock:
                    queued, self._inbox = self._inbox, []
                for request in [*queued, *self.loop.waiting, *self.loop.running]:
                    if request.finish_reason is None:
                        request.finish_reason = FinishReason.ABORT
                self.loop.close()
                self._exits.close()
            finally:
                self.engine._counters.session = None

    def __enter__(self) -> "OnlineEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- inside ---------------------------------------------------------------------------------------

    def _request(self, request_id: int, prompt: Sequence[int], params: RequestParams) -> Request:
        """The request of a valid ``prompt`` and ``params``; ValueError/TypeError naming what is not valid."""
        engine = self.engine
        if not isinstance(params, RequestParams):
            raise TypeError(f"params: expected a RequestParams, got {type(params).__name__}")
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(type(token) is int for token in prompt):
            raise ValueError("prompt: expected a non-empty list of token ids (ints)")
        prompt = list(prompt)
        engine._check_tokens([prompt])
        params.check(engine.vocab_size)
        if len(prompt) + params.max_new_tokens > engine.max_context:
            raise ValueError(f"max_new_tokens: the prompt ({len(prompt)} tokens) plus {params.max_new_tokens} new "
                             f"tokens exceed max_context={engine.max_context}")
        engine.probed.ropes.check_requests([prompt], params.max_new_tokens)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_IDS} stop ids per request (EOS ids included), "
                             f"got {len(stops)}")
        sampling = params.sampling
        if sampling is None and self.config_sampling is not None:
            sampling = SamplingMetadata.from_params(**{name: [value] for name, value in self.config_sampling.items()})
        generator = None
        if sampling is not None:
            seed = request_id if params.seed is None else params.seed
            generator = torch.Generator(device=engine.device).manual_seed(seed)
        tokens = RequestTokens(prompt, generator=generator, sampling=sampling, stops=stops,
                               min_new_tokens=params.min_new_tokens,
                               top_logprobs=params.top_logprobs if params.logprobs or params.top_logprobs else -1)
        request = Request(request_id, 0, tokens, max_new_tokens=params.max_new_tokens,
                          eos=frozenset() if params.ignore_eos else self.eos)
        if self.config.slots_needed(request) > engine.slots.num_slots - 1:
            raise ValueError(f"kv_slots: the request needs {self.config.slots_needed(request)} KV slots, the pool "
                             f"has {engine.slots.num_slots - 1}")
        if tokens.top_logprobs >= 0:
            request.logprobs = []
        return request

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            added, self._inbox = self._inbox, []
        for request in added:
            self.loop.add(request)

    def _get(self, request_id: int) -> Request:
        with self._inbox_lock:
            request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"request_id: no request {request_id!r} was added to this session")
        return request

    def _output(self, request: Request, before: Optional[int]) -> RequestOutput:
        """``request``'s output: after a step (``before``: its tokens before it) its live token list, the new tokens
        and their log-probabilities (no copy of what came earlier: a step costs the same late in a long request);
        else (None) copies of everything."""
        tokens, start = (list(request.output), 0) if before is None else (request.output, before)
        logprobs: Tuple[Optional[List[float]], Optional[List[List[Tuple[int, float]]]]] = (None, None)
        if request.logprobs is not None:
            logprobs = ([chosen for chosen, _ in request.logprobs[start:]], [top for _, top in request.logprobs[start:]])
        return RequestOutput(request.index, tokens, request.output[start:] if before is not None else [],
                             request.finish_reason is not None, request.finish_reason, self._errors.get(request.index),
                             *logprobs, times=request.times.summary(len(request.output)))


__all__ = ["MAX_STOP_IDS", "OnlineEngine"]
