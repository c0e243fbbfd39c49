"""``GraphRunner.decode``: several decode steps per call, one multi-step replay when a key serves.

A call is served by the multi-step key of its step count and padded size through the one replay
path (``replay_or_eager``: stage, replay, cut, count). When no such key serves (a step count not in
``decode_steps``, a batch above the largest size, an attention backend without ``advance_step``,
another ``next_tokens`` than the captured one, a key that failed or is disabled), its steps run one
by one through the runner's single-step path (each a single-step replay or an eager step, counted as
such), the next tokens chosen by ``next_tokens`` on the device; the call is counted in
``stats()["multi_step_fallbacks"]`` under the reason. Either way the tokens are those of the same
steps run eagerly.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.dispatch import Dispatcher
from graphrt.entry import EagerReason, replay_or_eager
from graphrt.multistep.steps import NextTokens, chosen_tokens, run_steps
from graphrt.registry import Decision, GraphRegistry
from graphrt.stats import RuntimeStats


class MultiStepReason(str, enum.Enum):
    """Why a ``decode()`` call ran its steps one by one, besides the eager reasons of its key
    (``batch_too_large``, ``capture_failed``, ``graphs_disabled``, ...)."""

    STEPS_NOT_CAPTURED = "steps_not_captured"  # decode_steps does not list this step count
    NO_ADVANCE_STEP = "no_advance_step"  # the attention backend refreshes its metadata on the host only
    SAMPLER_NOT_CAPTURED = "sampler_not_captured"  # another next_tokens than the keys were captured with


Reason = Union[MultiStepReason, EagerReason]


def unavailable_reason(context: Mapping[str, Any], graph_modes: Sequence[ForwardMode]) -> Optional[Reason]:
    """Why no multi-step key can be captured for this runner, or None. An attention backend whose
    metadata is refreshed on the host before each replay (``init_forward_metadata_replay``) must
    advance it on the device between the steps of one graph (``advance_step``): without that hook the
    later steps would read step 0's metadata, so its steps run one by one instead."""
    if ForwardMode.DECODE not in graph_modes:
        return EagerReason.MODE_NOT_CAPTURED
    backend = context.get("attn_backend")
    if getattr(backend, "init_forward_metadata_replay", None) is not None and (
            getattr(backend, "advance_step", None) is None):
        return MultiStepReason.NO_ADVANCE_STEP
    return None


def check_call(batch: Any, steps: Any, next_tokens: Any) -> None:
    """The arguments of ``decode()`` before anything is staged: TypeError/ValueError naming the field
    (the batch's own fields are checked by ``ForwardBatch.validate(steps=steps)`` next)."""
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    if batch.forward_mode is not ForwardMode.DECODE:
        mode = getattr(batch.forward_mode, "name", batch.forward_mode)
        raise ValueError(f"forward_mode: decode() runs DECODE batches, got {mode}")
    if next_tokens is not None and not callable(next_tokens):
        raise TypeError(f"next_tokens: expected a callable next_tokens(output, step), got {type(next_tokens).__name__}")
    loc = batch.out_cache_loc
    rows = loc.shape[0] if isinstance(loc, torch.Tensor) and loc.dim() == 1 else None
    if type(batch.batch_size) is int and rows != steps * batch.batch_size:
        got = list(loc.shape) if isinstance(loc, torch.Tensor) else type(loc).__name__
        raise ValueError(f"out_cache_loc: expected steps * batch_size = {steps} * {batch.batch_size} slots "
                         f"(step-major: step j's slots at [j*batch_size, (j+1)*batch_size)), got {got}")


class MultiStepDecoder:
    """Serves ``decode()`` calls of one runner: ``decode_steps`` (the captured step counts),
    ``sampler`` (the ``next_tokens`` they were captured with), ``unavailable`` (why none can be, or
    None), ``one_step`` (the runner's step of a validated single-step batch)."""

    def __init__(self, dispatcher: Dispatcher, registry: GraphRegistry, stats: RuntimeStats,
                 decode_steps: Sequence[int], sampler: NextTokens, unavailable: Optional[Reason],
                 one_step: Callable[[ForwardBatch], Any]) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.stats = stats
        self.decode_steps = frozenset(decode_steps)
        self.sampler = sampler
        self.unavailable = unavailable
        self.one_step = one_step

    def run(self, batch: ForwardBatch, steps: int, next_tokens: Optional[NextTokens]) -> torch.Tensor:
        """The ``[steps, batch_size]`` int64 tokens of a validated call: one multi-step replay, else
        its steps one by one (counted with the reason)."""
        fn = self.sampler if next_tokens is None else next_tokens
        rows = batch.batch_size
        if steps == 1:  # a single step: the runner's own path, then next_tokens
            return chosen_tokens(fn(self.one_step(batch), 0), rows).unsqueeze(0)
        reason = self._unavailable(steps, fn)
        entry = None
        if reason is None:
            decision = self.dispatcher.decide(batch, steps)
            entry, reason = decision
            if reason is None:
                return replay_or_eager(entry, batch, rows, rows, self._after_failed_replay, batch, steps, fn)
        tokens = self._fallback(reason, batch, steps, fn)
        if reason is EagerReason.AXIS_PROBE:  # the tokens' shape shows the key's batch axis
            self.registry.observe_eager(entry.key, rows, rows, tokens)
        return tokens

    def run_decided(self, batch: ForwardBatch, steps: int, next_tokens: NextTokens, decision: Decision,
                    one_step: Callable[[ForwardBatch], Any]) -> torch.Tensor:
        """A validated call whose key the ranks agreed on (lockstep): its multi-step replay (a replay that
        raises disables the key and raises: the peers replayed), else its steps one by one through
        ``one_step`` (each step agreed again), counted with the reason."""
        entry, reason = decision
        rows = batch.batch_size
        if reason is None:
            return replay_or_eager(entry, batch, rows, rows, None, batch, steps, next_tokens)
        self.stats.record_multi_step_fallback(reason.value)
        return run_steps(one_step, batch, steps, next_tokens)

    def unavailable_for(self, steps: int, next_tokens: NextTokens) -> Optional[Reason]:
        """Why a launch of ``steps`` steps choosing tokens with ``next_tokens`` takes no multi-step key
        whatever its size, or None."""
        return self._unavailable(steps, next_tokens)

    def _unavailable(self, steps: int, next_tokens: NextTokens) -> Optional[Reason]:
        if steps not in self.decode_steps:
            return MultiStepReason.STEPS_NOT_CAPTURED
        if self.unavailable is not None:
            return self.unavailable
        if next_tokens is not self.sampler:
            return MultiStepReason.SAMPLER_NOT_CAPTURED
        return None

    def _after_failed_replay(self, reason: EagerReason, batch: ForwardBatch, steps: int,
                             next_tokens: NextTokens) -> torch.Tensor:
        """``replay_or_eager``'s eager run of a multi-step call: its steps one by one."""
        return self._fallback(reason, batch, steps, next_tokens)

    def _fallback(self, reason: Reason, batch: ForwardBatch, steps: int, next_tokens: NextTokens) -> torch.Tensor:
        self.stats.record_multi_step_fallback(reason.value)
        return run_steps(self.one_step, batch, steps, next_tokens)

