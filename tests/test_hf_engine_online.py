"""graphrt.hf.engine_model served online (issue 50, item 6): requests added while others run (also from another
thread), ``step()``, ``abort(id)`` freeing a request's row and KV slots at once, streamed tokens, per-request
parameters (new-token limits, stop ids, min_new_tokens, seed, ignore_eos, log-probabilities), finish reasons,
a bad request rejected alone, and per-request times in ``stats()``. Tokens are compared with the model's own
``generate()`` and with the engine's offline ``generate()``, graphed and eager."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

from hf_engine_helpers import engine, generate_alone, llama, one_thread, ragged_prompts  # noqa: E402,F401

import graphrt.hf  # noqa: E402
from graphrt.hf import FinishReason, RequestParams  # noqa: E402
from graphrt.host.sampling import SamplingMetadata  # noqa: E402

NEW = 6


def capacity(engine):
    return engine.slots.available, engine.slots.free_rows


@pytest.mark.parametrize("graphs", [True, False], ids=["graphed", "eager"])
def test_requests_added_while_others_decode_get_generate_tokens(llama, engine, graphs):
    prompts = ragged_prompts([5, 9, 3, 12, 4], seed=31)
    limits = [NEW, 3, NEW, 5, 2]
    expected = [generate_alone(llama, [prompt], limit, eos_token_id=None)[0] for prompt, limit in zip(prompts, limits)]
    free = capacity(engine)
    with engine.online(graphs=graphs, eos_token_id=None) as online:
        ids = [online.add_request(prompts[0], RequestParams(max_new_tokens=limits[0]))]
        produced = {}
        for step in range(40):
            if step in (2, 3, 5):  # arriving while the first decode (and, later, more than a row holds: they queue)
                ids += [online.add_request(prompts[len(ids)], RequestParams(max_new_tokens=limits[len(ids)]))]
                if step == 5:
                    ids += [online.add_request(prompts[4], RequestParams(max_new_tokens=limits[4]))]
            for output in online.step():
                produced.setdefault(output.request_id, []).extend(output.new)
            if len(ids) == 5 and not online.busy:
                break
        outputs = [online.output(request_id) for request_id in ids]
    assert [output.tokens for output in outputs] == expected
    assert [produced[request_id] for request_id in ids] == expected  # step() reported every token once
    assert all(output.finish_reason is FinishReason.LENGTH for output in outputs)
    assert capacity(engine) == free
    # the engine's generate() is on the same loop: the same tokens
    assert engine.generate(prompts, max_new_tokens=NEW, eos_token_id=None, graphs=graphs) == \
        generate_alone(llama, prompts, NEW, eos_token_id=None)


def test_requests_added_from_another_thread_while_one_thread_steps(llama, engine):
    prompts = ragged_prompts([4, 7, 3, 6, 5, 8], seed=32)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    with engine.online(eos_token_id=None) as online:
        ids, added = [], threading.Event()

        def client():
            for prompt in prompts:
                ids.append(online.add_request(prompt, RequestParams(max_new_tokens=NEW)))
                time.sleep(0.005)
            added.set()

        thread = threading.Thread(target=client)
        thread.start()
        deadline = time.monotonic() + 120
        while not (added.is_set() and not online.busy) and time.monotonic() < deadline:
            online.step()
        thread.join()
        assert [online.output(request_id).tokens for request_id in ids] == expected


def test_abort_frees_the_row_and_slots_at_once_waiting_prefilling_or_decoding(llama, engine):
    prompts = ragged_prompts([4, 20, 5, 6], seed=33)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    free = capacity(engine)
    with engine.online(eos_token_id=None) as online:
        decoding = online.add_request(prompts[0], RequestParams(max_new_tokens=NEW))
        prefilling = online.add_request(prompts[1], RequestParams(max_new_tokens=NEW))  # 20 tokens: 3 chunks of 8
        kept = online.add_request(prompts[2], RequestParams(max_new_tokens=NEW))
        waiting = online.add_request(prompts[3], RequestParams(max_new_tokens=NEW))  # 3 rows: it waits
        online.step()
        online.step()
        assert online.output(prefilling).tokens == [] and online.output(decoding).tokens
        before = capacity(engine)
        assert online.abort(waiting) and capacity(engine) == before  # it held nothing yet
        held = engine.slots._held[online.loop.running[1].row][:]
        cache = engine.slots.prefixes  # its prompt's chunks already cached: no longer read once it ends
        evictable = cache.evictable_tokens
        assert online.abort(prefilling)  # mid-prefill
        unlocked = cache.evictable_tokens - evictable
        assert capacity(engine) == (before[0] + len(held) + unlocked, before[1] + 1)
        assert online.abort(decoding)  # mid-decode
        assert capacity(engine)[1] == before[1] + 2
        assert not online.abort(decoding)
        while online.busy:
            online.step()
        outputs = {request_id: online.output(request_id) for request_id in (decoding, prefilling, kept, waiting)}
    assert [outputs[request_id].finish_reason for request_id in (decoding, prefilling, waiting)] == \
        [FinishReason.ABORT] * 3
    assert outputs[kept].tokens == expected[2] and outputs[kept].finish_reason is FinishReason.LENGTH
    assert outputs[decoding].tokens == expected[0][: len(outputs[decoding].tokens)]
    assert outputs[waiting].tokens == [] and outputs[prefilling].tokens == []
    assert capacity(engine) == free


def test_streamed_tokens_come_as_they_are_chosen(llama, engine):
    prompts = ragged_prompts([5, 3], seed=34)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    with engine.online(eos_token_id=None) as online:
        first = online.add_request(prompts[0], RequestParams(max_new_tokens=NEW))
        second = online.add_request(prompts[1], RequestParams(max_new_tokens=NEW))
        pieces = list(online.stream(first))
        rest = list(online.stream(second))
    assert [token for piece in pieces for token in piece] == expected[0]
    assert len(pieces) >= NEW - 1 and all(pieces)  # a piece per step (overlap may join the last two)
    assert [token for piece in rest for token in piece] == expected[1]


def test_per_request_parameters_and_finish_reasons(llama):
    model = llama
    prompts = ragged_prompts([5, 7, 4, 6], seed=35)
    plain = generate_alone(model, prompts, 10, eos_token_id=None)
    eos = plain[0][2]  # prompt 0 chooses the model's EOS as its third token
    engine = graphrt.hf.engine_model(model, max_requests=4, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[4, 8])
    sampling = SamplingMetadata.from_params(temperatures=[1.0], top_ks=[-1], top_ps=[1.0])
    with engine.online(eos_token_id=eos) as online:
        ids = [online.add_request(prompts[0], RequestParams(max_new_tokens=10)),  # ends on EOS
               online.add_request(prompts[0], RequestParams(max_new_tokens=10, ignore_eos=True)),
               online.add_request(prompts[1], RequestParams(max_new_tokens=10, stop_token_ids=[plain[1][1]])),
               online.add_request(prompts[1], RequestParams(max_new_tokens=10, stop_token_ids=[plain[1][1]],
                                                            min_new_tokens=4)),
               online.add_request(prompts[2], RequestParams(max_new_tokens=3)),
               online.add_request(prompts[3], RequestParams(max_new_tokens=8, sampling=sampling, seed=11)),
               online.add_request(prompts[3], RequestParams(max_new_tokens=8, sampling=sampling, seed=11)),
               online.add_request(prompts[3], RequestParams(max_new_tokens=8, sampling=sampling, seed=12))]
        while online.busy:
            online.step()
        out = [online.output(request_id) for request_id in ids]
    held = generate_alone(model, prompts[1:2], 10, eos_token_id=[eos, plain[1][1]], min_new_tokens=4)[0]
    assert (out[0].tokens, out[0].finish_reason) == (plain[0][:3], FinishReason.EOS)
    assert (out[1].tokens, out[1].finish_reason) == (plain[0], FinishReason.LENGTH)
    assert (out[2].tokens, out[2].finish_reason) == (plain[1][:2], FinishReason.STOP)
    assert out[3].tokens == held and len(held) > 4
    assert (out[4].tokens, out[4].finish_reason) == (plain[2][:3], FinishReason.LENGTH)
    assert out[5].tokens == out[6].tokens != out[7].tokens  # seeded per request, whatever its neighbours


def test_logprobs_of_the_chosen_and_the_top_tokens(llama, engine):
    prompt = ragged_prompts([6], seed=36)[0]
    with engine.online(eos_token_id=None) as online:
        plain = online.add_request(prompt, RequestParams(max_new_tokens=4))
        asked = online.add_request(prompt, RequestParams(max_new_tokens=4, logprobs=True, top_logprobs=3))
        while online.busy:
            online.step()
        without, output = online.output(plain), online.output(asked)
    assert without.logprobs is None and output.tokens == without.tokens
    with torch.no_grad():
        logits = llama(torch.tensor([prompt + output.tokens])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    torch.testing.assert_close(torch.tensor(output.logprobs), logits.gather(1, torch.tensor(output.tokens)[:, None])[:, 0],
                               rtol=1e-4, atol=1e-4)
    values, top_ids = logits.topk(3)
    assert [[token for token, _ in top] for top in output.top_logprobs] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor([[value for _, value in top] for top in output.top_logprobs]), values,
                               rtol=1e-4, atol=1e-4)


def test_a_bad_request_is_rejected_alone(llama, engine):
    prompts = ragged_prompts([5, 4], seed=37)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    free = capacity(engine)
    with engine.online(eos_token_id=None) as online:
        good = online.add_request(prompts[0], RequestParams(max_new_tokens=NEW))
        too_long = online.add_request(list(range(3, 30)), RequestParams(max_new_tokens=NEW))
        outside = online.add_request([5, 4000, 6], RequestParams())
        bad_field = online.add_request(prompts[1], RequestParams(top_logprobs=99))
        other = online.add_request(prompts[1], RequestParams(max_new_tokens=NEW))
        while online.busy:
            online.step()
        outputs = [online.output(request_id) for request_id in (good, too_long, outside, bad_field, other)]
        stats = online.stats()
    assert [output.tokens for output in (outputs[0], outputs[4])] == expected
    assert [output.finish_reason for output in outputs[1:4]] == [FinishReason.REJECTED] * 3
    assert "max_context" in outputs[1].error and "prompts[0][1]: token id 4000" in outputs[2].error
    assert outputs[3].error.startswith("top_logprobs")
    assert capacity(engine) == free
    times = stats["requests"][good]
    assert 0 <= times["queue_s"] <= times["ttft_s"] and times["tpot_s"] > 0 and times["tokens"] == NEW
    assert stats["requests"][too_long]["ttft_s"] is None


def test_the_session_holds_the_engine_until_closed(llama, engine):
    prompt = ragged_prompts([4], seed=38)[0]
    online = engine.online(eos_token_id=None)
    with pytest.raises(RuntimeError, match="online session holds the engine"):
        engine.generate([prompt], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="online session"):
        engine.online()
    request_id = online.add_request(prompt, RequestParams(max_new_tokens=NEW))
    online.step()
    online.close()  # the running request is aborted, its row and slots back
    assert online.output(request_id).finish_reason is FinishReason.ABORT
    assert engine.generate([prompt], max_new_tokens=NEW, eos_token_id=None) == \
        generate_alone(llama, [prompt], NEW, eos_token_id=None)


def test_an_online_step_stays_at_the_host_floor_on_the_fake_cuda(llama, monkeypatch):
    """On the fake CUDA (2.11), overlap on (its default there): an online step copies in once from pinned
    memory and waits at most once (the tokens), requests arriving and one aborted mid-decode included; the
    tokens are generate()'s, with overlap on and off."""
    from fake_cuda import BEHAVIOURS, install
    from fake_cuda_traffic import traffic

    behaviour = next(behaviour for behaviour in BEHAVIOURS if behaviour.name == "2.11")
    prompts = ragged_prompts([5, 3, 6, 4], seed=39)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    tokens = {}
    with install(monkeypatch, behaviour) as fake, traffic(monkeypatch, fake) as log:
        engine = graphrt.hf.engine_model(llama, max_requests=3, max_context=32, max_step_tokens=8, backend="cuda",
                                         check_values=False, warmup_iters=1, piecewise_sizes=[8])
        assert engine.asynchronous
        with torch.no_grad():
            engine.generate(prompts, max_new_tokens=NEW, eos_token_id=None)  # captures
        for runner in engine.runners.all().values():
            log.register(slot.tensor for name, slot in runner.buffers.slots.items() if name.endswith("_cpu"))
        for overlap in (None, False):
            steps = []
            with engine.online(eos_token_id=None, overlap=overlap) as online:
                log.register(engine._arena.buffers.host_arenas, pinned=True)  # (made for the session's stop ids)
                ids = [online.add_request(prompt, RequestParams(max_new_tokens=NEW)) for prompt in prompts[:2]]
                aborted = online.add_request(prompts[0], RequestParams(max_new_tokens=NEW))
                for step in range(30):
                    if step == 2:
                        ids += [online.add_request(prompt, RequestParams(max_new_tokens=NEW)) for prompt in prompts[2:]]
                    if step == 3:
                        online.abort(aborted)
                    with log.watch() as entries:
                        online.step()
                    steps.append(list(entries))
                    if step > 3 and not online.busy:
                        break
                tokens[overlap] = [online.output(request_id).tokens for request_id in ids]
            for entries in steps:
                copies = [entry for entry in entries if entry[0] in ("h2d", "pageable h2d")]
                waits = [entry for entry in entries if entry[0] == "sync"]
                assert copies in ([], [("h2d", True, True)]), entries
                assert waits in ([], [("sync", "Event.synchronize")]), entries
    assert tokens[None] == tokens[False] == expected


