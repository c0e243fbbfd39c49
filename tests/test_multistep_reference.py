"""Multi-step launches on the reference model: its attention backend's ``advance_step`` between the
steps of one graph, a backend without it, and greedy generation with ``steps_per_launch``."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import python_runs
from fake_cuda import BEHAVIOURS, install
from multistep_helpers import eager_steps

from graphrt import GraphRunner
from graphrt.reference import (
    ReferenceConfig, TorchNativeAttnBackend, build_reference, generate_greedy, graph_runner_kwargs, make_decode_batch,
    make_extend_batch, run_eager,
)

CONFIG = ReferenceConfig.tiny()
PROMPTS = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43]]
STEPS = 4


class NoAdvanceBackend(TorchNativeAttnBackend):
    """Metadata refreshed on the host before each replay, and no device-side ``advance_step``."""

    advance_step = None


class StaleBackend(TorchNativeAttnBackend):
    """An ``advance_step`` that leaves the metadata as it was: every later step reads step 0's."""

    def advance_step(self, forward_batch):
        pass


def reference(backend_class=TorchNativeAttnBackend, device="cpu", **options):
    model, backend, pools = build_reference(CONFIG, num_requests=8, device=device)
    if backend_class is not TorchNativeAttnBackend:
        backend = backend_class(pools.req_to_token, pools.kv)
        for layer in model.layers:
            layer.self_attn.attn_backend = backend
        model.attn_backend = backend
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[2, 4], decode_steps=(STEPS,), progress=False,
                         device=device, **graph_runner_kwargs(backend, pools), **options)
    report = runner.capture()
    assert not report.failed, report.failed
    return model, backend, pools, runner


def prefilled(model, backend, pools):
    """The prompts prefilled eagerly; their requests, lengths and first tokens."""
    reqs = [pools.req_to_token.alloc() for _ in PROMPTS]
    lens = [len(prompt) for prompt in PROMPTS]
    loc = pools.assign(reqs, [0] * len(reqs), lens)
    device = pools.req_to_token.device
    logits = run_eager(model, make_extend_batch(PROMPTS, reqs, [0] * len(reqs), loc, device, pools=pools,
                                                attn_backend=backend))
    last = torch.tensor([sum(lens[:i + 1]) - 1 for i in range(len(lens))], device=device)
    return reqs, lens, logits[last].argmax(-1)


def launch(pools, backend, reqs, lens, ids, steps=STEPS):
    """The slots of ``steps`` positions per request mapped ahead; the launch's batch (step 0)."""
    loc = pools.assign(reqs, lens, [steps] * len(reqs)).view(len(reqs), steps).t().reshape(-1)
    return make_decode_batch(ids, reqs, [n + 1 for n in lens], loc, pools.req_to_token.device, pools=pools,
                             attn_backend=backend)


def launches(model, backend, pools, decode, count=2):
    """``count`` consecutive launches through ``decode(batch, steps)``: their tokens and the KV cache."""
    reqs, lens, ids = prefilled(model, backend, pools)
    chosen = []
    for _ in range(count):
        tokens = decode(launch(pools, backend, reqs, lens, ids), STEPS).clone()
        chosen.append(tokens)
        lens, ids = [n + STEPS for n in lens], tokens[-1]
    return torch.cat(chosen), [buffer.clone() for buffer in (*pools.kv.k_buffers, *pools.kv.v_buffers)]


def eager_decode(model):
    return lambda batch, steps: eager_steps(lambda each: run_eager(model, each), batch, steps)


def replays_only(model, runner):
    """``runner.decode``, asserting that the model's ``forward`` does not run during it (the prefill's
    eager run is forgotten first); and the list of calls seen, for other hooks to append to."""
    calls = []

    def decode(batch, steps):
        calls.clear()
        with python_runs(type(model).forward, calls):
            tokens = runner.decode(batch, steps)
        assert calls == [], f"the model's Python ran during a multi-step replay: {calls}"
        return tokens

    return decode, calls


def eager_launches(count=2, device="cpu"):
    """``launches`` of a fresh reference model (the same weights) run as eager steps."""
    model, backend, pools = build_reference(CONFIG, num_requests=8, device=device)
    return launches(model, backend, pools, eager_decode(model), count)


def assert_equal_eager_launches(graph_tokens, graph_kv, device="cpu", tolerance=1e-5):
    """The launches' tokens are those of the same launches run as eager steps, and every KV slot a
    request owns is within ``tolerance`` of eager's (padding changes GEMM shapes)."""
    tokens, kv = eager_launches(device=device)
    assert torch.equal(graph_tokens, tokens)
    for got, want in zip(graph_kv, kv):
        torch.testing.assert_close(got[1:], want[1:], atol=tolerance, rtol=tolerance)


def test_launches_equal_eager_steps_and_the_models_python_does_not_run():
    """Padded (3 requests, key 4) consecutive launches: the tokens of unpadded eager steps, the KV
    cache of every slot a request owns within rounding (padding changes GEMM shapes); no forward
    and no advance_step call during the replays."""
    model, backend, pools, runner = reference()
    decode, calls = replays_only(model, runner)
    backend.advance_step = lambda batch, advance=backend.advance_step: (calls.append("advance"), advance(batch))
    graph_tokens, graph_kv = launches(model, backend, pools, decode)
    assert runner.stats()["multi_step_runs"] == 2, runner.stats()["multi_step_fallbacks"]
    assert_equal_eager_launches(graph_tokens, graph_kv)


