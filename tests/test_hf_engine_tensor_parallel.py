"""The engine path on a tensor-parallel Hugging Face model: 2 gloo ranks on CPU, one spawned pair for every check.

Each rank builds the same tiny model, takes each prompt's greedy tokens from ``model.generate()`` on the
unsharded model, then ``engine_model(..., process_group=WORLD)`` shards it by its own plan and serves the
prompts with continuous batching (two request rows for three prompts, the third arriving late, prefill in
chunks of four tokens beside running decodes): graphed (decode graphs and piecewise prefill graphs with the
collectives inside, multi-step launches) and eagerly, every rank returning generate()'s tokens. Then the
faults: a capture that fails on rank 1 only, calls refused on one rank or made differently, a rank that
hangs and a rank that dies (each on a gloo group of its own with a one-second timeout; the death last).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_engine_helpers import generate_alone, ragged_prompts  # noqa: E402
from hf_helpers import tiny_model  # noqa: E402
from lockstep_helpers import report_now, run_ranks  # noqa: E402

import graphrt.hf  # noqa: E402
from graphrt.backends.state_journal import backing_tensor  # noqa: E402
from graphrt.hf.tensor_parallel import ATTRIBUTE  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

FAMILIES = ["llama", "qwen3", "qwen3-moe", "gemma2", "gpt-oss"]
LOGITS_FAMILIES = ("llama", "gemma2")  # prompt logits compared too (soft-capping, windows)
NEW_TOKENS = 4
LENGTHS = [6, 3, 9]
ARRIVALS = [0, 0, 2]
GROUP_TIMEOUT_S = 1.0  # the fault checks' gloo groups: a peer that does not come fails the wait after this
HANG_S = 1.5  # rank 1's hang, longer than the timeout
TIMEOUT_S = 240  # the whole pair; a hang fails the test


def engine_for(model, group=None, **options):
    return graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=4, warmup_iters=1,
                                   piecewise_sizes=[2, 4], process_group=group or dist.group.WORLD, **options)


def weight_bytes(model) -> int:
    """Bytes of the memory the model's parameters hold (a DTensor's: its local shard's), each allocation once."""
    storages = {}
    for parameter in model.parameters():
        storage = backing_tensor(parameter).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def serve_family(family: str) -> dict:
    """Tokens graphed and eager against generate() on the unsharded model; the shard's shapes; prompt logits."""
    model = tiny_model(family)
    prompts = ragged_prompts(LENGTHS)
    expected = generate_alone(model, prompts, NEW_TOKENS)
    reference = None
    if family in LOGITS_FAMILIES:
        model.set_attn_implementation("eager")  # the one that honours every argument (sdpa drops soft-capping)
        with torch.no_grad():
            reference = [model(torch.tensor([prompt])).logits[0].float() for prompt in prompts[:2]]
    q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    unsharded_bytes = weight_bytes(model)
    engine = engine_for(model)
    graphed = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS)
    stats = engine.stats()
    eager = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS, graphs=False)
    result = dict(expected=expected, graphed=graphed, eager=eager, stats=stats, eager_stats=engine.stats(),
                  rules=dict(getattr(model, ATTRIBUTE).rules), kv_heads=engine.layout.layers[0].num_kv_heads,
                  weight_bytes=(unsharded_bytes, weight_bytes(model)),
                  q_rows=(q_rows, model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]
                          if hasattr(model.model.layers[0].self_attn.q_proj.weight, "to_local") else q_rows))
    if reference is not None:
        served = engine.prompt_logits(prompts[:2])
        result["logits_error"] = max(float((got - want).abs().max()) for got, want in zip(served, reference))
    if family == "llama":
        result["launched"] = engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=2)
        result["launch_stats"] = engine.stats()
        result["refusals"] = refusals(engine, prompts, dist.get_rank())
        result["model_change"] = model_change(engine, model, prompts, dist.get_rank())
        if dist.get_rank() == 1:  # a Python value the step reads changes on rank 1: its guard fails there only
            model.lm_head.note = "changed"
        result["one_rank_changed"] = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        result["changed_stats"] = engine.stats()
    return result


