"""UnifiedBatchItem and build_forward_batch: chunked prefill beside decodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch

from graphrt.batch import ForwardMode
from graphrt.host.input_batch import InputBuffers
from graphrt.host.unified import UnifiedBatchItem, build_forward_batch


@dataclass
class FakeKvCache:
    """KvCacheHandle whose position p lives in slot ``base + p``."""

    req_pool_index: int
    base: int

    def slots_for(self, start: int, end: int) -> List[int]:
        return list(range(self.base + start, self.base + end))


def item(seq_id: str, tokens: List[int], pos_offset: int, final: bool = True, row: int = 0) -> UnifiedBatchItem:
    return UnifiedBatchItem(seq_id, tokens, FakeKvCache(row, 1000 * (row + 1)), pos_offset, final)


def test_chunked_prefill_with_decodes():
    items = [
        item("new", [11, 12, 13, 14], 0, final=False, row=0),  # first chunk of a long prompt
        item("cont", [21, 22, 23], 4, final=True, row=1),  # last chunk of a chunked prefill
        item("dec1", [31], 10, row=2),
        item("dec2", [41], 5, row=3),
    ]
    fb, logits_indices = build_forward_batch(items, device="cpu")
    fb.validate()
    assert fb.forward_mode == ForwardMode.MIXED and fb.batch_size == 4
    assert fb.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, 31, 41]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 5]
    assert fb.seq_lens.tolist() == [4, 7, 11, 6] and fb.seq_lens_cpu.tolist() == [4, 7, 11, 6]
    assert fb.seq_lens_sum == 28
    assert fb.extend_num_tokens == 9
    assert fb.extend_seq_lens.tolist() == [4, 3, 1, 1] and fb.extend_seq_lens_cpu == [4, 3, 1, 1]
    assert fb.extend_prefix_lens.tolist() == [0, 4, 10, 5] and fb.extend_prefix_lens_cpu == [0, 4, 10, 5]
    assert fb.extend_start_loc.tolist() == [0, 4, 7, 8]
    assert fb.req_pool_indices.tolist() == [0, 1, 2, 3]
    assert fb.out_cache_loc.tolist() == [1000, 1001, 1002, 1003, 2004, 2005, 2006, 3010, 4005]
    assert logits_indices.tolist() == [6, 7, 8]  # the non-final chunk gets no logits row


def test_all_decodes_is_decode_mode():
    items = [item(f"s{i}", [i + 1], 3 + i, row=i) for i in range(3)]
    fb, logits_indices = build_forward_batch(items)
    fb.validate()
    assert fb.forward_mode == ForwardMode.DECODE
    assert fb.extend_seq_lens is None and fb.extend_start_loc is None
    assert fb.seq_lens.tolist() == [4, 5, 6] and logits_indices.tolist() == [0, 1, 2]


def test_all_prefill_is_extend_mode():
    items = [item("a", [1, 2], 0, row=0), item("b", [3, 4, 5], 2, final=False, row=1)]
    fb, logits_indices = build_forward_batch(items)
    fb.validate()
    assert fb.forward_mode == ForwardMode.EXTEND
    assert logits_indices.tolist() == [1]


def test_empty_is_idle():
    fb, logits_indices = build_forward_batch([])
    fb.validate()
    assert fb.forward_mode == ForwardMode.IDLE and fb.batch_size == 0 and logits_indices.numel() == 0


def test_reused_buffers_and_extra_fields():
    buffers = InputBuffers.allocate(4, 16)
    backend = object()
    for step in range(3):
        fb, _ = build_forward_batch([item("a", [step, step], 0), item("b", [7], 9, row=1)],
                                    buffers=buffers, attn_backend=backend)
        assert fb.input_ids.data_ptr() == buffers.device_views["input_ids"].data_ptr()
        assert fb.input_ids.tolist() == [step, step, 7] and fb.attn_backend is backend


@pytest.mark.parametrize(
    "items, field",
    [
        ([item("a", [], 0)], "q_tokens"),
        ([item("a", [1], -1)], "pos_offset"),
        ([item("a", [1], 0), item("a", [2], 0)], "seq_id: duplicate"),
    ],
)
def test_bad_items_name_the_field(items, field):
    with pytest.raises(ValueError, match=field):
        build_forward_batch(items)


def test_handle_with_wrong_slot_count_is_rejected():
    class ShortCache(FakeKvCache):
        def slots_for(self, start: int, end: int) -> List[int]:
            return [0]

    bad = UnifiedBatchItem("a", [1, 2], ShortCache(0, 0), 0, True)
    with pytest.raises(ValueError, match="out_cache_loc: expected 2 slots"):
        build_forward_batch([bad])


def test_logits_indices_live_on_the_batch_device():
    _, logits_indices = build_forward_batch([item("a", [1, 2], 0, final=False), item("b", [3], 4, row=1)])
    assert logits_indices.device == torch.device("cpu") and logits_indices.dtype == torch.int64
