"""graphrt: CUDA-graph capture/replay for LLM inference steps, for any model callable.

The names here are what a user imports; everything else is importable from its module
(``graphrt.staging``, ``graphrt.sizes``, ``graphrt.host.input_batch``, ...).
"""

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.capture import CaptureReport
from graphrt.check import CheckReport, check
from graphrt.config import RunnerConfig
from graphrt.debug import StaleOutputError
from graphrt.entry import EagerReason, GraphKey
from graphrt.forward_context import current_batch
from graphrt.graphed_callable import GraphedCallable, wrap
from graphrt.runner import GraphRunner
from graphrt.ubatch import UBatchConfig

__version__ = "0.1.0"

__all__ = [
    "CaptureReport",
    "check",
    "CheckReport",
    "current_batch",
    "EagerReason",
    "ForwardBatch",
    "ForwardMode",
    "GraphedCallable",
    "GraphKey",
    "GraphRunner",
    "RunnerConfig",
    "StaleOutputError",
    "UBatchConfig",
    "wrap",
]
