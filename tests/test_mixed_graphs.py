"""Mixed prefill + decode batches through EXTEND/MIXED graphs equal eager, step by step."""

from __future__ import annotations

import random
from typing import Dict, List

import pytest
import torch
from conftest import BACKENDS

from graphrt import ForwardMode, GraphRunner
from graphrt.host.unified import UnifiedBatchItem, build_forward_batch
from graphrt.reference import ReferenceConfig, build_reference, graph_runner_kwargs, run_eager
from graphrt.reference.kv_cache import CachePools

# Padded GEMMs may round differently from unpadded ones, and the two chains feed their own KV.
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = {"a": list(range(3, 20)), "b": [5, 9, 2, 7, 1], "c": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}


class SequenceCache:
    """A KvCacheHandle over the reference pools: slots are assigned the first time a position is written."""

    def __init__(self, pools: CachePools) -> None:
        self.pools = pools
        self.req_pool_index = pools.req_to_token.alloc()

    def slots_for(self, start: int, end: int) -> List[int]:
        return self.pools.assign([self.req_pool_index], [start], [end - start]).tolist()


class Chain:
    """One model + pools + step function; two chains with the same seed start identical."""

    def __init__(self, device: str, backend: str):
        config = ReferenceConfig.tiny(max_context_len=64)
        self.model, self.attn, self.pools = build_reference(config, num_requests=8, device=device)
        self.device = device
        self.caches: Dict[str, SequenceCache] = {}
        self.runner = None
        if backend != "eager":
            self.runner = GraphRunner(
                self.model, max_batch_size=4, modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED),
                backend=backend, device=device, progress=False, extend_capture_sizes=([8, 16], [2, 4]),
                **graph_runner_kwargs(self.attn, self.pools),
            )
            self.runner.capture()

    def step(self, work) -> torch.Tensor:
        items = []
        for seq_id, tokens, offset, final in work:
            if seq_id not in self.caches:
                self.caches[seq_id] = SequenceCache(self.pools)
            cache = self.caches[seq_id]
            items.append(UnifiedBatchItem(seq_id, tokens, cache, offset, final))
        batch, logits_indices = build_forward_batch(
            items, device=self.device, attn_backend=self.attn,
            req_to_token_pool=self.pools.req_to_token, token_to_kv_pool=self.pools.kv,
        )
        logits = self.runner(batch) if self.runner is not None else run_eager(self.model, batch)
        return logits[logits_indices].clone(), batch.forward_mode


def random_schedule(seed: int):
    """Chunked prefill of three prompts interleaved with decode steps of the finished ones."""
    rng = random.Random(seed)
    done = {seq_id: 0 for seq_id in PROMPTS}
    schedule = []
    while len(schedule) < 8:
        work = []
        for seq_id, prompt in PROMPTS.items():
            if rng.random() < 0.25:
                continue
            if done[seq_id] < len(prompt):
                chunk = prompt[done[seq_id]: done[seq_id] + rng.randint(2, 6)]
                work.append((seq_id, chunk, done[seq_id], done[seq_id] + len(chunk) == len(prompt)))
            else:
                work.append((seq_id, None, done[seq_id], True))  # decode: token from the eager chain
            done[seq_id] += len(work[-1][1]) if work[-1][1] else 1
        if work:
            schedule.append(work)
    return schedule


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("backend_device", BACKENDS)
def test_unified_batches_through_graphs_equal_eager(backend_device, seed):
    backend, device = backend_device
    eager, graphed = Chain(device, "eager"), Chain(device, backend)
    last_token: Dict[str, int] = {}
    modes = set()
    for work in random_schedule(seed):
        resolved = [(seq_id, tokens or [last_token[seq_id]], offset, final) for seq_id, tokens, offset, final in work]
        expected, mode = eager.step(resolved)
        actual, _ = graphed.step(resolved)
        modes.add(mode)
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
        finals = [seq_id for seq_id, _, _, final in resolved if final]
        for seq_id, row in zip(finals, expected.argmax(-1).tolist()):
            last_token[seq_id] = row
    stats = graphed.runner.stats()
    assert stats["eager_runs"] == 0, stats["eager_reasons"]
    assert ForwardMode.MIXED in modes or ForwardMode.EXTEND in modes
    assert any(key.startswith(("mixed/", "extend/")) for key in stats["key_hits"])


def test_mixed_mode_without_backend_support_runs_eagerly():
    config = ReferenceConfig.tiny(max_context_len=32)
    model, attn, pools = build_reference(config, num_requests=4)
    attn.graph_modes = frozenset({ForwardMode.DECODE})
    runner = GraphRunner(model, max_batch_size=4, modes=(ForwardMode.DECODE, ForwardMode.MIXED),
                         backend="emulated", progress=False, **graph_runner_kwargs(attn, pools))
    runner.capture()
    cache_a, cache_b = SequenceCache(pools), SequenceCache(pools)
    run_eager(model, build_forward_batch([UnifiedBatchItem("b", [1, 2, 3], cache_b, 0)],
                                         attn_backend=attn)[0])
    batch, _ = build_forward_batch(
        [UnifiedBatchItem("a", [4, 5, 6], cache_a, 0), UnifiedBatchItem("b", [7], cache_b, 3)], attn_backend=attn)
    assert batch.forward_mode is ForwardMode.MIXED
    runner(batch)
    assert runner.stats()["eager_reasons"] == {"mode_not_captured": 1}


def test_static_batch_mirrors_follow_each_step():
    config = ReferenceConfig.tiny(max_context_len=32)
    model, attn, pools = build_reference(config, num_requests=4)
    seen = []
    replay_hook = attn.init_forward_metadata_replay

    def recording_hook(forward_batch):
        seen.append((forward_batch.extend_seq_lens_cpu, forward_batch.seq_lens_cpu))
        replay_hook(forward_batch)

    attn.init_forward_metadata_replay = recording_hook
    runner = GraphRunner(model, max_batch_size=4, modes=(ForwardMode.EXTEND,), backend="emulated", progress=False,
                         extend_capture_sizes=([4, 8], [4]), **graph_runner_kwargs(attn, pools))
    runner.capture()
    seen.clear()
    cache = SequenceCache(pools)
    batch, _ = build_forward_batch([UnifiedBatchItem("a", [1, 2, 3], cache, 0)], attn_backend=attn)
    runner(batch)
    batch, _ = build_forward_batch([UnifiedBatchItem("a", [4, 5], cache, 3)], attn_backend=attn)
    batch.extend_seq_lens_cpu = batch.extend_prefix_lens_cpu = batch.seq_lens_cpu = None
    runner(batch)
    assert seen[0][0] == [3, 0, 0, 0] and seen[0][1].tolist() == [3, 1, 1, 1]
    assert seen[1] == (None, None), "a step without mirrors must not see the previous step's"
