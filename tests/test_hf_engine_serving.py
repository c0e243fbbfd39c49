"""graphrt.hf.engine_model served as a user serves it: settings that change between calls, threads, the
model's generation config, faults. Each test is one a user found failing (issue 43): runners of one
engine captured in any order, penalties that must not depend on the neighbours, the generation config
``generate()`` reads, slots and rows released by every failed call, a context shorter than the step
budget, train mode, two threads on one engine, multi-step launches at full context, transient faults,
``recapture()``, and engines built and dropped.
"""

from __future__ import annotations

import gc
import linecache
import threading
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import engine, generate_alone, llama, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import VOCAB, tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
import graphrt.hf.paged_attention as paged_attention  # noqa: E402
from graphrt.host.sampling import SamplingMetadata  # noqa: E402

NEW_TOKENS = 5


def free_capacity(engine):
    return engine.slots.available, engine.slots.free_rows


def test_runners_captured_in_any_order_keep_every_graph_right(llama, engine):
    prompts = ragged_prompts([5, 2, 7], seed=3)
    expected = generate_alone(llama, prompts, NEW_TOKENS)
    for steps in (1, 2, 1, 2):  # the second single-step call replays graphs captured before the 2-step runner
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=steps) == expected
        assert engine.stats()["serve"]["decode_steps_graphed"] == engine.stats()["serve"]["decode_steps"]
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=False) == expected
    with torch.no_grad():
        for prompt, logits in zip(prompts, engine.prompt_logits(prompts)):
            torch.testing.assert_close(logits, llama(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)
    assert engine.stats()["failed_keys"] == {}


def test_repetition_penalty_counts_the_prompt_and_ignores_the_neighbours(llama, engine):
    prompts = ragged_prompts([6, 4, 5], seed=12)
    penalty = dict(top_ks=[-1] * 3, top_ps=[1.0] * 3, repetition_penalties=[3.0] * 3)
    all_greedy = SamplingMetadata.from_params(temperatures=[0.0] * 3, **penalty)
    beside_sampling = SamplingMetadata.from_params(temperatures=[0.0, 1.0, 0.0], **penalty)
    alone = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=all_greedy)
    beside = engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=beside_sampling, seed=3)
    assert alone == generate_alone(llama, prompts, NEW_TOKENS, repetition_penalty=3.0)
    assert alone != engine.generate(prompts, max_new_tokens=NEW_TOKENS)  # the penalty changed tokens here
    assert beside[0] == alone[0] and beside[2] == alone[2]


def test_the_generation_config_is_read_as_generate_reads_it():
    model = tiny_model("llama")
    prompts = ragged_prompts([5, 7, 3], seed=13)
    plain = generate_alone(model, prompts, 8)
    config = model.generation_config
    config.eos_token_id = plain[0][1]  # the second token prompt 0 would choose: min_new_tokens keeps it going
    config.min_new_tokens = 3
    config.repetition_penalty = 1.4
    config.no_repeat_ngram_size = 2
    config.bad_words_ids = [[plain[1][0]]]
    config.suppress_tokens = [plain[2][0]]
    expected = generate_alone(model, prompts, 8)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[8])

    assert expected != plain
    assert engine.generate(prompts, max_new_tokens=8) == expected
    assert [engine.generate([prompt], max_new_tokens=8)[0] for prompt in prompts] == expected
    assert engine.generate(prompts, max_new_tokens=8, generation_config=None, eos_token_id=None) == plain
    with pytest.raises(ValueError, match="steps_per_launch.*repetition_penalty, no_repeat_ngram_size"):
        engine.generate(prompts, max_new_tokens=8, steps_per_launch=2)
    config.sequence_bias = {(5,): -1.0}
    with pytest.raises(ValueError, match="generation_config.sequence_bias"):
        engine.generate(prompts, max_new_tokens=8)


