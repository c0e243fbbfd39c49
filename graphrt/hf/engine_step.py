"""One engine step on the device: one pinned copy in, the runner, the tokens chosen on the device, one read out.

``EngineSteps`` runs the work ``ServeLoop`` schedules (graphrt.hf.serve) for one ``generate`` call. A
step is written into the host half of graphrt.host's double-buffered arena (``write_requests``, the
one batch-building path of host-built batches, plus the engine's own regions: where the step's KV
slots go in the request table, where a decode's input id comes from, the chosen rows' ids and sampling
parameters) and staged with one non-blocking copy from pinned memory. On the device, with no read:
a decode whose last token was never read takes it from the tokens the previous step chose (one
``index_select`` over the arena), the token history takes the step's ids where the call's rules read
them, then the runner runs the batch (the step writes its new KV slots into the request table itself,
graphrt.hf.attention_plan)
and the call's ``TokenChooser`` writes each chosen row's token into the arena's ``tokens`` region,
copied back into the host half with one non-blocking copy. ``read`` waits for that copy: the one
synchronization of a step. Nothing here assigns to an object a guard watches: per step only locals,
the arena and the engine's counters (a plain object of their own) change.
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.hf.engine_runners import EngineRunners
from graphrt.hf.logits_rules import RowIds
from graphrt.hf.request_sampling import FLOAT_PARAMETERS, ChosenRows, TokenChooser
from graphrt.hf.requests import MAX_TOP_LOGPROBS, Request
from graphrt.hf.serve import StepWork
from graphrt.host.arena import CopyBack, InputBuffers
from graphrt.host.input_batch import write_requests
from graphrt.reference import CachePools

PARAMETER_COLUMNS = 8  # float32 columns per chosen row in the arena (FLOAT_PARAMETERS, padded to whole int64s)
# int64 values per chosen row copied back at most: its token, its log-probability, and the top ones (id, value)
RESULT_COLUMNS = 2 + 2 * MAX_TOP_LOGPROBS


@dataclass
class EngineCounters:
    """The engine's counts during a call (a plain object of their own: the engine itself is read by guards,
    and an assignment to it would move the state epoch): model calls (eager steps run the model's Python),
    seconds in the runners, of those in decode steps, the last call's statistics, and the online session that
    holds the engine (graphrt.hf.online)."""

    model_calls: int = 0
    runner_seconds: float = 0.0
    decode_seconds: float = 0.0
    stats: Optional[dict] = None
    session: Optional[Any] = None


class StepArena:
    """The engine's staging memory, kept across calls: the arena (sized for ``steps`` decode steps per
    launch), the ids of a step whose decodes read the last step's tokens, and the token history (each
    request row's ids, for rules and penalties; made on first use)."""

    def __init__(self, pools: CachePools, device: torch.device, max_requests: int, max_step_tokens: int,
                 events: bool) -> None:
        self.pools = pools
        self.device = device
        self.max_requests = max_requests
        self.max_step_tokens = max_step_tokens
        self.step_tokens = max(max_step_tokens, max_requests)  # a step's tokens: its budget, or a decode per request
        self.events = events
        self.buffers: Optional[InputBuffers] = None
        self.steps = self.hold_width = 0
        self.history: Optional[torch.Tensor] = None
        self.ids = torch.zeros(self.step_tokens, dtype=torch.int64, device=device)
        self.views: Dict[Any, Any] = {}  # views of the arenas per step size (graphrt.hf.engine_step.StepViews)

    def ready(self, steps: int, history: bool, hold_width: int = 1) -> None:
        """Sized for launches of ``steps`` decode steps and chosen rows holding back ``hold_width - 1`` stop ids
        (per call; reallocated only to grow), the history made."""
        if self.buffers is None or steps > self.steps or hold_width > self.hold_width:
            steps, hold_width = max(steps, self.steps), max(hold_width, self.hold_width)
            rows, tokens = self.max_requests, max(self.step_tokens, self.max_requests * steps)
            self.buffers = InputBuffers.allocate(
                rows, tokens, device=self.device, events=self.events,
                extra_regions={"table_index": tokens, "id_source": self.step_tokens, "chosen_rows": rows,
                               "chosen_table_rows": rows, "chosen_lengths": rows, "chosen_prompt_lengths": rows,
                               "chosen_top_ks": rows, "chosen_params": rows * PARAMETER_COLUMNS // 2,
                               "chosen_holds": rows * hold_width},
                result_regions={"tokens": rows * max(steps, RESULT_COLUMNS)})
            self.steps, self.hold_width = steps, hold_width
            self.views.clear()
        if history and self.history is None:
            self.history = torch.zeros_like(self.pools.req_to_token.req_to_token)


