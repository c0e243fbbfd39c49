"""graphrt.check: each gallery model's report names exactly its hazard and line; clean models
(the reference model, the Hugging Face models of test_hf_models, the examples) report no
hazard; the check leaves every tensor, binding and random generator as it was; the CLI."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import check_gallery as gallery
import pytest
import torch

import graphrt
from graphrt import GraphRunner
from graphrt.backends.op_graph import HostSyncError, OpRecorder
from graphrt.check import HAZARDS, Severity
from graphrt.check import __main__ as cli
from graphrt.check.findings import Namer, device_findings
from graphrt.check.names import ObjectGraph
from graphrt.check.recording import Step, record
from graphrt.reference import (
    ReferenceConfig,
    build_reference,
    graph_runner_kwargs,
    make_decode_batch,
)

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"#\s*HAZARD:\s*(\w+)")
NO_LINE = {"no_batch_dim"}  # found from the arguments alone, before anything runs


def marked(obj) -> set:
    """(kind, line) of every ``# HAZARD: kind`` marker in the source of ``obj``."""
    lines, start = inspect.getsourcelines(obj)
    return {(match.group(1), start + offset) for offset, line in enumerate(lines) for match in MARKER.finditer(line)}


def found(report) -> set:
    return {(f.kind, None if f.source is None else int(re.search(r":(\d+) in ", f.source).group(1)))
            for f in report.findings}


@pytest.mark.parametrize("name", sorted(gallery.HAZARD_FACTORIES))
def test_gallery_report_names_exactly_the_marked_hazard_and_line(name):
    fn, args = gallery.HAZARD_FACTORIES[name]()
    report = graphrt.check(fn, *args)
    expected = marked(fn if inspect.isfunction(fn) else type(fn))
    got = found(report)
    if expected and next(iter(expected))[0] in NO_LINE:
        expected = {(kind, None) for kind, _ in expected}
    assert got == expected, str(report)
    assert all(f.source is None or f.source.startswith("tests/check_gallery.py:") for f in report.findings)
    assert report.ok is all(HAZARDS[kind].severity is Severity.INFO for kind, _ in expected)


def test_every_hazard_kind_has_a_gallery_model_or_a_gpu_test():
    shown = {kind for name, factory in gallery.HAZARD_FACTORIES.items()
             for kind, _ in marked(_target_of(factory()[0]))}
    assert set(HAZARDS) - shown == {"cpu_tensor", "multiple_devices"}  # need a CUDA step: see the cuda tests


def _target_of(fn):
    return fn if inspect.isfunction(fn) else type(fn)


def test_findings_name_the_tensor_read_or_written():
    fn, args = gallery.lengths()
    (finding,) = graphrt.check(fn, *args).findings
    assert finding.tensor == "lengths" and finding.op == "Tensor.tolist"
    fn, args = gallery.input_write()
    (finding,) = graphrt.check(fn, *args).findings
    assert finding.tensor == "counter" and finding.op == "aten.add_"
    fn, args = gallery.rebind()
    (finding,) = graphrt.check(fn, *args).findings
    assert finding.tensor == "offset"


def test_clean_model_has_no_finding_no_state_no_note():
    fn, args = gallery.mlp()
    report = graphrt.check(fn, *args)
    assert report.ok and report.findings == [] and report.state_writes == [] and report.notes == []
    assert [(a.name, a.kind) for a in report.arguments] == [("x", "batch dim 0")]
    assert "OK: safe to graph" in str(report) and "hazards: none" in str(report)


def test_state_written_per_step_with_names_and_bytes():
    fn, args = gallery.kv_cache()
    report = graphrt.check(fn, *args)
    assert report.ok and report.findings == []
    writes = {write.tensor: write for write in report.state_writes}
    assert set(writes) == {"k_cache", "steps"}
    assert writes["k_cache"].bytes_per_step == gallery.BATCH * gallery.HIDDEN * 4  # the indexed rows only
    assert writes["k_cache"].ops == ["aten.index_put_"] and writes["steps"].bytes_per_step == 8
    assert writes["k_cache"].sources[0].startswith("tests/check_gallery.py:")


