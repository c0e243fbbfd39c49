"""Shared prompt prefixes computed once on the engine path (issue 50, item 7): requests whose prompts share a
prefix start after its cached keys and values, with the tokens of computing every prompt in full (graphed and
eager, a window through the request table, penalties that read the prompt's ids, the overlap scheduler);
cached prefixes evicted least recently used under pool pressure, never while a running request reads them;
every lock and slot back after a finished, failed or interrupted call; models whose layers cannot share
(a sliding window's ring) refused from sharing by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, llama, one_thread, ragged_prompts  # noqa: E402,F401
from hf_helpers import tiny_model  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.hf.engine_step import EngineSteps  # noqa: E402
from graphrt.hf.kv_layout import KVLayout, LayerKV  # noqa: E402
from graphrt.hf.prefix_sharing import sharing_refusal  # noqa: E402

NEW_TOKENS = 4
KV_SLOTS = 4 * 32 + 1


def system_prompts(count: int, system: int = 12, own: int = 3, seed: int = 5):
    """``count`` prompts: one system prompt of ``system`` tokens, then ``own`` tokens of each (one has none
    beyond a single token, one repeats another whole)."""
    shared = ragged_prompts([system], seed=seed)[0]
    owns = ragged_prompts([own] * count, seed=seed + 1)
    prompts = [shared + tail for tail in owns]
    prompts[1] = shared[:1] + owns[1]  # shares one token only
    prompts[-1] = list(prompts[0])  # the same prompt twice
    return prompts


def make_engine(model, sharing=True, **options):
    settings = dict(max_requests=4, max_context=32, max_step_tokens=8, kv_slots=KV_SLOTS, warmup_iters=1,
                    piecewise_sizes=[4, 8])
    settings.update(options)
    return graphrt.hf.engine_model(model, prefix_sharing=sharing, **settings)


def assert_all_back(engine):
    """No slot leaked, no prefix locked: every slot is free or held by the cache and evictable."""
    assert engine.slots.available == engine.slots.num_slots - 1
    cache = engine.slots.prefixes
    assert cache is None or cache.evictable_tokens == cache.cached_tokens


@pytest.fixture(scope="module")
def shared_engine(llama):
    return make_engine(llama)


@pytest.fixture(scope="module")
def plain_engine(llama):
    return make_engine(llama, sharing=False)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_a_shared_system_prompt_is_computed_once_with_the_tokens_of_computing_it_in_full(llama, shared_engine,
                                                                                        plain_engine, graphs):
    prompts = system_prompts(6)
    expected = generate_alone(llama, prompts, NEW_TOKENS)
    shared_engine.reset_prefix_cache()
    assert plain_engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=graphs) == expected
    computed_in_full = plain_engine.stats()["serve"]["prefill_tokens"]
    assert plain_engine.stats()["serve"]["prefix_tokens_reused"] == 0
    assert not plain_engine.stats()["prefix_cache"]["enabled"]

    assert shared_engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=graphs) == expected
    serve = shared_engine.stats()["serve"]
    # 6 prompts of 15 tokens, one of 4: the system prompt computed once, the others start after it (the
    # repeated prompt after all but its last token); the one sharing a token only reuses that token
    assert serve["prefix_tokens_reused"] == 12 * 3 + 14 + 1
    assert serve["prefill_tokens"] == computed_in_full - serve["prefix_tokens_reused"]
    assert serve["prefix_requests"] == 5
    if graphs:
        assert serve["decode_steps_graphed"] == serve["decode_steps"]
    assert_all_back(shared_engine)

    # a later call finds every prompt cached (and the first call's outputs: a prompt that continues one)
    continued = [prompts[2] + expected[2][:-1] + [7]]
    assert shared_engine.generate(prompts + continued, max_new_tokens=NEW_TOKENS, graphs=graphs) == \
        expected + generate_alone(llama, continued, NEW_TOKENS)
    serve = shared_engine.stats()["serve"]
    assert serve["prefill_tokens"] == len(prompts) + 1  # each prompt's last token only
    assert_all_back(shared_engine)


def test_logits_of_a_request_on_a_shared_prefix_match_the_model(llama, shared_engine):
    """The shared prefix's keys and values are those of the same tokens: the next token's logits agree with
    the model on the whole prompt within float32 rounding."""
    prompts = system_prompts(4)
    shared_engine.generate(prompts[:1], max_new_tokens=1)  # caches the system prompt
    with torch.no_grad():
        expected = [llama(torch.tensor([prompt])).logits[0, -1] for prompt in prompts[2:]]
    tokens = shared_engine.generate(prompts[2:], max_new_tokens=1)
    assert shared_engine.stats()["serve"]["prefix_tokens_reused"] >= 12 * 2
    assert tokens == [[int(logits.argmax())] for logits in expected]


def test_penalties_read_the_shared_prompt_ids_and_the_overlap_scheduler_gives_the_same_tokens(llama, shared_engine,
                                                                                            plain_engine):
    from graphrt.host.sampling import SamplingMetadata

    prompts = system_prompts(4, seed=21)
    penalty = SamplingMetadata.from_params(temperatures=[0.0] * 4, top_ks=[-1] * 4, top_ps=[1.0] * 4,
                                           repetition_penalties=[3.0] * 4)
    expected = plain_engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=penalty)
    assert expected == generate_alone(llama, prompts, NEW_TOKENS, repetition_penalty=3.0)
    shared_engine.reset_prefix_cache()
    assert shared_engine.generate(prompts, max_new_tokens=NEW_TOKENS, sampling=penalty) == expected
    assert shared_engine.stats()["serve"]["prefix_tokens_reused"] > 0
    shared_engine.reset_prefix_cache()
    plain = plain_engine.generate(prompts, max_new_tokens=NEW_TOKENS, overlap=True)
    assert shared_engine.generate(prompts, max_new_tokens=NEW_TOKENS, overlap=True) == plain
    assert shared_engine.stats()["serve"]["prefix_tokens_reused"] > 0
    assert_all_back(shared_engine)


def test_pool_pressure_evicts_the_least_recently_used_prefixes_never_a_running_ones(llama):
    """Slots for two requests at a time: each new prompt with a prefix of its own evicts cached prefixes of
    finished requests; the system prompt the running requests read stays, and every token is right."""
    engine = make_engine(llama, max_requests=2, kv_slots=2 * 20 + 1)
    system = ragged_prompts([12], seed=31)[0]
    prompts = [system + tail for tail in ragged_prompts([3] * 4, seed=32)]
    prompts += ragged_prompts([14, 13, 15, 14], seed=33)  # prefixes of their own
    prompts = [prompts[index] for index in (0, 4, 1, 5, 2, 6, 3, 7)]
    expected = generate_alone(llama, prompts, NEW_TOKENS)
    for graphs in (True, False):
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS, graphs=graphs) == expected
        assert engine.stats()["prefix_cache"]["evicted_tokens"] > 0
        assert engine.stats()["serve"]["prefix_tokens_reused"] > 0
        assert_all_back(engine)


def test_a_failed_or_interrupted_call_releases_every_lock_and_slot(llama, monkeypatch):
    engine = make_engine(llama)
    prompts = system_prompts(6, seed=41)
    expected = generate_alone(llama, prompts, NEW_TOKENS)
    engine.generate(prompts[:1], max_new_tokens=NEW_TOKENS)  # the system prompt cached
    launch = EngineSteps.launch
    for fault in (RuntimeError("device fault"), KeyboardInterrupt()):
        calls = []

        def failing(self, work, fault=fault, calls=calls):
            calls.append(work)
            if len(calls) == 4:  # requests running on the shared prefix, some mid-prefill
                raise fault
            return launch(self, work)

        monkeypatch.setattr(EngineSteps, "launch", failing)
        with pytest.raises(type(fault)):
            engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        monkeypatch.setattr(EngineSteps, "launch", launch)
        assert_all_back(engine)
        assert engine.generate(prompts, max_new_tokens=NEW_TOKENS) == expected
        assert_all_back(engine)


def test_weights_written_in_place_drop_the_cached_prefixes():
    model = tiny_model("llama")
    engine = make_engine(model)
    prompts = system_prompts(3, seed=51)
    engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert engine.stats()["prefix_cache"]["cached_tokens"] > 0
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)  # every cached key is stale now
    assert engine.generate(prompts, max_new_tokens=NEW_TOKENS) == generate_alone(model, prompts, NEW_TOKENS)
    assert engine.stats()["serve"]["prefix_requests"] == 2  # only what this call cached itself
    assert_all_back(engine)


def test_a_window_through_the_request_table_shares_and_a_ring_is_refused_by_name():
    # a window of 24 that slides over a context of 28 (a window plus a step is longer than the context, so the
    # layers read it through the request table): shared prefixes hold the same keys
    mistral = tiny_model("mistral-window", sliding_window=24)
    engine = make_engine(mistral, max_context=28)
    assert engine.layout.layers[0].window == 24 and engine.layout.layers[0].ring == 0
    prompts = system_prompts(4, system=16, own=4, seed=61)
    expected = generate_alone(mistral, prompts, 8)
    for graphs in (True, False):
        engine.reset_prefix_cache()
        assert engine.generate(prompts, max_new_tokens=8, graphs=graphs) == expected
        assert engine.stats()["serve"]["prefix_tokens_reused"] >= 16 * 2
    # a hybrid of full layers and windows kept in rings: sharing off, named, the tokens those of generate()
    gemma2 = tiny_model("gemma2")
    ringed = make_engine(gemma2)
    reason = ringed.prefixes.reason
    assert "layer 0 keeps its sliding window of 4 in a ring" in reason
    prompts = system_prompts(3, seed=62)
    assert ringed.generate(prompts, max_new_tokens=NEW_TOKENS) == generate_alone(gemma2, prompts, NEW_TOKENS)
    stats = ringed.stats()
    assert stats["serve"]["prefix_tokens_reused"] == 0 and stats["prefix_cache"]["reason"] == reason


def test_sharing_refusals_and_the_engine_option():
    full = LayerKV(2, 8, 8, torch.float32)
    assert sharing_refusal(KVLayout([full, full], 4, 64), False) is None
    assert "rotary frequencies depend on each request's length" in sharing_refusal(KVLayout([full], 4, 64), True)
    ring = LayerKV(2, 8, 8, torch.float32, window=4, ring=11)
    assert sharing_refusal(KVLayout([full, ring], 4, 64), False).startswith("layer 1 keeps its sliding window")
    with pytest.raises(TypeError, match="prefix_sharing: expected a bool"):
        graphrt.hf.engine_model(tiny_model("llama"), prefix_sharing="yes")


class FixedTokens:
    """A model-free executor: every chosen row's token is 5; ``seen()`` is called at each launch."""

    def __init__(self, seen):
        self.seen = seen

    def launch(self, work):
        self.seen()
        return len(work.sampled) * (work.steps if work.steps > 1 else 1), 0

    def admit(self, request):
        pass

    def read(self, handle):
        return [5] * handle

    def read_logprobs(self, handle):
        return None


