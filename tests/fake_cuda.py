"""A fake ``torch.cuda`` that keeps PyTorch's CUDA-graph and caching-allocator rules, on CPU tensors.

graphrt's CUDA backend has to keep the allocator's private graph pools valid across failed
captures, dropped graphs and recaptures. Those rules live in C++ and show only on a GPU, so this
module models them in Python and ``install()`` puts the model in place of ``torch.cuda`` for one
test (the allocator's bookkeeping is in tests/fake_cuda_allocator.py). Each rule names the PyTorch
source it follows; they agree from 2.4 to 2.13 unless a ``TorchBehaviour`` says otherwise:

- ``graph_pool_handle()`` only mints an id ``(0, uid)``; it creates no pool
  (aten/src/ATen/cuda/MemPool.cpp ``MemPool::graph_pool_handle``).
- ``CUDAGraph.capture_begin(pool)`` refuses the default stream, then calls the allocator's
  ``beginAllocateToPool`` and the pinned host allocator's ``begin_allocate_to_pool``, then
  ``cudaStreamBeginCapture`` (aten/src/ATen/cuda/CUDAGraph.cpp ``CUDAGraph::capture_begin``).
- ``beginAllocateToPool`` first creates the pool (use_count 1) or takes a reference on it, asserting
  it is still referenced (``create_or_incref_pool``: ``TORCH_INTERNAL_ASSERT(use_count > 0)``), then
  refuses a second routing to the same id (``TORCH_CHECK``: "beginAllocateToPool: already recording
  to mempool_id"), then routes (``captures_underway``) (c10/cuda/CUDACachingAllocator.cpp).
- ``capture_end`` calls ``cudaStreamEndCapture`` (which ends the capture even when it was
  invalidated) and raises on its error; only then ``endAllocateToPool`` ("endAllocatePool: not
  currently recording to mempool_id" when nothing routes) and the host allocator's end; only on
  success ``capture_ended_``. pytorch#180395 (release/2.12) ends both routings before raising.
- ``reset()`` (also the destructor) releases the pool only ``if (capture_ended_)``;
  ``releasePool`` decrements use_count (``TORCH_INTERNAL_ASSERT(uc >= 0)``: in a destructor, an
  abort) and at 0 makes the pool freeable. pytorch#190348 (merged upstream; backported to ROCm's
  2.11-2.13 branches) also releases a failed capture's reference.
- A freeable pool stays in ``graph_pools`` under its id until ``empty_cache`` (``release_cached_blocks``)
  finds none of its blocks in use. Up to 2.7 ``synchronize_and_free_events`` asserts ``captures_underway``
  is empty first (the crash pytorch#180395 reports); from 2.8 (pytorch#158152; the H200 probe on 2.11)
  ``empty_cache`` during a capture raises nothing and frees none of the default pools' blocks.
- A host sync while a stream captures (``.item()``, ``torch.cuda.synchronize()``) raises and
  invalidates the capture (cudaErrorStreamCaptureUnsupported; cudaStreamCaptureMode).
- ``torch.cuda.is_current_stream_capturing()`` is true for an active or an invalidated capture
  (torch/csrc/cuda/Module.cpp: ``currentStreamCaptureStatus() != CaptureStatus::None``).

A capture records the aten ops the step runs (a dispatch mode under every other mode) and a replay
runs them again on the captured tensors, copying each op's fresh result into the tensor it made
at capture, as a graph writes the same addresses every launch; the model's Python never runs.

What a capture executes (issue 33), in tests/fake_cuda_runtime.py: nothing of value. Every tensor
an op makes during a capture holds garbage (NaN, or 0 for integers) until a replay computes it, as
pool memory holds whatever was there. The default CUDA generator's capture (``capture_prologue`` in
``capture_begin``, ``capture_epilogue`` at the end of a successful ``capture_end``) sticks after an
invalidated capture up to 2.11: every later eager draw raises "Offset increment outside graph
capture" until a capture succeeds (pytorch#176752 runs the epilogue first). Up to 2.11 that flag is
one for the process (issue 40): while any capture is under way, another thread's eager draw and the
replay of a graph that drew (``replay_prologue``) raise it; a graph that drew nothing replays
(``replay_prologue`` returns before ``increase()`` when its whole-graph increment is 0, pytorch#143777,
from 2.7; issue 48). The first graph to register the generator allocates its seed and offset outside
the pools (a 2 MiB segment). Captures on several streams at once are legal
(``cudaStreamBeginCapture`` in ``thread_local`` mode). cuBLAS keeps one workspace per stream,
allocated in the capture's pool on the first matmul captured there (32 MiB on the Hopper modelled,
``get_device_capability``) and reused by every later capture on that stream; from pytorch#175276
``reset()`` frees it under the graphs that still use it (their replay: an illegal address).
``empty_cache()`` frees pools whose blocks no tensor owns: a tensor still viewing that memory (a
non-owning output) then reads freed memory, an illegal address. A capture past the allocator's
``capacity`` runs out of memory (it cannot free other pools' cached segments). Blocks round to 512
bytes in 2 MiB / 20 MiB / own segments (tests/fake_cuda_allocator.py).

Events (``torch.cuda.Event``) complete at once (the CPU ran the work before them), unless their stream is
stalled (``FakeStream.stall``: a kernel that never completes, as a captured NCCL collective waiting for a
peer that died, which ProcessGroupNCCL's watchdog never sees; issue 48): then an event recorded after it
never completes, and a host sync with that stream (``.item()``, ``synchronize()``) raises ``FakeHang``
where the host would wait forever.

Not modelled: kernels' timing and streams' ordering (capture runs the ops on the CPU, then replaces
what they made with garbage; its in-place writes to older tensors happen, where a GPU only records
them), block fragmentation inside a segment, graph-safe random numbers (a replay draws from the CPU
generator), explicit CUDA generators,
host syncs other than ``_local_scalar_dense``/``nonzero``/``equal``/``is_nonzero`` and device
synchronize (a pageable copy cannot be told from a CPU copy here), allocations outside graph pools
other than the generator's (``memory_reserved`` counts the modelled segments only),
``capture_error_mode`` beyond its names and ``thread_local``'s refused syncs, streams' ordering
(``wait_stream`` is a no-op), several devices, ``MemPool``, and whether the GPU build at hand
behaves as the ``TorchBehaviour`` chosen: the GPU twins in tests/test_cuda_pool.py and
scripts/gpu_checks.py, and scripts/gpu_probe.py's probes, check that.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set

import pytest
import torch
from fake_cuda_allocator import (  # noqa: F401 - the behaviours are part of this fake's interface
    BEHAVIOURS, END_BINDINGS, TORCH_2_7, TORCH_2_11, TORCH_2_12, TORCH_RESET_RELEASES, FakeAllocator, InternalAssert,
    PoolId, TorchBehaviour,
)
from fake_cuda_runtime import CaptureEffects
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

import graphrt.backends.cuda
import graphrt.backends.cuda_pool
import graphrt.backends.session
import graphrt.capture

aten = torch.ops.aten
HOST_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default,
                 aten.is_nonzero.default}
CAPTURE_MODES = ("global", "thread_local", "relaxed")


class FakeStream:
    """A CUDA stream: its capture status (cudaStreamCaptureStatus) and the graph capturing on it."""

    def __init__(self, device: Any = None, priority: int = 0, *, cuda: Optional["FakeCuda"] = None,
                 default: bool = False) -> None:
        self.cuda = cuda if cuda is not None else FakeCuda.installed
        self.cuda.streams.append(self)
        self.device = torch.device("cuda", 0) if device is None else torch.device(device)
        self.default = default
        self.status = "none"  # none | active | invalidated
        self.mode: Optional[str] = None
        self.thread: Optional[int] = None  # the thread that began the capture
        self.graph: Optional["FakeCUDAGraph"] = None
        self.stalled: Optional[str] = None  # a kernel that never completes (``stall``)

    def wait_stream(self, stream: "FakeStream") -> None:
        """Stream ordering is not modelled (the CPU runs every op at once)."""

    def wait_event(self, event: Any) -> None:
        """Stream ordering is not modelled."""

    def synchronize(self) -> None:
        self.cuda.refuse_sync("cudaStreamSynchronize")
        self.cuda.hang_on(self, "cudaStreamSynchronize")

    def stall(self, why: str) -> None:
        """A kernel on this stream that never completes (a collective waiting for a peer that is gone): the
        events recorded after it never complete, and a host sync with it waits forever (``FakeHang``)."""
        self.stalled = why

    def begin_capture(self, graph: "FakeCUDAGraph", mode: str) -> None:
        if self.status != "none":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (cudaStreamBeginCapture)")
        self.status, self.mode, self.graph = "active", mode, graph
        self.thread = threading.get_ident()

    def end_capture(self) -> bool:
        """cudaStreamEndCapture: ends any capture; False when it was invalidated (or none ran)."""
        valid = self.status == "active"
        self.status, self.mode, self.graph = "none", None, None
        return valid

    def invalidate(self) -> None:
        self.status = "invalidated"


class FakeHang(RuntimeError):
    """The host would wait here forever: a sync with a stream whose kernel never completes."""


class FakeEvent:
    """``torch.cuda.Event``: ``record`` on a stream (the current one by default); it completes once the work
    queued there before it has, which is at once here unless the stream is stalled (``FakeStream.stall``)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.done = True
        self.stream: Optional[FakeStream] = None

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.stream = stream if stream is not None else FakeCuda.installed.current_stream()
        self.done = self.stream.stalled is None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            raise FakeHang(f"the host would wait forever for an event after a stalled kernel ({self.stream.stalled})")

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        """Stream ordering is not modelled."""


