"""Host-built batches end to end: BatchBuilder -> GraphRunner on the reference model -> per-request sampling."""

from __future__ import annotations

import torch

from graphrt import GraphRunner
from graphrt.host.input_batch import BatchBuilder, InputBuffers, KvSlots
from graphrt.host.sampling import sample
from graphrt.reference import ReferenceConfig, build_reference, graph_runner_kwargs, run_eager

# (temperature, top_k, top_p) per request: greedy, top_k=1 (argmax too), tempered, tempered + nucleus.
PARAMS = [(0.0, -1, 1.0), (0.8, 1, 1.0), (0.7, -1, 1.0), (1.3, 20, 0.9)]


def test_sampling_step_on_reference_logits_uses_each_requests_parameters():
    config = ReferenceConfig.tiny(max_context_len=32)
    model, attn, pools = build_reference(config, num_requests=8)
    runner = GraphRunner(model, max_batch_size=8, backend="emulated", progress=False,
                         **graph_runner_kwargs(attn, pools))
    runner.capture()
    builder = BatchBuilder(InputBuffers.allocate(max_num_reqs=8, max_num_tokens=8))
    for index, (temperature, top_k, top_p) in enumerate(PARAMS):
        req = pools.req_to_token.alloc()
        cached = 3 + index
        pools.assign([req], [0], [cached])  # a cached prefix (KV values are whatever the pool holds)
        slot = pools.assign([req], [cached], [1]).tolist()
        builder.add_request(f"r{index}", [10 + index], [cached], temperature=temperature, top_k=top_k,
                            top_p=top_p, kv=KvSlots(req, out_cache_loc=slot))
    batch = builder.build()
    forward_batch = batch.to_forward_batch(attn_backend=attn)
    logits = runner(forward_batch).clone()
    assert runner.stats()["graph_runs"] == 1
    torch.testing.assert_close(logits, run_eager(model, forward_batch), atol=1e-5, rtol=1e-5)

    metadata = batch.sampling_metadata
    assert metadata.temperatures.tolist() == [torch.tensor(t).float().item() for t, _, _ in PARAMS]
    tokens = sample(logits, metadata, generator=torch.Generator().manual_seed(7))
    argmax = logits.argmax(-1)
    assert tokens[0] == argmax[0] and tokens[1] == argmax[1], "greedy and top_k=1 rows take the argmax"

    # Row 2 alone, drawn with the same generator state, must match a manual tempered draw.
    alone = sample(logits[2:3], metadata.slice(2, 3), generator=torch.Generator().manual_seed(11))
    probs = torch.softmax(logits[2:3].float() / 0.7, dim=-1)
    ordered, ids = probs.sort(dim=-1, descending=True)
    manual = ids.gather(1, torch.multinomial(ordered, 1, generator=torch.Generator().manual_seed(11)))
    assert alone.tolist() == manual.squeeze(1).tolist()

    # Row 3: every draw stays inside its top-20 and its nucleus of 0.9.
    draws = torch.stack([sample(logits[3:4], metadata.slice(3, 4), torch.Generator().manual_seed(s))
                         for s in range(200)]).flatten()
    scaled = torch.softmax(logits[3].float() / 1.3, dim=-1)
    ordered, ids = scaled.sort(descending=True)
    nucleus = ids[: int((ordered.cumsum(0) - ordered < 0.9).sum())][:20]
    assert set(draws.tolist()) <= set(nucleus.tolist())
    assert len(set(draws.tolist())) > 1, "a tempered row should not collapse to one token"