def test_check_leaves_tensors_bindings_and_random_state_as_they_were():
    model, args = gallery.kv_cache()
    model.k_cache.normal_()
    before = {name: tensor.clone() for name, tensor in model.named_buffers()}
    rng = torch.get_rng_state()
    graphrt.check(model, *args)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)

    rebinding, args = gallery.rebind()
    offset = rebinding.offset
    counter, _ = gallery.python_counter()
    noisy, _ = gallery.noise()
    for model in (rebinding, counter, noisy):
        graphrt.check(model, *args)
    assert rebinding.offset is offset and torch.equal(offset, torch.zeros(gallery.HIDDEN))
    assert counter.calls == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_user_variants_decide_the_branch_comparison():
    model = gallery.BranchModel()
    positive = torch.ones(2, gallery.HIDDEN)
    same_branch = graphrt.check(model, positive, variants=[((2 * positive,), {})])
    other_branch = graphrt.check(model, positive, variants=[((-positive,), {})])
    assert "value_dependent_branch" not in {f.kind for f in same_branch.findings}
    (branch,) = other_branch.of_kind("value_dependent_branch")
    assert "variant 1" in branch.message and branch.op == "aten.mul"


def test_arguments_are_classified_as_wrap_does():
    mlp = torch.nn.Linear(8, 4)

    def head(hidden, mask, temperature=1.0):
        return torch.softmax(mlp(hidden) / temperature, dim=-1) * mask

    report = graphrt.check(head, torch.randn(5, 8), torch.ones(1, 4), temperature=0.7)
    assert report.ok and report.findings == []
    kinds = {a.name: (a.kind, a.runs_eagerly_when) for a in report.arguments}
    assert kinds["hidden"][0] == "batch dim 0" and "batch_too_large" in kinds["hidden"][1]
    assert kinds["mask"][0] == "fixed" and "[1, 4]" in kinds["mask"][1]
    assert kinds["temperature"][0] == "constant" and "new argument layout" in kinds["temperature"][1]


def test_json_report():
    fn, args = gallery.branch()
    doc = json.loads(graphrt.check(fn, *args).to_json())
    assert doc["ok"] is False and doc["recordings"] == 3
    kinds = {f["kind"]: f for f in doc["findings"]}
    assert kinds["host_sync"]["severity"] == "error" and kinds["host_sync"]["graphrt"] == "capture_failed"
    assert kinds["value_dependent_branch"]["graphrt"] == "silent" and kinds["value_dependent_branch"]["fix"]


def test_op_recorder_still_raises_on_host_sync():
    with pytest.raises(HostSyncError, match="check_gallery.py"), OpRecorder():
        gallery.ItemModel()(torch.ones(2, 2))


def test_device_findings_flag_cpu_tensors_of_a_cuda_step():
    wrapped, args = gallery.kv_cache()
    fn = wrapped.fn  # the module wrap() graphs
    graph = ObjectGraph([("", fn)])
    recording = record(Step("example", lambda: fn(*args), {"x": args[0]}), graph)
    findings = device_findings(recording, Namer(graph, recording), torch.device("cuda", 0))
    assert {f.kind for f in findings} == {"cpu_tensor"}
    assert "k_cache" in {f.tensor for f in findings}
    assert device_findings(recording, Namer(graph, recording), torch.device("cpu")) == []


# ---------------------------------------------------------------- GraphRunner.check


@pytest.fixture
def reference():
    config = ReferenceConfig.tiny()
    model, backend, pools = build_reference(config, num_requests=8)
    runner = GraphRunner(model, max_batch_size=8, progress=False, **graph_runner_kwargs(backend, pools))
    return runner, backend, pools


def decode_example(backend, pools, lens=(5, 3, 7)):
    reqs = [pools.req_to_token.alloc() for _ in lens]
    pools.assign(reqs, [0] * len(lens), list(lens))
    out = pools.assign(reqs, list(lens), [1] * len(lens))
    return make_decode_batch([11, 12, 13], reqs, [n + 1 for n in lens], out, "cpu", pools=pools, attn_backend=backend)


