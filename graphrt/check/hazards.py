"""The catalog of what ``graphrt.check`` reports: per kind, how bad it is and what graphs do with it.

Every finding names one of these kinds. The catalog says, once for all findings of a kind,
what graphrt will do at run time (the ``EagerReason`` it records, or ``silent`` when the graph
replays and its outputs differ from eager without any error), what torch.compile's
``mode="reduce-overhead"`` says about the same model, and how to fix it. docs/CHECK.md is
this table written out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict

from graphrt.entry import EagerReason

SILENT = "silent"  # the graph replays; outputs or state differ from eager and nothing says so
REPLAYS = "replays"  # the graph replays and behaves as documented


class Severity(str, enum.Enum):
    """error: capture fails or replays differ from eager; warning: they differ under common use;
    info: what graphs do differently that is harmless for most models (never fails ``ok``)."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Hazard:
    """What one kind of finding means for a graph, for graphrt and for torch.compile."""

    severity: Severity
    title: str
    graphrt: str  # an EagerReason value, or SILENT
    torch_compile: str  # torch.compile's cudagraph skip reason (or its graph break), "" if none
    fix: str


HAZARDS: Dict[str, Hazard] = {
    "host_sync": Hazard(
        Severity.ERROR, "host sync in the step", EagerReason.CAPTURE_FAILED.value,
        "graph break (Tensor.item / data-dependent op) or 'disabling cudagraphs due to incompatible op'",
        "keep the value on the device (torch.where, masks of fixed shape, output_size=...), or compute it "
        "before the step from host data (CPU mirrors such as seq_lens_cpu)",
    ),
    "value_dependent_branch": Hazard(
        Severity.ERROR, "the op graph depends on input values", SILENT,
        "guard failure and recompilation (Python scalars) or graph break (tensor values)",
        "make the branch a tensor op (torch.where), or pass the deciding value as a constant argument "
        "so that each value gets its own graph",
    ),
    "input_written": Hazard(
        Severity.ERROR, "the step writes one of its inputs", SILENT, "skipping cudagraphs due to mutated inputs",
        "return the new value instead of writing the input, or keep the tensor as model state "
        "(a buffer or attribute: graphs write state in place)",
    ),
    "rebound_tensor": Hazard(
        Severity.ERROR, "the step rebinds a tensor it read", f"{SILENT} ({EagerReason.CAPTURE_FAILED.value} in wrap() "
        "when the object is an argument: RebindError)",
        "guard failure on the attribute's identity, then recompilation",
        "update the tensor in place (copy_, index_copy_) instead of assigning a new tensor",
    ),
    "python_state": Hazard(
        Severity.WARNING, "the step changes Python state", f"{SILENT} ({EagerReason.CAPTURE_FAILED.value} in wrap() "
        "when the object is an argument: RebindError)",
        "guard failure on the changed value, then recompilation",
        "keep counters in device tensors updated in place, or outside the graphed step",
    ),
    "cpu_tensor": Hazard(
        Severity.ERROR, "a CUDA step reads a CPU tensor", f"{EagerReason.CAPTURE_FAILED.value} or {SILENT}",
        "skipping cudagraphs due to cpu device",
        "move the tensor to the step's device once, before capture (register it as a buffer)",
    ),
    "multiple_devices": Hazard(
        Severity.ERROR, "the step reads tensors on more than one device",
        f"{EagerReason.CAPTURE_FAILED.value} or {SILENT}", "skipping cudagraphs due to multiple devices",
        "graph one device per step; move the tensors to the step's device",
    ),
    "random_generator": Hazard(
        Severity.INFO, "a random op draws from the step's own generator", REPLAYS, "",
        "nothing to do: graphrt registers the generator with the graph, and each replay advances it as eager "
        "would (on CUDA this needs torch's CUDAGraph.register_generator_state; without it the key runs eagerly)",
    ),
    "random_op": Hazard(
        Severity.INFO, "a random op in the step", REPLAYS, "",
        "nothing to do: each replay draws what the eager call would draw at that point of the generator's "
        "sequence, and capture leaves the generator as it was",
    ),
    "output_aliases_input": Hazard(
        Severity.WARNING, "an output is a view of an input", SILENT, "",
        "return a copy (.clone()): a graph returns a view of its static input copy, which the next call "
        "overwrites",
    ),
    "outputs_alias": Hazard(
        Severity.INFO, "two outputs share memory", REPLAYS, "",
        "nothing to do unless the caller writes one output and reads the other, or uses copy_outputs=True",
    ),
    "rows_interact": Hazard(
        Severity.ERROR, "padding rows change the real rows' outputs", SILENT, "",
        "compute per row (no reductions or normalization across the batch dimension), or capture "
        "exactly the batch sizes you run (capture_sizes)",
    ),
    "outside_tensor": Hazard(
        Severity.WARNING, "the step reads a tensor from outside its arguments and its model",
        f"{EagerReason.CAPTURE_FAILED.value} in wrap() when the next call reads another tensor there "
        "(OutsideTensorError); else a graph reads the captured tensor on every replay", "",
        "pass the tensor as an argument of the wrapped function; with GraphRunner, build the context inside the step "
        "from graphrt.current_batch() (the static batch a graph replays); a constant tensor can be a module buffer",
    ),
    "padding_writes_state": Hazard(
        Severity.WARNING, "padding rows write state the real rows' step leaves alone",
        "replays at exact sizes: wrap() records every call size on its own (GraphRunner: silent, its pad values "
        "must address rows no request owns)", "",
        "give the argument that addresses the write a pad value whose writes land in no live row: "
        "wrap(..., pad_values={...}) with -1 where the kernel skips it, else a row no request owns declared with "
        "scratch_state=[...]",
    ),
    "batch_not_padded": Hazard(
        Severity.INFO, "the step fails when its batch is padded", EagerReason.CAPTURE_FAILED.value, "",
        "capture exactly the batch sizes the step runs at (capture_sizes=[...]), e.g. a StaticCache's batch",
    ),
    "unsliceable_output": Hazard(
        Severity.INFO, "an output has no batch dimension to cut the padding rows off",
        EagerReason.UNSLICEABLE_OUTPUT.value, "",
        "return per-row outputs (reduce over the batch outside the step), or capture exactly the batch sizes "
        "you run: padded calls run eagerly",
    ),
    "no_batch_dim": Hazard(
        Severity.ERROR, "no argument has a batch dimension", "wrap() raises ValueError", "",
        "pass at least one tensor whose first dimension is the batch",
    ),
    "step_raised": Hazard(
        Severity.ERROR, "the step raised", EagerReason.CAPTURE_FAILED.value, "",
        "make the step run eagerly on the example first",
    ),
}
