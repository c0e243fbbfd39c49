"""Continuous batching over graphrt's paged KV pools: requests arrive, prefill in chunks, decode, finish.

``serve()`` is the scheduler of ``HFEngine.generate``. It never needs the model: every step it builds
a ForwardBatch with ``graphrt.reference``'s builders (``make_decode_batch`` / ``make_extend_batch``)
and hands it to the runner. Per step, at most ``max_running`` requests hold a request row; the
running decodes come first (one token each), then the prefills take what is left of the token budget
``max_step_tokens`` in chunks (chunked prefill), so a step is DECODE, EXTEND or MIXED. Requests that
have not arrived yet (``arrivals``: the step index of each) or find no free row, or not enough free KV
slots for all they may still write, wait in order. When
only decodes run and ``steps_per_launch`` > 1, one ``runner.decode`` call runs that many steps.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Deque, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.host.sampling import SamplingMetadata, sample
from graphrt.reference import CachePools, make_decode_batch, make_extend_batch

logger = logging.getLogger(__name__)

# batch -> (logits [num_tokens, vocab], how many of its steps ran the model eagerly: 0 or 1)
StepFn = Callable[[ForwardBatch], Tuple[torch.Tensor, int]]
# (decode batch, steps) -> (greedy tokens [steps, rows], how many of those steps ran the model eagerly)
LaunchFn = Callable[[ForwardBatch, int], Tuple[torch.Tensor, int]]


@dataclass
class Request:
    """One prompt being served: its request row, how many of its tokens are in the KV cache, its output."""

    index: int
    prompt: List[int]
    arrival: int
    generator: Optional[torch.Generator] = None
    row: int = 0
    cached: int = 0
    output: List[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        """True while part of the prompt is not in the KV cache yet."""
        return self.cached < len(self.prompt)


@dataclass
class ServeConfig:
    """How ``serve()`` schedules: request rows, the token budget of a step, steps per decode launch, stops."""

    max_running: int
    max_step_tokens: int
    max_new_tokens: int
    steps_per_launch: int = 1
    eos_token_ids: Tuple[int, ...] = ()

    def slots_needed(self, request: Request) -> int:
        """The most KV slots ``request`` may take: its prompt, its new tokens but the last (never fed back)
        and the steps a launch may run past its stop."""
        return len(request.prompt) + self.max_new_tokens - 1 + self.steps_per_launch - 1


@dataclass
class ServeCounts:
    """What one ``serve()`` did, per kind of step (launches of several decode steps count once)."""

    decode_steps: int = 0
    decode_steps_graphed: int = 0  # decode steps that did not run the model's Python (replayed)
    multi_step_launches: int = 0
    prefill_steps: int = 0  # EXTEND or MIXED
    prefill_tokens: int = 0  # prompt tokens run in EXTEND/MIXED steps
    prefill_tokens_graphed: int = 0  # of those, in steps that replayed (piecewise graphs)
    max_running: int = 0


class _Sampler:
    """Next tokens of the rows that end a request's step: argmax, or seeded per-request sampling."""

    def __init__(self, sampling: Optional[SamplingMetadata]) -> None:
        self.sampling = sampling
        self.greedy = sampling is None or bool(sampling.is_greedy().all())

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> List[int]:
        """One token per row of ``logits`` [rows, vocab]; row ``i`` ends a step of ``requests[i]``."""
        if self.greedy:
            return logits.argmax(-1).tolist()
        vocab = logits.shape[-1]
        chosen = []
        for row, request in enumerate(requests):  # each request draws from its own generator
            counts = torch.bincount(torch.tensor(request.output, dtype=torch.int64), minlength=vocab)
            meta = self.sampling.slice(request.index, request.index + 1)
            token = sample(logits[row: row + 1], meta, request.generator, counts[None, :vocab])
            chosen.append(int(token[0]))
        return chosen


def serve(pools: CachePools, attn_backend: object, step: StepFn, launch: Optional[LaunchFn],
          prompts: Sequence[Sequence[int]], arrivals: Sequence[int], config: ServeConfig,
          sampling: Optional[SamplingMetadata] = None, seed: int = 0) -> Tuple[List[List[int]], ServeCounts]:
    """Every prompt's generated tokens (up to ``max_new_tokens``, stopping after an EOS id) and the step
    counts. ``launch`` runs several greedy decode steps (``GraphRunner.decode``), used when
    ``steps_per_launch`` > 1. Request ``i`` samples from a generator seeded ``seed + i``. Pools are
    released on return."""
    device = pools.req_to_token.device
    choose = _Sampler(sampling)
    generators = [None] * len(prompts)
    if sampling is not None:
        generators = [torch.Generator(device=device).manual_seed(seed + index) for index in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda index: (arrivals[index], index))
    waiting: Deque[Request] = deque(Request(index, list(prompts[index]), arrivals[index], generators[index])
                                    for index in order)
    running: List[Request] = []
    done: List[Optional[List[int]]] = [None] * len(prompts)
    counts = ServeCounts()
    context = dict(pools=pools, attn_backend=attn_backend)
    clock = 0
    try:
        while waiting or running:
            while (waiting and waiting[0].arrival <= clock and len(running) < config.max_running
                   and _slots_left(pools, running, config) >= config.slots_needed(waiting[0])):
                request = waiting.popleft()
                request.row = pools.req_to_token.alloc()
                running.append(request)
            if not running:  # idle until the next arrival
                if waiting[0].arrival <= clock:
                    raise ValueError(f"kv_slots: request {waiting[0].index} needs {config.slots_needed(waiting[0])} "
                                     f"KV slots, the pool has {pools.kv.available} free")
                clock = waiting[0].arrival
                continue
            counts.max_running = max(counts.max_running, len(running))
            decodes = [request for request in running if not request.prefilling]
            if len(decodes) == len(running) and config.steps_per_launch > 1 and launch is not None:
                _launch(pools, launch, decodes, config, counts, context, device)
            else:
                _step(pools, step, running, decodes, config, counts, context, device, choose)
            for request in [request for request in running if _finished(request, config)]:
                running.remove(request)
                pools.release(request.row, request.cached)
                request.row = 0
                done[request.index] = request.output
            clock += 1
    finally:
        for request in running:
            if request.row:
                pools.release(request.row, request.cached)
    return done, counts


