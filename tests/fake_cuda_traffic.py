"""What a step costs the host on tests/fake_cuda.py: its host-to-device copies and the calls where the host
waits for the device, in the order they happen.

On the fake every tensor is CPU memory, so this module says which is host memory: the storages it is told
are (``host``: the engine's pinned staging arenas, the runners' host mirrors), every other tensor standing
for device memory. Logged while ``watching``, in order:

- ``("h2d", pinned, non_blocking)``: a ``copy_`` from host memory into device memory (``pinned``: from one
  of the storages registered as pinned);
- ``("pageable h2d", call)``: ``torch.tensor``/``torch.as_tensor`` given a ``device`` (on CUDA a copy from
  pageable memory that the host waits for);
- ``("d2h", non_blocking)``: a ``copy_`` from device memory into host memory;
- ``("sync", what)``: the host waits for the device: ``Event.synchronize``, a stream's or the device's
  ``synchronize``, an op that reads a device value on the host (``.item()``, ``nonzero``, ...), or a
  Python read of device memory (``tolist``, ``numpy``, ``int()``, ``bool()``, ...).

Not seen: reads inside C++ (an index tensor on the host for a device tensor), the order of streams.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Tuple

import pytest
import torch
from fake_cuda import HOST_SYNC_OPS, FakeCuda
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__")
COPIES = (aten.copy_.default,)


def _span(tensor: torch.Tensor) -> Tuple[int, int]:
    """The addresses of a tensor's storage (a ``torch.from_numpy`` view of an arena is a storage of its own,
    inside the arena's)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class Traffic(TorchDispatchMode):
    """The log of one watch (see the module docstring), over the host storages registered."""

    def __init__(self) -> None:
        super().__init__()
        self.log: List[Tuple[Any, ...]] = []
        self.host: List[Tuple[int, int]] = []
        self.pinned: List[Tuple[int, int]] = []
        self.watching = False

    def register(self, tensors: Iterable[torch.Tensor], pinned: bool = False) -> None:
        """These tensors' storages are host memory (``pinned``: page-locked staging memory)."""
        for tensor in tensors:
            self.host.append(_span(tensor))
            if pinned:
                self.pinned.append(_span(tensor))

    def is_host(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and _inside(tensor, self.host)

    def note(self, *entry: Any) -> None:
        if self.watching:
            self.log.append(entry)

    @contextlib.contextmanager
    def watch(self) -> Iterator[List[Tuple[Any, ...]]]:
        """Log what happens inside the block; the log, cleared first."""
        self.log.clear()
        self.watching = True
        try:
            yield self.log
        finally:
            self.watching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.watching:
            if func in COPIES:
                destination, source = args[0], args[1]
                non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
                if self.is_host(source) and not self.is_host(destination):
                    self.note("h2d", _inside(source, self.pinned), non_blocking)
                elif not self.is_host(source) and self.is_host(destination):
                    self.note("d2h", non_blocking)
            elif func in HOST_SYNC_OPS and any(isinstance(arg, torch.Tensor) and not self.is_host(arg) for arg in args):
                self.note("sync", str(func))
        return func(*args, **kwargs)


def _inside(tensor: torch.Tensor, spans: List[Tuple[int, int]]) -> bool:
    start, end = _span(tensor)
    return any(low <= start and end <= high for low, high in spans)


@contextlib.contextmanager
def traffic(monkeypatch: pytest.MonkeyPatch, cuda: FakeCuda) -> Iterator[Traffic]:
    """A ``Traffic`` over the installed fake (``cuda``): its events, syncs and the tensors' host reads patched to
    log while it watches; its dispatch mode under the fake's recording mode's."""
    log = Traffic()

    class Event:
        """``torch.cuda.Event`` that completes at once (the CPU ran the work before it), its waits logged."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            pass

        def record(self, stream: Any = None) -> None:
            log.note("record")

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            cuda.refuse_sync("cudaEventSynchronize")
            log.note("sync", "Event.synchronize")

        def wait(self, stream: Any = None) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    device_sync, stream_sync = cuda.synchronize, type(cuda.default_stream).synchronize
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: (log.note("sync", "device"), device_sync(device)))
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    monkeypatch.setattr(type(cuda.default_stream), "synchronize",
                        lambda stream: (log.note("sync", "stream"), stream_sync(stream)))
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(tensor: torch.Tensor, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if not log.is_host(tensor):
                log.note("sync", _name)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    for name in ("tensor", "as_tensor"):
        made = getattr(torch, name)

        def factory(*args: Any, _made: Any = made, _name: str = name, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                log.note("pageable h2d", _name)
            return _made(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)
    with log:
        yield log
