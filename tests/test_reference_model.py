"""Reference decoder: paged attention vs a dense causal forward, graph metadata hooks, generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
from torch.nn import functional as F

from graphrt import GraphRunner
from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.reference import (
    DUMMY_REQUEST,
    SCRATCH_SLOT,
    CachePools,
    KVPool,
    ReferenceConfig,
    ReferenceDecoder,
    ReqToTokenPool,
    build_reference,
    generate_greedy,
    graph_runner_kwargs,
    make_decode_batch,
    make_extend_batch,
    run_eager,
    token_requests,
)

CONFIG = ReferenceConfig.tiny()
ATOL, RTOL = 1e-5, 1e-4
PROMPTS = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50], [2, 7]]


class DenseCausalBackend:
    """Non-paged oracle: causal attention over one whole sequence, no cache."""

    def forward(self, q, k, v, layer_id, forward_batch):
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.fixture(scope="module")
def dense() -> ReferenceDecoder:
    return ReferenceDecoder(CONFIG, DenseCausalBackend())


def dense_logits(dense: ReferenceDecoder, tokens: List[int]) -> torch.Tensor:
    return dense(torch.tensor(tokens), torch.arange(len(tokens)), None)


@pytest.fixture
def ref():
    return build_reference(CONFIG, num_requests=8)


def prefill(pools: CachePools, backend, chunks: List[List[int]], reqs: List[int], prefixes: List[int], mode):
    """Assign slots for the chunks and build the EXTEND/MIXED batch that writes them."""
    loc = pools.assign(reqs, prefixes, [len(c) for c in chunks])
    device = pools.req_to_token.device
    return make_extend_batch(chunks, reqs, prefixes, loc, device, mode=mode, pools=pools, attn_backend=backend)


# ---- pools and config --------------------------------------------------------------------------


def test_config_presets_and_validation():
    assert CONFIG.head_dim == CONFIG.hidden_size // CONFIG.num_heads == 16
    big = ReferenceConfig.realistic(dtype=torch.bfloat16)
    assert (big.num_layers, big.hidden_size, big.num_kv_heads, big.vocab_size, big.head_dim) == (16, 1024, 8, 32000, 64)
    assert ReferenceConfig.tiny(hidden_size=128).head_dim == 32
    with pytest.raises(ValueError, match="num_kv_heads"):
        ReferenceConfig.tiny(num_kv_heads=3)


def test_pools_reserve_dummy_request_and_scratch_slot():
    req_pool = ReqToTokenPool(3, 4)
    rows = [req_pool.alloc(), req_pool.alloc()]
    assert DUMMY_REQUEST not in rows and req_pool.available == 0
    with pytest.raises(RuntimeError):
        req_pool.alloc()
    req_pool.req_to_token[rows[0]] = 5
    req_pool.free(rows[0])
    assert torch.all(req_pool.req_to_token[rows[0]] == SCRATCH_SLOT)
    with pytest.raises(ValueError, match="req"):
        req_pool.free(DUMMY_REQUEST)
    kv = KVPool(5, num_layers=1, num_kv_heads=1, head_dim=2)
    slots = kv.alloc(4)
    assert SCRATCH_SLOT not in slots.tolist() and kv.available == 0
    with pytest.raises(RuntimeError):
        kv.alloc(1)
    kv.free(slots[:2])
    assert sorted(kv.alloc(2).tolist()) == sorted(slots[:2].tolist())


def test_weights_are_seeded(dense):
    other = ReferenceDecoder(CONFIG, DenseCausalBackend())
    assert all(torch.equal(a, b) for a, b in zip(dense.parameters(), other.parameters()))
    reseeded = ReferenceDecoder(ReferenceConfig.tiny(seed=1), DenseCausalBackend())
    assert not torch.equal(dense.lm_head.weight, reseeded.lm_head.weight)


# ---- paged attention against the dense oracle ----------------------------------------------------


def test_paged_decode_matches_dense_forward(ref, dense):
    model, backend, pools = ref
    reqs = [pools.req_to_token.alloc() for _ in PROMPTS]
    batch = prefill(pools, backend, PROMPTS, reqs, [0] * len(PROMPTS), ForwardMode.EXTEND)
    batch.validate()
    logits = run_eager(model, batch)
    expected = torch.cat([dense_logits(dense, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    seqs = [list(p) for p in PROMPTS]
    for step in range(3):
        new = [(7 * step + i) % CONFIG.vocab_size for i in range(len(seqs))]
        lens = [len(s) for s in seqs]
        loc = pools.assign(reqs, lens, [1] * len(reqs))
        for seq, tok in zip(seqs, new):
            seq.append(tok)
        batch = make_decode_batch(new, reqs, [n + 1 for n in lens], loc, "cpu", pools, backend)
        batch.validate()
        logits = run_eager(model, batch)
        expected = torch.stack([dense_logits(dense, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def test_extend_continuing_prefix_and_mixed_batch_match_dense(ref, dense):
    model, backend, pools = ref
    long, short = PROMPTS[2], PROMPTS[0]
    reqs = [pools.req_to_token.alloc(), pools.req_to_token.alloc()]
    run_eager(model, prefill(pools, backend, [long[:6], short], reqs, [0, 0], ForwardMode.EXTEND))
    # MIXED: the rest of the long prompt on top of its cached prefix, plus one decode token.
    mixed = prefill(pools, backend, [long[6:], [77]], reqs, [6, len(short)], ForwardMode.MIXED)
    mixed.validate()
    logits = run_eager(model, mixed)
    torch.testing.assert_close(logits[: len(long) - 6], dense_logits(dense, long)[6:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[-1], dense_logits(dense, short + [77])[-1], atol=ATOL, rtol=RTOL)


# ---- graph metadata hooks -------------------------------------------------------------------------

PAD = {"input_ids": 0, "positions": 0, "out_cache_loc": SCRATCH_SLOT, "req_pool_indices": DUMMY_REQUEST,
       "seq_lens": 1, "extend_seq_lens": 0, "extend_prefix_lens": 0}
TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")
REQUEST_FIELDS = ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc")


@dataclass
class StaticBatches:
    """What a graph runner does around the hooks: static buffers, padding, capture/replay calls."""

    backend: object
    buffers: Dict[str, torch.Tensor]

    @classmethod
    def create(cls, backend, max_bs: int, max_tokens: int, device: str = "cpu") -> "StaticBatches":
        backend.init_graph_state(max_bs, max_tokens)
        sizes = {**{f: max_tokens for f in TOKEN_FIELDS}, **{f: max_bs for f in REQUEST_FIELDS}}
        return cls(backend, {f: torch.zeros(n, dtype=torch.int64, device=device) for f, n in sizes.items()})

    def stage(self, batch: ForwardBatch, bs: int, tokens: int) -> ForwardBatch:
        """Copy the live rows into the static buffers, pad the rest, return the padded static batch."""
        extend = batch.forward_mode.is_extend()
        views = {}
        for field, buf in self.buffers.items():
            live, rows = getattr(batch, field), (tokens if field in TOKEN_FIELDS else bs)
            if live is None:
                continue
            buf[: live.shape[0]].copy_(live)
            buf[live.shape[0] : rows].fill_(PAD.get(field, batch.num_tokens))  # start_loc pads with real tokens
            views[field] = buf[:rows]
        return ForwardBatch(
            forward_mode=batch.forward_mode, batch_size=bs, seq_lens_sum=batch.seq_lens_sum + bs - batch.batch_size,
            extend_num_tokens=tokens if extend else None, **views,
        )

    def replay(self, model, batch: ForwardBatch, bs: int, tokens: int, capture: bool = False) -> torch.Tensor:
        static = self.stage(batch, bs, tokens)
        hook = self.backend.init_forward_metadata_capture if capture else self.backend.init_forward_metadata_replay
        hook(static)
        return model(static.input_ids, static.positions, static)


def clone_batch(batch: ForwardBatch) -> ForwardBatch:
    fields = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
    return ForwardBatch(**fields)


def storage_ptrs(backend) -> List[int]:
    meta = backend.static_metadata
    return [meta.kv_indices.data_ptr(), meta.mask.data_ptr()]


def one_token_batch(pools: CachePools, backend, reqs: List[int], lens: List[int], token: int, mode) -> ForwardBatch:
    """One new token per request after ``lens`` cached ones, as a DECODE or EXTEND/MIXED batch."""
    if mode is not ForwardMode.DECODE:
        return prefill(pools, backend, [[token]] * len(reqs), reqs, lens, mode)
    loc = pools.assign(reqs, lens, [1] * len(reqs))
    seq_lens = [n + 1 for n in lens]
    return make_decode_batch([token] * len(reqs), reqs, seq_lens, loc, pools.req_to_token.device, pools, backend)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED])
def test_capture_and_replay_hooks_match_eager_in_place(ref, mode):
    model, backend, pools = ref
    assert mode in backend.graph_modes
    static = StaticBatches.create(backend, max_bs=8, max_tokens=24)
    ptrs = storage_ptrs(backend)
    reqs = [pools.req_to_token.alloc() for _ in PROMPTS[:3]]
    run_eager(model, prefill(pools, backend, PROMPTS[:3], reqs, [0, 0, 0], ForwardMode.EXTEND))
    lens = [len(p) for p in PROMPTS[:3]]
    for step in range(3):
        batch = one_token_batch(pools, backend, reqs, lens, step + 5, mode)
        lens = [n + 1 for n in lens]
        graph_logits = static.replay(model, batch, 4, 4, capture=step == 0)
        assert [t.data_ptr() for t in vars(backend.forward_metadata).values()] == ptrs
        eager_logits = run_eager(model, clone_batch(static.stage(batch, 4, 4)))  # same padded batch
        assert torch.equal(graph_logits, eager_logits)
        assert backend.forward_metadata.kv_indices.data_ptr() != ptrs[0]  # eager metadata is fresh
        torch.testing.assert_close(graph_logits[:3], run_eager(model, batch), atol=ATOL, rtol=RTOL)
    assert storage_ptrs(backend) == ptrs


def test_capture_hook_checks_graph_state(ref):
    _, backend, pools = ref
    reqs = [pools.req_to_token.alloc() for _ in range(3)]
    batch = one_token_batch(pools, backend, reqs, [0, 0, 0], 1, ForwardMode.DECODE)
    with pytest.raises(RuntimeError, match="init_graph_state"):
        backend.init_forward_metadata_capture(batch)
    backend.init_graph_state(max_bs=2, max_num_tokens=2)
    with pytest.raises(ValueError, match="batch_size"):
        backend.init_forward_metadata_capture(batch)
    with pytest.raises(ValueError, match="dummy"):
        pools.assign([DUMMY_REQUEST], [0], [1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_hook_drives_a_torch_cuda_graph_without_host_syncs():
    model, backend, pools = build_reference(CONFIG, num_requests=8, device="cuda")
    static = StaticBatches.create(backend, max_bs=4, max_tokens=4, device="cuda")
    reqs = [pools.req_to_token.alloc() for _ in PROMPTS[:3]]
    run_eager(model, prefill(pools, backend, PROMPTS[:3], reqs, [0, 0, 0], ForwardMode.EXTEND))
    lens = [len(p) for p in PROMPTS[:3]]
    padded = static.stage(one_token_batch(pools, backend, reqs, lens, 1, ForwardMode.DECODE), 4, 4)
    backend.init_forward_metadata_capture(padded)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(padded.input_ids, padded.positions, padded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(padded.input_ids, padded.positions, padded)
    for step in range(3):
        lens = [n + 1 for n in lens]
        padded = static.stage(one_token_batch(pools, backend, reqs, lens, step + 5, ForwardMode.DECODE), 4, 4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.init_forward_metadata_replay(padded)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(out, run_eager(model, clone_batch(padded)), atol=ATOL, rtol=RTOL)


def test_padding_rows_only_write_scratch_slot(ref):
    model, backend, pools = ref
    static = StaticBatches.create(backend, max_bs=8, max_tokens=8)
    reqs = [pools.req_to_token.alloc() for _ in PROMPTS]
    run_eager(model, prefill(pools, backend, PROMPTS, reqs, [0] * 4, ForwardMode.EXTEND))
    lens = [len(p) for p in PROMPTS]
    loc = pools.assign(reqs, lens, [1] * 4)
    table = pools.req_to_token.req_to_token.clone()
    batch = make_decode_batch([9, 8, 7, 6], reqs, [n + 1 for n in lens], loc, "cpu", pools, backend)
    before = [buf.clone() for buf in pools.kv.k_buffers + pools.kv.v_buffers]
    static.replay(model, batch, 8, 8, capture=True)
    written = set()
    for old, new in zip(before, pools.kv.k_buffers + pools.kv.v_buffers):
        written |= set(torch.nonzero((old != new).flatten(1).any(1)).flatten().tolist())
    assert written == set(loc.tolist()) | {SCRATCH_SLOT}
    assert torch.equal(pools.req_to_token.req_to_token, table)


def test_token_requests_for_padded_extend_batch(ref):
    _, backend, pools = ref
    static = StaticBatches.create(backend, max_bs=4, max_tokens=8)
    reqs = [pools.req_to_token.alloc(), pools.req_to_token.alloc()]
    batch = prefill(pools, backend, [[1, 2, 3], [4]], reqs, [0, 5], ForwardMode.MIXED)
    token_req, last_pos = token_requests(static.stage(batch, 4, 8))
    assert token_req.tolist() == [0, 0, 0, 1, 3, 3, 3, 3]  # padding tokens land on the last padding request
    assert last_pos.tolist() == [0, 1, 2, 5, 0, 0, 0, 0]


# ---- generation -------------------------------------------------------------------------------------


def padded_step(model, static: StaticBatches, bs: int):
    """A graph-runner-like decode step: pad to ``bs`` rows, replay hooks, real rows out."""
    return lambda batch: static.replay(model, batch, bs, bs)[: batch.batch_size]


def test_generation_is_deterministic_and_releases_pools(ref):
    model, backend, pools = ref
    free = (pools.req_to_token.available, pools.kv.available)
    first = generate_greedy(model, backend, pools, PROMPTS, max_new_tokens=6)
    assert [len(t) for t in first] == [6] * len(PROMPTS)
    assert (pools.req_to_token.available, pools.kv.available) == free
    assert generate_greedy(model, backend, pools, PROMPTS, max_new_tokens=6) == first
    other_model, other_backend, other_pools = build_reference(CONFIG, num_requests=8)
    assert generate_greedy(other_model, other_backend, other_pools, PROMPTS, max_new_tokens=6) == first
    static = StaticBatches.create(backend, max_bs=8, max_tokens=8)
    assert generate_greedy(model, backend, pools, PROMPTS, 6, step=padded_step(model, static, 8)) == first
    assert generate_greedy(model, backend, pools, PROMPTS[:1], 6)[0] == first[0]
    with pytest.raises(ValueError, match="backend"):
        generate_greedy(model, other_backend, pools, PROMPTS, 2)


# ---- through graphrt's GraphRunner ----------------------------------------------------------------

RUNNER_PROMPTS = [PROMPTS, PROMPTS[1:3], [[60] * 20, [1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11], [12, 13]]]


def check_runner_generation(graph_backend: str, device: str) -> None:
    """Greedy tokens through captured graphs equal eager ones, with every decode step a graph hit."""
    model, backend, pools = build_reference(CONFIG, num_requests=8, device=device)
    runner = GraphRunner(
        model, max_batch_size=8, capture_sizes=[1, 2, 4, 8], backend=graph_backend, device=device,
        progress=False, **graph_runner_kwargs(backend, pools),
    )
    assert not runner.capture().failed
    new_tokens = 7
    for prompts in RUNNER_PROMPTS:
        eager = generate_greedy(model, backend, pools, prompts, new_tokens)
        assert generate_greedy(model, backend, pools, prompts, new_tokens, step=runner) == eager
    stats = runner.stats()
    assert stats["eager_runs"] == 0
    assert stats["graph_runs"] == len(RUNNER_PROMPTS) * (new_tokens - 1)


def test_generation_through_emulated_graph_runner_matches_eager():
    check_runner_generation("emulated", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generation_through_cuda_graph_runner_matches_eager():
    check_runner_generation("cuda", "cuda")


def test_mixed_batch_through_emulated_graph_runner(ref):
    model, backend, pools = ref
    runner = GraphRunner(
        model, max_batch_size=4, modes=(ForwardMode.MIXED,), backend="emulated", progress=False,
        extend_capture_sizes=([8, 16], [2, 4]), **graph_runner_kwargs(backend, pools),
    )
    runner.capture()
    reqs = [pools.req_to_token.alloc(), pools.req_to_token.alloc()]
    run_eager(model, prefill(pools, backend, [PROMPTS[2][:6], PROMPTS[0]], reqs, [0, 0], ForwardMode.EXTEND))
    mixed = prefill(pools, backend, [PROMPTS[2][6:], [77]], reqs, [6, 5], ForwardMode.MIXED)
    graph_logits = runner(mixed).clone()
    assert (runner.stats()["graph_runs"], runner.stats()["eager_runs"]) == (1, 0)
    torch.testing.assert_close(graph_logits, run_eager(model, mixed), atol=ATOL, rtol=RTOL)