class RecordedOp:
    """One aten op of a capture: replay calls it again on the captured arguments and copies the
    fresh results into the tensors it made at capture (in-place ops and views write or alias their
    arguments already)."""

    def __init__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.made = [(i, t) for i, t in enumerate(leaves) if t.numel() and _storage(t) not in inputs]

    def hold_pool_memory_weakly(self, pool_storages: Set[int]) -> None:
        """Point at the pool memory the capture made (``pool_storages``) without owning it, as a
        graph holds addresses, not tensors: a block a capture frees goes back to its pool."""

        def weak(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.numel() and _storage(value) in pool_storages:
                return CaptureEffects.non_owning(value)
            return value

        self.args, self.kwargs = tree_map(weak, self.args), tree_map(weak, self.kwargs)
        self.made = [(index, weak(target)) for index, target in self.made]

    def replay(self) -> None:
        fresh = [t for t in tree_leaves(self.func(*self.args, **self.kwargs)) if isinstance(t, torch.Tensor)]
        for index, target in self.made:
            target.copy_(fresh[index])


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class FakeCUDAGraph:
    """``torch.cuda.CUDAGraph`` with CUDAGraph.cpp's capture_begin / capture_end / replay / reset / pool."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.cuda = FakeCuda.installed
        self.capture_stream = self.cuda.current_stream()  # CUDAGraph::CUDAGraph: the current stream
        self.pool_id: Optional[PoolId] = None
        self.referenced = False  # beginAllocateToPool took a reference on pool_id
        self.capture_ended = False
        self.ops: List[RecordedOp] = []
        self.drew = False  # its capture drew from the default generator (a whole-graph increment above 0)
        self.workspaces: List[object] = []  # the cuBLAS workspaces its kernels use
        self.pool_storages: Set[int] = set()  # the memory its capture allocated (data pointers)
        self.cuda.graphs.add(self)

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Explicit CUDA generators are not modelled (the fake's tensors and generators are the CPU's)."""

    def capture_begin(self, pool: Optional[PoolId] = None, capture_error_mode: str = "global") -> None:
        if self.capture_ended:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph.")
        if capture_error_mode not in CAPTURE_MODES:
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                               f"{capture_error_mode}")
        self.cuda.effects.register_generator(self)  # and capture_prologue, before the checks below (2.11)
        stream = self.cuda.current_stream()
        if stream.default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        self.capture_stream = stream
        if pool is not None and any(pool):
            self.cuda.allocator.internal_assert(not (pool[0] and pool[1]), "!(pool.first && pool.second)")
            self.pool_id = tuple(pool)
        else:
            self.pool_id = (next(self.cuda.uids), 0)  # a private pool of its own
        allocator = self.cuda.allocator
        allocator.create_or_incref_pool(self.pool_id)  # beginAllocateToPool, in two steps: the
        self.referenced = True  # reference is taken even when the routing is then refused
        allocator.route_to_pool(self.pool_id, stream)
        allocator.host_begin(self.pool_id)
        stream.begin_capture(self, capture_error_mode)
        self.cuda.pools_begun.append(self.pool_id)

    def capture_end(self) -> None:
        stream = self.cuda.current_stream()
        if stream is not self.capture_stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        valid = stream.end_capture()
        error = None if valid else RuntimeError(
            "CUDA error: operation failed due to a previous error during capture (cudaStreamEndCapture)")
        behaviour = self.cuda.behaviour
        if error is not None and behaviour.rng_epilogue_on_failure:
            self.cuda.effects.rng_capturing = False
        if error is not None and not behaviour.end_pool_before_raising:
            raise error
        self.cuda.allocator.end_allocate_to_pool(self.pool_id)
        self.cuda.allocator.host_end(self.pool_id)
        if error is not None:
            raise error
        self.cuda.effects.rng_capturing = False  # capture_epilogue
        self.capture_ended = True

    def replay(self) -> None:
        if not self.capture_ended:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self.cuda.effects.check_replay(self)
        self.cuda.effects.check_workspaces(self)
        with torch.no_grad(), _disable_current_modes():  # a launch: no dispatch mode sees its kernels
            for op in self.ops:
                op.replay()

    def pool(self) -> PoolId:
        if not self.capture_ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def reset(self) -> None:
        release = self.capture_ended or (self.referenced and self.cuda.behaviour.reset_releases_failed)
        if self.capture_ended and self.cuda.behaviour.reset_frees_workspace:
            self.cuda.effects.free_workspace(self.capture_stream)
        self.capture_ended = self.referenced = False
        self.ops = []
        self.cuda.effects.unregister_generator(self)
        if release:
            self.cuda.allocator.release_pool(self.pool_id)

    def __del__(self) -> None:
        try:
            self.reset()
        except InternalAssert as error:  # a throwing destructor: std::terminate on a GPU
            self.cuda.aborts.append(str(error))


