"""Shared fixtures: a toy paged model, batch factories, and the backend matrix (cuda tests skip cleanly)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import gemm_rounding
import pytest
import torch

from graphrt import ForwardBatch, ForwardMode
from graphrt.parallel.lockstep import pad_forward_batch

# One torch thread in the test processes and in the interpreters they start (OMP_NUM_THREADS, unless set): the
# tests' ops are tiny, and on a shared 2-core machine running 2 pytest-xdist workers a second thread only
# spin-waits for the first (a [4, 32] x [32, 64] linear took 16 ms of CPU with 2 threads under load, 4 us with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
SCRATCH_SLOT = 0
gemm_rounding.install()  # GRAPHRT_TEST_GEMM_ROUNDING=1: GEMMs round per batch size (tests/gemm_rounding.py)
CUDA_AVAILABLE = torch.cuda.is_available()

BACKENDS = [
    pytest.param(("emulated", "cpu"), id="emulated"),
    pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.cuda),
]


class Faults:
    """Fault injection for a test model: its forward calls ``point(rows)``, a device-side assertion
    (``torch._assert_async``, as a CUDA kernel's) on the switches, a tensor: at the batch sizes marked
    ``failing``, or on every call while ``always``. Flipping a fault writes that tensor, no Python state of
    the step (a Python attribute or container its forward reads would be state, which the guards compare:
    the calls after a flip would run eagerly); a replay reads the switches as eager does."""

    __slots__ = ("failing", "always")

    def __init__(self, capture_at=None, max_rows=64):
        self.failing = torch.zeros(max_rows + 1, dtype=torch.bool)  # per batch size: its steps fail
        self.always = torch.zeros((), dtype=torch.bool)
        self.capture_at = capture_at

    def point(self, rows: int) -> None:
        torch._assert_async(~(self.failing[rows] | self.always), "simulated failure")

    @property
    def capture_at(self):
        marked = self.failing.nonzero().flatten().tolist()
        return marked[0] if marked else None

    @capture_at.setter
    def capture_at(self, rows):
        self.failing.zero_()
        if rows is not None:
            self.failing[rows] = True

    @property
    def now(self):
        return bool(self.always)

    @now.setter
    def now(self, value):
        self.always.fill_(bool(value))


@contextmanager
def failing_capture(runner, num_reqs, error):
    """The capture of ``runner``'s key of ``num_reqs`` requests raises ``error`` from its step (an out-of-memory,
    an interrupt: the runtime's doing, not the model's), until the block ends."""
    entry = next(entry for key, entry in runner.registry.entries.items() if key.num_reqs == num_reqs)
    step = entry.step

    def failing():
        raise error

    entry.step = failing
    try:
        yield entry
    finally:
        entry.step = step


@contextmanager
def python_runs(function, record):
    """Appends ``function``'s name to ``record`` each time its code runs in the block. A profiler
    sees it without changing the model: a hook registered on the model would be a change its
    graphs' guards see (the calls after it would run eagerly, the hook included)."""
    code = function.__code__
    outer = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            record.append(code.co_name)
        if outer is not None:
            outer(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield record
    finally:
        sys.setprofile(outer)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords and not CUDA_AVAILABLE:
            item.add_marker(skip)


class ToyPagedModel(torch.nn.Module):
    """Embeds tokens and positions, writes each token's state into an external KV tensor at
    out_cache_loc, mixes in the request's previous KV row, and projects through a GEMM."""

    def __init__(self, vocab: int = 97, hidden: int = 32, num_slots: int = 256, device: str = "cpu") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator).to(device))
        self.pos = torch.nn.Parameter(torch.randn(512, hidden, generator=generator).to(device))
        self.proj = torch.nn.Parameter(torch.randn(hidden, vocab, generator=generator).to(device) / hidden**0.5)
        self.kv = torch.zeros(num_slots, hidden, device=device)

    def forward(self, input_ids, positions, forward_batch):
        if positions is None:
            positions = forward_batch.seq_lens.long() - 1
        hidden = self.embed[input_ids] + self.pos[positions]
        self.kv.index_copy_(0, forward_batch.out_cache_loc, hidden)
        previous = self.kv[forward_batch.req_pool_indices]
        hidden = hidden + 0.5 * previous + forward_batch.seq_lens.to(hidden.dtype)[:, None] * 1e-3
        return hidden @ self.proj