def test_online_follows_the_generation_config_as_generate_does():
    """A config that samples is sampled online too, each request seeded by its own seed: with the seeds
    generate() gives its requests (seed + i), the same tokens; a config the session cannot follow is named."""
    from hf_helpers import tiny_model

    model = tiny_model("llama")
    for name, value in dict(do_sample=True, temperature=0.8, top_k=6, repetition_penalty=1.3).items():
        setattr(model.generation_config, name, value)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=8, warmup_iters=1,
                                     piecewise_sizes=[8])
    prompts = ragged_prompts([5, 3, 6], seed=40)
    offline = engine.generate(prompts, max_new_tokens=NEW, seed=4, eos_token_id=None)
    with engine.online(eos_token_id=None) as online:
        outputs = online.run(prompts, [RequestParams(max_new_tokens=NEW, seed=4 + index) for index in range(3)])
        with pytest.raises(ValueError, match="params: expected one RequestParams per prompt"):
            online.run(prompts, [RequestParams()])
    assert [output.tokens for output in outputs] == offline
    assert offline != engine.generate(prompts, max_new_tokens=NEW, eos_token_id=None, generation_config=None)
    model.generation_config.forced_eos_token_id = 2
    with pytest.raises(ValueError, match="forced_eos_token_id"):
        engine.online()
    assert engine.generate(prompts[:1], max_new_tokens=2)  # a refused session leaves the engine free


