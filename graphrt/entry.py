"""GraphKey and GraphEntry: what a graph was captured for, and the one replay every front runs.

A captured key is the only thing that runs a replay (``GraphEntry.replay``: stage through its
front's stager, replay, cut, count), for full graphs, piecewise graphs, multi-step keys and
``wrap()`` alike, and ``replay_or_eager`` is the one rule for a replay that raises.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import (
    Any, Callable, Dict, FrozenSet, Generic, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple, TypeVar,
)

import torch

from graphrt.backends import CapturedGraph, CollectiveError, another_capture_error
from graphrt.backends.compile_runs import CompileOutcome
from graphrt.batch import ForwardMode
from graphrt.debug import GenerationCounter, guard_outputs
from graphrt.guards import GuardSpec, KeyGuard, Observation
from graphrt.layout.tensor_tree import unflatten

logger = logging.getLogger(__name__)


class KeyKind(str, enum.Enum):
    """What a key's graph is: the whole step, pieces around ops run eagerly (splitting ops), or a
    call of a function ``wrap()`` graphs (whatever the call computes: a prefill, a decode step)."""

    FULL = "full"
    PIECEWISE = "piecewise"
    CALL = "call"


class GraphKey(NamedTuple):
    """What a graph was captured for: mode, padded row counts (tokens, requests), kind, and the
    decode steps one replay runs (``steps`` > 1: a multi-step key, ``decode/bs=8,steps=4``)."""

    mode: ForwardMode
    num_tokens: int
    num_reqs: int
    kind: KeyKind = KeyKind.FULL
    steps: int = 1

    def __str__(self) -> str:
        if self.kind is KeyKind.PIECEWISE:
            return f"piecewise/tokens={self.num_tokens}"
        if self.kind is KeyKind.CALL:
            return f"call/bs={self.num_reqs}"
        if self.num_tokens == self.num_reqs:
            name = f"{self.mode.name.lower()}/bs={self.num_reqs}"
        else:
            name = f"{self.mode.name.lower()}/tokens={self.num_tokens},reqs={self.num_reqs}"
        return name if self.steps == 1 else f"{name},steps={self.steps}"


PIECEWISE_REQS = 1  # a piecewise key is recorded on one dummy request holding all its tokens


class GraphStatus(enum.Enum):
    """Where a key stands: waiting for capture, replayable, or out of use (with a reason)."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    VERIFY_FAILED = "verify_failed"  # captured, but its first replay differed from eager
    DISABLED = "disabled"


class EagerReason(str, enum.Enum):
    """Why a step ran eagerly instead of replaying a graph (a fixed set, each counted)."""

    GRAPHS_DISABLED = "graphs_disabled"  # backend="eager" or GRAPHRT_DISABLE=1
    WARMUP = "warmup"  # wrap(): a size's first call is its warm-up, run eagerly as the real step
    NOT_CAPTURED = "not_captured"  # capture() has not run (or was interrupted) for this key
    MODE_NOT_CAPTURED = "mode_not_captured"
    BATCH_TOO_LARGE = "batch_too_large"
    SHAPE_MISMATCH = "shape_mismatch"  # wrap(): the call fits no layout with graphs, and its kind changes every call
    CAPTURE_FAILED = "capture_failed"
    VERIFY_FAILED = "verify_failed"  # the key's first replay differed from eager at capture
    DISABLED = "disabled"  # an earlier replay of this key raised where eager did not
    UNSUPPORTED_FIELD = "unsupported_field"  # logprobs or multimodal fields: graphs are captured without them
    CONTEXT_MISMATCH = "context_mismatch"  # attn_backend or a pool other than the captured one
    REPLAY_FAILED = "replay_failed"  # the replay raised; the step re-ran eagerly
    PEER_EAGER = "peer_eager"  # lockstep: another rank must run this step eagerly, so every rank does
    AXIS_PROBE = "axis_probe"  # padded, and the outputs' batch axes are not known yet: this run's shapes show them
    UNSLICEABLE_OUTPUT = "unsliceable_output"  # padded, and an output has no batch axis to cut the padding off
    AUTOGRAD = "autograd"  # wrap(): grad mode on and an input requires grad; eager so gradients flow
    AMBIGUOUS_BATCH_AXIS = "ambiguous_batch_axis"  # wrap(): padded, and an argument has the batch size in two dims
    # Guards (graphrt.guards): the key was captured under another state than the call's.
    AUTOCAST = "autocast"  # GraphRunner: autocast differs from capture (wrap(): graphs of its own)
    TRAINING = "training"  # GraphRunner: a module's training flag differs from capture (wrap(): graphs of its own)
    PYTHON_STATE = "python_state"  # GraphRunner: a Python value the step read changed (wrap(): graphs of its own)
    HOOKS = "hooks"  # GraphRunner: forward hooks added or removed on a module the step ran (wrap(): graphs of its own)
    MODULE_MOVED = "module_moved"  # a tensor the graph reads changed dtype, device or memory (to(), half(), ...)
    REBOUND_STATE = "rebound_state"  # a tensor or module the step reached through an attribute was rebound
    ALIASED_INPUTS = "aliased_inputs"  # staged tensors share memory with each other or with state the step uses
    TENSOR_SUBCLASS = "tensor_subclass"  # wrap(): an argument is a tensor subclass (its __torch_function__ runs)


