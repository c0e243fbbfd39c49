"""Batch builders and a greedy generation loop for the reference decoder.

Per-request bookkeeping (lengths, request rows) stays on the host as Python ints, so
``seq_lens_sum`` and ``seq_lens_cpu`` are filled without reading device memory, and
the decode loop feeds each step's argmax back as the next ``input_ids`` on the device:
the only device-to-host read is the final transfer of the generated tokens.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.multistep import greedy, run_steps
from graphrt.reference.kv_cache import DUMMY_REQUEST, SCRATCH_SLOT, CachePools
from graphrt.reference.model import ReferenceDecoder, run_eager

logger = logging.getLogger(__name__)

StepFn = Callable[[ForwardBatch], torch.Tensor]
Launch = Callable[[ForwardBatch, int], torch.Tensor]  # (batch, steps) -> [steps, rows] tokens
Device = Union[str, torch.device]


def _index_tensor(values: Sequence[int], device: Device) -> torch.Tensor:
    """A host list of ints as an int64 tensor on ``device`` (one host-to-device copy)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _context(pools: Optional[CachePools], attn_backend: Any) -> dict:
    """The runner-set ForwardBatch fields that point at the cache and the backend."""
    return dict(
        req_to_token_pool=pools.req_to_token if pools is not None else None,
        token_to_kv_pool=pools.kv if pools is not None else None,
        attn_backend=attn_backend,
    )


def graph_runner_kwargs(attn_backend: Any, pools: CachePools) -> dict:
    """The ``batch_context`` and ``pad_values`` a GraphRunner needs to capture the reference model."""
    return dict(
        batch_context=_context(pools, attn_backend),
        pad_values={"out_cache_loc": SCRATCH_SLOT, "req_pool_indices": DUMMY_REQUEST},
    )


def make_decode_batch(
    input_ids: Union[torch.Tensor, Sequence[int]],
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: Device,
    pools: Optional[CachePools] = None,
    attn_backend: Any = None,
) -> ForwardBatch:
    """A DECODE batch: one new token per request; ``seq_lens`` count that token."""
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    if not isinstance(input_ids, torch.Tensor):
        input_ids = _index_tensor(input_ids, device)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=input_ids,
        req_pool_indices=_index_tensor(req_pool_indices, device),
        seq_lens=seq_lens_cpu.to(device),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        positions=(seq_lens_cpu - 1).to(device),
        **_context(pools, attn_backend),
    )


def make_extend_batch(
    token_ids: Sequence[Sequence[int]],
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    out_cache_loc: torch.Tensor,
    device: Device,
    mode: ForwardMode = ForwardMode.EXTEND,
    pools: Optional[CachePools] = None,
    attn_backend: Any = None,
) -> ForwardBatch:
    """An EXTEND (or MIXED) batch: request i adds ``token_ids[i]`` after ``prefix_lens[i]`` cached tokens.

    A decode request inside a MIXED batch is a one-token chunk whose prefix is its cache.
    """
    extend_lens = [len(ids) for ids in token_ids]
    seq_lens = [prefix + extend for prefix, extend in zip(prefix_lens, extend_lens)]
    start_loc = [0, *itertools.accumulate(extend_lens)][:-1]
    positions = [pos for prefix, extend in zip(prefix_lens, extend_lens) for pos in range(prefix, prefix + extend)]
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(token_ids),
        input_ids=_index_tensor([tok for ids in token_ids for tok in ids], device),
        req_pool_indices=_index_tensor(req_pool_indices, device),
        seq_lens=seq_lens_cpu.to(device),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        positions=_index_tensor(positions, device),
        extend_num_tokens=sum(extend_lens),
        extend_seq_lens=_index_tensor(extend_lens, device),
        extend_prefix_lens=_index_tensor(prefix_lens, device),
        extend_start_loc=_index_tensor(start_loc, device),
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=extend_lens,
        **_context(pools, attn_backend),
    )


