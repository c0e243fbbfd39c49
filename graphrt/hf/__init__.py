"""Everything Hugging Face in one place: ``generate()`` replaying its forward calls (``generate``),
several decode steps per launch (``multistep``), and the caches that replay (``window_layers``,
``layer_kinds``, ``cross_attention``, ``cache_keyword``). The engine path: any decoder with
transformers' modeling-backend contract as a GraphRunner model (``engine``; its probe and refusals
``engine_probe``; its per-layer KV pools ``kv_layout`` and their host bookkeeping ``engine_slots``; its runners
``engine_runners``; its attention ``paged_attention``, planned once per step in ``attention_plan``; its
continuous batching ``serve`` (its requests, parameters and finish reasons ``requests``; served online,
requests added, streamed and aborted while it runs, ``online``), each step staged and its tokens read back in ``engine_step``; per-request
token choice on the device ``request_sampling``, the generation config's rules ``logits_rules``; sharded
over ranks by its tensor-parallel plan, ``tensor_parallel``, the ranks agreeing in ``engine_ranks``).

``import graphrt.hf`` does not import transformers: the modules that need it (``window_layers``,
``layer_kinds``) are imported inside the functions that use them.
"""

from graphrt.hf.generate import GenerateForward, StaticCachePool, decode_masks, graph_generate, graph_safe_cache
from graphrt.hf.engine import HFEngine, engine_model
from graphrt.hf.multistep import MultiStepGenerate
from graphrt.hf.online import OnlineEngine
from graphrt.hf.requests import FinishReason, RequestOutput, RequestParams

__all__ = ["FinishReason", "GenerateForward", "HFEngine", "MultiStepGenerate", "OnlineEngine", "RequestOutput",
           "RequestParams", "StaticCachePool", "decode_masks", "engine_model",
           "graph_generate", "graph_safe_cache"]