class RecordingMode(TorchDispatchMode):
    """Under every other mode: records the ops of an active capture on the current stream, and
    refuses host syncs while it captures."""

    def __init__(self, cuda: "FakeCuda") -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stream, effects = self.cuda.current_stream(), self.cuda.effects
        if stream.status != "none" and func in HOST_SYNC_OPS:
            stream.invalidate()
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
        if func in HOST_SYNC_OPS:
            self.cuda.hang_on(stream, str(func))
        effects.check_reads(func, args, kwargs)
        effects.check_draw(func, args, kwargs, stream)
        if stream.status != "active":
            return func(*args, **kwargs)
        with effects.writing_nothing(func, args, kwargs):
            out = func(*args, **kwargs)
        op = RecordedOp(func, args, kwargs, out)
        for _, tensor in op.made:
            self.cuda.allocator.allocated_in_capture(stream, tensor)
        effects.use_workspace(func, stream)
        effects.garble(op.made)
        stream.graph.pool_storages.update(_storage(tensor) for _, tensor in op.made)
        op.hold_pool_memory_weakly(stream.graph.pool_storages)
        stream.graph.ops.append(op)
        return out


class FakeCuda:
    """The fake runtime: one device, its streams, the allocator, and the torch.cuda functions graphrt calls."""

    installed: Optional["FakeCuda"] = None

    def __init__(self, behaviour: TorchBehaviour) -> None:
        self.behaviour = behaviour
        self.allocator = FakeAllocator(behaviour.empty_cache_asserts_in_capture)
        self.uids = itertools.count(1)
        self.streams: List[FakeStream] = []
        self.default_stream = FakeStream(cuda=self, default=True)
        self._local = threading.local()  # each thread's current stream
        self.effects = CaptureEffects(self)
        self.graphs: "weakref.WeakSet[FakeCUDAGraph]" = weakref.WeakSet()  # every graph alive
        self.pools_begun: List[PoolId] = []  # the pool of every capture_begin that got that far
        self.aborts: List[str] = []  # destructors that would have aborted the process
        self.device_capability = (9, 0)  # a Hopper, as the GPU machines' H100 and H200
        self.peers_lost = False  # a collective's peers are gone (a test sets it): its kernels never complete

    def collective(self, what: str) -> None:
        """A collective's kernel launched on the current stream: it completes, or, once ``peers_lost``, never
        does (device and network state, which no Python state of the step holds)."""
        if self.peers_lost:
            self.current_stream().stall(what)

    # ---- torch.cuda -----------------------------------------------------------------------------

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", self.default_stream)

    @contextlib.contextmanager
    def stream(self, stream: Optional[FakeStream]) -> Iterator[None]:
        previous = self.current_stream()
        if stream is not None:
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def graph_pool_handle(self) -> PoolId:
        return (0, next(self.uids))

    def refuse_sync(self, call: str) -> None:
        """A device or stream sync is prohibited while a capture in ``global`` mode, or one of this
        thread in ``thread_local`` mode, is under way (cudaStreamCaptureMode)."""
        for stream in self.capturing_streams():
            if stream.mode == "global" or (stream.mode == "thread_local" and stream.thread == threading.get_ident()):
                stream.invalidate()
                raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({call})")

    def synchronize(self, device: Any = None) -> None:
        self.refuse_sync("cudaDeviceSynchronize")
        for stream in self.streams:
            self.hang_on(stream, "cudaDeviceSynchronize")

    def hang_on(self, stream: FakeStream, call: str) -> None:
        """``call`` syncs the host with ``stream``: ``FakeHang`` if a kernel there never completes."""
        if stream.stalled is not None:
            raise FakeHang(f"{call}: the host would wait forever for a stalled kernel ({stream.stalled})")

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream().status != "none"

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def memory_reserved(self, device: Any = None) -> int:
        return self.allocator.reserved()

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocator.allocated()

    def memory_stats(self, device: Any = None) -> Dict[str, int]:
        return {"allocated_bytes.all.current": self.allocator.allocated(),
                "reserved_bytes.all.current": self.allocator.reserved()}

    def end_allocate_to_pool(self, device: int, pool_id: PoolId) -> None:
        self.allocator.end_allocate_to_pool(tuple(pool_id))

    def release_pool(self, device: int, pool_id: PoolId) -> None:
        self.allocator.release_pool(tuple(pool_id))

    # ---- for tests ------------------------------------------------------------------------------

    def capturing_streams(self) -> List[FakeStream]:
        return [stream for stream in self.streams if stream.status != "none"]

    def torch_cuda(self) -> Dict[str, Any]:
        """The ``torch.cuda`` names the fake replaces."""
        return {
            "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
            "Stream": FakeStream, "Event": FakeEvent, "current_stream": self.current_stream, "stream": self.stream,
            "synchronize": self.synchronize, "CUDAGraph": FakeCUDAGraph, "graph_pool_handle": self.graph_pool_handle,
            "is_current_stream_capturing": self.is_current_stream_capturing, "empty_cache": self.empty_cache,
            "memory_reserved": self.memory_reserved, "memory_allocated": self.memory_allocated,
            "memory_stats": self.memory_stats, "get_device_capability": lambda device=None: self.device_capability,
            "get_device_name": lambda device=None: "a Hopper faked on the CPU (tests/fake_cuda.py)",
        }