def refusals(engine, prompts, rank: int) -> dict:
    """Calls one rank refuses, both refuse, or the ranks make differently: raised on every rank, no step run."""
    calls_before = engine._counters.model_calls
    found = {}
    bad = [[5, 999]]  # token id 999 is outside the vocabulary (128)
    for name, mine in (("both_bad", bad), ("rank1_bad", bad if rank == 1 else prompts),
                       ("different", prompts if rank == 0 else prompts[:2])):
        try:
            engine.generate(mine, max_new_tokens=NEW_TOKENS)
            found[name] = None
        except ValueError as error:
            found[name] = str(error)
    found["model_calls"] = engine._counters.model_calls - calls_before
    try:
        graphrt.hf.engine_model(tiny_model("llama", num_key_value_heads=1), process_group=dist.group.WORLD)
    except ValueError as error:
        found["kv_heads"] = str(error)
    return found


def local_shape(tensor) -> tuple:
    return tuple((tensor.to_local() if hasattr(tensor, "to_local") else tensor).shape)


def serve_peft() -> dict:
    """A PEFT LoRA model (adapters on q/v, colwise, and o/down, rowwise): its plan matched under the wrapper's
    prefix, tokens against generate() on the unsharded PEFT model; then the plans graphrt refuses."""
    import peft

    torch.manual_seed(0)
    lora = peft.LoraConfig(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], r=4, lora_alpha=8,
                           init_lora_weights=False)  # random A and B: adapters that change the tokens
    model = peft.get_peft_model(tiny_model("llama"), lora).eval()
    prompts = ragged_prompts(LENGTHS)
    expected = generate_alone(model, prompts, NEW_TOKENS)
    base_expected = generate_alone(tiny_model("llama"), prompts, NEW_TOKENS)
    unsharded_bytes = weight_bytes(model)
    engine = engine_for(model)
    graphed = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS)
    stats = engine.stats()
    eager = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS, graphs=False)
    attention = model.base_model.model.model.layers[0].self_attn
    shapes = {name: local_shape(tensor) for name, tensor in (
        ("q_base", attention.q_proj.base_layer.weight), ("q_lora_A", attention.q_proj.lora_A.default.weight),
        ("q_lora_B", attention.q_proj.lora_B.default.weight), ("o_base", attention.o_proj.base_layer.weight),
        ("o_lora_A", attention.o_proj.lora_A.default.weight), ("o_lora_B", attention.o_proj.lora_B.default.weight))}
    dora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"], use_dora=True)).eval()
    return dict(expected=expected, base_expected=base_expected, graphed=graphed, eager=eager, stats=stats,
                rules=dict(getattr(model, ATTRIBUTE).rules), weight_bytes=(unsharded_bytes, weight_bytes(model)),
                kv_heads=engine.layout.layers[0].num_kv_heads, shapes=shapes, dora=refused_whole(dora))


def refused_whole(model) -> tuple:
    """(the ValueError engine_model raised, whether the model was left unsharded), or None when it was served."""
    before = weight_bytes(model)
    try:
        engine_for(model)
        return None
    except ValueError as error:
        return str(error), weight_bytes(model) == before and getattr(model, ATTRIBUTE, None) is None


def unmatched_plan() -> tuple:
    """A plan none of whose entries names one of the model's modules."""
    model = tiny_model("llama")
    model._tp_plan = {"decoder.blocks.*.attn.q_proj": "colwise", "decoder.blocks.*.attn.o_proj": "rowwise"}
    return refused_whole(model)


def model_change(engine, model, prompts, rank: int) -> dict:
    """The model's config changed on rank 1 only (refused on every rank, before any probe or step), then on every
    rank (each rank probes the shard again, in lockstep, and serves on)."""
    found = {}
    if rank == 1:
        model.config.use_cache = False
    try:
        engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        found["one_rank"] = None
    except ValueError as error:
        found["one_rank"] = str(error)
    model.config.use_cache = False
    found["every_rank"] = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    model.config.use_cache = True
    return found


