"""Continuous batching over graphrt's paged KV pools: requests arrive, prefill in chunks, decode, finish.

``serve()`` is the scheduler of ``HFEngine.generate``. It never needs the model: every step it builds
a ForwardBatch with ``graphrt.reference``'s builders (``make_decode_batch`` / ``make_extend_batch``)
and hands it to the runner. Per step, at most ``max_running`` requests hold a request row; the
running decodes come first (one token each), then the prefills take what is left of the token budget
``max_step_tokens`` in chunks (chunked prefill), so a step is DECODE, EXTEND or MIXED. Requests that
have not arrived yet (``arrivals``: the step index of each) or find no free row, or not enough free KV
slots for all they may still write, wait in order. When only decodes run and ``steps_per_launch`` > 1,
one ``runner.decode`` call runs that many steps. Each request's tokens are chosen from its own logits,
ids and generator (graphrt.hf.request_sampling). A request's KV slots count as its own the moment they
are mapped in its table row, so a step that raises (or an interrupt) releases every slot and row.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Deque, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.hf.request_sampling import RequestTokens, choose_tokens
from graphrt.reference import CachePools, make_decode_batch, make_extend_batch

logger = logging.getLogger(__name__)

# batch -> (logits [num_tokens, vocab], how many of its steps ran the model eagerly: 0 or 1)
StepFn = Callable[[ForwardBatch], Tuple[torch.Tensor, int]]
# (decode batch, steps) -> (greedy tokens [steps, rows], how many of those steps ran the model eagerly)
LaunchFn = Callable[[ForwardBatch, int], Tuple[torch.Tensor, int]]
# the tokens a step chose (flat) -> the tokens to go on with (tensor parallel: rank 0's, on every rank)
ShareFn = Callable[[List[int]], List[int]]


@dataclass
class Request:
    """One prompt being served: its request row, how many KV slots it was assigned and how many of its
    tokens are in the KV cache, what its tokens are chosen from, the ids that stop it."""

    index: int
    arrival: int
    tokens: RequestTokens
    stops: FrozenSet[int] = frozenset()
    row: int = 0
    assigned: int = 0  # KV slots mapped in its table row (released with it, whatever happens to the step)
    cached: int = 0

    def __post_init__(self) -> None:
        self.prompt: List[int] = self.tokens.prompt  # the same lists: a token appended to one is in both
        self.output: List[int] = self.tokens.output

    @property
    def prefilling(self) -> bool:
        """True while part of the prompt is not in the KV cache yet."""
        return self.cached < len(self.prompt)


@dataclass
class ServeConfig:
    """How ``serve()`` schedules: request rows, the token budget of a step, steps per decode launch, the
    context, how many tokens a request may generate."""

    max_running: int
    max_step_tokens: int
    max_new_tokens: int
    max_context: int
    steps_per_launch: int = 1

    def slots_needed(self, request: Request) -> int:
        """The most KV slots ``request`` may take: its prompt, its new tokens but the last (never fed back)
        and the steps a launch may run past its stop, never more than the context (a launch stops there)."""
        wanted = len(request.prompt) + self.max_new_tokens - 1 + self.steps_per_launch - 1
        return min(wanted, self.max_context)


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


def serve(pools: CachePools, step: StepFn, launch: Optional[LaunchFn], requests: Sequence[Request],
          config: ServeConfig, counts: ServeCounts, share: Optional[ShareFn] = None) -> List[List[int]]:
    """Every request's generated tokens (up to ``max_new_tokens``, stopping after one of its stop ids),
    counting what ran in ``counts`` (filled as it goes: a call that raises leaves what it did).
    ``launch`` runs several greedy decode steps (``GraphRunner.decode``), used when ``steps_per_launch``
    > 1. ``share``: the tokens each step chose, made the tokens every rank goes on with (tensor parallel:
    rank 0's). Every request row and KV slot taken is released on return, an exception or interrupt included."""
    device = pools.req_to_token.device
    waiting: Deque[Request] = deque(sorted(requests, key=lambda request: (request.arrival, request.index)))
    running: List[Request] = []
    done: List[Optional[List[int]]] = [None] * len(requests)
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
                _launch(pools, launch, decodes, config, counts, device, share)
            else:
                _step(pools, step, running, decodes, config, counts, device, share)
            for request in [request for request in running if _finished(request, config)]:
                running.remove(request)
                _release(pools, request)
                done[request.index] = request.output
            clock += 1
    finally:
        for request in running:
            _release(pools, request)
    return done


def _release(pools: CachePools, request: Request) -> None:
    """The request's row and every KV slot mapped in it back to the pools."""
    if request.row:
        pools.release(request.row, request.assigned)
        request.row, request.assigned = 0, 0


def _assign(pools: CachePools, requests: Sequence[Request], counts: Sequence[int]) -> torch.Tensor:
    """``counts[i]`` KV slots after what ``requests[i]`` holds, counted as its own at once."""
    out_loc = pools.assign([request.row for request in requests], [request.assigned for request in requests], counts)
    for request, count in zip(requests, counts):
        request.assigned += count
    return out_loc


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
    return pools.kv.available - sum(config.slots_needed(request) - request.assigned for request in running)


def _finished(request: Request, config: ServeConfig) -> bool:
    return len(request.output) >= config.max_new_tokens or (bool(request.output) and request.output[-1] in request.stops)


def _step(pools: CachePools, step: StepFn, running: List[Request], decodes: List[Request], config: ServeConfig,
          counts: ServeCounts, device: torch.device, share: Optional[ShareFn]) -> None:
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
    out_loc = _assign(pools, requests, [len(chunk) for _, chunk in chunks])
    if len(decodes) == len(chunks):
        batch = make_decode_batch([chunk[0] for _, chunk in chunks], rows, [start + 1 for start in starts], out_loc,
                                  device, pools=pools)
        logits, eager = step(batch)
        counts.decode_steps += 1
        counts.decode_steps_graphed += 1 - eager
    else:
        mode = ForwardMode.MIXED if decodes else ForwardMode.EXTEND
        batch = make_extend_batch([chunk for _, chunk in chunks], rows, starts, out_loc, device, mode=mode, pools=pools)
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
    tokens = choose_tokens(rows_logits, [request.tokens for request in sampled])
    if share is not None:
        tokens = share(tokens)
    for request, token in zip(sampled, tokens):
        request.output.append(token)


def _launch(pools: CachePools, launch: LaunchFn, decodes: List[Request], config: ServeConfig, counts: ServeCounts,
            device: torch.device, share: Optional[ShareFn]) -> None:
    """Several greedy decode steps in one ``launch``: every step's slots mapped ahead in the request table
    (step-major), tokens past a request's stop dropped (their slots stay the request's until release)."""
    steps = min(config.steps_per_launch, *(config.max_context - request.cached for request in decodes))
    rows = [request.row for request in decodes]
    starts = [request.cached for request in decodes]
    out_loc = _assign(pools, decodes, [steps] * len(decodes))
    step_major = out_loc.view(len(decodes), steps).t().reshape(-1)
    batch = make_decode_batch([request.output[-1] for request in decodes], rows, [start + 1 for start in starts],
                              step_major, device, pools=pools)
    chosen_tokens, eager = launch(batch, steps)
    chosen = chosen_tokens.t().reshape(-1).tolist()  # row-major: each request's steps in turn
    if share is not None:
        chosen = share(chosen)
    tokens = [chosen[row * steps: (row + 1) * steps] for row in range(len(decodes))]
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
