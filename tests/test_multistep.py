"""Several decode steps per launch (``decode_steps``, ``GraphRunner.decode``): the API, equality
with K eager steps (tokens and every KV slot a request owns; padded and unpadded; greedy and seeded
sampling; consecutive launches), the model's Python not running at replay, the fallbacks and their
counted reasons, an attention backend without ``advance_step``, and bad input writing nothing."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import python_runs, static_checksums
from faithful_helpers import rng_state, same_rng_state, set_rng_state
from multistep_helpers import TableAttentionModel, TableEngine, eager_steps, pad_launch, sample, state

from graphrt import ForwardMode, GraphRunner, RunnerConfig
from graphrt.multistep import step_slot

STEPS = 4


def table_runner(model, must_capture: bool = True, **options) -> GraphRunner:
    options = {"max_batch_size": 4, "capture_sizes": [2, 4], "decode_steps": (2, STEPS), "backend": "emulated",
               "progress": False, "scratch_state": [model.kv], **options}
    runner = GraphRunner(model, **options)
    report = runner.capture()
    assert not (must_capture and report.failed), report.failed
    return runner


def model_forward(model):
    return lambda batch: model(batch.input_ids, batch.positions, batch)


# ---- the API ----------------------------------------------------------------------------------


def test_the_api_keys_stats_and_shapes():
    parameters = inspect.signature(GraphRunner.decode).parameters
    assert list(parameters) == ["self", "batch", "steps", "next_tokens"] and parameters["next_tokens"].default is None
    assert RunnerConfig().decode_steps == () and RunnerConfig(decode_steps=[8, 4, 8]).decode_steps == (4, 8)
    model = TableAttentionModel()
    runner = table_runner(model)
    names = [str(report.key) for report in runner.capture().keys] + runner.stats()["captured_keys"]
    for name in ("decode/bs=4,steps=4", "decode/bs=2,steps=2", "decode/bs=4"):
        assert name in names
    assert runner.buffers.slots[step_slot(STEPS - 1)].tensor.shape == (4,)  # max_batch_size rows per step
    engine = TableEngine(model, 3)
    batch = engine.launch(STEPS)
    before = {name: value.clone() for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}
    tokens = runner.decode(batch, STEPS)
    assert tokens.shape == (STEPS, 3) and tokens.dtype == torch.int64
    assert all(torch.equal(getattr(batch, name), value) for name, value in before.items()), "the batch was modified"
    stats = runner.stats()
    assert stats["multi_step_runs"] == 1 and stats["key_hits"] == {"decode/bs=4,steps=4": 1}
    assert stats["multi_step_fallbacks"] == {} and stats["graph_runs"] == 0 and stats["eager_runs"] == 0
    assert (stats["real_tokens"], stats["padded_tokens"]) == (3 * STEPS, STEPS)


@pytest.mark.parametrize("options, error, field", [
    ({"decode_steps": (1, 4)}, ValueError, "decode_steps"),
    ({"decode_steps": "4"}, ValueError, "decode_steps"),
    ({"next_tokens": 3}, TypeError, "next_tokens"),
])
def test_bad_options_name_the_option(options, error, field):
    with pytest.raises(error, match=field):
        RunnerConfig(**options)


# ---- equal to K eager steps --------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [4, 3], ids=["unpadded", "padded"])
@pytest.mark.parametrize("sampler", ["greedy", "seeded"])
def test_launches_equal_eager_steps_on_a_model_reading_the_cache_through_a_table(batch_size, sampler):
    """Two consecutive launches of 4 steps: tokens, the KV cache and the generator as the same steps
    run eagerly (on the batch padded to the key, bitwise; greedy tokens also as unpadded eager)."""
    next_tokens = sample if sampler == "seeded" else None
    model = TableAttentionModel()
    runner = table_runner(model, next_tokens=next_tokens)
    engine = TableEngine(model, batch_size, seed=batch_size)
    control = copy.deepcopy(model)
    torch.manual_seed(11)
    for launch in range(2):
        batch = engine.launch(STEPS)
        control.req_to_token.copy_(model.req_to_token)  # the engine mapped the launch's slots ahead
        start = rng_state("cpu")
        tokens = runner.decode(batch, STEPS).clone()
        after = rng_state("cpu")
        set_rng_state(start)
        padded = pad_launch(batch, 4, STEPS)
        expected = eager_steps(model_forward(control), padded, STEPS, next_tokens)[:, :batch_size]
        assert torch.equal(tokens, expected), f"launch {launch}"
        assert same_rng_state(after, rng_state("cpu")), "the replay drew what the eager steps draw"
        assert torch.equal(model.kv[1:], control.kv[1:]), "every slot but the scratch slot as eager left it"
        engine.advance(tokens)
    if sampler == "greedy":  # and the tokens of unpadded eager steps, from the cache as it was
        fresh, engine = TableAttentionModel(), TableEngine(TableAttentionModel(), batch_size, seed=batch_size)
        fresh.kv.copy_(engine.model.kv)
        chosen = []
        for _ in range(2):
            batch = engine.launch(STEPS)
            fresh.req_to_token.copy_(engine.model.req_to_token)
            chosen.append(eager_steps(model_forward(fresh), batch, STEPS))
            engine.advance(chosen[-1])
        replayed = TableAttentionModel()
        runner = table_runner(replayed)
        engine = TableEngine(replayed, batch_size, seed=batch_size)
        for launch in range(2):
            tokens = runner.decode(engine.launch(STEPS), STEPS)
            assert torch.equal(tokens, chosen[launch])
            engine.advance(tokens)
    assert runner.stats()["multi_step_runs"] == 2 and runner.stats()["multi_step_fallbacks"] == {}


def test_capture_leaves_the_cache_and_every_generator_as_they_were():
    model = TableAttentionModel()
    engine = TableEngine(model, 4)
    engine.launch(STEPS)
    before, generators = state(model), rng_state("cpu")
    runner = table_runner(model, next_tokens=sample)
    assert all(torch.equal(a, b) for a, b in zip(state(model), before))
    assert same_rng_state(rng_state("cpu"), generators)
    runner.retune(1)  # the multi-step keys follow the new decode sizes
    assert sorted(key.steps for key in runner.registry.ready_keys()) == [1, 2, 4]
    assert same_rng_state(rng_state("cpu"), generators)


def test_the_models_python_does_not_run_during_a_multi_step_replay():
    model = TableAttentionModel()
    runner = table_runner(model)
    calls = []
    with python_runs(type(model).forward, calls):
        runner.decode(TableEngine(model, 4).launch(STEPS), STEPS)
    assert calls == [] and runner.stats()["multi_step_runs"] == 1


def test_a_single_step_is_the_runners_step_then_next_tokens():
    model = TableAttentionModel()
    runner = table_runner(model)
    engine = TableEngine(model, 3)
    batch = engine.launch(1)
    control = copy.deepcopy(model)
    assert torch.equal(runner.decode(batch, 1), eager_steps(model_forward(control), batch, 1))
    assert runner.stats()["graph_runs"] == 1 and runner.stats()["multi_step_fallbacks"] == {}


# ---- fallbacks ---------------------------------------------------------------------------------


def _fallback_case(model, case):
    """A runner, a batch, decode()'s extra arguments and the steps for one fallback case."""
    if case == "capture_failed":  # a sampler reading a device value on the host cannot be graphed
        runner = table_runner(model, must_capture=False,
                              next_tokens=lambda output, step: output.argmax(-1) + int(output.sum() > 1e30))
        assert all(key.steps == 1 for key in runner.registry.ready_keys())
    else:
        runner = table_runner(model, **({"backend": "eager"} if case == "graphs_disabled" else {}))
    bs = 6 if case == "batch_too_large" else 3
    steps = 3 if case == "steps_not_captured" else STEPS
    extra = {"next_tokens": lambda output, step: output.argmax(-1)} if case == "sampler_not_captured" else {}
    return runner, TableEngine(model, bs, seed=5).launch(steps), extra, steps


