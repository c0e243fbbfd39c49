"""graphrt: CUDA-graph capture/replay for LLM inference steps, for any model callable."""

from .backends import BACKEND_NAMES
from .batch import ForwardBatch, ForwardMode
from .buffers import (
    BufferEntry,
    BufferPool,
    BufferSpec,
    BufferState,
    InputBufferManager,
    InputSlot,
    RowAxis,
    SimpleBufferPool,
)
from .dispatcher import Decision, EagerReason, ReplayDispatcher
from .graphed_callable import GraphedCallable, wrap
from .registry import CaptureReport, GraphEntry, GraphKey, GraphRegistry, GraphStatus
from .runner import GraphRunner
from .sizes import default_capture_sizes

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "BufferEntry",
    "BufferPool",
    "BufferSpec",
    "BufferState",
    "CaptureReport",
    "Decision",
    "EagerReason",
    "ForwardBatch",
    "ForwardMode",
    "GraphEntry",
    "GraphKey",
    "GraphRegistry",
    "GraphRunner",
    "GraphStatus",
    "GraphedCallable",
    "InputBufferManager",
    "InputSlot",
    "ReplayDispatcher",
    "RowAxis",
    "SimpleBufferPool",
    "default_capture_sizes",
    "wrap",
]