@pytest.mark.cuda
def test_launches_on_cuda_graphs_equal_eager_steps():
    """The same on a GPU: one CUDA graph per launch (4 steps, advance_step captured between them)."""
    model, backend, pools, runner = reference(device="cuda")
    graph_tokens, graph_kv = launches(model, backend, pools, runner.decode)
    assert runner.backend_name == "cuda" and runner.stats()["multi_step_runs"] == 2
    assert_equal_eager_launches(graph_tokens, graph_kv, device="cuda", tolerance=1e-4)


@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda behaviour: f"fake-torch-{behaviour.name}")
def test_launches_through_the_cuda_backend_share_its_pool_and_equal_eager_steps(behaviour, monkeypatch):
    """The CUDA backend's path for multi-step keys, over tests/fake_cuda.py (PyTorch's graph-pool
    rules, CPU tensors standing for device memory): every key, single- and multi-step, captured into
    the one shared pool and ready; each launch one replay of a recorded CUDA graph, with the tokens
    and KV cache of eager steps; the allocator left sound (no assertion, no routing left)."""
    with install(monkeypatch, behaviour) as fake:
        model, backend, pools, runner = reference(backend="cuda")
        assert runner.backend_name == "cuda"
        graphs = {str(key): entry.graph for key, entry in runner.registry.entries.items()}
        assert sorted(graphs) == ["decode/bs=2", "decode/bs=2,steps=4", "decode/bs=4", "decode/bs=4,steps=4"]
        assert len({tuple(graph.graph.pool()) for graph in graphs.values()}) == 1, "one pool for every key"
        decode, _ = replays_only(model, runner)
        graph_tokens, graph_kv = launches(model, backend, pools, decode)
        assert runner.stats()["multi_step_runs"] == 2, runner.stats()["multi_step_fallbacks"]
        del runner, graphs, decode
        gc.collect()
        assert fake.allocator.asserts == [] and fake.aborts == [] and fake.allocator.captures_underway == []
    assert_equal_eager_launches(graph_tokens, graph_kv)


def test_a_no_op_advance_step_reads_stale_metadata_and_gives_other_tokens():
    """What ``advance_step`` is for: with one that does nothing the graph verifies (its eager run
    reads the same stale metadata) but its tokens are not the eager steps'."""
    model, backend, pools, runner = reference(StaleBackend)
    stale, _ = launches(model, backend, pools, runner.decode, count=1)
    tokens, _ = eager_launches(count=1)
    assert runner.stats()["multi_step_runs"] == 1 and not torch.equal(stale, tokens)


def test_a_backend_without_advance_step_runs_single_step_replays_with_a_reason():
    model, backend, pools, runner = reference(NoAdvanceBackend)
    assert all(key.steps == 1 for key in runner.registry.entries), "no multi-step key is captured"
    tokens, _ = launches(model, backend, pools, runner.decode, count=1)
    expected, _ = eager_launches(count=1)
    stats = runner.stats()
    assert torch.equal(tokens, expected)
    assert stats["multi_step_fallbacks"] == {"no_advance_step": 1} and stats["graph_runs"] == STEPS


@pytest.mark.parametrize("steps_per_launch", [2, STEPS])
def test_greedy_generation_with_several_steps_per_launch_gives_the_tokens_of_one(steps_per_launch):
    """Eager and through the runner, with stops inside a launch: EOS (tokens after it dropped) and the
    length (7 new tokens: 6 decode steps, the last launch's extra tokens dropped); every slot and
    request row released after."""
    model, backend, pools, runner = reference()
    free = (pools.kv.available, pools.req_to_token.available)
    expected = generate_greedy(model, backend, pools, PROMPTS, 7)
    eos = expected[0][2]  # the first request stops after its third token, inside a launch
    expected_eos = generate_greedy(model, backend, pools, PROMPTS, 7, eos_token_id=eos)
    assert len(expected_eos[0]) == 3 and all(len(tokens) == 7 for tokens in expected)
    for step in (None, runner):
        assert generate_greedy(model, backend, pools, PROMPTS, 7, step=step, steps_per_launch=steps_per_launch) == expected
        assert generate_greedy(model, backend, pools, PROMPTS, 7, step=step, steps_per_launch=steps_per_launch,
                               eos_token_id=eos) == expected_eos
    assert (pools.kv.available, pools.req_to_token.available) == free
    stats = runner.stats()
    if steps_per_launch == STEPS:
        assert stats["multi_step_runs"] == 4 and stats["multi_step_fallbacks"] == {}, stats["multi_step_fallbacks"]
    else:
        assert stats["multi_step_fallbacks"] == {"steps_not_captured": 6}
    with pytest.raises(ValueError, match="step"):
        generate_greedy(model, backend, pools, PROMPTS, 3, step=lambda batch: None, steps_per_launch=2)