@pytest.mark.parametrize("case", ["steps_not_captured", "batch_too_large", "sampler_not_captured", "capture_failed",
                                  "graphs_disabled"])
def test_a_call_no_multi_step_key_serves_runs_its_steps_one_by_one_with_a_counted_reason(case):
    model = TableAttentionModel()
    runner, batch, extra, steps = _fallback_case(model, case)
    control = copy.deepcopy(model)
    tokens = runner.decode(batch, steps, **extra)
    assert torch.equal(tokens, eager_steps(model_forward(control), batch, steps))
    assert torch.allclose(model.kv[1:], control.kv[1:], atol=1e-6)
    stats = runner.stats()
    assert stats["multi_step_fallbacks"] == {case: 1} and stats["multi_step_runs"] == 0
    single = {"batch_too_large": "batch_too_large", "graphs_disabled": "graphs_disabled"}.get(case)
    assert (stats["eager_reasons"] == {single: steps}) if single else (stats["graph_runs"] == steps)


def test_a_replay_that_raises_reruns_the_steps_one_by_one_and_disables_the_key():
    model = TableAttentionModel()
    runner = table_runner(model)
    engine = TableEngine(model, 4, seed=2)
    batch = engine.launch(STEPS)
    entry = runner.dispatcher.decide(batch, STEPS).entry

    def broken() -> None:
        raise RuntimeError("injected")

    entry.graph.replay = broken
    control = copy.deepcopy(model)
    assert torch.equal(runner.decode(batch, STEPS), eager_steps(model_forward(control), batch, STEPS))
    engine.advance(eager_steps(model_forward(copy.deepcopy(control)), batch, STEPS))
    runner.decode(engine.launch(STEPS), STEPS)
    stats = runner.stats()
    assert stats["multi_step_fallbacks"] == {"replay_failed": 1, "disabled": 1}
    assert "injected" in stats["failed_keys"]["decode/bs=4,steps=4"]


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error, field", [
    (lambda batch: (batch, 0), ValueError, "steps"),
    (lambda batch: (batch, "4"), ValueError, "steps"),
    (lambda batch: (batch, 3), ValueError, "out_cache_loc"),
    (lambda batch: (batch.__class__(**{**vars(batch), "forward_mode": ForwardMode.EXTEND}), STEPS), ValueError,
     "forward_mode"),
    (lambda batch: (batch.__class__(**{**vars(batch), "out_cache_loc": batch.out_cache_loc[:-1]}), STEPS), ValueError,
     "out_cache_loc"),
    (lambda batch: (batch.__class__(**{**vars(batch), "out_cache_loc": -batch.out_cache_loc}), STEPS), ValueError,
     "out_cache_loc"),
    (lambda batch: (batch.__class__(**{**vars(batch), "seq_lens_sum": 1}), STEPS), ValueError, "seq_lens_sum"),
    (lambda batch: ("batch", STEPS), TypeError, "batch"),
])
@pytest.mark.parametrize("value_checks", ["python_ints", "torch_reductions"])
def test_bad_input_names_the_field_and_writes_nothing(bad, error, field, value_checks, monkeypatch):
    if value_checks == "torch_reductions":  # the path of batches of more values than HOST_LIST_VALUES
        monkeypatch.setattr("graphrt.batch.HOST_LIST_VALUES", 0)
    model = TableAttentionModel()
    runner = table_runner(model)
    batch = TableEngine(model, 3).launch(STEPS)
    slots, before = static_checksums(runner), state(model)
    with pytest.raises(error, match=field):
        runner.decode(*bad(batch))
    assert all(torch.equal(slots[name], runner.buffers.slots[name].tensor) for name in slots)
    assert all(torch.equal(a, b) for a, b in zip(state(model), before))
    assert runner.stats()["multi_step_runs"] == 0 and runner.stats()["multi_step_fallbacks"] == {}
