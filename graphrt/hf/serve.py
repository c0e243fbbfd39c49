"""Continuous batching over graphrt's paged KV pools: requests arrive, prefill in chunks, decode, finish.

``ServeLoop`` is the scheduler of ``HFEngine.generate``, and model-free: its state is the requests
waiting and running, and ``step()`` advances it by one scheduling step. A step admits the requests that
have arrived (``arrivals``: the step index of each) while a request row and enough free KV slots for all
a request may still write are left, in order; picks the step's work (the running decodes first, one
token each, then prefill chunks within the token budget ``max_step_tokens``: chunked prefill, so a step
is DECODE, EXTEND or MIXED; when only decodes run and ``steps_per_launch`` > 1, a launch of that many
decode steps); assigns its KV slots (graphrt.hf.engine_slots: host bookkeeping, a request's slots its
own the moment they are assigned, so a step that raises, or an interrupt, releases every slot and row);
hands the work to the executor (graphrt.hf.engine_step), and takes the tokens of the step they are due.
With ``prefixes`` (graphrt.hf.prefix_sharing) a request's first prefill chunk may start after a cached
prompt prefix, or wait for an earlier request computing more of it.

With ``overlap`` (the engine's default on CUDA; SGLang's overlap scheduler and vLLM's async scheduling
do the same) step N+1 is launched before step N's tokens are read: a decode whose last token is still
on the device reads it there (``Request.carried``), a stop is seen one step late and the token chosen
after it is dropped, and a request's row is released one step later. Without it, each step's tokens
are read right after its launch. The tokens are the same either way: a request's token depends on its
own logits, ids and generator only. Multi-step launches and tensor parallelism (``share``: the tokens
every rank goes on with) read each launch's tokens before the next is scheduled.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from graphrt.batch import ForwardMode
from graphrt.hf.engine_slots import SlotTable
from graphrt.hf.requests import FinishReason, Request

logger = logging.getLogger(__name__)

# the tokens a step chose (flat) -> the tokens to go on with (tensor parallel: rank 0's, on every rank)
ShareFn = Callable[[List[int]], List[int]]


@dataclass
class ServeConfig:
    """How ``ServeLoop`` schedules: request rows, the token budget of a step, steps per decode launch, the
    context, how many tokens a request may generate."""

    max_running: int
    max_step_tokens: int
    max_new_tokens: int
    max_context: int
    steps_per_launch: int = 1

    def limit(self, request: Request) -> int:
        """The most new tokens of ``request``: its own limit, else the call's."""
        return request.max_new_tokens or self.max_new_tokens

    def slots_needed(self, request: Request) -> int:
        """The most KV slots ``request`` may take: its prompt, its new tokens but the last (never fed back)
        and the steps a launch may run past its stop, never more than the context (a launch stops there)."""
        wanted = len(request.prompt) + self.limit(request) - 1 + self.steps_per_launch - 1
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
    prefix_tokens_reused: int = 0  # prompt tokens not computed: their keys and values were a cached prefix's
    prefix_requests: int = 0  # requests that started on a cached prefix
    max_running: int = 0


@dataclass
class StepWork:
    """One step (or launch) as the executor runs it: the requests in batch order, the tokens each runs
    (``counts``; a launch: its steps) after the ``starts`` it had cached, their host-known ids
    (``chunks``), the decodes whose input id is on the device instead (``carried``: (token row, row of the
    previous step's tokens); their chunk holds a placeholder), the positions of the rows that choose a
    token (``sampled``), and the new tokens' KV slots and request-table indices (request-major)."""

    mode: ForwardMode
    requests: List[Request]
    counts: List[int]
    starts: List[int]
    chunks: List[Sequence[int]]
    sampled: List[int]
    slots: List[int]
    table_index: List[int]
    steps: int = 1
    carried: List[Tuple[int, int]] = field(default_factory=list)


