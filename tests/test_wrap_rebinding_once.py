"""A layout records again after a one-off rebinding, whenever it happens (issue 49, item 7).

``load_state_dict(assign=True)``, a replaced head, ``quantize_dynamic(inplace=True)`` or a conv+BN fusion
right after capture (two replays) rebinds what the graphs read once: the manual says wrap() records the
layout again, so later calls replay a new recording with eager's result, not eager forever under
``rebound_state``. A binding that changes every few calls (beam search's cache reorder) still runs eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphrt import wrap

REPLAYS_BEFORE = 2


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def assign_weights(model):
    model.load_state_dict({name: value * 2 for name, value in model.state_dict().items()}, assign=True)


def replace_head(model):
    model.head = nn.Linear(16, 4)


def quantize(model):
    torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def fuse(model):
    model.conv = torch.nn.utils.fusion.fuse_conv_bn_eval(model.conv, model.bn)
    model.bn = nn.Identity()


CASES = {"load_state_dict(assign=True)": (Head, assign_weights, (4, 8)),
         "a replaced head": (Head, replace_head, (4, 8)),
         "quantize_dynamic(inplace=True)": (Head, quantize, (4, 8)),
         "conv+BN fusion": (ConvNet, fuse, (4, 3, 5, 5))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_records_again_after_one_rebinding_right_after_capture(case):
    make, rebind, shape = CASES[case]
    torch.manual_seed(0)
    model = make().eval()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(shape)
    with torch.no_grad():
        while fast.stats()["graph_runs"] < REPLAYS_BEFORE:
            assert torch.equal(fast(x), model(x))
        rebind(model)
        reference = copy.deepcopy(model)
        for _ in range(4):
            assert torch.allclose(fast(x), reference(x), rtol=1e-5, atol=1e-6)
        runs = fast.stats()["graph_runs"]
        assert torch.allclose(fast(x), reference(x), rtol=1e-5, atol=1e-6)
    assert fast.stats()["graph_runs"] == runs + 1, fast.stats()["eager_reasons"]


def test_a_binding_changed_every_call_still_runs_eagerly():
    model = Head().eval()
    fast = wrap(model, max_batch_size=4, capture_sizes=[4])
    x = torch.randn(4, 8)
    with torch.no_grad():
        while fast.stats()["graph_runs"] < REPLAYS_BEFORE:
            fast(x)
        for _ in range(12):
            replace_head(model)
            assert torch.equal(fast(x), model(x))
    assert fast.stats()["eager_reasons"].get("rebound_state", 0) >= 6
