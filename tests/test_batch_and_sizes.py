"""ForwardMode predicates, ForwardBatch construction/validation, capture-size policies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import decode_batch

from graphrt import ForwardBatch, ForwardMode
from graphrt.batch import HOST_SUM_ROWS
from graphrt.sizes import SizeGrid, build_pad_table, default_capture_sizes, normalize_capture_sizes


def test_forward_mode_predicates():
    assert ForwardMode.EXTEND.is_extend() and ForwardMode.MIXED.is_extend() and ForwardMode.MIXED.is_prefill()
    assert not ForwardMode.DECODE.is_extend() and ForwardMode.DECODE.is_decode()
    assert ForwardMode.MIXED.is_mixed() and ForwardMode.IDLE.is_idle()
    assert ForwardMode.IDLE.is_decode_or_idle() and ForwardMode.DECODE.is_decode_or_idle()
    assert not ForwardMode.EXTEND.is_decode_or_idle()


def test_forward_batch_has_every_seed_field_with_defaults():
    names = [field.name for field in dataclasses.fields(ForwardBatch)]
    assert names == [
        "forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens", "out_cache_loc",
        "seq_lens_sum", "seq_lens_cpu", "positions", "extend_num_tokens", "extend_seq_lens",
        "extend_prefix_lens", "extend_start_loc", "extend_prefix_lens_cpu", "extend_seq_lens_cpu",
        "return_logprob", "top_logprobs_nums", "req_to_token_pool", "token_to_kv_pool", "attn_backend",
        "mrope_position_deltas", "pixel_values", "image_grid_thw",
    ]
    batch = decode_batch(2)
    assert batch.return_logprob is False and batch.seq_lens_cpu is None and batch.num_tokens == 2


def test_validate_extend_fields():
    ok = dict(forward_mode=ForwardMode.EXTEND, extend_num_tokens=3, input_ids=torch.tensor([1, 2, 3]),
              out_cache_loc=torch.tensor([4, 5, 6]), positions=torch.tensor([0, 1, 0]),
              extend_seq_lens=torch.tensor([2, 1], dtype=torch.int32),
              extend_prefix_lens=torch.zeros(2, dtype=torch.int32),
              extend_start_loc=torch.tensor([0, 2], dtype=torch.int32), extend_seq_lens_cpu=[2, 1])
    decode_batch(2, **ok).validate()
    with pytest.raises(ValueError, match="extend_num_tokens"):
        decode_batch(2, **{**ok, "extend_num_tokens": 2}).validate()
    with pytest.raises(ValueError, match="extend_seq_lens_cpu"):
        decode_batch(2, **{**ok, "extend_seq_lens_cpu": [1, 1]}).validate()
    with pytest.raises(ValueError, match="extend_start_loc: required"):
        decode_batch(2, **{**ok, "extend_start_loc": None}).validate()


def large_decode_batch(batch_size: int) -> ForwardBatch:
    """A valid DECODE batch of more rows than the Python-int checks take (HOST_SUM_ROWS)."""
    rows = torch.arange(1, batch_size + 1)
    seq_lens = (rows % 50 + 1).to(torch.int32)
    return dataclasses.replace(decode_batch(1), batch_size=batch_size, input_ids=rows % 97, req_pool_indices=rows,
                               seq_lens=seq_lens, out_cache_loc=rows, seq_lens_sum=int(seq_lens.sum()),
                               positions=seq_lens.long() - 1)


@pytest.mark.parametrize("check_values", [True, False], ids=["value_checks", "metadata_only"])
@pytest.mark.parametrize("batch_size", [3, HOST_SUM_ROWS + 5], ids=["python_ints", "torch_sum"])
def test_validate_uses_cpu_mirror_for_sums(batch_size, check_values):
    batch = decode_batch(batch_size) if batch_size <= HOST_SUM_ROWS else large_decode_batch(batch_size)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    batch.validate(check_values=check_values)
    batch.seq_lens_cpu = batch.seq_lens + 1
    with pytest.raises(ValueError, match=f"seq_lens_sum: expected seq_lens.sum\\(\\)={batch.seq_lens_sum + batch_size}"):
        batch.validate(check_values=check_values)


def test_validate_refuses_a_cpu_mirror_of_another_shape():
    batch = decode_batch(3)
    batch.seq_lens_cpu = batch.seq_lens[:2]
    with pytest.raises(ValueError, match=r"seq_lens_cpu: expected shape \[3\]"):
        batch.validate()


def test_default_capture_sizes():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch_size"):
        default_capture_sizes(0)


def test_pad_table_and_grids():
    table = build_pad_table([1, 4, 6])
    assert table == [1, 1, 4, 4, 4, 6, 6]
    assert normalize_capture_sizes([4, 1, 4], 8) == [1, 4]
    grid = SizeGrid.for_extend([8, 16], [1, 4, 16])
    assert grid.pairs() == [(16, 16), (16, 4), (16, 1), (8, 4), (8, 1)]
    assert SizeGrid.for_decode([1, 2]).pairs() == [(2, 2), (1, 1)]
