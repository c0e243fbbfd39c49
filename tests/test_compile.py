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


@pytest.mark.cuda
def test_a_forward_compiled_in_place_compiles_before_the_cuda_capture_and_replays():
    """Issue 42, item 7: ``model.forward = torch.compile(model.forward)`` (the compile inside the wrapped
    module, not handed over): each key compiles between its warm-ups and its CUDA recording, the batch
    dim dynamic (one graph for sizes 2 to 8), so inductor's kernels are recorded in graphrt's graph and
    nothing compiles inside the capture; replays equal eager."""
    model = Stepper().cuda().eval()
    model.forward = torch.compile(model.forward, mode="max-autotune-no-cudagraphs")
    fast = graphrt.wrap(model, max_batch_size=8, capture_sizes=[2, 4, 8], backend="cuda")
    report = fast.capture(torch.randn(8, 16, device="cuda"))
    assert report.ok and not report.failed and [key.compiled for key in report.keys] == [True] * 3, str(report)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for call in range(1, 5):
            x = torch.randn(3, 16, generator=generator).cuda()
            steps = int(model.steps)
            out = fast(x)
            assert int(model.steps) == steps + 1
            torch.testing.assert_close(out, torch.nn.functional.gelu(model.linear(x)) * 2 + model.steps,
                                       rtol=1e-4, atol=1e-4)
    assert fast.stats()["graph_runs"] == 4


class TrainDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.dropout(self.linear(x), p=0.5, training=True)


