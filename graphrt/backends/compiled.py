"""torch.compile'd callables inside graphrt: refuse those that capture CUDA graphs of their own,
and never call one under a dispatch mode.

``mode="reduce-overhead"`` (and ``"max-autotune"``) make inductor capture its own CUDA graphs
(cudagraph trees); captured again inside graphrt's graph they would nest, which CUDA refuses.
Fusion without graphs (``mode="max-autotune-no-cudagraphs"``, or the default mode) pairs well:
graphrt records the compiled step's kernels on CUDA, and on CPU the recording runs the step's
eager ops, which verification compares with the compiled step's own numbers.

A compiled callable called while a dispatch mode is active (graphrt's state journal, recorder,
check) is skipped by Dynamo for good: its code is never compiled again. So every run graphrt
makes under its modes takes the eager path without Dynamo (``eager_stance``), and each key is
compiled by a warm-up with no mode active before its capture (``graphrt.capture``), so that
compilation and autotuning never happen under a CUDA capture either.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch

RECOMMENDED_MODE = "max-autotune-no-cudagraphs"


def _compile_config(fn: Any) -> Optional[dict]:
    """The inductor options ``fn`` was compiled with, or None when it is not a torch.compile'd callable."""
    context = getattr(fn, "dynamo_ctx", None)  # an OptimizedModule
    if context is None:  # a compiled function holds its OptimizeContext in its closure
        for cell in getattr(fn, "__closure__", None) or ():
            contents = cell.cell_contents
            if type(contents).__name__ == "OptimizeContext":
                context = contents
                break
    if context is None:
        return None
    return dict(getattr(context, "compiler_config", None) or {})


def refuse_compiled_cudagraphs(fn: Any, field: str) -> None:
    """Raise ValueError when ``fn`` was compiled to capture CUDA graphs itself (they would nest)."""
    config = _compile_config(fn)
    if config and config.get("triton.cudagraphs"):
        raise ValueError(
            f"{field}: compiled with CUDA graphs of its own (torch.compile mode='reduce-overhead' or "
            f"'max-autotune'); graphrt's graphs cannot hold them. Compile with mode='{RECOMMENDED_MODE}' "
            "(fused kernels, no graphs) and let graphrt capture"
        )


def is_compiled(fn: Any) -> bool:
    """Whether ``fn`` is a torch.compile'd callable (an OptimizedModule or a compiled function)."""
    return _compile_config(fn) is not None


def eager_stance() -> AbstractContextManager:
    """Compiled callables run their eager code, without Dynamo, inside the block: what graphrt
    wraps around every run under its dispatch modes (``torch.compiler.set_stance("force_eager")``,
    torch >= 2.6; on an older torch nothing changes, and a compiled model called under a mode
    stays uncompiled)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()