class Fault:
    """A forward hook raising ``error`` at the model's ``at``-th call from now (one call: one step)."""

    def __init__(self, module, at, error):
        self.calls, self.at, self.error = 0, at, error
        self.handle = module.register_forward_hook(self)

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise self.error


def test_refused_and_failed_calls_release_every_slot_and_row(llama):
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=16, max_step_tokens=8, kv_slots=32)
    free = free_capacity(engine)
    prompts = ragged_prompts([5, 4], seed=12)
    expected = generate_alone(llama, prompts, 4)
    assert engine.generate(prompts, max_new_tokens=4, graphs=False) == expected
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\]: token id 130 is outside the model's vocabulary"):
        engine.generate([prompts[0], [5, 6, VOCAB + 2]], max_new_tokens=4, graphs=False)
    for error in (RuntimeError("injected fault"), KeyboardInterrupt()):
        fault = Fault(llama.model.norm, 2, error)  # the first decode step, after the prompts' prefill step
        try:
            with pytest.raises(type(error)):
                engine.generate(prompts, max_new_tokens=4, graphs=False)
        finally:
            fault.handle.remove()
        assert free_capacity(engine) == free
        serve = engine.stats()["serve"]  # the failed call's counts, not the call before's
        assert serve["prefill_steps"] == 1 and serve["decode_steps"] == 0
    assert engine.generate(prompts, max_new_tokens=4) == expected
    assert free_capacity(engine) == free


def test_a_context_shorter_than_the_step_budget(llama):
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=12, max_step_tokens=16, warmup_iters=1)
    prompts = ragged_prompts([9, 6], seed=14)
    assert engine.generate(prompts, max_new_tokens=3) == generate_alone(llama, prompts, 3)
    stats = engine.stats()
    assert stats["failed_keys"] == {}
    assert stats["serve"]["prefill_tokens_graphed"] == stats["serve"]["prefill_tokens"] == 15


def test_train_mode_is_refused(llama):
    llama.model.layers[1].train()
    try:
        with pytest.raises(ValueError, match=r"model.layers.1 is in train mode.*call model.eval\(\)"):
            graphrt.hf.engine_model(llama, max_requests=2, max_context=16)
    finally:
        llama.eval()
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=16)
    llama.train()
    try:
        with pytest.raises(ValueError, match="train mode"):
            engine.generate([[5, 6, 7]], max_new_tokens=2)
    finally:
        llama.eval()


def test_two_threads_on_one_new_engine_each_get_their_own_tokens(llama):
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[8])
    calls = {"a": ragged_prompts([5, 3, 7], seed=15), "b": ragged_prompts([4, 8, 2], seed=16)}
    expected = {name: generate_alone(llama, prompts, NEW_TOKENS) for name, prompts in calls.items()}
    implementation = llama.config._attn_implementation
    start = threading.Barrier(2, timeout=60)
    results, errors = {}, []

    def run(name):
        try:
            start.wait()
            for _ in range(2):
                results[name] = engine.generate(calls[name], max_new_tokens=NEW_TOKENS)
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == [] and results == expected
    assert llama.config._attn_implementation == implementation
    assert generate_alone(llama, calls["a"][:1], NEW_TOKENS) == expected["a"][:1]  # the model's generate() works


def test_multi_step_launches_serve_requests_at_full_context(llama):
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=16, max_step_tokens=16, warmup_iters=1,
                                     piecewise_sizes=[16])
    prompts = ragged_prompts([12, 11], seed=17)  # 12 + 4 new tokens fill the context
    expected = generate_alone(llama, prompts, 4, eos_token_id=None)
    assert engine.generate(prompts, max_new_tokens=4, steps_per_launch=4, eos_token_id=None) == expected
    serve = engine.stats()["serve"]
    assert serve["max_running"] == 2 and serve["multi_step_launches"] > 0
    alone = graphrt.hf.engine_model(llama, max_requests=1, max_context=16, max_step_tokens=16, warmup_iters=1,
                                    piecewise_sizes=[16])  # the pool holds one request at full context
    assert alone.generate(prompts[:1], max_new_tokens=4, steps_per_launch=4, eos_token_id=None) == expected[:1]