def test_reference_runner_is_clean_and_left_as_it_was(reference):
    runner, _, pools = reference
    pools.kv.k_buffers[0].normal_()
    before = [t.clone() for t in pools.kv.k_buffers + pools.kv.v_buffers + [pools.req_to_token.req_to_token]]
    slots = {name: slot.tensor.clone() for name, slot in runner.buffers.slots.items()}
    report = runner.check()
    assert report.ok and report.findings == [], str(report)
    writes = {write.tensor: write.bytes_per_step for write in report.state_writes}
    config = runner.model.config
    assert len(writes) == 2 * config.num_layers
    assert writes["forward_batch.token_to_kv_pool.k_buffers.0"] == 8 * config.num_kv_heads * config.head_dim * 4
    after = pools.kv.k_buffers + pools.kv.v_buffers + [pools.req_to_token.req_to_token]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(slots[name], slot.tensor) for name, slot in runner.buffers.slots.items())
    assert not runner.capture().failed  # the check left the runner ready to capture


def test_reference_runner_with_a_real_example(reference):
    runner, backend, pools = reference
    example = decode_example(backend, pools)
    report = graphrt.check(runner, example)
    assert report.ok and report.findings == [] and report.notes == [], str(report)
    assert report.recordings == 2 * 2 + 3  # two keys (twice each), then the example: padded, rolled, unpadded


