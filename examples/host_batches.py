"""A serving loop whose batches are built on the host: UnifiedBatchItem for the prefill, BatchBuilder for decode.

The prefill step is built from ``UnifiedBatchItem``s (``build_forward_batch``); each decode step is
built by a ``BatchBuilder`` writing every request's ids, positions and KV slots into one packed
host arena, copied to the device once (``InputBuffers``), then handed to the runner as a
ForwardBatch (``InputBatch.to_forward_batch``). The runner replays its decode graphs; the prefill
runs eagerly through it (no EXTEND graphs are captured here). The tokens must equal eager greedy
generation's.

    python examples/host_batches.py
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Sequence

import torch

from graphrt import GraphRunner
from graphrt.host.input_batch import BatchBuilder, InputBuffers, KvSlots
from graphrt.host.unified import UnifiedBatchItem, build_forward_batch
from graphrt.reference import CachePools, ReferenceConfig, build_reference, generate_greedy, graph_runner_kwargs


@dataclass
class RequestCache:
    """A request's row of the request-to-token table (the ``KvCacheHandle`` a UnifiedBatchItem takes)."""

    req_pool_index: int
    pools: CachePools

    def slots_for(self, start: int, end: int) -> Sequence[int]:
        return self.pools.req_to_token.req_to_token[self.req_pool_index, start:end].tolist()


def serve(runner: GraphRunner, pools: CachePools, context: dict, prompts: List[List[int]],
          new_tokens: int) -> List[List[int]]:
    """Greedy generation with host-built batches; every request's slots are released at the end."""
    device = pools.req_to_token.device
    reqs = [pools.req_to_token.alloc() for _ in prompts]
    lengths = [len(prompt) for prompt in prompts]
    pools.assign(reqs, [0] * len(reqs), lengths)
    items = [UnifiedBatchItem(f"r{i}", list(prompt), RequestCache(req, pools), pos_offset=0)
             for i, (req, prompt) in enumerate(zip(reqs, prompts))]
    prefill, logits_rows = build_forward_batch(items, device, **context)
    next_ids = runner(prefill)[logits_rows].argmax(-1).tolist()
    generated = [[token] for token in next_ids]
    buffers = InputBuffers.allocate(max_num_reqs=len(prompts), max_num_tokens=len(prompts), device=device)
    try:
        for _ in range(new_tokens - 1):
            slots = pools.assign(reqs, lengths, [1] * len(reqs)).tolist()
            builder = BatchBuilder(buffers)
            for i, (req, token, position, slot) in enumerate(zip(reqs, next_ids, lengths, slots)):
                builder.add_request(f"r{i}", [token], [position], kv=KvSlots(req, out_cache_loc=[slot]))
            lengths = [length + 1 for length in lengths]
            next_ids = runner(builder.build().to_forward_batch(**context)).argmax(-1).tolist()
            for tokens, token in zip(generated, next_ids):
                tokens.append(token)
    finally:
        for req, length in zip(reqs, lengths):
            pools.release(req, length)
    return generated


def main() -> None:
    torch.manual_seed(0)
    config = ReferenceConfig.tiny()
    model, attn, pools = build_reference(config, num_requests=8, device="cpu")
    options = graph_runner_kwargs(attn, pools)
    runner = GraphRunner(model, max_batch_size=4, capture_sizes=[1, 2, 4], progress=False, **options)
    runner.capture()
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(3, 9))] for _ in range(3)]
    served = serve(runner, pools, options["batch_context"], prompts, new_tokens=6)
    eager = generate_greedy(model, attn, pools, prompts, 6)
    stats = runner.stats()
    print(f"decode steps replayed: {stats['graph_runs']}, eager steps: {stats['eager_reasons']}")
    print(f"same tokens: {served == eager}")


if __name__ == "__main__":
    main()
