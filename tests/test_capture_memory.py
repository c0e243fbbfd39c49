"""Capture holds no copy of the KV cache, and captures only on pad values (issue: the CUDA path hardened).

A model that writes its KV cache through an opaque custom op (``mutates_args=("cache",)``, as
vLLM's ``reshape_and_cache_flash`` or FlashInfer's append) gives the state journal nothing to
narrow: undoing the write would copy the whole cache, per warm-up, per recording, per check.
Capture stages pad values first, so such writes land in the scratch slot only; the cache is
scratch state (held by ``batch_context``'s KV pool, or named in ``scratch_state``) and is never
copied. Anything else written that way is copied once per view within a budget, past which the
key fails by name instead of exhausting memory.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import BACKENDS, SCRATCH_SLOT, ToyPagedModel, decode_batch
from fake_cuda import TORCH_2_11, install
from fake_cuda_allocator import LARGE_BUFFER, SMALL_BUFFER, block_size, segment_size
from test_graph_contract import _reset_peak_rss, _rss_kib

from graphrt import GraphRunner
from graphrt.backends.cuda_pool import cublas_workspace_bytes

SEEN_LOCATIONS = []  # the out_cache_loc tensors the op was called with (copies)


@torch.library.custom_op("graphrt_test::opaque_kv_write", mutates_args=("cache",))
def opaque_kv_write(cache: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
    """Writes ``values`` at rows ``loc``: the journal cannot see which rows (an opaque kernel)."""
    SEEN_LOCATIONS.append(loc.clone())  # a device copy: a host read would fail a capture
    cache.index_copy_(0, loc, values)


class KvPool:
    """A KV pool as an engine holds it: one cache tensor, sized in slots."""

    def __init__(self, num_slots: int, hidden: int, device: str) -> None:
        self.num_slots = num_slots
        self.kv = torch.zeros(num_slots, hidden, device=device)


class OpaqueKvModel(torch.nn.Module):
    """Embeds tokens, writes them into the pool's cache through the opaque op, reads the request's row."""

    def __init__(self, pool: KvPool, device: str, hidden: int = 32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(97, hidden, generator=generator).to(device))
        self.pool = pool

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed[input_ids]
        opaque_kv_write(self.pool.kv, forward_batch.out_cache_loc, hidden)
        return hidden + self.pool.kv[forward_batch.req_pool_indices]


def opaque_runner(pool: KvPool, device: str, backend: str, **options) -> GraphRunner:
    options.setdefault("batch_context", {"token_to_kv_pool": pool})
    return GraphRunner(OpaqueKvModel(pool, device), max_batch_size=16, capture_sizes=[1, 2, 4, 8, 16],
                       backend=backend, device=device, progress=False, **options)


def test_capture_with_an_opaque_kv_write_copies_no_cache_and_touches_no_request_row():
    pool = KvPool(num_slots=1 << 21, hidden=32, device="cpu")  # 2**21 x 32 floats = 256 MiB
    runner = opaque_runner(pool, "cpu", "emulated")
    opaque_runner(KvPool(64, 32, "cpu"), "cpu", "emulated").capture()  # one-time costs outside the measurement
    if not _reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable: cannot measure peak memory here")
    resident = _rss_kib("VmRSS")
    report = runner.capture()
    growth_mib = (_rss_kib("VmHWM") - resident) / 1024
    assert not report.failed, report.failed
    assert growth_mib < 16, f"capture's peak memory grew by {growth_mib:.0f} MiB for a 256 MiB cache"

    pool.kv.normal_(generator=torch.Generator().manual_seed(1))  # requests' rows hold data
    for batch_size in (5, 3):
        runner(decode_batch(batch_size, seed=batch_size))  # real steps dirty the static slots
    before = pool.kv.clone()
    SEEN_LOCATIONS.clear()
    runner._stats.merge_histogram({runner.config.modes[0]: {3: 10, 5: 4}})
    assert not runner.retune(max_graphs=2).failed
    assert SEEN_LOCATIONS and all(rows.eq(SCRATCH_SLOT).all() for rows in SEEN_LOCATIONS), (
        "capture staged pad values: every write lands in the scratch slot")
    changed = (pool.kv != before).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {SCRATCH_SLOT}, f"rows {changed} of requests changed during retune()"


def test_scratch_state_names_a_cache_the_batch_context_does_not_hold():
    pool = KvPool(num_slots=1 << 18, hidden=32, device="cpu")  # 32 MiB: over the copy budget
    runner = opaque_runner(pool, "cpu", "emulated", batch_context={}, scratch_state=[pool.kv])
    assert not runner.capture().failed
    batch = decode_batch(3, seed=3)
    expected = OpaqueKvModel(KvPool(1 << 18, 32, "cpu"), "cpu")(batch.input_ids, batch.positions, batch)
    assert torch.equal(runner(batch), expected)


def test_an_unnarrowable_write_past_the_budget_fails_its_key_by_name():
    pool = KvPool(num_slots=1 << 18, hidden=32, device="cpu")  # 32 MiB, held by no batch context
    runner = opaque_runner(pool, "cpu", "emulated", batch_context={})
    failed = runner.capture().failed
    assert len(failed) == 5, failed
    assert all(reason.startswith("CaptureMemoryError: graphrt_test.opaque_kv_write.default") and "scratch_state"
               in reason for reason in failed.values()), failed
    batch = decode_batch(3, seed=3)
    runner(batch)
    assert runner.stats()["eager_reasons"] == {"capture_failed": 1}


class SpyBackend:
    """An attention backend that records the static batch each capture starts from."""

    graph_modes = ()

    def __init__(self) -> None:
        self.seen = []

    def init_forward_metadata_capture(self, forward_batch) -> None:
        self.seen.append((forward_batch.out_cache_loc.tolist(), forward_batch.req_pool_indices.tolist(),
                          forward_batch.seq_lens.tolist(), forward_batch.seq_lens_sum))


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_every_capture_starts_from_pad_values_after_real_steps(backend_device):
    """retune() and a later capture() after real steps: the capture hook sees only pad values
    (scratch slot 0, dummy request 0, length 1), not the last step's rows."""
    backend, device = backend_device
    spy = SpyBackend()
    pool = KvPool(256, 32, device)
    runner = opaque_runner(pool, device, backend, batch_context={"token_to_kv_pool": pool, "attn_backend": spy})
    runner.capture()
    for batch_size in (16, 5):
        runner(decode_batch(batch_size, device=device, seed=batch_size))
    spy.seen.clear()
    runner._stats.merge_histogram({runner.config.modes[0]: {5: 10, 16: 4}})
    runner.retune(max_graphs=2)
    assert len(spy.seen) == 2
    for locations, requests, seq_lens, seq_lens_sum in spy.seen:
        size = len(locations)
        assert locations == [0] * size and requests == [0] * size and seq_lens == [1] * size
        assert seq_lens_sum == size