@contextlib.contextmanager
def install(monkeypatch: pytest.MonkeyPatch, behaviour: TorchBehaviour) -> Iterator[FakeCuda]:
    """``torch.cuda`` (and the private allocator bindings of ``torch._C``) replaced by a fake that
    behaves as ``behaviour`` says, for the block; the recording mode sits under every other mode."""
    cuda = FakeCuda(behaviour)
    for name, value in cuda.torch_cuda().items():
        monkeypatch.setattr(torch.cuda, name, value)
    for name in END_BINDINGS:
        if name == behaviour.end_binding:
            monkeypatch.setattr(torch._C, name, cuda.end_allocate_to_pool, raising=False)
        else:
            monkeypatch.delattr(torch._C, name, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", cuda.release_pool, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", cuda.effects.clear_workspaces, raising=False)
    # Outputs are non-owning views of pool memory as on a GPU (the fake allocator keeps the CPU memory).
    monkeypatch.setattr(graphrt.backends.cuda, "non_owning", cuda.effects.non_owning)
    monkeypatch.setattr(FakeCuda, "installed", cuda)
    # graphrt's gates on torch's release, as graphrt sets them on the release modelled
    up_to_2_11 = behaviour in (TORCH_2_7, TORCH_2_11)
    monkeypatch.setattr(graphrt.backends.session, "GENERATOR_FLAG_PROCESS_WIDE", up_to_2_11)
    monkeypatch.setattr(graphrt.backends.cuda_pool, "RELEASE_FAILED_CAPTURE_POOL", up_to_2_11)
    # CPU tensors stand for device memory here, so capture's check that a CUDA graph's tensors live
    # on its device (tests/test_wrap_capture.py tests it) would refuse every key.
    monkeypatch.setattr(graphrt.capture, "check_devices", lambda entry, graph, device: None)
    with RecordingMode(cuda):
        yield cuda