StaticInputs = TypeVar("StaticInputs")


class Stager(Protocol):
    """How a front writes one call into a key's static inputs (its own way: a ForwardBatch's
    fields, the token fields of a piecewise step, a wrapped function's pytree)."""

    def stage(self, entry: "GraphEntry", call: Any, num_tokens: int, num_reqs: int) -> None:
        """Copy the call's rows into ``entry.static_inputs``, padding the rest (inputs already checked)."""

    def reset(self) -> None:
        """Every static slot back to its pad value (after a failed step, before a capture)."""

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        """Which of the staged inputs a captured step writes in place (their storages among ``storages``)."""

    def write_back(self, entry: "GraphEntry", call: Any, num_tokens: int, num_reqs: int) -> None:
        """After a replay that wrote staged inputs (``entry.written_inputs``): their live rows back
        into the caller's tensors, as the eager call would have left them."""

    def sources(self, call: Any) -> Sequence[Optional[torch.Tensor]]:
        """The caller's tensors ``stage`` copies from (the aliasing guard reads their memory)."""


class CutOutputs:
    """The outputs one replay of a key returns for one real size: its static output leaves cut
    to the real rows (views), rebuilt into the step's structure once."""

    __slots__ = ("leaves", "structure", "value")

    def __init__(self, leaves: List[Any], structure: Any) -> None:
        self.leaves = leaves
        self.structure = structure
        self.value = unflatten(structure, iter(leaves))

    def result(self) -> Any:
        return self.value


class CopiedOutputs(CutOutputs):
    """``copy_outputs=True``: owned copies, valid after later replays."""

    __slots__ = ()

    def result(self) -> Any:
        return unflatten(self.structure, iter([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf
                                               for leaf in self.leaves]))


class GuardedOutputs(CutOutputs):
    """Debug mode: views that raise StaleOutputError once a later replay in their pool may have overwritten them."""

    __slots__ = ("counter", "key")

    def __init__(self, leaves: List[Any], structure: Any, counter: GenerationCounter, key: str) -> None:
        super().__init__(leaves, structure)
        self.counter = counter
        self.key = key

    def result(self) -> Any:
        return unflatten(self.structure, iter(guard_outputs(self.leaves, self.counter, self.key)))


def _no_count(real_tokens: int, padded_tokens: int) -> None:
    """The default replay counter of an entry no front counts (tests, graphrt.check)."""