class StepExecutor(Protocol):
    """Runs the steps ``ServeLoop`` schedules (graphrt.hf.engine_step.EngineSteps)."""

    def admit(self, request: Request) -> None:
        """``request`` took its request row (before its first step)."""

    def launch(self, work: StepWork) -> Tuple[Any, int]:
        """Start ``work``: a handle ``read`` takes, and how many of its steps ran the model eagerly."""

    def read(self, handle: Any) -> List[int]:
        """The tokens a launched step chose, one per sampled row (a launch: step-major, every row)."""

    def read_logprobs(self, handle: Any) -> Optional[List[Tuple[float, List[Tuple[int, float]]]]]:
        """After ``read``: per sampled row, its token's log-probability and the top ones (None: none computed)."""


class PrefixHooks(Protocol):
    """Prefix sharing's side of the scheduler (graphrt.hf.prefix_sharing.PrefixSharing)."""

    def ready(self, request: Request) -> bool:
        """Whether ``request`` runs a prefill chunk in this step (its first may start on a cached prefix)."""

    def refresh(self) -> None:
        """Cache what the steps launched so far computed."""

    def finish(self, request: Request) -> None:
        """Cache a finished request's tokens."""

    def drop(self, request: Request) -> None:
        """``request`` releases its row."""


class ServeLoop:
    """The scheduler's state (requests waiting, running, and the step whose tokens are not read yet),
    ``step()``, ``add`` and ``abort``; ``done`` holds each finished request's tokens by index, ``produced`` the
    requests that got tokens since it was last cleared and how many they had before (the online engine
    reports them)."""

    def __init__(self, slots: SlotTable, executor: StepExecutor, requests: Sequence[Request], config: ServeConfig,
                 counts: ServeCounts, share: Optional[ShareFn] = None, overlap: bool = False,
                 prefixes: Optional[PrefixHooks] = None) -> None:
        self.slots = slots
        self.prefixes = prefixes
        self.executor = executor
        self.config = config
        self.counts = counts
        self.share = share
        self.overlap = overlap and share is None and config.steps_per_launch == 1
        self.waiting: Deque[Request] = deque(sorted(requests, key=lambda request: (request.arrival, request.index)))
        self.running: List[Request] = []
        self.done: Dict[int, List[int]] = {}
        self.produced: Dict[int, Tuple[Request, int]] = {}  # by index: the request, its tokens before
        self.clock = 0  # steps launched
        self.pending: Optional[Tuple[StepWork, Any]] = None

    @property
    def busy(self) -> bool:
        """Whether any request waits, runs, or has tokens not read yet."""
        return bool(self.waiting or self.running or self.pending)

    def step(self) -> List[Request]:
        """One scheduling step; the requests it finished."""
        self._admit()
        work = self._schedule()
        if work is None:
            if self.pending is not None:
                return self._take(self._pop_pending())
            if self.waiting:
                self._idle()
            return []
        handle, eager = self.executor.launch(work)
        self._count(work, eager)
        self.clock += 1
        previous, self.pending = self.pending, (work, handle)
        finished = self._take(previous) if previous is not None else []
        if not self.overlap:
            finished += self._take(self._pop_pending())
        return finished

    def add(self, request: Request) -> None:
        """Queue ``request``, arrived now."""
        request.arrival = self.clock
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """End ``request`` now (waiting, prefilling or decoding): its row and KV slots back to the pools at once
        (a step in flight that carries it still runs on the device before any later step; its token is dropped)."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self._release(request)
        else:
            return
        self._finish(request, FinishReason.ABORT)

    def close(self) -> None:
        """Every request row and KV slot still held back to the pools (on return, an exception or an interrupt)."""
        for request in self.running:
            self._release(request)
        self.running = []
        self.pending = None

    # ---- scheduling -------------------------------------------------------------------------------

    def _admit(self) -> None:
        config, waiting = self.config, self.waiting
        while (waiting and waiting[0].arrival <= self.clock and len(self.running) < config.max_running
               and self._slots_left() >= config.slots_needed(waiting[0])):
            request = waiting.popleft()
            request.row = self.slots.take_row()
            request.times.admitted = time.perf_counter()
            self.running.append(request)
            self.executor.admit(request)
        self.counts.max_running = max(self.counts.max_running, len(self.running))

    def _idle(self) -> None:
        """No work and nothing in flight: wait for the next arrival (a request that has arrived and does not
        fit in an empty engine never will)."""
        head = self.waiting[0]
        if head.arrival <= self.clock:
            raise ValueError(f"kv_slots: request {head.index} needs {self.config.slots_needed(head)} KV slots, "
                             f"the pool has {self.slots.available} free")
        self.clock = head.arrival

    def _slots_left(self) -> int:
        """Free KV slots once every running request has taken all it may still need (admission waits for
        room rather than running out of slots mid-request)."""
        return self.slots.available - sum(self.config.slots_needed(request) - request.assigned
                                          for request in self.running)

    def _schedule(self) -> Optional[StepWork]:
        """The next step's work, its slots assigned (None: nothing to run before a token is read)."""
        limit = self.config.limit
        decodes: List[Request] = []
        prefills: List[Request] = []
        if self.prefixes is not None:
            self.prefixes.refresh()
        for request in self.running:
            if request.cached < len(request.prompt):
                prefills.append(request)
            elif request.chosen < limit(request) and not request.stopped:
                decodes.append(request)
        if not decodes and not prefills:
            return None
        if self.config.steps_per_launch > 1 and not prefills and self.pending is None:
            return self._launch_work(decodes)
        requests: List[Request] = []
        counts: List[int] = []
        chunks: List[Sequence[int]] = []
        carried: List[Tuple[int, int]] = []
        for request in decodes:
            if request.in_flight:
                carried.append((len(requests), request.carried))
                chunks.append((0,))
            else:
                chunks.append((request.output[-1],))
            requests.append(request)
            counts.append(1)
        room = self.config.max_step_tokens - len(requests)
        for request in prefills:
            if room <= 0:
                break
            if self.prefixes is not None and not self.prefixes.ready(request):
                continue
            chunk = request.prompt[request.cached: request.cached + room]
            requests.append(request)
            counts.append(len(chunk))
            chunks.append(chunk)
            room -= len(chunk)
        mode = ForwardMode.DECODE if len(requests) == len(decodes) else (
            ForwardMode.MIXED if decodes else ForwardMode.EXTEND)
        work = self._assigned(mode, requests, counts, chunks, 1)
        work.carried = carried
        sampled = work.sampled
        for position, request in enumerate(requests):
            if request.cached >= len(request.prompt):  # its chunk reached the end of the prompt (or it decodes)
                request.carried = len(sampled)
                request.chosen += 1
                sampled.append(position)
        return work

    def _launch_work(self, decodes: List[Request]) -> StepWork:
        """Several greedy decode steps in one launch; every step's slots assigned ahead."""
        steps = min(self.config.steps_per_launch, *(self.config.max_context - request.cached for request in decodes))
        work = self._assigned(ForwardMode.DECODE, decodes, [steps] * len(decodes),
                              [(request.output[-1],) for request in decodes], steps)
        work.sampled.extend(range(len(decodes)))
        return work

    def _assigned(self, mode: ForwardMode, requests: List[Request], counts: List[int], chunks: List[Sequence[int]],
                  steps: int) -> StepWork:
        return assigned_work(self.slots, mode, requests, counts, chunks, steps)

    def _count(self, work: StepWork, eager: int) -> None:
        counts = self.counts
        if work.mode is ForwardMode.DECODE:
            counts.decode_steps += work.steps
            counts.decode_steps_graphed += work.steps - eager
            counts.multi_step_launches += work.steps > 1
            return
        prompt_tokens = sum(count for request, count, start in zip(work.requests, work.counts, work.starts)
                            if start < len(request.prompt))
        counts.prefill_steps += 1
        counts.prefill_tokens += prompt_tokens
        counts.prefill_tokens_graphed += 0 if eager else prompt_tokens

    # ---- tokens -----------------------------------------------------------------------------------

    def _pop_pending(self) -> Tuple[StepWork, Any]:
        pending, self.pending = self.pending, None
        return pending

    def _take(self, launched: Tuple[StepWork, Any]) -> List[Request]:
        """Read a launched step's tokens into its requests' outputs (dropping what follows a stop or the
        token limit), then finish the requests that are done."""
        work, handle = launched
        tokens = self.executor.read(handle)
        if self.share is not None:
            tokens = self.share(tokens)
        limit = self.config.limit
        if work.steps > 1:
            rows = len(work.requests)
            for row, request in enumerate(work.requests):
                for token in tokens[row::rows]:
                    if request.stopped or len(request.output) >= limit(request) or request.finish_reason:
                        break
                    self._append(request, token)
                request.chosen = len(request.output)
        else:
            logprobs = self.executor.read_logprobs(handle)
            for index, (position, token) in enumerate(zip(work.sampled, tokens)):
                request = work.requests[position]
                if not request.stopped and request.finish_reason is None:  # not ended, nor aborted since
                    self._append(request, token)
                    if request.logprobs is not None:
                        request.logprobs.append(logprobs[index])
        finished = [request for request in self.running
                    if request.stopped or (len(request.output) >= limit(request) and not request.in_flight)]
        for request in finished:
            self.running.remove(request)
            if self.prefixes is not None:
                self.prefixes.finish(request)
            self._release(request)
            self._finish(request, (FinishReason.EOS if request.output[-1] in request.eos else FinishReason.STOP)
                         if request.stopped else FinishReason.LENGTH)
        return finished

    def _append(self, request: Request, token: int) -> None:
        if not request.output:
            request.times.first_token = time.perf_counter()
        self.produced.setdefault(request.index, (request, len(request.output)))
        request.output.append(token)
        if token in request.stops:
            request.stopped = True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        request.times.finished = time.perf_counter()
        self.done[request.index] = request.output

    def _release(self, request: Request) -> None:
        if self.prefixes is not None:
            self.prefixes.drop(request)
        release(self.slots, request)