def capture_fault(rank: int) -> dict:
    """Rank 1's head reads a host value when it has 2 rows, after every collective of the step: its recordings
    of the 2-row keys fail there only, and every rank runs those steps eagerly."""
    model = tiny_model("llama")
    prompts = ragged_prompts(LENGTHS, seed=2)
    expected = generate_alone(model, prompts, NEW_TOKENS)
    logged = []

    def read_on_host(module, args, output) -> None:
        if output.shape[-2] == 2:
            logged.append(float(output[0, 0, 0]))

    if rank == 1:
        model.lm_head.register_forward_hook(read_on_host)
    engine = engine_for(model)
    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS)
    return dict(expected=expected, tokens=tokens, stats=engine.stats())


def peer_fault(rank: int, kind: str, group) -> dict:
    """Rank 1 hangs (``HANG_S``) or dies after its second step; what rank 0's generate() raises, and when."""
    dist.barrier()  # on WORLD: the ranks start together (the last check's waits ended at different times)
    engine = engine_for(tiny_model("llama"), group)
    share, steps = engine.ranks.share_tokens, []

    def shared_then_fault(tokens):
        chosen = share(tokens)
        steps.append(chosen)
        if rank == 1 and len(steps) == 2:
            if kind == "death":
                report_now(REPORT)
                os._exit(0)
            time.sleep(HANG_S)
        return chosen

    engine.ranks.share_tokens = shared_then_fault
    start = time.monotonic()
    try:
        engine.generate(ragged_prompts(LENGTHS), max_new_tokens=NEW_TOKENS, graphs=False)
        return dict(error=None)
    except Exception as error:  # the point: which error, and how soon
        return dict(error=type(error).__name__, message=str(error), seconds=time.monotonic() - start)


REPORT: dict = {}


def tp_worker(rank: int) -> dict:
    torch.set_num_threads(1)  # two ranks on two cores
    REPORT.clear()
    REPORT["families"] = {family: serve_family(family) for family in FAMILIES}
    REPORT["peft"] = serve_peft() if importlib.util.find_spec("peft") else None
    REPORT["unmatched"] = unmatched_plan()
    REPORT["capture_fault"] = capture_fault(rank)
    # Groups of their own (made now, while the ranks are together): a fault leaves its group unusable.
    hang_group, death_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
                               for _ in range(2))
    REPORT["hang"] = peer_fault(rank, "hang", hang_group)
    REPORT["death"] = peer_fault(rank, "death", death_group)  # last: rank 1 reports, then exits
    return REPORT