@contextmanager
def held_rows(pools: CachePools, count: int) -> Iterator[Tuple[List[int], List[int]]]:
    """``count`` request rows of ``pools`` and, per row, how many KV slots it was assigned (the caller
    keeps that list current); every row and its slots are released on exit, an exception included."""
    rows: List[int] = []
    assigned: List[int] = []
    try:
        while len(rows) < count:
            rows.append(pools.req_to_token.alloc())
            assigned.append(0)
        yield rows, assigned
    finally:
        for row, slots in zip(rows, assigned):
            pools.release(row, slots)


def _slots_left(pools: CachePools, running: Sequence[Request], config: ServeConfig) -> int:
    """Free KV slots once every running request has taken all it may still need (admission waits for
    room rather than running out of slots mid-request)."""
    return pools.kv.available - sum(config.slots_needed(request) - request.cached for request in running)


def _finished(request: Request, config: ServeConfig) -> bool:
    return len(request.output) >= config.max_new_tokens or (
        bool(request.output) and request.output[-1] in config.eos_token_ids)


def _step(pools: CachePools, step: StepFn, running: List[Request], decodes: List[Request], config: ServeConfig,
          counts: ServeCounts, context: dict, device: torch.device, choose: _Sampler) -> None:
    """One step through ``step``: the running decodes first, then prefill chunks within the token budget."""
    chunks = [(request, [request.output[-1]]) for request in decodes]
    room = config.max_step_tokens - len(chunks)
    for request in running:
        if request.prefilling and room > 0:
            chunk = request.prompt[request.cached: request.cached + room]
            chunks.append((request, chunk))
            room -= len(chunk)
    requests = [request for request, _ in chunks]
    rows = [request.row for request in requests]
    starts = [request.cached for request in requests]
    out_loc = pools.assign(rows, starts, [len(chunk) for _, chunk in chunks])
    if len(decodes) == len(chunks):
        batch = make_decode_batch([chunk[0] for _, chunk in chunks], rows, [start + 1 for start in starts], out_loc,
                                  device, **context)
        logits, eager = step(batch)
        counts.decode_steps += 1
        counts.decode_steps_graphed += 1 - eager
    else:
        mode = ForwardMode.MIXED if decodes else ForwardMode.EXTEND
        batch = make_extend_batch([chunk for _, chunk in chunks], rows, starts, out_loc, device, mode=mode, **context)
        logits, eager = step(batch)
        prompt_tokens = sum(len(chunk) for request, chunk in chunks if request.prefilling)
        counts.prefill_steps += 1
        counts.prefill_tokens += prompt_tokens
        counts.prefill_tokens_graphed += 0 if eager else prompt_tokens
    last_rows, sampled = [], []
    end = 0
    for request, chunk in chunks:
        end += len(chunk)
        request.cached += len(chunk)
        if not request.prefilling:  # the chunk reached the end of the prompt: its last row picks a token
            last_rows.append(end - 1)
            sampled.append(request)
    if not sampled:
        return
    rows_logits = logits[torch.tensor(last_rows, device=logits.device)]
    tokens = choose(rows_logits, sampled)
    for request, token in zip(sampled, tokens):
        request.output.append(token)


def _launch(pools: CachePools, launch: LaunchFn, decodes: List[Request], config: ServeConfig, counts: ServeCounts,
            context: dict, device: torch.device) -> None:
    """Several greedy decode steps in one ``launch``: every step's slots mapped ahead in the request table
    (step-major), tokens past a request's stop dropped (their slots stay the request's until release)."""
    context_len = pools.req_to_token.max_context_len
    steps = min(config.steps_per_launch, *(context_len - request.cached for request in decodes))
    rows = [request.row for request in decodes]
    starts = [request.cached for request in decodes]
    out_loc = pools.assign(rows, starts, [steps] * len(decodes))
    step_major = out_loc.view(len(decodes), steps).t().reshape(-1)
    batch = make_decode_batch([request.output[-1] for request in decodes], rows, [start + 1 for start in starts],
                              step_major, device, **context)
    chosen_tokens, eager = launch(batch, steps)
    tokens = chosen_tokens.t().tolist()  # [rows, steps]
    counts.multi_step_launches += 1
    counts.decode_steps += steps
    counts.decode_steps_graphed += steps - eager
    for request, chosen in zip(decodes, tokens):
        request.cached += steps
        for token in chosen:
            if _finished(request, config):
                break
            request.output.append(token)


__all__ = ["Request", "ServeConfig", "ServeCounts", "held_rows", "serve"]