@dataclass(eq=False)
class GraphEntry(Generic[StaticInputs]):
    """One key: the padded inputs its graph reads, the step capture records, how its front stages
    a call into those inputs, and what it holds once captured (graph, cut outputs, counters)."""

    key: GraphKey
    static_inputs: StaticInputs  # views of the static slots at the key's size (a ForwardBatch, or wrap()'s call)
    step: Callable[[], Any]  # the model on static_inputs: what capture records
    passthrough: FrozenSet[int] = frozenset()  # ids of argument objects the step may return as they are
    stager: Optional[Stager] = None
    count: Callable[[int, int], None] = _no_count  # the front's counter of one replay (real, padded tokens)
    record: Optional[Callable[..., CapturedGraph]] = None  # record(backend, fn, generators); None: backend.capture
    graph: Optional[CapturedGraph] = None
    status: GraphStatus = GraphStatus.PENDING
    reason: Optional[str] = None
    seconds: float = 0.0
    verify_seconds: float = 0.0
    pool_bytes: Optional[int] = None
    hits: int = 0
    cuts: Dict[Tuple[int, int], CutOutputs] = field(default_factory=dict, repr=False)  # real size -> outputs
    output_structure: Any = field(default=None, repr=False)  # how graph.outputs (leaves) rebuild the result
    written_inputs: Tuple[int, ...] = ()  # the staged inputs the step writes in place (the stager's positions)
    reads_grad: bool = True  # whether the captured step read a tensor that requires grad (True until captured)
    guard_spec: Optional[GuardSpec] = None  # the front's state watch and binding roots (None: no guard)
    guard: Optional[KeyGuard] = None  # the state the graph was captured under, checked per call (set when READY)
    observation: Optional[Observation] = field(default=None, repr=False)  # what the captured step ran
    runs_compiled: bool = False  # the step ran torch.compile'd code (seen at capture)
    compiled: Optional[CompileOutcome] = None  # whether that code is compiled at this key's shapes
    refused: Optional[Exception] = None  # why the step, not the size, failed capture: no other key of it is captured
    serving: Any = field(default=None, repr=False)  # the registry's decision to replay it, made once (per call: no tuple)

    def replay(self, call: Any, num_tokens: int, num_reqs: int) -> Any:
        """The one replay: stage ``call`` (``num_tokens``/``num_reqs`` real rows, a size the
        registry's lookup prepared), replay, write written inputs back, cut the real rows, count."""
        self.stager.stage(self, call, num_tokens, num_reqs)
        self.graph.replay()
        if self.written_inputs:
            self.stager.write_back(self, call, num_tokens, num_reqs)
        outputs = self.cuts[num_tokens, num_reqs].result()
        self.hits += 1
        self.count(num_tokens, self.key.num_tokens)
        return outputs


def replay_or_eager(entry: GraphEntry, call: Any, num_tokens: int, num_reqs: int,
                    run_eager: Optional[Callable[..., Any]], *eager_args: Any) -> Any:
    """Replay ``entry``; the one rule for a replay that raises. The static slots go back to their
    pad values (no value of the failed step stays for a later step or capture), then the step runs
    eagerly (``run_eager(EagerReason.REPLAY_FAILED, *eager_args)``). If eager raises too, the input
    was at fault: its error surfaces and the key stays in use. If eager succeeds, the graph was at
    fault: the key is disabled, unless the error was another capture's (``another_capture_error``:
    torch <= 2.11 fails the replay of a graph that drew random numbers while any capture of the process
    is under way), or a collective's (``CollectiveError``: a peer lost). Without
    ``run_eager`` (lockstep: the peers replayed) the key is disabled and the replay's error surfaces."""
    try:
        return entry.replay(call, num_tokens, num_reqs)
    except Exception as replay_error:
        why = f"replay raised {type(replay_error).__name__}: {replay_error}"
        its_own = not (another_capture_error(replay_error) or isinstance(replay_error, CollectiveError))
        try:
            entry.stager.reset()
        except Exception as reset_error:  # never in the way of the eager step (slots are made to be writable)
            disable(entry, f"{why}; its static slots could not be reset: {reset_error}")
        if run_eager is None:
            if its_own:
                disable(entry, why)
            raise
        result = run_eager(EagerReason.REPLAY_FAILED, *eager_args)  # raises: the input's fault, the key stays
        if its_own:
            disable(entry, f"{why} (the same step ran eagerly)")
        return result


def disable(entry: GraphEntry, reason: str) -> None:
    """Take ``entry`` out of use (its steps run eagerly) and drop its graph."""
    entry.status, entry.reason, entry.graph, entry.guard = GraphStatus.DISABLED, reason, None, None
    entry.cuts.clear()
    logger.warning("graph %s disabled: %s", entry.key, reason)
