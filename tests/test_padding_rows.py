"""Padding rows never touch live state (graphrt.padding_rows).

wrap() pads a call's arguments up to the next capture size. A padding row that writes state (a
paged KV store at ``slot_mapping``, whose padding rows hold slot 0) would overwrite a live
request's keys, and verification cannot see it: it compares the padded replay with eager on the
same padded inputs. Before a key first records, the step at the real size and at the padded size
are compared on the write journal; padding rows that write state the real rows' step does not
make the layout record exact sizes (counted in ``stats()["exact_sizes"]``, said once, naming the
argument and a remedy that works). ``pad_values=`` says what a padding row holds: a row no
request owns (declared with ``scratch_state=``), or ``-1`` for kernels that skip it, as vLLM's and
nano-vllm's store kernels do. Both fronts take negative pad values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
from conftest import decode_batch

import graphrt
from graphrt import GraphRunner, RunnerConfig, wrap


@torch.library.custom_op("graphrt_test::store_skipping_negative", mutates_args=("cache",))
def store_skipping_negative(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """A paged KV store that skips slot -1, as nano-vllm's store_kvcache_kernel and vLLM's
    reshape_and_cache (a padded slot_mapping entry of -1 writes nothing)."""
    keep = slots >= 0
    cache.index_copy_(0, slots[keep], rows[keep])


@store_skipping_negative.register_fake
def _(cache, slots, rows):
    return None


def issue_step(cache):
    def step(x, slot):
        cache.index_copy_(0, slot, x)  # a paged KV store at slot_mapping
        return x * 2

    return step


def call_three_times(fast):
    with torch.no_grad():
        return [fast(torch.full((3, 4), step + 1.0), torch.tensor([5, 6, 7])) for step in range(3)]


def test_the_issue_snippet_leaves_the_live_slot_alone(caplog):
    """Fails on main: cache[0] became [0, 0, 0, 0] with no error and no eager reason."""
    cache = torch.zeros(16, 4)
    cache[0] = 9.0  # slot 0 belongs to a live request
    fast = wrap(issue_step(cache), max_batch_size=8)
    with caplog.at_level(logging.WARNING, logger="graphrt"):
        outputs = call_three_times(fast)
        call_three_times(fast)
    assert torch.equal(cache[0], torch.full((4,), 9.0))
    assert torch.equal(cache[5:8], torch.full((3, 4), 3.0)) and torch.equal(outputs[-1], torch.full((3, 4), 6.0))
    stats = fast.stats()
    assert stats["graph_runs"] == 5 and stats["key_hits"] == {"call/bs=3": 5}, "calls of 3 rows replay their own graph"
    (why,) = stats["exact_sizes"].values()
    assert "aten.index_copy_" in why and "computed from slot" in why and "pad_values={'slot'" in why
    warnings = [record.getMessage() for record in caplog.records if "exact sizes" in record.getMessage()]
    assert len(warnings) == 1 and "test_padding_rows.py" in warnings[0], "said once, with the model line"


def test_a_key_whose_padding_was_refused_still_serves_calls_of_its_own_size():
    """The padding check's real-size run is the key's verification's eager run, after the recording: a key
    whose padding rows write live state keeps its graph (verified once more against eager at its own size,
    the only case a key's capture runs the step a fourth time) for calls of its own size, whose every row is
    real; the call of 3 rows records a key of its own. Before, the key stayed pending and a call of 4 rows
    recorded it all over again."""
    cache = torch.zeros(16, 4)
    runs = []

    def step(x, slot):
        runs.append(x.shape[0])
        cache.index_copy_(0, slot, x)
        return x * 2

    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        fast(torch.ones(3, 4), torch.tensor([5, 6, 7]))
        fast(torch.ones(3, 4), torch.tensor([5, 6, 7]))
        assert runs == [3, 4, 4, 1, 4, 3, 3, 3], "warm-up; key 4: warm-up, recording, 1 real row, eager; key 3"
        runs.clear()
        out = fast(torch.full((4, 4), 2.0), torch.tensor([8, 9, 10, 11]))
    assert runs == [] and torch.equal(out, torch.full((4, 4), 4.0)) and torch.equal(cache[8:12], torch.full((4, 4), 2.0))
    assert fast.stats()["key_hits"] == {"call/bs=3": 1, "call/bs=4": 1} and fast.stats()["exact_sizes"]


def test_the_remedy_named_works_a_row_no_request_owns_declared_scratch():
    cache = torch.zeros(17, 4)  # row 16: scratch, no request owns it
    cache[0] = 9.0
    fast = wrap(issue_step(cache), max_batch_size=8, pad_values={"slot": 16}, scratch_state=[cache])
    call_three_times(fast)
    assert torch.equal(cache[0], torch.full((4,), 9.0))
    stats = fast.stats()
    assert stats["exact_sizes"] == {} and stats["key_hits"] == {"call/bs=4": 2} and stats["padded_tokens"] == 2


@pytest.mark.parametrize("key", ["slot_mapping", "args[1]"])
def test_negative_pad_values_for_a_store_kernel_that_skips_them(key):
    cache, reference = torch.zeros(16, 4), torch.zeros(16, 4)
    cache[0] = reference[0] = 9.0

    def step(x, slot_mapping):
        store_skipping_negative(cache, slot_mapping, x * 3)
        return x + 1

    fast = wrap(step, max_batch_size=8, pad_values={key: -1})
    with torch.no_grad():
        for call in range(4):
            x, slots = torch.full((3, 4), call + 1.0), torch.tensor([5, 6, 7]) + call
            assert torch.equal(fast(x, slots), x + 1)
            reference.index_copy_(0, slots, x * 3)
    assert torch.equal(cache, reference)
    stats = fast.stats()
    assert stats["exact_sizes"] == {} and stats["key_hits"] == {"call/bs=4": 3}


def test_the_same_kernel_padded_with_zeros_records_exact_sizes():
    """An opaque op's writes are compared by value: the live slot 0 holds what the padding row overwrites."""
    cache = torch.zeros(16, 4)
    cache[0] = 9.0
    fast = wrap(lambda x, slots: store_skipping_negative(cache, slots, x) or x + 1, max_batch_size=8)
    call_three_times(fast)
    (why,) = fast.stats()["exact_sizes"].values()
    assert "graphrt_test.store_skipping_negative" in why and "pad_values={'slots': -1}" in why
    assert fast.stats()["key_hits"] == {"call/bs=3": 2}


def test_a_padding_write_of_values_equal_to_what_is_there_is_found():
    """Positions, not values: a zero row padded into a zero slot changes nothing now, but overwrites
    the slot once a request owns it."""
    cache = torch.zeros(16, 4)
    fast = wrap(issue_step(cache), max_batch_size=8)
    with torch.no_grad():
        for _ in range(3):
            fast(torch.ones(3, 4), torch.tensor([5, 6, 7]))
    assert fast.stats()["exact_sizes"]


def test_state_reduced_over_the_padded_batch_is_found():
    stat = torch.zeros(4)

    def step(x):
        stat.copy_(x.mean(dim=0))  # the padding rows change the mean
        return x * 2

    fast = wrap(step, max_batch_size=8)
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(call))
            fast(x)
            torch.testing.assert_close(stat, x.mean(dim=0))
    assert "aten.copy_" in next(iter(fast.stats()["exact_sizes"].values()))