def test_a_transient_fault_in_the_attention_op_is_captured_again_once(llama, monkeypatch):
    # prefix sharing off: each call prefills the same prompts in full through the faulty key
    engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[8], prefix_sharing=False)
    prompts = ragged_prompts([6, 5], seed=18)
    expected = generate_alone(llama, prompts, 3)
    assert engine.generate(prompts, max_new_tokens=3) == expected  # captured
    plan, armed = paged_attention.step_plan, []

    def flaky(batch, width=None):
        if armed:
            armed.pop()
            raise RuntimeError("transient device fault")
        return plan(batch, width)

    monkeypatch.setattr(paged_attention, "step_plan", flaky)
    armed.append(True)  # the prefill step's replay raises once; its eager rerun succeeds
    assert engine.generate(prompts, max_new_tokens=3) == expected
    assert engine.stats()["eager_reasons"] == {"replay_failed": 1}
    assert engine.stats()["failed_keys"] == {}  # captured again before the next step
    assert engine.generate(prompts, max_new_tokens=3) == expected
    assert engine.stats()["serve"]["prefill_tokens_graphed"] == 11
    armed.append(True)  # a second fault of the same key: it stays disabled
    assert engine.generate(prompts, max_new_tokens=3) == expected
    assert list(engine.stats()["failed_keys"]) == ["decode@32+prefill:piecewise/tokens=8"]


def test_recapture_serves_rebound_weights_from_graphs():
    model = tiny_model("llama")
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[8])
    prompts = ragged_prompts([6, 5], seed=19)
    engine.generate(prompts, max_new_tokens=3)
    torch.manual_seed(5)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))  # a weight load by rebinding
    expected = generate_alone(model, prompts, 3)
    assert engine.generate(prompts, max_new_tokens=3) == expected  # guards: eager until recaptured
    assert engine.stats()["serve"]["decode_steps_graphed"] == 0
    engine.recapture()
    assert engine.generate(prompts, max_new_tokens=3) == expected
    serve = engine.stats()["serve"]
    assert serve["decode_steps_graphed"] == serve["decode_steps"] > 0


ENGINES = 5  # built and dropped per round: an object kept per engine shows as ENGINES of them


def test_engines_built_and_dropped_keep_nothing(llama):
    """Nothing an engine made outlives it: no Python object, no recorded step's generated source (torch.fx
    keeps each in a process-wide cache and in ``linecache``, about 47 KiB per tiny engine before)."""
    prompts = ragged_prompts([5, 3], seed=20)

    def serve_once():
        engine = graphrt.hf.engine_model(llama, max_requests=2, max_context=16, max_step_tokens=4, warmup_iters=0,
                                         capture_sizes=[2], piecewise_sizes=[4], verify=False)
        engine.generate(prompts, max_new_tokens=2)

    def held():
        gc.collect()
        counts = {}  # a plain loop: counting through a generator left weakrefs of its own in ABC caches
        for thing in gc.get_objects():
            counts[type(thing).__name__] = counts.get(type(thing).__name__, 0) + 1
        return Counter(counts), len(linecache.cache)

    for _ in range(2):  # caches that fill once (torch's, transformers')
        serve_once()
    gc.freeze()  # the objects of now out of every collection: capture's gc.collect() and ours stay fast
    try:
        held_after = []
        for _ in range(2):  # 5 engines, then 5 more: what the second 5 keep beyond the first is per engine
            for _ in range(ENGINES):
                serve_once()
            held_after.append(held())
    finally:
        gc.unfreeze()
    (objects, sources), (now_objects, now_sources) = held_after
    kept = now_objects - objects
    assert sum(kept.values()) < ENGINES and now_sources == sources, \
        f"{now_sources - sources} sources and these objects kept by {ENGINES} engines: {kept.most_common(8)}"
