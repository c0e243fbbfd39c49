"""A tensor the model rebinds before its graphed steps read it (issue 49, item 9).

Qwen2-VL keeps its ``rope_deltas`` as a module attribute and binds a new tensor at the start of every
``generate()`` call; its decode steps then read it. A graph recorded on the old tensor reads the old
memory, so the rebinding used to send a decode step per call eagerly (``rebound_state``) and record the
layout again. A tensor the step only reads, rebound to one of the same shape, dtype, device and strides,
is staged into the captured tensor before each replay, like an argument; one the step writes, or of
another shape, is still a rebinding.
"""

from __future__ import annotations

import pytest
import torch
from conftest import calls, failures
from torch import nn

from graphrt import wrap


class Offset(nn.Module):
    """Reads a tensor attribute its caller rebinds between calls (as a prefill sets Qwen2-VL's rope_deltas)."""

    def __init__(self, writes=False):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.offset = torch.zeros(1, 8)
        self.writes = writes

    def forward(self, x):
        if self.writes:
            self.offset.add_(1)
        return self.linear(x) + self.offset


def test_a_read_only_tensor_rebound_to_one_of_its_shape_is_staged_and_replays():
    model = Offset()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        calls(fast, x)
        runs = fast.stats()["graph_runs"]
        for value in (1.0, 2.0, 3.0):
            model.offset = torch.full((1, 8), value)
            assert all(torch.equal(fast(x), model(x)) for _ in range(2))
            model.offset.mul_(2)  # written in place after the rebinding: read where it is bound now
            assert torch.equal(fast(x), model(x))
        assert fast.stats()["graph_runs"] == runs + 9
        model.offset = torch.ones(8)  # another shape: a rebinding, as before
        assert torch.equal(fast(x), model(x))
    assert "rebound_state:" in failures(fast)


def test_a_rebound_tensor_the_step_writes_is_not_staged():
    model = Offset(writes=True)
    reference = Offset(writes=True)
    reference.load_state_dict(model.state_dict())
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(fast(x), reference(x))
        model.offset, reference.offset = torch.ones(1, 8), torch.ones(1, 8)
        for _ in range(3):
            assert torch.equal(fast(x), reference(x))
        assert torch.equal(model.offset, reference.offset)
    assert "rebound_state:" in failures(fast)


def tiny_qwen2_vl():
    transformers = pytest.importorskip("transformers")
    from hf_helpers import DECODER

    torch.manual_seed(0)
    text = dict(DECODER, model_type="qwen2_vl", rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1, in_chans=3)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=127,
                                        video_token_id=126, vision_start_token_id=125, vision_end_token_id=124)
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def test_graph_generate_of_qwen2_vl_replays_every_step_of_a_repeated_call():
    from hf_helpers import family_inputs

    import graphrt.hf

    model = tiny_qwen2_vl()
    inputs = family_inputs("llama", batch=2)
    new_tokens = 8
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(**inputs, **options)
        fast = graphrt.hf.graph_generate(model, max_batch_size=4)
        for _ in range(2):  # warm-ups and recordings
            assert torch.equal(model.generate(**inputs, **options), expected)
        for _ in range(3):
            runs = fast.stats()["graph_runs"]
            assert torch.equal(model.generate(**inputs, **options), expected)
            assert fast.stats()["graph_runs"] - runs == new_tokens  # the prefill and every decode step
    assert "rebound_state" not in fast.stats()["eager_reasons"], fast.stats()["guard_failures"]
