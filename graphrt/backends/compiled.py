"""torch.compile'd callables inside graphrt: refuse those that capture CUDA graphs of their own.

``mode="reduce-overhead"`` (and ``"max-autotune"``) make inductor capture its own CUDA graphs
(cudagraph trees); captured again inside graphrt's graph they would nest, which CUDA refuses.
Fusion without graphs (``mode="max-autotune-no-cudagraphs"``, or the default mode) pairs well:
graphrt records the compiled step's kernels on CUDA, and on CPU the recording runs the step's
eager ops (torch.compile steps aside under a dispatch mode), which verification compares with
the compiled step's own numbers.
"""

from __future__ import annotations

from typing import Any, Optional

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