def test_keys_share_their_output_memory_and_the_report_shows_it():
    """Keys captured into one pool share their output memory (graph memory stays near the largest
    key's outputs, not their sum), so a returned output is valid until the next replay of any key
    in the pool: a smaller key's replay overwrites the rows a larger key returned."""
    model = ToyPagedModel()
    runner = GraphRunner(model, max_batch_size=16, capture_sizes=[1, 2, 4, 8, 16], backend="emulated",
                         progress=False)
    report = runner.capture()
    row_bytes = 97 * 4  # float32 logits over ToyPagedModel's 97-token vocabulary
    assert [key_report.output_bytes for key_report in report.keys] == [size * row_bytes for size in (16, 8, 4, 2, 1)]
    assert report.output_bytes == 31 * row_bytes
    assert 16 * row_bytes <= report.pool_bytes < 17 * row_bytes, "the pool holds the largest key's outputs once"
    assert "pool total" in str(report)
    large = runner(decode_batch(16, seed=1))
    kept = large.clone()
    runner(decode_batch(2, seed=2))
    assert not torch.equal(large[:2], kept[:2]) and torch.equal(large[2:], kept[2:]), (
        "the 2-row key's replay wrote over the 16-row key's first rows")


@pytest.mark.parametrize("on", [pytest.param("fake", id="fake-torch-2.11"),
                                pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
def test_cuda_keys_share_the_pool_memory_of_their_outputs(on, monkeypatch):
    """Outputs are non-owning views: once a key is captured its output blocks return to the pool,
    and the next (smaller) key's capture reuses them. The caching allocator rounds what it reserves
    (a block over 10 MiB gets a segment of its own rounded to 2 MiB, a smaller one a 2 or 20 MiB
    segment), so the pool is compared with the largest key's segment plus one 20 MiB segment, plus
    what every first capture adds (issue 40): the cuBLAS workspace its first matmul allocates in the
    pool (graphrt clears the cached ones before each capture; 32 MiB on Hopper) and, the first time
    the default generator is registered, its seed and offset (a 2 MiB segment). Keys that did not
    share would need the next key's 16 MiB segment and a 20 MiB one on top."""
    vocab = 128_000
    with install(monkeypatch, TORCH_2_11) if on == "fake" else contextlib.nullcontext():
        device = "cpu" if on == "fake" else "cuda"
        model = ToyPagedModel(vocab=vocab, device=device)
        runner = GraphRunner(model, max_batch_size=64, capture_sizes=[1, 2, 4, 8, 16, 32, 64], backend="cuda",
                             device=device, progress=False)
        report = runner.capture()
        assert not report.failed
        assert report.output_bytes == 127 * vocab * 4
        largest_segment = segment_size(block_size(64 * vocab * 4))  # 32 MiB
        workspace = segment_size(block_size(cublas_workspace_bytes(torch.cuda.get_device_capability(device))))
        bound = largest_segment + LARGE_BUFFER + workspace + SMALL_BUFFER
        assert report.pool_bytes <= bound, (report.pool_bytes, bound)
        out = runner(decode_batch(5, device=device, seed=1))
        batch = decode_batch(5, device=device, seed=1)
        torch.testing.assert_close(out, model(batch.input_ids, batch.positions, batch), atol=1e-4, rtol=1e-4)

def test_runners_sharing_a_graph_pool_hold_one_largest_key_and_one_cublas_workspace(monkeypatch):
    """Issue 48, item 5: an engine built a runner per decode width, each with a pool of its own (its
    largest key's segments and a 32 MiB cuBLAS workspace each). A runner built with
    ``share_graphs_with`` captures into the other's pool on its capture stream: its keys reuse the
    blocks the first runner's keys reserved (their outputs are views the pool may reuse), its workspace
    the block of the first's, so it adds nothing to the pool."""
    vocab = 128_000
    with install(monkeypatch, TORCH_2_11) as fake:
        model = ToyPagedModel(vocab=vocab, device="cpu")
        options = dict(max_batch_size=64, capture_sizes=[16, 32, 64], backend="cuda", device="cpu", progress=False)
        first = GraphRunner(model, **options)
        alone = first.capture().pool_bytes
        second = GraphRunner(model, **options, share_graphs_with=first)
        shared = second.capture().pool_bytes
        pools = {tuple(entry.graph.graph.pool()) for runner in (first, second) for entry in runner.registry.entries.values()}
        assert alone > 32 << 20 and shared == 0, (alone, shared)
        assert len(pools) == 1 and second.backend is first.backend and len(fake.streams) == 2  # default + one capture stream
        for runner in (first, second):
            batch = decode_batch(40, seed=3)
            torch.testing.assert_close(runner(batch), model(batch.input_ids, batch.positions, batch), atol=1e-4,
                                       rtol=1e-4)
        with pytest.raises(ValueError, match="share_graphs_with: expected a runner on backend 'emulated'"):
            GraphRunner(model, max_batch_size=8, backend="emulated", share_graphs_with=first)