class SyncingPagedModel(torch.nn.Module):
    """Reads the longest sequence length on the host, and normalizes the hidden states over the batch."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(97, 8)

    def forward(self, input_ids, positions, forward_batch):
        longest = int(forward_batch.seq_lens.max())  # HAZARD: host_sync
        hidden = self.embed(input_ids) * longest
        return hidden - hidden.mean(dim=0)  # HAZARD: rows_interact


def test_runner_check_finds_host_sync_and_leaking_padding():
    runner = GraphRunner(SyncingPagedModel(), max_batch_size=4, progress=False)
    static = runner.check()
    assert {f.kind for f in static.findings} == {"host_sync"} and not static.ok
    from conftest import decode_batch
    with_example = runner.check(decode_batch(3))
    assert "host_sync" in {f.kind for f in with_example.findings}
    assert any("padding was not compared" in note for note in with_example.notes)


# ---------------------------------------------------------------- Hugging Face and the examples


def decode_step(model, cache):
    """One greedy decode step over a StaticCache, as tests/test_hf_models.py and examples/hf_decode.py run it."""
    from hf_helpers import cache_argument

    def step(input_ids, position_ids):
        return model(input_ids=input_ids, **cache_argument(model, cache), position_ids=position_ids,
                     use_cache=True).logits[:, -1]

    return step


def test_hugging_face_static_cache_decode_is_clean():
    pytest.importorskip("transformers")
    from hf_helpers import cache_argument
    from test_hf_models import MAX_CACHE_LEN, PROMPT_LEN, make_prompt, tiny_causal_lm
    from transformers import StaticCache

    for kind in ("llama", "qwen2", "gpt2"):
        model = tiny_causal_lm(kind)
        cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)

        with torch.no_grad():
            token = model(input_ids=make_prompt(), **cache_argument(model, cache),
                          use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        report = graphrt.check(decode_step(model, cache), token, torch.full(token.shape, PROMPT_LEN))
        assert report.ok, str(report)
        # StaticCache's batch is fixed: the report says padded sizes will not capture (info only).
        assert {f.kind for f in report.findings} <= {"batch_not_padded"}, str(report)
        assert {"cache.layers.0.keys", "cache.layers.0.cumulative_length"} <= {w.tensor for w in report.state_writes}
        after = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), kind


def test_wrap_callable_example_is_clean():
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))

    def head(hidden, mask, temperature=1.0):  # examples/wrap_callable.py
        return torch.softmax(mlp(hidden) / temperature, dim=-1) * mask

    report = graphrt.check(head, torch.randn(5, 64), mask=torch.ones(5, 1), temperature=0.7)
    assert report.ok and report.findings == [] and report.state_writes == [], str(report)


# ---------------------------------------------------------------- command line


def test_cli_prints_the_report_and_exits_non_zero_on_a_hazard():
    bad = subprocess.run([sys.executable, "-m", "graphrt.check", "tests.check_gallery:branch"], cwd=ROOT,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert bad.returncode == 1, bad.stderr
    line = next(line for kind, line in marked(gallery.BranchModel) if kind == "value_dependent_branch")
    assert "value_dependent_branch" in bad.stdout and f"tests/check_gallery.py:{line}" in bad.stdout
    assert "RuntimeWarning" not in bad.stderr  # graphrt.check is a package: runpy does not import it twice


def test_cli_json_and_usage_errors(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["tests.check_gallery:mlp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli.main(["tests.check_gallery:no_such_factory"]) == 2
    assert "no_such_factory" in capsys.readouterr().err
    assert cli.main(["tests.check_gallery:kv_cache"]) == 0
    assert "k_cache" in capsys.readouterr().out


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_cuda_step_reading_a_cpu_tensor():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8).cuda()
            self.scale = torch.ones(8)  # left on the CPU

        def forward(self, x):
            return self.linear(x) * self.scale.to(x.device)  # HAZARD: cpu_tensor

    report = graphrt.check(Mixed(), torch.randn(4, 8, device="cuda"))
    assert found(report) == marked(Mixed), str(report)
    assert {f.tensor for f in report.findings} == {"scale"}


@pytest.mark.cuda
def test_cuda_clean_model_and_state_untouched():
    fn, args = gallery.kv_cache("cuda")  # moved before wrap(): the wrapper's .cuda() returned the bare module
    before = fn.k_cache.clone()
    report = graphrt.check(fn, *args)
    assert report.ok and report.findings == [], str(report)
    assert torch.equal(before, fn.k_cache)


def test_wrapped_callable_and_bad_variants():
    fn, args = gallery.item()
    report = graphrt.check(graphrt.wrap(fn, max_batch_size=8), *args)
    assert {f.kind for f in report.findings} == {"host_sync"}
    with pytest.raises(ValueError, match=r"variants\[0\]"):
        graphrt.check(fn, *args, variants=[((torch.ones(3, 2),), {})])


def test_bench_records_the_check_of_the_reference_model(reference, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench

    summary = bench.check_summary(reference[0])
    assert summary["ok"] is True and summary["findings"] == [] and summary["seconds"] > 0
    assert summary["recordings"] == 4 and summary["state_tensors"] == 4


def test_docs_describe_every_finding():
    text = (ROOT / "docs" / "CHECK.md").read_text()
    table = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    assert set(HAZARDS) <= table
    for kind, hazard in HAZARDS.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{kind}` |"))
        assert f"| {hazard.severity.value} |" in row, kind


def test_runner_check_of_chosen_keys(reference):
    runner = reference[0]
    key = sorted(runner.registry.entries)[0]
    report = runner.check(keys=[key])
    assert report.ok and report.recordings == 2
    with pytest.raises(ValueError, match="keys"):
        runner.check(keys=[key._replace(num_tokens=3, num_reqs=3)])


def test_a_wrapped_modules_to_returns_the_wrapper_with_its_scratch_state_moved():
    """The H200 session: ``wrap(model, ..., scratch_state=[model.k_cache]).cuda()`` was the bare module
    (the wrapper passed ``.cuda`` to it), so graphrt.check saw no pad values and no scratch state and
    reported the padding rows' KV writes. Now a module method that returns the module returns the
    wrapper, and the scratch tensors it replaced (``.to`` makes new ones) stay scratch."""
    fn, args = gallery.kv_cache()
    moved = fn.to(torch.float64)  # new tensors, as .cuda() makes on a GPU
    assert moved is fn and fn.k_cache.dtype == torch.float64
    report = graphrt.check(moved, *(arg.double() if arg.is_floating_point() else arg for arg in args))
    assert report.ok and report.findings == [], str(report)
