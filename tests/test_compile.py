"""torch.compile inside graphrt: a compiled model gives eager's numbers on every call, its state
advances once per call, and its graphs replay; one compiled with CUDA graphs of its own is refused.

On CPU the recording sees the step's eager ops (graphrt runs compiled callables eagerly under its dispatch
modes; each key is compiled first with no mode active) and verification compares the replay with the step; compiled kernels
round differently from eager by a few ulps, hence allclose.
"""

from __future__ import annotations

import pytest
import torch

import graphrt
from tests.conftest import ToyPagedModel, decode_batch


class Stepper(torch.nn.Module):
    """An MLP with a step counter (state that must advance once per call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return torch.nn.functional.gelu(self.linear(x)) * 2 + self.steps


def test_wrap_of_an_inductor_compiled_module_equals_eager_and_replays():
    model = Stepper().eval()
    fast = graphrt.wrap(torch.compile(model, mode="max-autotune-no-cudagraphs"), max_batch_size=8, backend="emulated")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for call in range(1, 5):
            x = torch.randn(3, 16, generator=generator)
            out = fast(x)
            assert int(model.steps) == call
            expected = torch.nn.functional.gelu(model.linear(x)) * 2 + model.steps
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    stats = fast.stats()
    assert stats["graph_runs"] == 3 and stats["eager_reasons"] == {"warmup": 1}


@pytest.mark.cuda
def test_an_inductor_compiled_module_under_cuda_capture_equals_eager_and_replays():
    """torch.compile's kernels (inductor, Triton) recorded in a graphrt CUDA graph (issue 40, item 7): each
    size compiles with no capture under way, then records; replays give eager's numbers and state."""
    model = Stepper().cuda().eval()
    fast = graphrt.wrap(torch.compile(model, mode="max-autotune-no-cudagraphs"), max_batch_size=8, backend="cuda")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for call in range(1, 6):
            x = torch.randn(3, 16, generator=generator).cuda()
            out = fast(x)
            assert int(model.steps) == call
            torch.testing.assert_close(out, torch.nn.functional.gelu(model.linear(x)) * 2 + model.steps,
                                       rtol=1e-4, atol=1e-4)
    stats = fast.stats()
    assert stats["backend"] == "cuda" and stats["graph_runs"] == 4 and stats["failed_keys"] == {}, stats


def test_runner_of_a_compiled_model_equals_eager_and_replays():
    """``backend="aot_eager"``: torch.compile's tracing without inductor's C++ build (seconds, not tens)."""
    model = ToyPagedModel()
    runner = graphrt.GraphRunner(torch.compile(model, backend="aot_eager"), max_batch_size=8, capture_sizes=[4, 8],
                                 backend="emulated", progress=False)
    report = runner.capture()
    assert not report.failed
    for seed in range(3):
        batch = decode_batch(3, seed=seed)
        with torch.no_grad():
            expected = model(batch.input_ids, batch.positions, batch)
        torch.testing.assert_close(runner(batch), expected)
    assert runner.stats()["graph_runs"] == 3


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compiled_with_its_own_cuda_graphs_is_refused_naming_the_pairing(mode):
    model = Stepper()
    with pytest.raises(ValueError, match="fn: compiled with CUDA graphs of its own.*max-autotune-no-cudagraphs"):
        graphrt.wrap(torch.compile(model, mode=mode), max_batch_size=8)
    with pytest.raises(ValueError, match="model: compiled with CUDA graphs"):
        graphrt.GraphRunner(torch.compile(model.forward, mode=mode), max_batch_size=8)


class CountingBackend:
    """A torch.compile backend that counts compilations (and the dispatch mode active during each)
    and runs of the compiled code."""

    def __init__(self) -> None:
        self.compiles_under_mode = []  # per compilation: was a torch dispatch mode active
        self.runs = 0

    def __call__(self, graph_module, example_inputs):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        self.compiles_under_mode.append(_get_current_dispatch_mode() is not None)

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)

        return run


def test_a_compiled_model_compiles_outside_every_dispatch_mode_and_stays_compiled():
    """A compiled callable first called under a dispatch mode is skipped by Dynamo for good: capture
    compiles each key with no mode active (state undone), records its eager path, and after capture
    an eager step still runs compiled code."""
    model = ToyPagedModel()
    counting = CountingBackend()
    runner = graphrt.GraphRunner(torch.compile(model, backend=counting, dynamic=False), max_batch_size=8,
                                 capture_sizes=[4, 8], backend="emulated", progress=False)
    kv = model.kv.clone()
    assert not runner.capture().failed
    assert len(counting.compiles_under_mode) >= 2 and not any(counting.compiles_under_mode), (
        "every key compiled, none under a dispatch mode")
    assert torch.equal(model.kv, kv), "the compile warm-ups' writes are undone"
    runs = counting.runs
    batch = decode_batch(9, seed=1)  # above the largest key: eager
    with torch.no_grad():
        expected = model(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(runner(batch), expected)
    assert runner.stats()["eager_reasons"] == {"batch_too_large": 1} and counting.runs == runs + 1, (
        "the eager step ran the compiled code")


def test_check_leaves_a_compiled_callable_compilable():
    counting = CountingBackend()
    compiled = torch.compile(Stepper().eval(), backend=counting)
    assert graphrt.check(compiled, torch.ones(2, 16)).ok
    compiled(torch.ones(2, 16))
    assert counting.compiles_under_mode == [False] and counting.runs == 1
