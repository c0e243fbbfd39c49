"""A small Llama-style decoder with a paged KV cache and a torch-native attention backend.

Used by graphrt's examples, tests and benchmark as a realistic model to capture.
"""

from graphrt.reference.attention import AttnMetadata, TorchNativeAttnBackend, token_requests
from graphrt.reference.config import ReferenceConfig
from graphrt.reference.generate import generate_greedy, graph_runner_kwargs, make_decode_batch, make_extend_batch
from graphrt.reference.kv_cache import DUMMY_REQUEST, SCRATCH_SLOT, CachePools, KVPool, ReqToTokenPool
from graphrt.reference.model import ReferenceDecoder, build_reference, run_eager
from graphrt.reference.varlen import VARLEN_OP, VarlenAttnBackend, varlen_attention

__all__ = [
    "AttnMetadata",
    "CachePools",
    "DUMMY_REQUEST",
    "KVPool",
    "ReferenceConfig",
    "ReferenceDecoder",
    "ReqToTokenPool",
    "SCRATCH_SLOT",
    "TorchNativeAttnBackend",
    "VARLEN_OP",
    "VarlenAttnBackend",
    "build_reference",
    "generate_greedy",
    "graph_runner_kwargs",
    "make_decode_batch",
    "make_extend_batch",
    "run_eager",
    "token_requests",
    "varlen_attention",
]