def centered(x):
    return x - x.mean(dim=0)  # every row's result depends on every other row


def batch_softmax(x):
    return torch.softmax(x, dim=0)


@pytest.mark.parametrize("step", [centered, batch_softmax], ids=lambda step: step.__name__)
def test_outputs_whose_real_rows_the_padding_rows_change_are_found(step, caplog):
    """A step that mixes rows writes no state, and verification compares the padded replay with eager on the
    same padded rows: before, calls of 3 rows padded to 4 replayed other values than eager's, silently. The
    real rows' outputs at both sizes are compared too: the layout records each call size exactly, said once,
    and every call gives eager's result (torch.compile's dynamic shapes would recompile, not pad)."""
    fast = wrap(step, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="graphrt"):
        for call in range(5):
            x = torch.randn(3, 5, generator=torch.Generator().manual_seed(call))
            torch.testing.assert_close(fast(x), step(x))
    (why,) = fast.stats()["exact_sizes"].values()
    assert "output leaf 0 differ" in why and "mixes rows" in why
    assert sum("mixes rows" in record.getMessage() for record in caplog.records) == 1
    assert fast.stats()["key_hits"] == {"call/bs=3": 4} and fast.stats()["padded_tokens"] == 0  # calls 2 to 5


def test_outputs_of_independent_rows_still_pad_within_rounding():
    """A linear layer's rows are independent (its GEMM may round otherwise at another batch size): padded
    calls replay the padded key, no exact sizes."""
    linear = torch.nn.Linear(5, 7)
    fast = wrap(linear, max_batch_size=4, capture_sizes=[4])
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(3, 5, generator=torch.Generator().manual_seed(call))
            torch.testing.assert_close(fast(x), linear(x))
    assert fast.stats()["exact_sizes"] == {} and fast.stats()["key_hits"] == {"call/bs=4": 3}