@pytest.mark.cuda
def test_an_inductor_compiled_train_mode_dropout_is_refused_by_verification_on_cuda():
    """Issue 42, item 7 (a prediction for the first GPU session; docs/MANUAL.md records it): inductor
    draws dropout's mask with its own philox kernels, not eager's, so the replay of a compiled
    train-mode dropout differs from the eager step graphrt verifies it against: ``verify_failed``, and
    the calls run the compiled model as it is (no wrong answer, no replay)."""
    model = TrainDropout().cuda()
    fast = graphrt.wrap(torch.compile(model), max_batch_size=4, capture_sizes=[4], backend="cuda")
    x = torch.ones(4, 16, device="cuda")
    with torch.no_grad():
        outputs = [fast(x) for _ in range(3)]
    stats = fast.stats()
    assert stats["graph_runs"] == 0 and stats["eager_reasons"].get("verify_failed", 0) >= 1, stats
    assert all(reason.startswith("VerifyError") for reason in stats["failed_keys"].values()), stats["failed_keys"]
    for output in outputs:
        dropped = float((output == 0).float().mean())
        assert 0.2 < dropped < 0.8, "the compiled model's own dropout ran"


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
    with pytest.raises(ValueError, match=r"fn: torch.compile\(Stepper, backend='inductor'\) captures CUDA graphs of its "
                                         "own.*max-autotune-no-cudagraphs"):
        graphrt.wrap(torch.compile(model, mode=mode), max_batch_size=8)
    with pytest.raises(ValueError, match=r"model: torch.compile\(Stepper.forward, .*\) captures CUDA graphs"):
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
    report = runner.capture()
    assert not report.failed and [key.compiled for key in report.keys] == [True, True], str(report)
    assert counting.compiles_under_mode and not any(counting.compiles_under_mode), "none compiled under a dispatch mode"
    assert counting.runs == 2, "each key's compile run ran compiled code"
    assert torch.equal(model.kv, kv), "the compile warm-ups' writes are undone"
    runs = counting.runs
    batch = decode_batch(9, seed=1)  # above the largest key: eager
    with torch.no_grad():
        expected = model(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(runner(batch), expected)
    assert runner.stats()["eager_reasons"] == {"batch_too_large": 1} and counting.runs == runs + 1, (
        "the eager step ran the compiled code")


class MetaRebindingBackend(CountingBackend):
    """A compile backend that rebinds its GraphModule's ``meta`` after building it, as inductor does on
    CUDA (seen on an H200, torch 2.11: ``RebindError: GraphModuleImpl.meta: the step rebinds it``)."""

    def __call__(self, graph_module, example_inputs):
        graph_module.meta = dict(graph_module.meta)
        return super().__call__(graph_module, example_inputs)


@pytest.mark.parametrize("where", ["handed over", "forward compiled in place"])
def test_compiling_runs_outside_the_assignment_journal(where):
    """The compile run of each key runs the step bare: the attributes compiling assigns on Dynamo's and
    inductor's own modules are not the step's Python state (before: the first recording of every key
    failed with RebindError on a GPU, naming ``GraphModuleImpl.meta``)."""
    model = Stepper().eval()
    backend = MetaRebindingBackend()
    if where == "handed over":
        fn = torch.compile(model, backend=backend)
    else:
        model.forward = torch.compile(model.forward, backend=backend)
        fn = model
    fast = graphrt.wrap(fn, max_batch_size=8, capture_sizes=[4, 8], backend="emulated")
    report = fast.capture(torch.randn(8, 16))
    assert not report.failed and [key.compiled for key in report.keys] == [True, True], str(report)


def test_check_leaves_a_compiled_callable_compilable():
    counting = CountingBackend()
    compiled = torch.compile(Stepper().eval(), backend=counting)
    assert graphrt.check(compiled, torch.ones(2, 16)).ok
    compiled(torch.ones(2, 16))
    assert counting.compiles_under_mode == [False] and counting.runs == 1


def test_wrap_warm_up_leaves_a_compiled_part_of_the_model_compilable():
    """The warm-up notes the tensors read from outside the arguments under a dispatch mode: a compiled
    submodule (nano-vllm compiles its RMSNorm and sampler) runs its eager code there, not skipped for good."""
    counting = CountingBackend()

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.compile(Stepper().eval(), backend=counting)

        def forward(self, x):
            return self.inner(x) + 1

    model = Outer().eval()
    fast = graphrt.wrap(model, max_batch_size=4, capture_sizes=[2])
    with torch.no_grad():
        fast(torch.ones(2, 16))  # the warm-up
        model.inner(torch.ones(2, 16))
    assert counting.compiles_under_mode == [False] and counting.runs == 1


# ---------------------------------------------------------------- CUDA-graph modes wherever the compile sits


class WithCompiledPart(torch.nn.Module):
    """A model one of whose parts is compiled (nano-vllm compiles its RMSNorm and sampler this way)."""

    def __init__(self, part) -> None:
        super().__init__()
        self.part = part

    def forward(self, x):
        return self.part(x) + 1


@pytest.mark.parametrize("where, options", [("forward assigned back", dict(mode="reduce-overhead")),
                                            ("compiled submodule", dict(mode="max-autotune")),
                                            ("lambda over a compiled module", dict(backend="cudagraphs"))])
def test_a_cuda_graph_compile_anywhere_in_the_step_is_refused_by_name_with_the_fix(where, options):
    """Issue 42, item 1: refused only when handed to graphrt before; found now from what the step ran.
    The first recording names it and the fix; no other key is tried, every call runs eagerly (eager's
    numbers), nothing is compiled with CUDA graphs inside graphrt's runs."""
    inner = Stepper().eval()
    if where == "forward assigned back":
        model = inner
        model.forward = torch.compile(model.forward, **options)
        fn, name = model, "Stepper.forward"
    elif where == "compiled submodule":
        model = WithCompiledPart(torch.compile(inner, **options)).eval()
        fn, name = model, "Stepper"
    else:
        compiled = torch.compile(inner, **options)
        model, fn, name = inner, (lambda x: compiled(x)), "Stepper"
    fast = graphrt.wrap(fn, max_batch_size=8, backend="emulated")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for call in range(1, 5):
            x = torch.randn(3, 16, generator=generator)
            before = int(inner.steps)
            out = fast(x)
            assert int(inner.steps) == before + 1
            expected = torch.nn.functional.gelu(inner.linear(x)) * 2 + inner.steps
            torch.testing.assert_close(out, expected + (1 if where == "compiled submodule" else 0))
    stats = fast.stats()
    (reason,) = stats["failed_keys"].values()
    assert reason.startswith(f"NestedGraphsError: the step runs torch.compile({name}, ") and (
        "captures CUDA graphs of its own" in reason and "mode='max-autotune-no-cudagraphs'" in reason), reason
    assert stats["graph_runs"] == 0 and stats["eager_reasons"] == {"warmup": 1, "capture_failed": 3}, stats


def test_a_runner_whose_model_forward_was_compiled_with_cuda_graphs_refuses_every_key_after_the_first():
    model = ToyPagedModel()
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    runner = graphrt.GraphRunner(model, max_batch_size=8, capture_sizes=[2, 4, 8], backend="emulated", progress=False)
    report = runner.capture()
    assert len(report.failed) == 3 and len(set(report.failed.values())) == 1, report.failed
    assert "NestedGraphsError: the step runs torch.compile(ToyPagedModel.forward, " in report.keys[0].reason
    assert report.keys[1].seconds < report.keys[0].seconds, "the later keys were not run"
    batch = decode_batch(3, seed=1)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        expected = model(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(runner(batch), expected)
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1}


# ---------------------------------------------------------------- compiled code for every capture size


def test_every_capture_size_gets_compiled_code_and_the_users_later_calls_stay_compiled():
    """Issue 42, item 5: with ``dynamic=False`` each capture size's compile warm-up was a recompile,
    and Dynamo's limit (8) left sizes 4, 2 and 1 uncompiled (capture goes largest first) and the code
    object eager for good: the user's later compiled calls at new sizes ran eagerly too. Now the
    batch dim is marked dynamic once and the limit raised for graphrt's runs: every key's code is
    compiled (the report says so per key) and later calls at new sizes run compiled code."""
    model = ToyPagedModel()
    counting = CountingBackend()
    compiled = torch.compile(model, backend=counting, dynamic=False)
    runner = graphrt.GraphRunner(compiled, max_batch_size=64, backend="emulated", progress=False)
    report = runner.capture()
    assert len(report.keys) == 11 and not report.failed, report.failed
    assert [key.compiled for key in report.keys] == [True] * 11, str(report)
    assert "compiled" in str(report).splitlines()[0] and " yes+1 " in str(report).splitlines()[1]
    assert " yes " in str(report).splitlines()[2], "the next key runs the graph compiled for the first"
    assert len(counting.compiles_under_mode) <= 3, "one graph for every size (and Dynamo's size-1 specialization)"
    for size in (3, 5, 7, 9, 11, 13, 15, 17, 19, 21):  # the user's own calls, at sizes no key has
        runs = counting.runs
        batch = decode_batch(size, seed=size)
        with torch.no_grad():
            compiled(batch.input_ids, batch.positions, batch)
        assert counting.runs == runs + 1, f"the compiled model ran eagerly at {size} rows"


# ---------------------------------------------------------------- a dynamic model compiles once


@pytest.mark.parametrize("front, how", [("runner", "dynamic=True"), ("wrap", "dynamic=True"), ("wrap", "mark_dynamic")])
def test_a_model_compiled_dynamic_compiles_at_most_twice_across_every_capture_size(front, how):
    """Issue 48, item 7: a model compiled with ``dynamic=True``, or called with its batch dim marked
    dynamic, compiled a graph per capture size under graphrt (3 for sizes 1, 2 and 4): graphrt marked the
    static inputs' batch dims, a marking the graph compiled from the user's call lacked, which Dynamo's
    guards take for a recompile. Now a key's compile run first tries the graphs compiled before, unmarked:
    one dynamic graph serves every size but 1, which Dynamo specializes (the report's ``compiled`` column:
    ``yes`` for a key served by a graph compiled before, ``yes+N`` for N graphs compiled for the key)."""
    counting = CountingBackend()
    sizes = [1, 2, 4, 8]
    if front == "runner":
        model = ToyPagedModel()
        compiled = torch.compile(model, backend=counting, dynamic=True)
        batch = decode_batch(3, seed=3)
        with torch.no_grad():
            compiled(batch.input_ids, batch.positions, batch)  # the user tries the model once first
        runner = graphrt.GraphRunner(compiled, max_batch_size=8, capture_sizes=sizes, backend="emulated",
                                     progress=False)
        report = runner.capture()
        assert not report.failed and all(key.compiled for key in report.keys), str(report)
        assert [key.compiled_graphs for key in report.keys] == [0, 0, 0, 1], str(report)
        assert str(report).splitlines()[1].split()[-1] == "yes" and "yes+1" in str(report).splitlines()[4]
        for size in (5, 3):
            batch = decode_batch(size, seed=size)
            with torch.no_grad():
                expected = model(batch.input_ids, batch.positions, batch)
            torch.testing.assert_close(runner(batch), expected)
    else:
        compiled = torch.compile(Stepper(), backend=counting, dynamic=True if how == "dynamic=True" else None)
        fast = graphrt.wrap(compiled, max_batch_size=8, capture_sizes=sizes, backend="emulated")
        for size in [size for size in reversed(sizes) for _ in range(3)]:  # warm-up, record, replay per size
            x = torch.randn(size, 16)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 0)
            with torch.no_grad():
                fast(x)
        assert fast.stats()["graph_runs"] >= len(sizes), fast.stats()
    assert len(counting.compiles_under_mode) <= 2, f"{len(counting.compiles_under_mode)} compilations"
    assert not any(counting.compiles_under_mode)