def test_an_online_session_leaves_the_state_epoch_where_it_was(llama, engine):
    """Nothing an online step does (the inbox, the session's bookkeeping, the requests' times) assigns to an
    object a guard watches: the epoch does not move, and every decode step replays."""
    from graphrt.guards import epoch

    prompts = ragged_prompts([5, 3, 7], seed=41)
    expected = generate_alone(llama, prompts, NEW, eos_token_id=None)
    engine.generate(prompts, max_new_tokens=NEW, eos_token_id=None)  # every key captured
    with engine.online(eos_token_id=None) as online:
        ids = [online.add_request(prompts[0], RequestParams(max_new_tokens=NEW))]
        online.step()
        before = epoch.EPOCH[0]
        ids += [online.add_request(prompt, RequestParams(max_new_tokens=NEW)) for prompt in prompts[1:]]
        while online.busy:
            online.step()
        assert epoch.EPOCH[0] == before
        serve = online.stats()["serve"]
        assert [online.output(request_id).tokens for request_id in ids] == expected
    assert serve["decode_steps"] >= NEW - 1 and serve["decode_steps_graphed"] == serve["decode_steps"]


def test_generate_says_each_requests_times_and_finish_reason(llama, engine):
    prompts = ragged_prompts([5, 3, 7, 4], seed=42)
    plain = generate_alone(llama, prompts, NEW, eos_token_id=None)
    eos = next(token for token in plain[1][1:] if token not in plain[0] + plain[2] + plain[3][:1])  # request 1's only
    tokens = engine.generate(prompts, max_new_tokens=NEW, eos_token_id=[eos], stop_token_ids=[[], [], [], [plain[3][0]]])
    requests = engine.stats()["requests"]
    assert [request["finish_reason"] for request in requests] == [
        FinishReason.LENGTH, FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP]
    assert [request["tokens"] for request in requests] == [len(row) for row in tokens]
    assert all(0 <= request["queue_s"] <= request["ttft_s"] for request in requests)
    assert requests[3]["queue_s"] > requests[0]["queue_s"]  # 3 rows: the fourth waited for one
