"""Shared by the piecewise tests: test-only splitting ops, a varlen reference runner, random prefill/mixed steps."""

from __future__ import annotations

import random
from typing import Callable, List, Optional

import torch

from graphrt import ForwardMode, GraphRunner, current_batch
from graphrt.reference import ReferenceConfig, VARLEN_OP, build_reference, graph_runner_kwargs, make_extend_batch

PIECEWISE_SIZES = [8, 16, 32, 64]
OP_CALLS: List[Callable[[], None]] = []  # hooks the test ops call (to see when they run)


@torch.library.custom_op("graphrt_test::double_rows", mutates_args=())
def double_rows(x: torch.Tensor) -> torch.Tensor:
    """A splitting op that returns a fresh tensor: 2 * x."""
    for hook in OP_CALLS:
        hook()
    return x * 2


@torch.library.custom_op("graphrt_test::double_rows_", mutates_args=("x",))
def double_rows_(x: torch.Tensor) -> None:
    """A splitting op that writes its argument in place and returns nothing (as vLLM's attention writes ``out``)."""
    x.mul_(2)


@torch.library.custom_op("graphrt_test::real_rows", mutates_args=())
def real_rows(x: torch.Tensor) -> torch.Tensor:
    """A splitting op that returns only the live batch's real rows (not the padded shape it was given)."""
    return x[: current_batch().num_tokens] * 2


@torch.library.custom_op("graphrt_test::host_lengths", mutates_args=())
def host_lengths(x: torch.Tensor) -> torch.Tensor:
    """Reads the step's seq_lens with ``.tolist()`` (a host read: allowed between pieces): x times their sum."""
    return x * float(sum(current_batch().seq_lens.tolist()))


@torch.library.custom_op("graphrt_test::batch_total", mutates_args=())
def batch_total(x: torch.Tensor) -> torch.Tensor:
    """Reads a host value of the step through graphrt.current_batch(): x filled with seq_lens_sum."""
    return torch.full_like(x, float(current_batch().seq_lens_sum))


class VarlenSetup:
    """The reference model with varlen attention, its pools, and a runner with piecewise keys."""

    def __init__(self, sizes=PIECEWISE_SIZES, max_batch_size: int = 4, splitting_ops=(VARLEN_OP,),
                 modes=(ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED), capture: bool = True,
                 max_context_len: int = 64, backend: str = "emulated", device: str = "cpu") -> None:
        config = ReferenceConfig.tiny(max_context_len=max_context_len)
        self.device = device
        self.model, self.attn, self.pools = build_reference(config, num_requests=64, device=device, attention="varlen")
        self.runner = GraphRunner(
            self.model, max_batch_size=max_batch_size, modes=modes, backend=backend, device=device, progress=False,
            splitting_ops=splitting_ops, piecewise_sizes=sizes, **graph_runner_kwargs(self.attn, self.pools))
        self.report = self.runner.capture() if capture else None
        self.lengths = {}  # request row -> cached tokens

    def step_batch(self, rng: random.Random, max_reqs: int = 6, max_new: int = 9, mode: Optional[ForwardMode] = None,
                   num_reqs: Optional[int] = None):
        """A prefill or mixed batch of ``num_reqs`` (default 1..max_reqs) requests, 1..max_new new tokens
        each (new requests or continuing ones)."""
        reqs, prefixes, chunks = [], [], []
        for _ in range(num_reqs or rng.randint(1, max_reqs)):
            continuing = [req for req in self.lengths if req not in reqs
                          and self.lengths[req] + max_new <= self.pools.req_to_token.max_context_len]
            if continuing and rng.random() < 0.5:
                req = rng.choice(continuing)
            else:
                req = self.pools.req_to_token.alloc()
                self.lengths[req] = 0
            reqs.append(req)
            prefixes.append(self.lengths[req])
            chunks.append([rng.randrange(128) for _ in range(rng.randint(1, max_new))])
        out_loc = self.pools.assign(reqs, prefixes, [len(chunk) for chunk in chunks])
        for req, chunk in zip(reqs, chunks):
            self.lengths[req] += len(chunk)
        if mode is None:
            mode = ForwardMode.MIXED if any(prefixes) and rng.random() < 0.5 else ForwardMode.EXTEND
        return make_extend_batch(chunks, reqs, prefixes, out_loc, self.device, mode=mode, pools=self.pools,
                                 attn_backend=self.attn)
