"""What a capture does and does not execute, for tests/fake_cuda.py's fake torch.cuda (issue 33).

A real capture records kernels and runs none: what a captured op makes is pool memory holding
whatever was there. The default CUDA generator knows it is capturing between ``capture_prologue``
and ``capture_epilogue`` (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp ``CUDAGeneratorState::increase``
refuses a draw that disagrees with the stream's capture status). cuBLAS caches one workspace per
(handle, stream) (aten/src/ATen/cuda/CublasHandlePool.cpp), allocated on the first matmul, inside
a capture from the capture's pool. Memory the allocator gave back to the driver is an illegal
address to any kernel that reads it. Each rule is modelled here on CPU tensors.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

import torch
from torch.utils._pytree import tree_leaves

from graphrt.backends.state_journal import written_tensors

if TYPE_CHECKING:
    from fake_cuda import FakeCuda, FakeCUDAGraph, FakeStream

aten = torch.ops.aten
CUBLAS_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
              aten._addmm_activation.default}
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


class CaptureEffects:
    """The fake runtime's execution rules: garbage at capture, the default generator's capture
    state, cuBLAS workspaces, reads of freed memory. ``illegal_accesses`` keeps every illegal
    address hit (on a GPU each is sticky: the CUDA context is lost), whether a caller caught it or not."""

    def __init__(self, cuda: "FakeCuda") -> None:
        self.cuda = cuda
        self.rng_capturing = False  # the default CUDA generator's ``capturing_``
        self.workspaces: Dict["FakeStream", object] = {}  # the cuBLAS workspace cached per stream
        self.freed_workspaces: List[object] = []
        self.illegal_accesses: List[str] = []

    def _illegal(self, what: str) -> None:
        self.illegal_accesses.append(what)
        raise RuntimeError(f"{ILLEGAL_ADDRESS} ({what})")

    # ---- one capture at a time ------------------------------------------------------------------

    def refuse_second_capture(self) -> None:
        """A capture while another stream of the process captures raises (one capture at a time)."""
        if self.cuda.capturing_streams():
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(cudaStreamBeginCapture: another capture is under way in this process)")

    # ---- garbage ----------------------------------------------------------------------------------

    @staticmethod
    def garble(made: List[Tuple[int, torch.Tensor]]) -> None:
        """What a captured op made holds no value until a replay: NaN (0 for integer tensors, so that
        an index built from it stays in range as the recorded kernel never runs)."""
        with torch.no_grad():
            for _, tensor in made:
                tensor.fill_(math.nan if tensor.is_floating_point() or tensor.is_complex() else 0)

    @staticmethod
    @contextlib.contextmanager
    def writing_nothing(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[None]:
        """A captured op writes nothing: what it writes in place is put back after it ran (its
        replays write it)."""
        saved = [(target, target.clone()) for _, target in written_tensors(func, args, kwargs)]
        yield
        with torch.no_grad():
            for target, before in saved:
                target.copy_(before)

    # ---- the default generator ------------------------------------------------------------------

    def check_draw(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], capturing: bool) -> None:
        """CUDAGeneratorState::increase for a draw from the default generator."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return
        if any(isinstance(leaf, torch.Generator) for leaf in tree_leaves((args, kwargs))):
            return  # an explicit generator: not modelled
        if capturing and not self.rng_capturing:
            raise RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
        if not capturing and self.rng_capturing:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")

    # ---- cuBLAS workspaces ------------------------------------------------------------------------

    def use_workspace(self, func: Any, stream: "FakeStream") -> None:
        """A captured matmul uses the stream's cached workspace, allocated on the stream's first one."""
        if func in CUBLAS_OPS:
            workspace = self.workspaces.setdefault(stream, object())
            if workspace not in stream.graph.workspaces:
                stream.graph.workspaces.append(workspace)

    def free_workspace(self, stream: "FakeStream") -> None:
        """pytorch#175276: a graph's reset() frees its capture stream's cached workspace."""
        workspace = self.workspaces.pop(stream, None)
        if workspace is not None:
            self.freed_workspaces.append(workspace)

    def clear_workspaces(self) -> None:
        """``torch._C._cuda_clearCublasWorkspaces``: forget the cached workspaces (the memory goes
        back to its pool; graphs captured with one keep using their own)."""
        self.workspaces.clear()

    def check_workspaces(self, graph: "FakeCUDAGraph") -> None:
        """A replay whose kernels use a freed workspace reads freed memory."""
        if any(workspace in self.freed_workspaces for workspace in graph.workspaces):
            self._illegal("replay of a graph whose cuBLAS workspace was freed")

    # ---- freed memory -----------------------------------------------------------------------------

    def check_reads(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """An op on a tensor whose memory empty_cache() gave back to the driver: an illegal address."""
        freed = self.cuda.allocator.freed
        if not freed:
            return
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() in freed:
                self._illegal(f"{func} on memory empty_cache() freed")

    @staticmethod
    def non_owning(value: Any) -> Any:
        """graphrt's non-owning output view, on the CPU tensors that stand for device memory."""
        if not isinstance(value, torch.Tensor):
            return value
        return graphrt_non_owning_view(value)


def graphrt_non_owning_view(value: torch.Tensor) -> torch.Tensor:
    """graphrt.backends.cuda.non_owning_view (imported late: the fake is installed over that module)."""
    from graphrt.backends.cuda import non_owning_view

    return non_owning_view(value)
