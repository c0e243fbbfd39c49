"""An engine step costs the host what its graph needs (issue 47): one pinned, non-blocking copy in and one wait
for the chosen tokens per step, on the fake CUDA (tests/fake_cuda_traffic.py says what it sees); the next step
staged before the last one's tokens are read (overlap, the default on CUDA), with the same tokens as without;
prefill attention whose work per layer does not grow with the requests; steps that move no state epoch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from fake_cuda import BEHAVIOURS, install  # noqa: E402
from fake_cuda_traffic import traffic  # noqa: E402
from hf_engine_helpers import generate_alone, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import graphrt.hf  # noqa: E402
import graphrt.hf.paged_attention as paged_attention  # noqa: E402
from graphrt.guards import epoch  # noqa: E402
from graphrt.hf.serve import ServeLoop  # noqa: E402
from graphrt.host.sampling import SamplingMetadata  # noqa: E402

TORCH_2_11 = next(behaviour for behaviour in BEHAVIOURS if behaviour.name == "2.11")
PROMPTS = ragged_prompts([5, 3, 6], seed=2)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def fake_engine(model, **options):
    """An engine whose graphs are the fake's CUDA graphs. The model stays on the CPU, so the runners would
    read the batches' values as host tensors' (``check_values``): on CUDA they never read device values."""
    return graphrt.hf.engine_model(model, max_requests=3, max_context=32, max_step_tokens=8, backend="cuda",
                                   check_values=False, warmup_iters=1, piecewise_sizes=[8], **options)


def watch_steps(monkeypatch, log):
    """Each ServeLoop.step's traffic: (whether it launched a decode step, its log)."""
    steps = []
    step = ServeLoop.step

    def watched(loop):
        decodes = loop.counts.decode_steps
        with log.watch() as entries:
            finished = step(loop)
        steps.append((loop.counts.decode_steps > decodes, list(entries)))
        return finished

    monkeypatch.setattr(ServeLoop, "step", watched)
    return steps


def register_host(log, engine):
    """The engine's staging arenas (pinned on CUDA) and its runners' host mirrors are host memory."""
    log.register(engine._arena.buffers.host_arenas, pinned=True)
    for runner in engine.runners.all().values():
        log.register(slot.tensor for name, slot in runner.buffers.slots.items() if name.endswith("_cpu"))


CALLS = {
    "greedy": dict(),
    "sampled, with the generation config's processors": dict(
        sampling=SamplingMetadata.from_params([0.9, 0.0, 1.2], [20, -1, -1], [0.9, 1.0, 1.0],
                                              repetition_penalties=[1.2, 1.0, 1.0]),
        generation_config=GenerationConfig(no_repeat_ngram_size=2, min_new_tokens=2, eos_token_id=1), seed=3),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_step_copies_once_from_pinned_memory_and_waits_once(llama, monkeypatch, call):
    with install(monkeypatch, TORCH_2_11) as fake, traffic(monkeypatch, fake) as log:
        engine = fake_engine(llama)
        with torch.no_grad():
            expected = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, **CALLS[call])  # captures
            register_host(log, engine)
            steps = watch_steps(monkeypatch, log)
            assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, **CALLS[call]) == expected
    decodes = [entries for decode, entries in steps if decode]
    assert len(decodes) >= 3 and engine.stats()["serve"]["decode_steps_graphed"] == len(decodes)
    for decode, entries in steps:
        copies = [entry for entry in entries if entry[0] in ("h2d", "pageable h2d")]
        waits = [entry for entry in entries if entry[0] == "sync"]
        if decode or copies:
            assert copies == [("h2d", True, True)], entries  # one copy in: from pinned memory, not blocking
        assert waits in ([], [("sync", "Event.synchronize")]), entries  # at most one wait: the tokens
    assert all(any(entry[0] == "sync" for entry in entries) for entries in decodes[1:])


def test_the_next_step_is_staged_before_the_last_steps_tokens_are_read(llama, monkeypatch):
    """Overlap (on by default where the graphs are CUDA graphs): each step's copy in comes before the wait for
    the tokens of the step before it; without overlap every wait follows its own step's copy."""
    orders = {}
    with install(monkeypatch, TORCH_2_11) as fake, traffic(monkeypatch, fake) as log:
        engine = fake_engine(llama)
        assert engine.asynchronous
        with torch.no_grad():
            engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            register_host(log, engine)
            for overlap in (None, False):
                with log.watch() as entries:
                    engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, overlap=overlap)
                orders[overlap] = ["stage" if entry[0] == "h2d" else "read" for entry in entries
                                   if entry[0] == "h2d" or entry == ("sync", "Event.synchronize")]
    steps = orders[False].count("stage")
    assert orders[False] == ["stage", "read"] * steps
    assert orders[None] == ["stage"] + ["stage", "read"] * (steps - 1) + ["read"]