def test_a_call_at_a_capture_size_checks_the_sizes_that_will_pad_to_it():
    """Recorded on a call of exactly 4 rows, key 4 still serves calls of 3: checked on 3 rows first."""
    cache = torch.zeros(16, 4)
    cache[0] = 9.0
    fast = wrap(issue_step(cache), max_batch_size=8)
    with torch.no_grad():
        for _ in range(3):
            fast(torch.ones(4, 4), torch.tensor([5, 6, 7, 8]))
        for _ in range(2):
            fast(torch.ones(3, 4), torch.tensor([9, 10, 11]))
    assert torch.equal(cache[0], torch.full((4,), 9.0))
    assert set(fast.stats()["key_hits"]) == {"call/bs=4", "call/bs=3"}


def test_capture_up_front_checks_padding_too():
    cache = torch.zeros(16, 4)
    cache[0] = 9.0
    fast = wrap(issue_step(cache), max_batch_size=4, capture_sizes=[4])
    fast.capture(torch.ones(3, 4), torch.tensor([5, 6, 7]))
    assert fast.stats()["exact_sizes"] and torch.equal(cache[0], torch.full((4,), 9.0))


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    positions: torch.Tensor


def test_pad_values_by_path_inside_an_argument():
    cache = torch.zeros(16, 4)

    def step(x, meta):
        store_skipping_negative(cache, meta.slot_mapping, x + meta.positions[:, None])
        return x * 2

    fast = wrap(step, max_batch_size=8, pad_values={"meta.slot_mapping": -1})
    with torch.no_grad():
        for _ in range(3):
            fast(torch.ones(3, 4), Metadata(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])))
    assert fast.stats()["exact_sizes"] == {} and fast.stats()["key_hits"] == {"call/bs=4": 2}
    assert not cache[0].any() and not cache[4:].any()


def test_bad_pad_values_are_refused_naming_them():
    step = issue_step(torch.zeros(16, 4))
    with pytest.raises(ValueError, match="'slto' names no parameter"):
        wrap(step, max_batch_size=8, pad_values={"slto": -1})
    with pytest.raises(TypeError, match=r"pad_values\['slot'\]: expected an int or float"):
        wrap(step, max_batch_size=8, pad_values={"slot": True})
    with pytest.raises(TypeError, match="scratch_state"):
        wrap(step, max_batch_size=8, scratch_state=[3])
    fast = wrap(step, max_batch_size=8, pad_values={"slot": 0.5})
    with pytest.raises(TypeError, match=r"pad_values\['slot'\]: expected an int for a torch.int64 tensor"):
        fast(torch.ones(3, 4), torch.tensor([5, 6, 7]))
    fast.pad_values["slot"] = 15  # the layout was not kept: the next call opens it afresh
    call_three_times(fast)
    assert fast.stats()["graph_runs"] == 2


def test_graph_runner_accepts_negative_pad_values_for_index_fields():
    config = RunnerConfig(pad_values={"out_cache_loc": -1, "req_pool_indices": -1})
    assert config.pad_values["out_cache_loc"] == -1
    with pytest.raises(ValueError, match="seq_lens"):
        RunnerConfig(pad_values={"seq_lens": -1})


class SkippingPagedModel(torch.nn.Module):
    """A GraphRunner model whose KV store skips slot -1: padding rows write nothing."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, 8, generator=generator))
        self.kv = torch.zeros(64, 8)

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed[input_ids] + positions[:, None]
        store_skipping_negative(self.kv, forward_batch.out_cache_loc, hidden)
        return hidden * 2


def test_graph_runner_with_slot_minus_one_leaves_every_kv_row_but_the_real_ones():
    model = SkippingPagedModel()
    runner = GraphRunner(model, max_batch_size=8, capture_sizes=[4, 8], pad_values={"out_cache_loc": -1},
                         progress=False)
    assert runner.capture().failed == {}
    batch = decode_batch(3, seed=2, out_cache_loc=torch.tensor([10, 11, 12]))
    model.kv[0], model.kv[63] = 7.0, 5.0  # slot 0 and the last slot (where index_put_ would take -1) are live
    before = model.kv.clone()
    replayed = runner(batch).clone()
    changed = (model.kv != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [10, 11, 12] and runner.stats()["graph_runs"] == 1
    torch.testing.assert_close(replayed, model(batch.input_ids, batch.positions, batch))


def test_check_names_a_padding_row_write_and_the_fix():
    cache = torch.zeros(16, 4)
    report = graphrt.check(issue_step(cache), torch.ones(3, 4), torch.tensor([5, 6, 7]))
    (finding,) = report.of_kind("padding_writes_state")
    assert not report.ok and finding.op == "aten.index_copy_" and "test_padding_rows.py" in finding.source
    assert "pad_values={'slot'" in finding.message
    scratch_row = torch.zeros(17, 4)
    clean = graphrt.check(wrap(issue_step(scratch_row), max_batch_size=8, pad_values={"slot": 16},
                               scratch_state=[scratch_row]), torch.ones(3, 4), torch.tensor([5, 6, 7]))
    assert not clean.of_kind("padding_writes_state"), str(clean)