@dataclass(frozen=True)
class StepViews:
    """The device arena's views a step of one size reads."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    table_index: torch.Tensor
    id_source: torch.Tensor
    carried_ids: torch.Tensor


@dataclass
class Launched:
    """A launched step: its chosen tokens on their way to the host (None: it chose none), with ``top`` >= 0
    their log-probabilities and ``top`` most likely tokens' after them (``read`` decodes them: ``logprobs``)."""

    copied: Optional[CopyBack]
    top: int = -1
    logprobs: Optional[List[Tuple[float, List[Tuple[int, float]]]]] = None


class EngineSteps:
    """The executor of one call: its runners (graphs or eager, steps per launch) and token choice."""

    def __init__(self, arena: StepArena, runners: EngineRunners, counters: EngineCounters, graphs: bool,
                 steps_per_launch: int, chooser: Optional[TokenChooser]) -> None:
        arena.ready(steps_per_launch, chooser is not None and chooser.needs_ids,
                    1 if chooser is None else chooser.hold_width)
        self.arena = arena
        self.buffers = arena.buffers
        self.runners = runners
        self.counters = counters
        self.graphs = graphs
        self.steps_per_launch = steps_per_launch
        self.chooser = chooser
        self.history = arena.history.view(-1) if chooser is not None and chooser.needs_ids else None
        self.context = dict(req_to_token_pool=arena.pools.req_to_token, token_to_kv_pool=arena.pools.kv)
        buffers = self.buffers
        ids_offset = buffers.regions["input_ids"][0]
        self.id_sources = np.arange(ids_offset, ids_offset + arena.step_tokens)  # a host id: its own row
        self.tokens_offset = buffers.regions["tokens"][0]
        self.params = buffers.device_views["chosen_params"].view(torch.float32).view(-1, PARAMETER_COLUMNS)
        self._runners: Dict[Any, Tuple[Any, Any]] = {}  # the call's runners by kind of step (decode width, prefill)

    def admit(self, request: Request) -> None:
        """``request`` took its request row: what its tokens are chosen from written there (the token history
        made first when its choice reads ids and no earlier request's did)."""
        chooser = self.chooser
        if chooser is None:
            return
        chooser.admit(request.row, request.tokens)
        if chooser.needs_ids and self.history is None:
            self.arena.ready(self.steps_per_launch, True)
            self.history = self.arena.history.view(-1)

    def launch(self, work: StepWork) -> Tuple[Launched, int]:
        """Run ``work`` and start copying its chosen tokens back; how many steps ran the model eagerly."""
        output, eager = self.run(work)
        buffers, chosen = self.buffers, len(work.sampled)
        if not chosen:
            return Launched(None), eager
        if work.steps > 1:  # [steps, rows] greedy tokens of a launch, step-major
            return Launched(buffers.copy_back("tokens", output.reshape(-1))), eager
        rows_at, tokens = self._chosen_views(chosen)
        rows = output if work.mode is ForwardMode.DECODE else output.index_select(0, rows_at)
        if self.chooser.greedy:
            torch.argmax(rows, dim=-1, out=tokens)
        else:
            self.chooser.choose(rows, tokens, self._chosen_rows(work, chosen))
        top = self.chooser.top_logprobs
        if top < 0:
            return Launched(buffers.copy_back("tokens", tokens)), eager
        return Launched(buffers.copy_back("tokens", _with_logprobs(rows, tokens, top)), top), eager

    def write_prompt_ids(self, row: int, start: int, ids: Sequence[int]) -> None:
        """Positions ``start..`` of request row ``row``'s token history hold ``ids`` (a shared prompt prefix, which
        no step of this request runs), where the call's rules or penalties read ids."""
        if self.history is not None:
            first = row * self.arena.history.shape[1] + start
            values = torch.tensor(list(ids), dtype=self.history.dtype, pin_memory=self.history.is_cuda)
            self.history[first:first + len(values)].copy_(values, non_blocking=True)

    def read(self, launched: Launched) -> List[int]:
        """The tokens of a launched step, on the host: the step's one wait (their log-probabilities, when
        computed, come in the same copy: kept in ``launched.logprobs``)."""
        if launched.copied is None:
            return []
        values = self.buffers.read_back(launched.copied)
        if launched.top < 0:
            return values
        top, chosen = launched.top, len(values) // (2 + 2 * launched.top)
        logprobs = np.array(values[chosen:], dtype=np.int64).view(np.float64)
        ids = values[2 * chosen: (2 + top) * chosen]
        tops = logprobs[(1 + top) * chosen:]
        launched.logprobs = [(float(logprobs[row]), [(ids[row * top + k], float(tops[row * top + k]))
                                                     for k in range(top)]) for row in range(chosen)]
        return values[:chosen]

    @staticmethod
    def read_logprobs(launched: Launched) -> Optional[List[Tuple[float, List[Tuple[int, float]]]]]:
        """The log-probabilities ``read`` decoded (None: the step computed none)."""
        return launched.logprobs

    def run(self, work: StepWork) -> Tuple[torch.Tensor, int]:
        """Stage ``work`` and run it: the runner's output (logits of its tokens, or a launch's tokens) and
        how many steps ran the model eagerly."""
        batch, longest = self._stage(work)
        key, runner = self._runner(batch, work, longest)
        counters = self.counters
        calls, start = counters.model_calls, time.perf_counter()
        output = runner(batch) if work.steps == 1 else runner.decode(batch, work.steps)
        seconds = time.perf_counter() - start
        counters.runner_seconds += seconds
        if work.mode is ForwardMode.DECODE:
            counters.decode_seconds += seconds
        eager = counters.model_calls - calls
        if eager:
            self.runners.after_eager_step(key, runner)
            self._runners.clear()  # a replay fault is captured again before the next step (EngineRunners.get)
        return output, eager

    def _runner(self, batch: ForwardBatch, work: StepWork, longest: int) -> Tuple[Any, Any]:
        """The runner of ``batch`` (EngineRunners.for_batch), kept for the call's later steps of its kind."""
        if not self.graphs:
            kind: Any = None
        elif work.mode is ForwardMode.DECODE:
            kind = self.runners.width_for(longest + work.steps - 1)
        else:
            kind = "prefill"
        found = self._runners.get(kind)
        if found is None:
            found = self._runners[kind] = self.runners.for_batch(self.graphs, batch, self.steps_per_launch, work.steps,
                                                                 longest)
        return found

    # ---- staging ----------------------------------------------------------------------------------

    def _stage(self, work: StepWork) -> Tuple[ForwardBatch, int]:
        """``work`` written into the host arena, staged with one copy, the device table and ids made ready;
        the batch and its longest request."""
        buffers = self.buffers
        buffers.wait_host_free()
        host = buffers.host_views
        requests, steps = len(work.requests), work.steps
        counts, starts, chunks = work.counts, work.starts, work.chunks
        rows = [request.row for request in work.requests]
        slots, table_index = work.slots, work.table_index
        extend = work.mode.is_extend()
        if extend:
            ids = [token for chunk in chunks for token in chunk]
            positions = [position for start, count in zip(starts, counts) for position in range(start, start + count)]
            new_tokens = counts
        else:  # a token per request
            ids = [chunk[0] for chunk in chunks]
            positions, new_tokens = starts, [1] * requests
            if steps > 1:  # every step's slots, step-major (GraphRunner.decode)
                slots = [slots[row * steps + step] for step in range(steps) for row in range(requests)]
                table_index = [table_index[row * steps + step] for step in range(steps) for row in range(requests)]
        tokens, assigned = len(ids), len(slots)
        seq_lens = list(map(operator.add, starts, new_tokens))
        write_requests(host, 0, 0, ids, positions, slots, new_tokens, seq_lens, rows, extend)
        if self.history is not None:  # where the rules read each token's id (the step writes its slot in the table)
            host["table_index"][:assigned] = table_index
        if work.carried:
            source = host["id_source"]
            source[:tokens] = self.id_sources[:tokens]
            for token, row in work.carried:
                source[token] = self.tokens_offset + row
        if work.sampled and steps == 1:
            self._write_chosen(work, host, rows, seq_lens, counts)
        buffers.stage(requests)
        device = self._views(requests, tokens, assigned)
        input_ids = device.input_ids
        if work.carried:
            input_ids = torch.index_select(buffers.device_arena, 0, device.id_source, out=device.carried_ids)
        if self.history is not None:
            self.history.index_copy_(0, device.table_index, input_ids)
        if not extend:
            return ForwardBatch(work.mode, requests, input_ids, device.req_pool_indices, device.seq_lens,
                                device.out_cache_loc, sum(seq_lens), self._host_seq_lens(requests), device.positions,
                                **self.context), max(seq_lens)
        return ForwardBatch(work.mode, requests, input_ids, device.req_pool_indices, device.seq_lens,
                            device.out_cache_loc, sum(seq_lens), self._host_seq_lens(requests), device.positions,
                            extend_num_tokens=tokens, extend_seq_lens=device.extend_seq_lens,
                            extend_prefix_lens=device.extend_prefix_lens, extend_start_loc=device.extend_start_loc,
                            extend_prefix_lens_cpu=starts, extend_seq_lens_cpu=counts, **self.context), max(seq_lens)

    def _views(self, requests: int, tokens: int, assigned: int) -> "StepViews":
        """The device arena's views of a step of these sizes (made once per size)."""
        key = (requests, tokens, assigned)
        views = self.arena.views.get(key)
        if views is None:
            device = self.buffers.device_views
            views = self.arena.views[key] = StepViews(
                device["input_ids"][:tokens], device["positions"][:tokens], device["out_cache_loc"][:assigned],
                device["req_pool_indices"][:requests], device["seq_lens"][:requests],
                device["extend_seq_lens"][:requests], device["extend_prefix_lens"][:requests],
                device["query_start_loc"][:requests], device["table_index"][:assigned], device["id_source"][:tokens],
                self.arena.ids[:tokens])
        return views

    def _chosen_views(self, chosen: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The device arena's rows of the chosen tokens' logits and the chosen tokens, for ``chosen`` rows."""
        views = self.arena.views.get(chosen)
        if views is None:
            device = self.buffers.device_views
            views = self.arena.views[chosen] = (device["chosen_rows"][:chosen], device["tokens"][:chosen])
        return views

    def _host_seq_lens(self, requests: int) -> torch.Tensor:
        """The host mirror of ``seq_lens``: a view of the host arena written for this step."""
        host = self.buffers.host_views  # the half written for this step (one dict per half)
        key = (id(host), requests)
        mirror = self.arena.views.get(key)
        if mirror is None:
            mirror = self.arena.views[key] = torch.from_numpy(host["seq_lens"][:requests])
        return mirror

    def _write_chosen(self, work: StepWork, host: Any, rows: List[int], seq_lens: List[int],
                      counts: List[int]) -> None:
        """What the chooser reads of the chosen rows: their token rows (a prefill step's last token of each),
        and where the call's rules or sampling read them, their ids' rows and lengths and their parameters."""
        chosen, sampled = len(work.sampled), work.sampled
        if work.mode is not ForwardMode.DECODE:
            ends = list(itertools.accumulate(counts))
            host["chosen_rows"][:chosen] = [ends[position] - 1 for position in sampled]
        chooser = self.chooser
        if chooser.greedy:
            return
        indices = [rows[position] for position in sampled]
        if chooser.needs_ids:
            host["chosen_table_rows"][:chosen] = indices
            host["chosen_lengths"][:chosen] = [seq_lens[position] for position in sampled]
            host["chosen_prompt_lengths"][:chosen] = chooser.prompt_lengths[indices]
            if chooser.holding:
                host["chosen_holds"][:chosen * chooser.hold_width] = chooser.holds[indices].reshape(-1)
        if chooser.sampled:
            params = host["chosen_params"].view(np.float32).reshape(-1, PARAMETER_COLUMNS)
            params[:chosen, :len(FLOAT_PARAMETERS)] = chooser.params[indices]
            host["chosen_top_ks"][:chosen] = chooser.top_ks[indices]

    def _chosen_rows(self, work: StepWork, chosen: int) -> ChosenRows:
        """The device views of what ``_write_chosen`` staged."""
        chooser, device = self.chooser, self.buffers.device_views
        requests = [work.requests[position].row for position in work.sampled]
        ids = None
        if chooser.needs_ids:
            width = max(work.starts[position] + work.counts[position] for position in work.sampled)
            table_rows = self.arena.history.index_select(0, device["chosen_table_rows"][:chosen])[:, :width]
            min_new = stops = None
            if chooser.holding:
                holds = device["chosen_holds"][:chosen * chooser.hold_width].view(chosen, chooser.hold_width)
                min_new, stops = holds[:, 0], holds[:, 1:]
            ids = RowIds(table_rows, device["chosen_lengths"][:chosen], device["chosen_prompt_lengths"][:chosen],
                         min_new, stops)
        if not chooser.sampled:
            return ChosenRows(ids, None, None, requests)
        return ChosenRows(ids, self.params[:chosen, :len(FLOAT_PARAMETERS)], device["chosen_top_ks"][:chosen],
                          requests)


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """``tokens`` [rows], then their log-probabilities under ``logits`` [rows, vocab], the ``top`` most likely
    ids and their log-probabilities (row-major), as one int64 tensor (float64 bits) for one copy back."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).double().view(torch.int64)
    values, ids = logprobs.topk(top, dim=-1)
    return torch.cat((tokens, chosen, ids.reshape(-1), values.double().reshape(-1).view(torch.int64)))


__all__ = ["EngineCounters", "EngineSteps", "Launched", "StepArena"]
