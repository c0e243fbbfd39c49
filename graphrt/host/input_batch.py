"""Host-built batches: InputBatch and BatchBuilder over the packed arena of ``graphrt.host.arena``.

The builder writes every integer field of a step (token ids, positions, KV slots,
per-request lengths, block table) into one host arena through numpy, then copies
the used prefix of that arena to a device arena of the same layout with a single
non-blocking ``copy_``. ``InputBatch`` tensors are views into the device arena, so
building a batch allocates no tensor storage: an ``InputBatch`` (and its sampling
metadata) stays valid until the next build on the same ``InputBuffers``, the same
contract as the static outputs of a CUDA graph.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from graphrt.batch import ForwardBatch, ForwardMode
from graphrt.host.arena import DUMMY_REQ_POOL_INDEX, SCRATCH_SLOT, InputBuffers
from graphrt.host.sampling import SAMPLING_DEFAULTS, SamplingMetadata, check_sampling_values

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class KvSlots:
    """Where a request's KV lives: its ReqToTokenPool row and the slots its new tokens are written to.

    ``out_cache_loc`` gives one slot per new token explicitly; otherwise the slots are derived
    from the paged ``block_ids`` (``block_ids[pos // block_size] * block_size + pos % block_size``).
    ``block_ids``, when given, also fill the request's row of the block table.
    """

    req_pool_index: int
    out_cache_loc: Optional[Sequence[int]] = None
    block_ids: Optional[Sequence[int]] = None


@dataclass
class RequestView:
    """One request of an InputBatch: its token range, token views and sampling row."""

    req_id: str
    req_idx: int
    token_range: Tuple[int, int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    sampling_metadata: SamplingMetadata


@dataclass
class InputBatch:
    """One step's inputs: device views into ``InputBuffers`` plus host mirrors and sampling rows.

    Request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``; ``seq_lens`` is
    prefix + new tokens (last position + 1).
    """

    req_ids: List[str]
    req_index: Dict[str, int]
    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    query_start_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    logits_indices: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: np.ndarray
    extend_prefix_lens_cpu: np.ndarray
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    has_kv_slots: bool
    sampling_metadata: SamplingMetadata
    inputs_embeds: Optional[torch.Tensor] = None

    @property
    def num_reqs(self) -> int:
        """Number of requests in the batch."""
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        """Number of tokens across all requests."""
        return self.input_ids.shape[0]

    @classmethod
    def make_dummy(cls, num_reqs: int, num_tokens: int, buffers: InputBuffers) -> "InputBatch":
        """A harmless batch for warm-up/capture: token 0, reserved request row and scratch KV slot."""
        if num_reqs < 0 or num_tokens < num_reqs or (num_reqs == 0 and num_tokens != 0):
            raise ValueError(f"num_tokens: expected >= num_reqs={num_reqs} (0 when num_reqs is 0), got {num_tokens}")
        builder = BatchBuilder(buffers)
        base, extra = divmod(num_tokens, num_reqs) if num_reqs else (0, 0)
        for i in range(num_reqs):
            n = base + (i >= num_reqs - extra)
            builder.add_request(f"dummy-{i}", np.zeros(n, dtype=np.int64), np.arange(n),
                                kv=KvSlots(DUMMY_REQ_POOL_INDEX, out_cache_loc=[SCRATCH_SLOT] * n))
        return builder.build()

    @classmethod
    def from_requests(
        cls,
        req_ids: Sequence[str],
        input_ids_list: Sequence[Sequence[int]],
        positions_list: Sequence[Sequence[int]],
        buffers: InputBuffers,
        sampling_metadata: Optional[SamplingMetadata] = None,
        kv_slots: Optional[Sequence[KvSlots]] = None,
    ) -> "InputBatch":
        """Build a batch from parallel per-request lists (``kv_slots`` optional, one per request)."""
        named = {"input_ids_list": input_ids_list, "positions_list": positions_list, "kv_slots": kv_slots}
        for name, values in named.items():
            if values is not None and len(values) != len(req_ids):
                raise ValueError(f"{name}: expected {len(req_ids)} entries (one per req_id), got {len(values)}")
        if sampling_metadata is not None and sampling_metadata.num_reqs != len(req_ids):
            raise ValueError(f"sampling_metadata: expected {len(req_ids)} rows, got {sampling_metadata.num_reqs}")
        builder = BatchBuilder(buffers)
        for i, req_id in enumerate(req_ids):
            builder.add_request(req_id, input_ids_list[i], positions_list[i], kv=kv_slots[i] if kv_slots else None)
        batch = builder.build()
        if sampling_metadata is not None:
            batch.sampling_metadata = sampling_metadata
        return batch

    def get_req_index(self, req_id: str) -> int:
        """Row of ``req_id`` in this batch (KeyError if absent)."""
        try:
            return self.req_index[req_id]
        except KeyError:
            raise KeyError(f"req_id: {req_id!r} is not in this batch") from None

    def get_logits_indices(self) -> torch.Tensor:
        """Device tensor [num_reqs]: token index of each request's last token."""
        return self.logits_indices

    def get_token_range(self, req_idx: int) -> Tuple[int, int]:
        """``(start, end)`` token indices of request ``req_idx``, read from the host mirror."""
        if not 0 <= req_idx < self.num_reqs:
            raise IndexError(f"req_idx: expected 0 <= req_idx < {self.num_reqs}, got {req_idx}")
        return int(self.query_start_loc_cpu[req_idx]), int(self.query_start_loc_cpu[req_idx + 1])

    def slice_request(self, req_idx: int) -> RequestView:
        """Views of one request's tokens and its sampling row."""
        start, end = self.get_token_range(req_idx)
        return RequestView(self.req_ids[req_idx], req_idx, (start, end), self.input_ids[start:end],
                           self.positions[start:end], self.sampling_metadata.slice(req_idx, req_idx + 1))

    def to_forward_batch(
        self,
        req_pool_indices: Optional[torch.Tensor] = None,
        out_cache_loc: Optional[torch.Tensor] = None,
        **extra: Any,
    ) -> ForwardBatch:
        """A ForwardBatch over the same device views; host-only metadata, no device reads.

        KV placement comes from the ``KvSlots`` given when requests were added, or from the
        ``req_pool_indices``/``out_cache_loc`` tensors passed here (which take precedence).
        ``extra`` sets further ForwardBatch fields (``attn_backend``, pools, ``return_logprob``).
        """
        if not self.has_kv_slots and (req_pool_indices is None or out_cache_loc is None):
            raise ValueError("out_cache_loc: requests were added without KvSlots; pass req_pool_indices "
                             "and out_cache_loc tensors")
        batch_fields: Dict[str, Any] = dict(
            forward_mode=self.forward_mode, batch_size=self.num_reqs, input_ids=self.input_ids,
            positions=self.positions, seq_lens=self.seq_lens, seq_lens_sum=self.seq_lens_sum,
            seq_lens_cpu=self.seq_lens_cpu,
            req_pool_indices=self.req_pool_indices if req_pool_indices is None else req_pool_indices,
            out_cache_loc=self.out_cache_loc if out_cache_loc is None else out_cache_loc,
        )
        if self.forward_mode.is_extend():
            batch_fields.update(
                extend_num_tokens=self.num_tokens, extend_seq_lens=self.extend_seq_lens,
                extend_prefix_lens=self.extend_prefix_lens, extend_start_loc=self.query_start_loc[:-1],
                extend_seq_lens_cpu=np.diff(self.query_start_loc_cpu).tolist(),
                extend_prefix_lens_cpu=self.extend_prefix_lens_cpu.tolist(),
            )
        return ForwardBatch(**batch_fields, **extra)


def _index_array(name: str, values: Any) -> np.ndarray:
    """Validate a 1-D sequence of non-negative integers and return it as an int64 array."""
    array = np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values)
    if array.ndim != 1 or (array.dtype.kind not in "iu" and array.size):
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {list(array.shape)} of {array.dtype}")
    if array.size and array.min() < 0:
        raise ValueError(f"{name}: expected non-negative entries, got {int(array.min())}")
    return array.astype(np.int64, copy=False)


NO_BLOCKS = np.zeros(0, dtype=np.int64)


def write_requests(host: Dict[str, np.ndarray], first_request: int, first_token: int, input_ids: Sequence[int],
                   positions: Sequence[int], out_cache_loc: Sequence[int], counts: Sequence[int],
                   seq_lens: Sequence[int], req_pool_indices: Sequence[int], extend: bool = True) -> None:
    """Requests ``first_request..`` into a host arena's views (graphrt.host.arena), their tokens from
    ``first_token`` on: ``counts[i]`` new tokens each (``input_ids``, ``positions``), every KV slot they
    write (``out_cache_loc``: one per token, or several steps' of a launch), their ``seq_lens`` (prefix plus
    new tokens) and request rows; with ``extend``, their query start offsets, prefix lengths and last-token
    rows too (a batch of one-token decodes reads none of those). The one way a host-built batch is
    written: ``BatchBuilder`` a request at a time, the engine (graphrt.hf.engine_step) a step at a time.
    Sequences (lists or arrays) of equal lengths, already checked."""
    last = first_request + len(counts)
    host["input_ids"][first_token:first_token + len(input_ids)] = input_ids
    host["positions"][first_token:first_token + len(positions)] = positions
    host["out_cache_loc"][first_token:first_token + len(out_cache_loc)] = out_cache_loc
    host["req_pool_indices"][first_request:last] = req_pool_indices
    host["seq_lens"][first_request:last] = seq_lens
    if not extend:
        return
    ends = list(itertools.accumulate(counts, initial=first_token))[1:]
    host["query_start_loc"][first_request + 1:last + 1] = ends
    host["extend_seq_lens"][first_request:last] = counts
    host["extend_prefix_lens"][first_request:last] = [length - count for length, count in zip(seq_lens, counts)]
    host["logits_indices"][first_request:last] = [end - 1 for end in ends]


class BatchBuilder:
    """Accumulates requests straight into the host arena of ``buffers`` and builds an InputBatch."""

    def __init__(self, buffers: InputBuffers) -> None:
        self.buffers = buffers
        self._sampling_np = {name: getattr(buffers.sampling, name).numpy() for name in SAMPLING_DEFAULTS}
        self.reset()

    def reset(self) -> None:
        """Forget the accumulated requests (the arena is overwritten, not cleared)."""
        self._req_ids: List[str] = []
        self._req_index: Dict[str, int] = {}
        self._num_tokens = 0
        self._seq_lens_sum = 0
        self._num_single_token = 0
        self._num_decodes = 0
        self._has_kv_slots = True

    @property
    def num_reqs(self) -> int:
        """Requests added since the last reset."""
        return len(self._req_ids)

    @property
    def total_tokens(self) -> int:
        """Tokens added since the last reset."""
        return self._num_tokens

    @property
    def is_empty(self) -> bool:
        """True when no request was added."""
        return not self._req_ids

    @property
    def is_full(self) -> bool:
        """True when no further request fits (request or token capacity reached)."""
        return self.num_reqs >= self.buffers.max_num_reqs or self._num_tokens >= self.buffers.max_num_tokens

    def add_request(
        self,
        req_id: str,
        input_ids: Sequence[int],
        positions: Sequence[int],
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        kv: Optional[KvSlots] = None,
    ) -> int:
        """Validate one request fully, then write it into the host arena; returns its row index.

        ``positions`` are absolute, so ``seq_len = positions[-1] + 1`` and the cached prefix is
        ``seq_len - len(input_ids)``. Without ``kv`` the request gets the reserved request row and
        scratch slot, and ``to_forward_batch`` must be given real KV tensors.
        """
        buf = self.buffers
        ids, pos = _index_array("input_ids", input_ids), _index_array("positions", positions)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("input_ids: expected at least one token, got 0")
        if pos.shape[0] != n:
            raise ValueError(f"positions: expected {n} entries (one per input id), got {pos.shape[0]}")
        if req_id in self._req_index:
            raise ValueError(f"req_id: duplicate request id {req_id!r}")
        if self.num_reqs >= buf.max_num_reqs:
            raise ValueError(f"req_id: batch already holds max_num_reqs={buf.max_num_reqs} requests")
        if self._num_tokens + n > buf.max_num_tokens:
            raise ValueError(f"input_ids: {n} tokens after {self._num_tokens} exceed max_num_tokens="
                             f"{buf.max_num_tokens}")
        seq_len = int(pos[-1]) + 1
        if seq_len < n:
            raise ValueError(f"positions: last position {seq_len - 1} leaves no room for {n} new tokens")
        params = (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty)
        for name, value in zip(SAMPLING_DEFAULTS, params):
            check_sampling_values(name, value)
        slots, blocks = self._kv_slots(kv, pos)

        buf.wait_host_free()
        i, end = self.num_reqs, self._num_tokens + n
        host = buf.host_views
        write_requests(host, i, self._num_tokens, ids, pos, np.full(n, SCRATCH_SLOT) if slots is None else slots,
                       [n], [seq_len], [DUMMY_REQ_POOL_INDEX if kv is None else kv.req_pool_index])
        host["block_table"][i, :blocks.shape[0]] = blocks
        host["block_table"][i, blocks.shape[0]:] = 0
        for name, value in zip(SAMPLING_DEFAULTS, params):
            self._sampling_np[name][i] = value

        self._req_ids.append(req_id)
        self._req_index[req_id] = i
        self._num_tokens = end
        self._seq_lens_sum += seq_len
        self._num_single_token += n == 1
        self._num_decodes += n == 1 and seq_len > 1
        self._has_kv_slots &= kv is not None
        return i

    def _kv_slots(self, kv: Optional[KvSlots], pos: np.ndarray) -> Tuple[Optional[np.ndarray], np.ndarray]:
        """Validated (slot per token or None, block ids) for one request."""
        if kv is None:
            return None, NO_BLOCKS
        if type(kv.req_pool_index) is not int or kv.req_pool_index < 0:
            raise ValueError(f"req_pool_index: expected a non-negative int, got {kv.req_pool_index!r}")
        blocks = NO_BLOCKS if kv.block_ids is None else _index_array("block_ids", kv.block_ids)
        max_blocks, block_size = self.buffers.max_blocks_per_req, self.buffers.block_size
        if blocks.shape[0] > max_blocks:
            raise ValueError(f"block_ids: expected at most max_blocks_per_req={max_blocks}, got {blocks.shape[0]}")
        if kv.out_cache_loc is not None:
            slots = _index_array("out_cache_loc", kv.out_cache_loc)
            if slots.shape[0] != pos.shape[0]:
                raise ValueError(f"out_cache_loc: expected {pos.shape[0]} slots (one per token), got {slots.shape[0]}")
            return slots, blocks
        if kv.block_ids is None:
            raise ValueError("out_cache_loc: KvSlots needs out_cache_loc or block_ids")
        needed = int(pos.max()) // block_size + 1
        if blocks.shape[0] < needed:
            raise ValueError(f"block_ids: positions up to {int(pos.max())} need {needed} blocks of "
                             f"{block_size}, got {blocks.shape[0]}")
        return blocks[pos // block_size] * block_size + pos % block_size, blocks

    def _forward_mode(self) -> ForwardMode:
        """IDLE if empty; DECODE if every request has one token; MIXED if decodes sit beside longer
        chunks; else EXTEND."""
        if self.is_empty:
            return ForwardMode.IDLE
        if self._num_single_token == self.num_reqs:
            return ForwardMode.DECODE
        return ForwardMode.MIXED if self._num_decodes else ForwardMode.EXTEND

    def build(self) -> InputBatch:
        """Copy the arena to the device once and return views of it (valid until the next build)."""
        buf, n, t = self.buffers, self.num_reqs, self._num_tokens
        buf.stage(n)
        dev, host = buf.device_views, buf.host_views
        return InputBatch(
            req_ids=list(self._req_ids), req_index=dict(self._req_index), forward_mode=self._forward_mode(),
            input_ids=dev["input_ids"][:t], positions=dev["positions"][:t], out_cache_loc=dev["out_cache_loc"][:t],
            query_start_loc=dev["query_start_loc"][:n + 1], req_pool_indices=dev["req_pool_indices"][:n],
            seq_lens=dev["seq_lens"][:n], extend_seq_lens=dev["extend_seq_lens"][:n],
            extend_prefix_lens=dev["extend_prefix_lens"][:n], logits_indices=dev["logits_indices"][:n],
            block_table=dev["block_table"][:n], query_start_loc_cpu=host["query_start_loc"][:n + 1],
            extend_prefix_lens_cpu=host["extend_prefix_lens"][:n],
            seq_lens_cpu=torch.from_numpy(host["seq_lens"][:n]), seq_lens_sum=self._seq_lens_sum,
            has_kv_slots=self._has_kv_slots, sampling_metadata=buf.sampling.slice(0, n),
            inputs_embeds=None if buf.inputs_embeds is None else buf.inputs_embeds[:t],
        )