def decode_batch(batch_size: int, device: str = "cpu", seed: int = 0, **overrides) -> ForwardBatch:
    """A valid random DECODE batch (slots and requests start at 1: 0 is reserved for padding)."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 50, (batch_size,), generator=generator, dtype=torch.int32)
    fields = dict(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch_size,
        input_ids=torch.randint(0, 97, (batch_size,), generator=generator).to(device),
        req_pool_indices=(torch.randperm(100, generator=generator)[:batch_size] + 1).to(device),
        seq_lens=seq_lens.to(device),
        out_cache_loc=(torch.randperm(200, generator=generator)[:batch_size] + 1).to(device),
        seq_lens_sum=int(seq_lens.sum()),
        positions=(seq_lens.long() - 1).to(device),
    )
    fields.update(overrides)
    return ForwardBatch(**fields)


def captured_runner(model, **options):
    """A GraphRunner of ``model`` with one key (4 rows, emulated backend), captured without a failure."""
    from graphrt import GraphRunner

    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[4], backend="emulated", progress=False, **options)
    assert not runner.capture().failed
    return runner


def calls(fast, *args, times=3, **kwargs):
    """``times`` calls of a wrapped callable (warm-up, recording, replay by default); the last result."""
    result = None
    for _ in range(times):
        result = fast(*args, **kwargs)
    return result


def failures(fast):
    """A front's guard failures, in one string."""
    return " | ".join(fast.stats()["guard_failures"])


def eager_step(model, batch):
    """``model`` on ``batch`` eagerly, as a runner's eager path calls it."""
    with torch.no_grad():
        return model(batch.input_ids, batch.positions, batch)


def pad_batch(batch: ForwardBatch, padded: int, scratch: int = SCRATCH_SLOT) -> ForwardBatch:
    """The same batch padded eagerly the way the runner pads (ids/positions 0, seq_lens 1,
    out_cache_loc the scratch slot, req_pool_indices the dummy request 0)."""
    pad_values = {"input_ids": 0, "positions": 0, "seq_lens": 1, "out_cache_loc": scratch, "req_pool_indices": 0}
    return pad_forward_batch(batch, padded, padded, pad_values)


def static_checksums(runner) -> dict:
    """A copy of every static input tensor, to prove bad input leaves them unchanged."""
    return {name: slot.tensor.clone() for name, slot in runner.buffers.slots.items()}


@pytest.fixture(params=["python_ints", "torch_reductions"])
def value_check_path(request, monkeypatch):
    """Both ways ``ForwardBatch.validate`` reads host values: as Python ints (small batches) and as
    fused torch reductions (batches of more values than ``HOST_LIST_VALUES``, and device tensors)."""
    if request.param == "torch_reductions":
        monkeypatch.setattr("graphrt.batch.HOST_LIST_VALUES", 0)
    return request.param


@pytest.fixture(autouse=True)
def nothing_left_active():
    """Every test leaves the process as it found it: no capture journal, tracer, profiler or dispatch mode
    left active, the collector on, no capture session open and torch's global settings (default dtype,
    matmul precision, ...) as they were (a leak would change what later tests see)."""
    import gc

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from graphrt.backends import session
    from graphrt.guards import epoch
    from graphrt.guards.torch_settings import torch_settings

    tracer, profiler, settings = sys.gettrace(), sys.getprofile(), torch_settings()
    yield
    left = {
        "an assignment journal": epoch.JOURNAL.active is not None,
        "a tracer": sys.gettrace() is not tracer,
        "a profiler": sys.getprofile() is not profiler,
        "a dispatch mode": bool(_get_current_dispatch_mode_stack()),
        "the collector off": not gc.isenabled(),
        "a capture session": session._gc_sessions != 0,
        "torch's settings changed": torch_settings() != settings,
    }
    assert not any(left.values()), f"left active: {[name for name, active in left.items() if active]}"