def test_overlap_is_the_default_on_cuda_only(llama):
    assert not graphrt.hf.engine_model(llama, max_requests=2, max_context=16).asynchronous
    with pytest.raises(TypeError, match="overlap: expected None or a bool"):
        graphrt.hf.engine_model(llama, max_requests=2, max_context=16).generate([[3, 4]], overlap="yes")


OVERLAP_CALLS = {
    "greedy": dict(),
    "queued arrivals": dict(arrivals=[0, 2, 0, 5, 1]),
    "stops one step late": dict(eos_token_id=[5, 9, 17, 33, 40], stop_token_ids=[[7], [], [9, 11], [3], []]),
    "seeded sampling": dict(sampling=SamplingMetadata.from_params([0.9, 0.0, 1.2, 0.7, 1.0], [20, -1, -1, 5, -1],
                                                                  [0.9, 1.0, 1.0, 1.0, 0.8]), seed=7, eos_token_id=None),
    "processors": dict(generation_config=GenerationConfig(repetition_penalty=1.5, no_repeat_ngram_size=2,
                                                          min_new_tokens=2, eos_token_id=1)),
}


@pytest.fixture(scope="module")
def engine(llama):
    return graphrt.hf.engine_model(llama, max_requests=3, max_context=32, max_step_tokens=8, warmup_iters=1,
                                   piecewise_sizes=[4, 8])


@pytest.mark.parametrize("call", list(OVERLAP_CALLS))
def test_tokens_are_the_same_with_overlap_on_and_off(llama, engine, call):
    prompts = ragged_prompts([5, 2, 7, 3, 6], seed=3)
    with torch.no_grad():
        tokens = [engine.generate(prompts, max_new_tokens=NEW_TOKENS, overlap=overlap, graphs=graphs,
                                  **OVERLAP_CALLS[call]) for overlap, graphs in ((False, True), (True, True), (True, False))]
    assert tokens[0] == tokens[1] == tokens[2]
    if call == "greedy":
        assert tokens[0] == generate_alone(llama, prompts, NEW_TOKENS)


def test_prefill_attention_runs_the_same_ops_for_one_request_or_many(llama, engine, monkeypatch):
    """A prefill step's attention, per layer and in all, calls the same torch functions whether its tokens
    belong to one request or to several: no Python loop over the requests."""
    calls = []
    attend = paged_attention._attend_tokens

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls[-1].append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def counted(*args):
        calls.append([])
        with Count():
            return attend(*args)

    monkeypatch.setattr(paged_attention, "_attend_tokens", counted)
    per_step = []
    for lengths in ([8], [3, 2, 3]):  # 8 prompt tokens either way, in one prefill step
        calls.clear()
        engine.prompt_logits([prompt + [9] for prompt in ragged_prompts(lengths, seed=4)], graphs=False)
        per_step.append([len(layer) for layer in calls])
    layers = llama.config.num_hidden_layers
    assert len(per_step[0]) == len(per_step[1]) == layers
    assert per_step[0] == per_step[1]
    assert per_step[0][1] < per_step[0][0]  # the step's plan is made once, by its first layer


def test_the_engines_steps_move_no_state_epoch(engine):
    prompts = ragged_prompts([4, 6], seed=5)
    with torch.no_grad():
        engine.generate(prompts, max_new_tokens=NEW_TOKENS)  # its graphs captured
        before = epoch.EPOCH[0]
        engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=False)
    assert epoch.EPOCH[0] == before


def test_a_step_budget_below_the_request_count_with_overlap(llama):
    """A token budget of 2 for 4 requests: prompts prefill a chunk at a time beside decodes that read their
    last token on the device, and every request gets generate()'s tokens, with overlap on and off."""
    engine = graphrt.hf.engine_model(llama, max_requests=4, max_context=32, max_step_tokens=2, warmup_iters=1)
    prompts = ragged_prompts([3, 2, 4, 5], seed=8)
    with torch.no_grad():
        tokens = [engine.generate(prompts, max_new_tokens=5, overlap=overlap) for overlap in (False, True)]
    assert tokens[0] == tokens[1] == generate_alone(llama, prompts, 5)
    assert engine.stats()["serve"]["max_running"] == 4
