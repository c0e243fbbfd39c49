"""Check a GraphRunner's model: on the padded batches capture records, and on real examples.

Without examples the check records exactly what ``runner.capture()`` would: per key, the
attention capture hook, then ``model(static.input_ids, static.positions, static)`` on the
static batch with its padding values, after one warm-up run. With example batches it also
records each one padded to its key the way staging pads it (the padded run is what a replay
computes), a rolled variant of it (value-dependent branches) and the unpadded eager run
(whether padding rows leak into real rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from graphrt.backends.compiled import eager_stance
from graphrt.batch import ForwardBatch
from graphrt.check.inputs import CallTree
from graphrt.check.names import callable_roots
from graphrt.check.recording import Step, preserved_random_state, preserved_state, raising_line
from graphrt.check.report import CheckReport
from graphrt.check.session import CheckSession
from graphrt.check.splits import SplitScanRecorder, piece_refusal, split_sites
from graphrt.dispatch import with_context
from graphrt.entry import EagerReason, GraphEntry, GraphKey, KeyKind
from graphrt.parallel.lockstep import pad_forward_batch
from graphrt.capture import recorded_step
from graphrt.registry import GraphRegistry

@runtime_checkable
class RunnerLike(Protocol):
    """What the check reads of a GraphRunner (its public names), so this package needs no import of it."""

    model: Callable[..., Any]
    registry: GraphRegistry
    dispatcher: Any
    context: Mapping[str, Any]
    pad_values: Mapping[str, int]
    device: torch.device
    debug: bool
    piecewise: bool  # whether the registry holds piecewise keys (splitting ops set)

    def prepare_capture(self) -> Callable[[GraphEntry], None]: ...


# Keys whose entries exist but are not replayable yet: the example still pads to them.
_KEY_KNOWN = (None, EagerReason.NOT_CAPTURED, EagerReason.CAPTURE_FAILED, EagerReason.DISABLED)


def check_runner(runner: RunnerLike, examples: Sequence[ForwardBatch] = (),
                 keys: Optional[Sequence[GraphKey]] = None) -> CheckReport:
    """The check of ``runner``'s model (see GraphRunner.check); the runner's lock must be held."""
    before_capture = runner.prepare_capture()  # graph state first: it outlives the check
    entries = _entries(runner, keys)
    roots = ([("forward_batch", entries[0].static_inputs)] if entries else []) + callable_roots(runner.model) + [
        ("batch_context", runner.context)]
    session = CheckSession(f"GraphRunner({type(runner.model).__name__})", roots, runner.device)
    with preserved_random_state(), preserved_state(session.graph), eager_stance():
        if runner.piecewise:
            _check_splits(session, runner)
        for position, entry in enumerate(entries):
            step = Step(f"static batch of {entry.key}", recorded_step(entry), _batch_inputs(entry.static_inputs),
                        lambda entry=entry: before_capture(entry))
            if not _warm_up(session, step):
                continue
            recording = session.record(step)
            if session.analyze(recording, with_state=position == 0):
                session.compare(recording, session.record(dataclasses.replace(step, label=f"second {step.label}")))
        for index, example in enumerate(examples):
            _check_example(session, runner, index, example)
    return session.finish()


def _check_splits(session: CheckSession, runner: RunnerLike) -> None:
    """Record the step on the smallest piecewise key's dummy batch and list where it splits."""
    entry = min((entry for key, entry in runner.registry.entries.items() if key.kind is KeyKind.PIECEWISE),
                key=lambda entry: entry.key.num_tokens)
    step = Step(f"dummy batch of {entry.key}", recorded_step(entry), _batch_inputs(entry.static_inputs))
    if not _warm_up(session, step):
        return
    recorder = entry.record  # a PieceRecorder: the splitting ops and the request-shaped slots
    recording = session.record(step, SplitScanRecorder(recorder.splitting))
    if session.analyze(recording, with_state=False):
        session.report.splits, session.report.pieces = split_sites(recording, recorder.splitting)
        refusal = piece_refusal(step.fn, recorder.splitting, recorder.request_fields)
        if refusal is not None:
            session.add_error(f"{step.label} (piecewise capture)", refusal, raising_line(refusal))


def _entries(runner: RunnerLike, keys: Optional[Sequence[GraphKey]]) -> List[GraphEntry]:
    """The requested keys' entries, else the largest and smallest single-step full-graph key of each
    mode (largest first); multi-step keys record the same model, ``steps`` times."""
    entries = runner.registry.entries
    if keys is not None:
        missing = [key for key in keys if key not in entries]
        if missing:
            raise ValueError(f"keys: expected keys of this runner ({sorted(map(str, entries))}), got {missing}")
        return [entries[key] for key in keys]
    full = [key for key in entries if key.kind is KeyKind.FULL and key.steps == 1]
    chosen: Dict[GraphKey, GraphEntry] = {}
    for mode in dict.fromkeys(key.mode for key in full):
        of_mode = sorted((key for key in full if key.mode is mode), key=lambda k: (k.num_tokens, k.num_reqs))
        for key in (of_mode[-1], of_mode[0]):
            chosen.setdefault(key, entries[key])
    return list(chosen.values())


def _batch_inputs(batch: ForwardBatch) -> Dict[str, torch.Tensor]:
    return CallTree((batch,), {}, ["forward_batch"]).tensors()


def _warm_up(session: CheckSession, step: Step) -> bool:
    """One unrecorded run, as capture warms up; its writes stay until the check ends."""
    try:
        if step.prepare is not None:
            step.prepare()
        step.fn()
    except Exception as error:  # reported like a failed capture
        session.add_error(step.label, error, raising_line(error))
        return False
    return True


def _check_example(session: CheckSession, runner: RunnerLike, index: int, example: ForwardBatch) -> None:
    """Record one real batch padded to its key, a rolled variant, and its unpadded run."""
    example.validate(runner.device, runner.debug)
    decision = runner.dispatcher.decide(example)
    if decision.reason not in _KEY_KNOWN or decision.entry is None:
        session.report.notes.append(f"example {index} runs eagerly ({decision.reason.value}): not checked")
        return
    if decision.entry.key.kind is KeyKind.PIECEWISE:
        session.report.notes.append(f"example {index} replays piecewise ({decision.entry.key}): its pieces are "
                                    "checked on that key's dummy batch, not on the example")
        return
    key = decision.entry.key
    example = with_context(example, runner.context)
    padded = pad_forward_batch(example, key.num_tokens, key.num_reqs, runner.pad_values)
    recording = session.record(_eager_step(runner, f"example {index} padded to {key}", padded))
    if not session.analyze(recording, with_state=False):
        return
    (variant,), _ = CallTree((padded,), {}, ["forward_batch"]).rolled()
    session.compare(recording, session.record(_eager_step(runner, f"rolled variant of example {index}", variant)))
    real = session.record(_eager_step(runner, f"example {index}", example))
    rows = {key.num_tokens: example.num_tokens, key.num_reqs: example.batch_size}
    session.compare_padding(real, recording, rows)


def _eager_step(runner: RunnerLike, label: str, batch: ForwardBatch) -> Step:
    """The model on ``batch``; the eager attention metadata is built before the recording starts."""
    init_metadata: Any = getattr(batch.attn_backend, "init_forward_metadata", None)
    prepare = (lambda: init_metadata(batch)) if init_metadata is not None else None
    return Step(label, lambda: runner.model(batch.input_ids, batch.positions, batch), _batch_inputs(batch), prepare,
                graphed=False)