def generate_greedy(
    model: ReferenceDecoder,
    backend: Any,
    pools: CachePools,
    prompts: List[List[int]],
    max_new_tokens: int,
    step: Optional[StepFn] = None,
    steps_per_launch: int = 1,
    eos_token_id: Optional[int] = None,
) -> List[List[int]]:
    """Greedy-decode up to ``max_new_tokens`` tokens per prompt; prefill runs eagerly, decode through ``step``.

    ``step(forward_batch) -> logits`` for the batch's real tokens defaults to ``run_eager``;
    pass a graphrt ``GraphRunner`` to decode through graphs. ``steps_per_launch`` > 1 runs that
    many decode steps per launch, the next token chosen on the device: ``step.decode(batch, k)``
    (a GraphRunner; its multi-step keys, ``decode_steps``, serve it in one replay) or, without
    ``step``, eager steps. The slots of every step of a launch are mapped ahead in the request
    table. A request stops after its ``eos_token_id`` (kept) or ``max_new_tokens`` tokens; tokens a
    launch chose after the stop are dropped, and the KV slots they wrote belong to the request until
    it is released. Without ``eos_token_id`` the tokens are read from the device once, at the end;
    with it, once per launch. Pools are released on return.
    """
    if backend is not model.attn_backend:
        raise ValueError("backend: expected the attention backend the model was built with")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if type(steps_per_launch) is not int or steps_per_launch < 1:
        raise ValueError(f"steps_per_launch: expected an int >= 1, got {steps_per_launch!r}")
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token lists")
    launch = _launcher(model, step, steps_per_launch)
    device = pools.req_to_token.device
    reqs: List[int] = []
    cached: List[int] = []  # KV slots assigned per request, for release on any exit
    try:
        for _ in prompts:
            reqs.append(pools.req_to_token.alloc())
            cached.append(0)
        lens = [len(prompt) for prompt in prompts]
        out_loc = pools.assign(reqs, cached, lens)
        cached = list(lens)
        prefill = make_extend_batch(
            prompts, reqs, [0] * len(prompts), out_loc, device, pools=pools, attn_backend=backend
        )
        last_rows = _index_tensor([end - 1 for end in itertools.accumulate(lens)], device)
        next_ids = run_eager(model, prefill)[last_rows].argmax(-1)
        decoding = _Decoding(list(range(len(prompts))), max_new_tokens, eos_token_id, next_ids)
        context = pools.req_to_token.max_context_len
        while decoding.active:
            rows = decoding.active
            # A launch runs its full count of steps while every request has room (tokens past a stop
            # are dropped), else only the steps still wanted.
            room = context - max(cached[row] for row in rows)
            steps = steps_per_launch if room >= steps_per_launch else min(steps_per_launch, decoding.wanted)
            live = [reqs[row] for row in rows]
            out_loc = pools.assign(live, [cached[row] for row in rows], [steps] * len(rows))
            step_major = out_loc.view(len(rows), steps).t().reshape(-1)
            batch = make_decode_batch(decoding.next_ids, live, [cached[row] + 1 for row in rows], step_major, device,
                                      pools=pools, attn_backend=backend)
            for row in rows:
                cached[row] += steps
            decoding.add(launch(batch, steps))
        tokens = decoding.tokens()
    finally:
        for req, count in zip(reqs, cached):
            pools.release(req, count)
    logger.debug("generated %d x up to %d tokens, %d steps per launch", len(prompts), max_new_tokens,
                 steps_per_launch)
    return tokens


def _launcher(model: ReferenceDecoder, step: Optional[StepFn], steps_per_launch: int) -> Launch:
    """``launch(batch, steps) -> [steps, rows]`` greedy tokens: one step through ``step`` (default
    eager), or several through ``step.decode`` (a GraphRunner) or eager steps."""
    if steps_per_launch == 1:
        one = step if step is not None else (lambda batch: run_eager(model, batch))
        return lambda batch, steps: one(batch).argmax(-1)[None]
    if step is None:
        return lambda batch, steps: run_steps(lambda each: run_eager(model, each), batch, steps, greedy)
    decode = getattr(step, "decode", None)
    if decode is None:
        raise ValueError(f"step: steps_per_launch > 1 needs a GraphRunner (its decode()) or None (eager steps), "
                         f"got {type(step).__name__}")
    return decode


class _Decoding:
    """The requests still decoding and the tokens chosen so far (on the device until a stop must be
    seen: with ``eos_token_id``, each launch's tokens are read once to find the stops)."""

    def __init__(self, active: List[int], max_new_tokens: int, eos_token_id: Optional[int],
                 next_ids: torch.Tensor) -> None:
        self.active = active
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.next_ids = next_ids  # the last token of each active request, the next launch's input ids
        self.count = 1  # tokens chosen per active request (the prefill chose one)
        self.launches: List[torch.Tensor] = [next_ids[None]]  # [steps, rows] per launch, without a stop
        self.chosen: List[List[int]] = [[] for _ in active]  # per request, with eos_token_id
        if eos_token_id is not None:
            self._read(next_ids[None])
        elif max_new_tokens == 1:
            self.active = []

    @property
    def wanted(self) -> int:
        """Tokens each active request still wants."""
        return self.max_new_tokens - self.count

    def add(self, tokens: torch.Tensor) -> None:
        """The ``[steps, rows]`` tokens of one launch over the active requests."""
        self.count += tokens.shape[0]
        self.next_ids = tokens[-1]
        if self.eos_token_id is None:
            self.launches.append(tokens.clone())  # views of the graph's output: the next launch overwrites them
            if self.count >= self.max_new_tokens:
                self.active = []
            return
        self._read(tokens)

    def _read(self, tokens: torch.Tensor) -> None:
        """Append each active request's tokens up to its stop; drop stopped requests from the batch."""
        keep = []
        for position, (row, values) in enumerate(zip(self.active, tokens.t().tolist())):
            chosen = self.chosen[row]
            for token in values:
                chosen.append(token)
                if token == self.eos_token_id or len(chosen) == self.max_new_tokens:
                    break
            else:
                keep.append(position)
        if len(keep) < len(self.active):
            self.next_ids = self.next_ids[_index_tensor(keep, self.next_ids.device)]
            self.active = [self.active[position] for position in keep]

    def tokens(self) -> List[List[int]]:
        """Every request's tokens (read from the device once when no stop had to be seen)."""
        if self.eos_token_id is not None:
            return self.chosen
        return [row[: self.max_new_tokens] for row in torch.cat(self.launches).t().tolist()]
