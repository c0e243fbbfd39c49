"""What a capture does and does not execute, for tests/fake_cuda.py's fake torch.cuda (issues 33, 40, 48).

A real capture records kernels and runs none: what a captured op makes is pool memory holding
whatever was there. Up to torch 2.11 the default CUDA generator has one capture flag for the process,
on between ``capture_prologue`` and ``capture_epilogue`` (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp):
``CUDAGeneratorState::increase`` refuses a draw that disagrees with the calling stream's capture
status, so another thread's eager draw raises while any capture is under way. A replay calls it too
(``replay_prologue(wholegraph_increment)``), but only for a graph that drew: since pytorch#143777
(December 2024, in every release from 2.7) ``replay_prologue`` returns before ``increase()`` when the
graph's capture drew nothing, so replaying such a graph during another thread's capture works. The
first graph that registers the generator allocates its seed and offset (two 8-byte tensors, outside
any graph pool). cuBLAS caches one workspace per (handle, stream)
(aten/src/ATen/cuda/CublasHandlePool.cpp), allocated on the first matmul, inside a capture from the
capture's pool: ``graphrt.backends.cuda_pool.cublas_workspace_bytes`` of the Hopper this fake
models (``get_device_capability``), which scripts/gpu_probe.py checks on a GPU. Memory the allocator gave back to the driver is an illegal
address to any kernel that reads it. Each rule is modelled here on CPU tensors.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_leaves

from graphrt.backends.cuda_pool import cublas_workspace_bytes
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
        self.rng_capturing = False  # the default CUDA generator's ``capturing_`` (one for the process up to 2.11)
        self.rng_graphs: "weakref.WeakSet[FakeCUDAGraph]" = weakref.WeakSet()  # graphs that registered it
        self.rng_tensors: List[torch.Tensor] = []  # its seed and offset while a graph is registered
        self.workspaces: Dict["FakeStream", Workspace] = {}  # the cuBLAS workspace cached per stream
        self.freed_workspaces: List[Workspace] = []
        self.illegal_accesses: List[str] = []

    def _illegal(self, what: str) -> None:
        self.illegal_accesses.append(what)
        raise RuntimeError(f"{ILLEGAL_ADDRESS} ({what})")

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

    def register_generator(self, graph: "FakeCUDAGraph") -> None:
        """capture_begin registers the default generator (up to 2.11, before anything else): the first
        graph registered allocates its seed and offset outside the pools; then ``capture_prologue``."""
        if self.cuda.behaviour.rng_per_capture:
            return
        if not self.rng_graphs:
            self.rng_tensors = [torch.empty(1, dtype=torch.int64) for _ in range(2)]
            for tensor in self.rng_tensors:
                self.cuda.allocator.allocate_outside_pools(tensor)
        self.rng_graphs.add(graph)
        self.rng_capturing = True

    def unregister_generator(self, graph: "FakeCUDAGraph") -> None:
        """reset() unregisters it; the last graph gone frees the seed and offset (their segment stays cached)."""
        self.rng_graphs.discard(graph)
        if not self.rng_graphs:
            self.rng_tensors = []

    def check_replay(self, graph: "FakeCUDAGraph") -> None:
        """``replay_prologue(wholegraph_increment)``: nothing for a graph whose capture drew nothing
        (pytorch#143777); for one that drew, the default generator's ``increase()`` outside a capture,
        which refuses while its process-wide flag is on (another thread's capture under way)."""
        if graph.drew and not self.cuda.behaviour.rng_per_capture and self.rng_capturing:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")

    def check_draw(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], stream: "FakeStream") -> None:
        """CUDAGeneratorState::increase for a draw from the default generator (on ``stream``); a draw
        inside a capture gives its graph a whole-graph increment (its replays draw)."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return
        if any(isinstance(leaf, torch.Generator) for leaf in tree_leaves((args, kwargs))):
            return  # an explicit generator: not modelled
        capturing = stream.status != "none"
        if capturing and stream.graph is not None:
            stream.graph.drew = True
        if self.cuda.behaviour.rng_per_capture:
            return  # each capture draws from a state of its own
        if capturing and not self.rng_capturing:
            raise RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
        if not capturing and self.rng_capturing:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")

    # ---- cuBLAS workspaces ------------------------------------------------------------------------

    def use_workspace(self, func: Any, stream: "FakeStream") -> None:
        """A captured matmul uses the stream's cached workspace, allocated in the capture's pool on the
        stream's first one."""
        if func not in CUBLAS_OPS:
            return
        workspace = self.workspaces.get(stream)
        if workspace is None:
            memory = torch.empty(cublas_workspace_bytes(self.cuda.device_capability), dtype=torch.uint8)
            self.cuda.allocator.allocated_in_capture(stream, memory)
            workspace = self.workspaces[stream] = Workspace(memory)
        if workspace not in stream.graph.workspaces:
            stream.graph.workspaces.append(workspace)

    def free_workspace(self, stream: "FakeStream") -> None:
        """pytorch#175276: a graph's reset() frees its capture stream's cached workspace."""
        workspace = self.workspaces.pop(stream, None)
        if workspace is not None:
            workspace.memory = None
            self.freed_workspaces.append(workspace)

    def clear_workspaces(self) -> None:
        """``torch._C._cuda_clearCublasWorkspaces``: forget the cached workspaces (their blocks go back
        to their pool; graphs captured with one keep using its addresses)."""
        for workspace in self.workspaces.values():
            workspace.memory = None
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


class Workspace:
    """One cuBLAS workspace: its memory while cuBLAS caches it (a freed block of its pool after)."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory: Optional[torch.Tensor] = memory


def graphrt_non_owning_view(value: torch.Tensor) -> torch.Tensor:
    """graphrt.backends.cuda.non_owning_view (imported late: the fake is installed over that module)."""
    from graphrt.backends.cuda import non_owning_view

    return non_owning_view(value)