def test_a_finished_request_unlocks_at_once_and_a_closed_loop_unlocks_everything():
    """The scheduler alone: two requests on one system prompt; the one that stops first gives its lock back
    while the other still runs (the prefix stays locked by it alone); closing the loop mid-request (an
    abort, an interrupt) gives back every lock and slot."""
    from graphrt.hf.engine_slots import SlotTable
    from graphrt.hf.prefix_cache import PrefixCache
    from graphrt.hf.prefix_sharing import PrefixSharing
    from graphrt.hf.request_sampling import RequestTokens
    from graphrt.hf.requests import Request
    from graphrt.hf.serve import ServeConfig, ServeCounts, ServeLoop
    from graphrt.reference import ReqToTokenPool

    cache, counts = PrefixCache(), ServeCounts()
    slots = SlotTable(ReqToTokenPool(4, 32, "cpu"), 64, cache)
    system = list(range(10, 22))
    requests = [Request(0, 0, RequestTokens(system + [40, 41])), Request(1, 0, RequestTokens(system + [50], stops=frozenset({5})))]
    config = ServeConfig(max_running=3, max_step_tokens=8, max_new_tokens=6, max_context=32)
    locks = []
    executor = FixedTokens(lambda: locks.append(cache.match(system)[1].locks))
    loop = ServeLoop(slots, executor, requests, config, counts, prefixes=PrefixSharing(slots, cache, counts))
    while 1 not in loop.done:
        loop.step()
    assert locks[-1] == 2  # both read the system prompt in the step that finished one
    assert cache.match(system)[1].locks == 1 and loop.running == [requests[0]]  # its lock given back at once
    assert counts.prefix_tokens_reused == 12 and counts.prefix_requests == 1
    assert requests[1].output == [5]
    assert cache.match(system + [50, 5])[0][-1] != 0  # its prompt and its output's computed tokens are cached
    assert slots.available < 63  # the running request holds its own slots
    loop.close()
    assert cache.evictable_tokens == cache.cached_tokens and slots.available == 63


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_an_online_session_shares_prefixes_and_captures_before_its_first_step(llama, graphs, monkeypatch):
    """The online session (issue 50, item 6) runs the loop generate() runs: prompts sharing a system prompt
    compute it once there too, with generate()'s tokens, and every runner is captured when the session
    opens, not between two of its steps (issue 48, item 5)."""
    from graphrt import GraphRunner

    engine = make_engine(llama)
    prompts = system_prompts(4)
    expected = generate_alone(llama, prompts, NEW_TOKENS)
    events = []
    capture, call = GraphRunner.capture, GraphRunner.__call__
    monkeypatch.setattr(GraphRunner, "capture", lambda runner: (events.append("capture"), capture(runner))[1])
    monkeypatch.setattr(GraphRunner, "__call__", lambda runner, batch: (events.append("step"), call(runner, batch))[1])
    with engine.online(graphs=graphs) as online:
        outputs = online.run(prompts, [graphrt.hf.RequestParams(max_new_tokens=NEW_TOKENS)] * len(prompts))
        serve = online.stats()["serve"]
    assert [output.tokens for output in outputs] == expected
    assert serve["prefix_tokens_reused"] > 0 and serve["prefix_requests"] >= 2, serve
    if graphs:
        assert "capture" in events and "capture" not in events[events.index("step"):], events
    assert_all_back(engine)
