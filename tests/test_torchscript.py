"""TorchScript in a step (issue 42, item 4): refused by name, never an internal error.

Before: every capture of a ``torch.jit.script`` or ``torch.jit.trace`` module failed with
``TypeError: contains(): incompatible function arguments`` (a scripted module's parameter table is not a
dict). TorchScript runs its code in its own interpreter, where graphrt cannot see the modules,
attributes and Python state its guards check, so it is refused: at ``wrap()``/``GraphRunner()`` when
handed over, and at the first recording when a step runs a scripted submodule (that layout then runs
eagerly, eager's numbers, no other key tried). A scripted *function* called by a step has no state to
guard: it captures and replays.
"""

from __future__ import annotations

import pytest
import torch

import graphrt
from graphrt.backends.torchscript import TorchScriptError

COLS = 8


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(COLS, COLS)

    def forward(self, x):
        return torch.relu(self.up(x))


@torch.jit.script
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def handed_over():
    yield "torch.jit.script(module)", torch.jit.script(MLP().eval()), "a TorchScript module MLP"
    yield "torch.jit.trace(module)", torch.jit.trace(MLP().eval(), torch.ones(2, COLS)), "a TorchScript module MLP"
    yield "a scripted module's forward", torch.jit.script(MLP().eval()).forward, "a TorchScript method MLP.forward"
    yield "torch.jit.script(function)", scaled, "a TorchScript function scaled"


@pytest.mark.parametrize("case", list(handed_over()), ids=lambda case: case[0])
def test_torchscript_handed_to_wrap_or_a_runner_is_refused_by_name(case):
    _, scripted, described = case
    with pytest.raises(TorchScriptError, match=f"fn: {described} \\(torch.jit.script or torch.jit.trace\\).*"
                                               "hand graphrt the eager module"):
        graphrt.wrap(scripted, max_batch_size=4)
    with pytest.raises(TypeError, match=f"model: {described}"):
        graphrt.GraphRunner(scripted, max_batch_size=4)


class WithScriptedPart(torch.nn.Module):
    def __init__(self, part) -> None:
        super().__init__()
        self.part = part

    def forward(self, x):
        return self.part(x) + 1


def test_a_step_running_a_scripted_submodule_runs_eagerly_with_the_reason_named():
    model = WithScriptedPart(torch.jit.script(MLP().eval())).eval()
    fast = graphrt.wrap(model, max_batch_size=8)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, COLS, generator=generator)
            assert torch.equal(fast(x), model(x))
    stats = fast.stats()
    (reason,) = stats["failed_keys"].values()
    assert reason.startswith("TorchScriptError: the step runs a TorchScript module MLP (torch.jit.script"), reason
    assert stats["graph_runs"] == 0 and stats["eager_reasons"] == {"warmup": 1, "capture_failed": 3}, stats


def test_a_scripted_function_inside_a_step_captures_and_replays():
    model = MLP().eval()
    fast = graphrt.wrap(lambda x: scaled(model(x)), max_batch_size=8)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(4):  # 3 rows, replayed at the padded size 4: GEMMs may round differently per batch size
            x = torch.randn(3, COLS, generator=generator)
            torch.testing.assert_close(fast(x), scaled(model(x)), rtol=1e-5, atol=1e-5)
    stats = fast.stats()
    assert stats["graph_runs"] == 3 and stats["failed_keys"] == {}, stats
