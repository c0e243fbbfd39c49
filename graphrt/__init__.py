"""graphrt: CUDA-graph capture/replay for LLM inference steps, for any model callable."""

from .backends import BACKEND_NAMES
from .batch import ForwardBatch, ForwardMode
from .buffer_tiers import HierarchicalBufferPool, PredictiveBufferManager, Tier, create_input_buffer_manager
from .check import CheckReport, check
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
from .debug import StaleOutputError
from .dispatcher import Decision, EagerReason, ReplayDispatcher
from .graphed_callable import GraphedCallable, wrap
from .input_batch import BatchBuilder, InputBatch, InputBuffers, KvSlots
from .registry import CaptureReport, GraphEntry, GraphKey, GraphRegistry, GraphStatus
from .runner import GraphRunner
from .sampling import SamplingMetadata, sample
from .sizes import default_capture_sizes
from .lockstep import pad_forward_batch
from .sizes import choose_capture_sizes, padding_waste
from .ubatch import DynamicUBatchWrapper, UBatchConfig, UBatchWrapper
from .unified import KvCacheHandle, UnifiedBatchItem, build_forward_batch

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "BatchBuilder",
    "BufferEntry",
    "BufferPool",
    "BufferSpec",
    "BufferState",
    "build_forward_batch",
    "CaptureReport",
    "check",
    "CheckReport",
    "choose_capture_sizes",
    "create_input_buffer_manager",
    "Decision",
    "default_capture_sizes",
    "DynamicUBatchWrapper",
    "EagerReason",
    "ForwardBatch",
    "ForwardMode",
    "GraphedCallable",
    "GraphEntry",
    "GraphKey",
    "GraphRegistry",
    "GraphRunner",
    "GraphStatus",
    "HierarchicalBufferPool",
    "InputBatch",
    "InputBufferManager",
    "InputBuffers",
    "InputSlot",
    "KvCacheHandle",
    "KvSlots",
    "pad_forward_batch",
    "padding_waste",
    "PredictiveBufferManager",
    "ReplayDispatcher",
    "RowAxis",
    "sample",
    "SamplingMetadata",
    "SimpleBufferPool",
    "StaleOutputError",
    "Tier",
    "UBatchConfig",
    "UBatchWrapper",
    "UnifiedBatchItem",
    "wrap",
]
