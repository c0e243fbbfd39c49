"""Micro-batching: split a batch into pieces that land on captured graph sizes.

A batch larger than the largest captured size would run eagerly; cut between
requests into pieces of captured sizes, it replays graphs instead.
``UBatchWrapper.compute_slices`` plans the cut (least padding, then fewest
pieces; ``graphrt.ubatch.plan``), the wrapper slices every input (tensors by token
or request rows, a ForwardBatch through ``split_forward_batch``), runs the pieces
in order or on worker threads (on CUDA each on its own stream, started together
through a ``UBatchBarrier``; ``graphrt.ubatch.sync``), and concatenates the outputs
along dim 0.
"""

from graphrt.ubatch.plan import UBatchSlice, split_forward_batch
from graphrt.ubatch.sync import (
    UBatchBarrier,
    UBatchBarrierError,
    UBatchContext,
    UbatchMetadata,
    UBatchState,
    UBatchTimeoutError,
    current_ubatch,
    make_ubatch_contexts,
)
from graphrt.ubatch.wrapper import DynamicUBatchWrapper, UBatchConfig, UBatchWrapper

__all__ = [
    "DynamicUBatchWrapper",
    "UBatchBarrier",
    "UBatchBarrierError",
    "UBatchConfig",
    "UBatchContext",
    "UBatchSlice",
    "UBatchState",
    "UBatchTimeoutError",
    "UBatchWrapper",
    "UbatchMetadata",
    "current_ubatch",
    "make_ubatch_contexts",
    "split_forward_batch",
]