@pytest.fixture(scope="module")
def reports() -> dict:
    """Both ranks' reports of one spawned pair (every check below reads them)."""
    return run_ranks(tp_worker, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_serves_generates_tokens_graphed_and_eager(reports, family):
    for report in reports.values():
        served = report["families"][family]
        assert served["graphed"] == served["expected"], "graphed tokens differ from generate()'s"
        assert served["eager"] == served["expected"], "eager tokens differ from generate()'s"
        stats = served["stats"]
        assert stats["ranks"] == 2 and stats["failed_keys"] == {}
        assert stats["graph_runs"] > 0 and stats["piecewise_runs"] > 0  # decode graphs, piecewise prefill
        assert stats["serve"]["decode_steps_graphed"] == stats["serve"]["decode_steps"]
        assert stats["serve"]["prefill_tokens_graphed"] == stats["serve"]["prefill_tokens"] > 0
        assert served["eager_stats"]["graph_runs"] == served["eager_stats"]["piecewise_runs"] == 0
        assert served.get("logits_error", 0.0) < 1e-4
    assert reports[0]["families"][family]["rules"] == reports[1]["families"][family]["rules"]


def test_each_rank_holds_its_shard_as_the_plan_says(reports):
    served = reports[0]["families"]
    rules = {family: served[family]["rules"] for family in FAMILIES}
    for family in ("llama", "qwen3", "qwen3-moe", "gemma2"):  # attention sharded: one of the 2 KV heads per rank
        assert rules[family]["model.layers.0.self_attn.k_proj"] == "colwise"
        assert rules[family]["model.layers.0.self_attn.o_proj"] == "rowwise"
        assert served[family]["kv_heads"] == 1
        full, local = served[family]["q_rows"]
        assert local * 2 == full
        unsharded, sharded = served[family]["weight_bytes"]  # the whole weights are not kept beside the shards
        assert sharded < 0.6 * unsharded, (family, unsharded, sharded)
    assert rules["qwen3-moe"]["model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert rules["qwen3-moe"]["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert rules["gpt-oss"]["lm_head"] == "colwise_gather_output"  # its plan leaves attention whole
    assert served["gpt-oss"]["kv_heads"] == 2


def test_a_peft_model_is_sharded_by_its_base_models_plan_and_serves_generates_tokens(reports):
    if reports[0]["peft"] is None:
        pytest.skip("peft is not installed")
    for report in reports.values():
        served = report["peft"]
        assert served["expected"] != served["base_expected"]  # the adapters change the tokens
        assert served["graphed"] == served["expected"] and served["eager"] == served["expected"]
        assert served["stats"]["failed_keys"] == {} and served["stats"]["graph_runs"] > 0
        rules = served["rules"]  # named as the wrapper names its modules
        assert rules["base_model.model.model.layers.0.self_attn.q_proj"] == "colwise"
        assert rules["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"] == "colwise"
        assert rules["base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight"] == "rowwise"
        assert rules["base_model.model.model.layers.0.self_attn.k_proj"] == "colwise"  # no adapter there
        assert served["kv_heads"] == 1
        shapes = served["shapes"]  # hidden 32 (4 heads of 8), LoRA rank 4: each rank its half of the heads
        assert shapes["q_base"] == (16, 32) and shapes["q_lora_B"] == (16, 4) and shapes["q_lora_A"] == (4, 32)
        assert shapes["o_base"] == (32, 16) and shapes["o_lora_A"] == (4, 16) and shapes["o_lora_B"] == (32, 4)
        unsharded, sharded = served["weight_bytes"]
        assert sharded < 0.6 * unsharded, (unsharded, sharded)


def test_a_plan_that_matches_no_module_is_refused_with_the_model_left_whole(reports):
    for report in reports.values():
        message, untouched = report["unmatched"]
        assert "LlamaForCausalLM: no plan entry matched its modules" in message and untouched


def test_an_adapter_graphrt_cannot_shard_is_refused_with_the_model_left_whole(reports):
    if reports[0]["peft"] is None:
        pytest.skip("peft is not installed")
    for report in reports.values():
        message, untouched = report["peft"]["dora"]
        assert "base_model.model.model.layers.0.self_attn.q_proj is a peft.tuners.lora" in message
        assert "no DoRA" in message and untouched


def test_multi_step_launches_replay_with_the_collectives_inside(reports):
    for report in reports.values():
        llama = report["families"]["llama"]
        assert llama["launched"] == llama["expected"]
        assert llama["launch_stats"]["multi_step_runs"] > 0 and llama["launch_stats"]["multi_step_fallbacks"] == {}


def test_a_call_refused_on_one_rank_is_refused_on_every_rank_before_any_step(reports):
    zero, one = (report["families"]["llama"]["refusals"] for report in (reports[0], reports[1]))
    for refused in (zero, one):
        assert "prompts[0][1]: token id 999" in refused["both_bad"]
        assert "ranks were called with different arguments" in refused["different"]
        assert refused["model_calls"] == 0
        assert "num_key_value_heads=1, which 2 ranks do not divide" in refused["kv_heads"]
    assert one["rank1_bad"].startswith("prompts[0][1]: token id 999")
    assert zero["rank1_bad"].startswith("generate: refused on rank 1: ValueError: prompts[0][1]")


def test_a_model_changed_on_one_rank_is_refused_on_every_rank_and_followed_when_every_rank_changed_it(reports):
    for report in reports.values():
        llama = report["families"]["llama"]
        assert "ranks were called with different arguments" in llama["model_change"]["one_rank"]
        assert llama["model_change"]["every_rank"] == llama["expected"]


def test_a_capture_failing_on_one_rank_runs_that_key_eagerly_on_every_rank(reports):
    zero, one = reports[0]["capture_fault"], reports[1]["capture_fault"]
    for fault in (zero, one):
        assert fault["tokens"] == fault["expected"]
        assert set(fault["stats"]["failed_keys"]) == {"decode@32+prefill:decode/bs=2",
                                                      "decode@32+prefill:piecewise/tokens=2"}
        assert fault["stats"]["eager_reasons"].get("capture_failed", 0) > 0
        assert fault["stats"]["graph_runs"] > 0  # the other keys replay
    assert all("HostSyncError" in why for why in one["stats"]["failed_keys"].values())
    assert all("failed on rank 1: HostSyncError" in why for why in zero["stats"]["failed_keys"].values())


@pytest.mark.parametrize("kind", ["hang", "death"])
def test_a_peer_that_hangs_or_dies_fails_the_others_within_the_groups_timeout(reports, kind):
    fault = reports[0][kind]
    assert fault["error"] == "PeerLostError", fault
    assert "rank 0 lost its peers at the step agreement" in fault["message"]
    assert fault["seconds"] < GROUP_TIMEOUT_S + 3
    if kind == "hang":  # the hung rank finds its peer gone when it comes back
        assert reports[1]["hang"]["error"] == "PeerLostError"


def test_a_guard_failing_on_one_rank_runs_the_step_eagerly_on_every_rank(reports):
    # Rank 1 set an attribute on its head after capture: its steps run eagerly (python_state), so rank 0's do too.
    for report in reports.values():
        llama = report["families"]["llama"]
        assert llama["one_rank_changed"] == llama["expected"]
        assert llama["changed_stats"]["graph_runs"] == llama["changed_stats"]["piecewise_runs"] == 0
    assert reports[1]["families"]["llama"]["changed_stats"]["eager_reasons"].get("python_state", 0) > 0
    assert reports[0]["families"]["llama"]["changed_stats"]["eager_reasons"].get("peer_eager", 0) > 0


def nccl_engine_worker(rank: int) -> dict:
    """A 1-rank NCCL group: the engine's CUDA graphs capture its collectives (all-reduce, all-gather)."""
    model = tiny_model("llama", "cuda")
    prompts = ragged_prompts(LENGTHS)
    expected = generate_alone(model, prompts, NEW_TOKENS)
    engine = graphrt.hf.engine_model(model, max_requests=2, max_context=32, max_step_tokens=4,
                                     process_group=dist.group.WORLD)
    tokens = engine.generate(prompts, max_new_tokens=NEW_TOKENS, arrivals=ARRIVALS)
    stats = engine.stats()
    launched = engine.generate(prompts, max_new_tokens=NEW_TOKENS, steps_per_launch=2)
    return dict(expected=expected, tokens=tokens, stats=stats, launched=launched, launch_stats=engine.stats(),
                agreement_backend=dist.get_backend(engine.ranks.cpu_group))


@pytest.mark.cuda
def test_one_rank_nccl_engine_replays_its_collectives_in_cuda_graphs():
    if not dist.is_nccl_available():
        pytest.skip("this torch was built without NCCL")
    report = run_ranks(nccl_engine_worker, world_size=1, backend="nccl", timeout_s=300)[0]
    assert report["agreement_backend"] == "gloo"
    assert report["tokens"] == report["expected"] and report["launched"] == report["expected"]
    stats = report["stats"]
    assert stats["backend"] == "cuda" and stats["failed_keys"] == {} and stats["ranks"] == 1
    assert stats["graph_runs"] > 0 and stats["serve"]["prefill_tokens_graphed"] == stats["serve"]["prefill_tokens"]
    assert report["launch_stats"]["multi_step_runs"] > 0 and report["launch_stats"]["failed_keys"] == {}