def assigned_work(slots: SlotTable, mode: ForwardMode, requests: List[Request], counts: List[int],
                  chunks: List[Sequence[int]], steps: int = 1) -> StepWork:
    """The work of ``requests`` running ``counts`` tokens each, their KV slots assigned (theirs at once) and
    their cache counts advanced."""
    starts = [request.cached for request in requests]
    new_slots, table_index = slots.assign([request.row for request in requests], starts, counts)
    for request, count in zip(requests, counts):
        request.assigned += count
        request.cached += count
    return StepWork(mode, requests, counts, starts, chunks, [], new_slots, table_index, steps)


def release(slots: SlotTable, request: Request) -> None:
    """The request's row and every KV slot held in it back to the pools."""
    if request.row:
        slots.release(request.row, request.assigned)
        request.row, request.assigned = 0, 0


def serve(slots: SlotTable, executor: StepExecutor, requests: Sequence[Request], config: ServeConfig,
          counts: ServeCounts, share: Optional[ShareFn] = None, overlap: bool = False,
          prefixes: Optional[PrefixHooks] = None) -> List[List[int]]:
    """Every request's generated tokens (up to ``max_new_tokens``, stopping after one of its stop ids),
    counting what ran in ``counts`` (filled as it goes: a call that raises leaves what it did). Every
    request row and KV slot taken is released on return, an exception or interrupt included."""
    loop = ServeLoop(slots, executor, requests, config, counts, share, overlap, prefixes)
    try:
        while loop.busy:
            loop.step()
            loop.produced.clear()
    finally:
        loop.close()
    return [loop.done[request.index] for request in requests]


__all__ = ["PrefixHooks", "Request", "ServeConfig", "ServeCounts", "ServeLoop", "StepExecutor", "StepWork", "assigned_work", "release",
           "serve"]
