"""scripts/gpu_probe.py over the fake torch.cuda: each probe reads the rule the fake models as the
probe expects it of that torch, so a probe that disagrees on a GPU points at the fake's model."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from fake_cuda import TORCH_2_11, TORCH_2_12, install

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
# The probes whose rule the fake models (the others need a GPU's kernels or its whole allocator).
MODELLED = ["rng_after_invalidated_capture", "capture_executes_nothing", "second_capture_in_another_thread",
            "empty_cache_during_capture", "segment_rounding", "replay_during_another_capture",
            "cublas_workspace_in_pool", "first_capture_generator_segment", "failed_capture_pool_released"]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("gpu_probe")
    monkeypatch.setattr(module, "DEVICE", "cpu")
    return module


@pytest.mark.parametrize("behaviour", [TORCH_2_11, TORCH_2_12], ids=["fake-torch-2.11", "fake-torch-2.12"])
@pytest.mark.parametrize("name", MODELLED)
def test_each_probe_agrees_with_the_fake_it_describes(name, behaviour, probe, monkeypatch):
    monkeypatch.setattr(probe, "torch_after_2_11", lambda: behaviour is TORCH_2_12)
    with install(monkeypatch, behaviour):
        result = probe.run_probe(name)
    assert result["agrees"], result


def test_the_rng_probe_sees_a_stuck_generator_on_2_11_and_its_remedy(probe, monkeypatch):
    monkeypatch.setattr(probe, "torch_after_2_11", lambda: False)
    with install(monkeypatch, TORCH_2_11):
        result = probe.run_probe("rng_after_invalidated_capture")
    assert result["draw_error"].startswith("Offset increment outside graph capture")
    assert result["draw_error_after_remedy"] == ""


@pytest.mark.cuda
def test_every_probe_agrees_on_this_gpu(probe, monkeypatch):
    monkeypatch.setattr(probe, "DEVICE", "cuda")
    results = list(probe.run_in_children(list(probe.PROBES)))
    assert all(result["agrees"] for result in results), results


def test_the_replay_probe_tells_a_graph_that_drew_from_one_that_drew_nothing(probe, monkeypatch):
    """Issue 48, item 1: on torch 2.11 another thread's capture fails the replay of a graph that drew random
    numbers and an eager draw, not the replay of a graph that drew nothing (pytorch#143777)."""
    monkeypatch.setattr(probe, "torch_after_2_11", lambda: False)
    with install(monkeypatch, TORCH_2_11):
        result = probe.run_probe("replay_during_another_capture")
    assert result["plain_replay_error"] == "", result
    assert result["drawing_replay_error"].startswith("Offset increment outside graph capture"), result
    assert result["draw_error"].startswith("Offset increment outside graph capture"), result
    assert result["agrees"], result
