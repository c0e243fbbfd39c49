"""One tiny model per hazard graphrt.check finds, each line that causes it marked ``# HAZARD: <kind>``.

Every factory returns ``(callable, example_args)`` (what ``python -m graphrt.check
tests.check_gallery:<factory>`` takes). tests/test_check.py asserts that each report names
exactly the marked kind at exactly the marked line, and that the clean ones report nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt import wrap

HIDDEN = 8
BATCH = 4


def _rows(seed: int = 0, batch: int = BATCH) -> torch.Tensor:
    return torch.randn(batch, HIDDEN, generator=torch.Generator().manual_seed(seed))


class Mlp(nn.Module):
    """Clean: a per-row MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class KvCacheModel(nn.Module):
    """Clean, with state: writes each row into a KV cache at its slot, counts its steps. The last
    slot is scratch: wrapped with it as the slots' pad value, padding rows write only there."""

    def __init__(self, slots: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("k_cache", torch.zeros(slots + 1, HIDDEN))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.scratch_slot = slots

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(x)
        self.k_cache[slots] = hidden
        self.steps.add_(1)
        return hidden + self.k_cache[slots - 1]


class PaddedStoreModel(nn.Module):
    """A paged KV store whose padding rows (slot 0, wrap()'s default pad) overwrite a live slot."""

    def __init__(self, slots: int = 32) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(slots, HIDDEN))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.k_cache.index_copy_(0, slots, x)  # HAZARD: padding_writes_state
        return x * 2


class ForwardContext:
    """A module-level forward context, set before each step (nano-vllm's utils/context.py)."""

    scale = torch.full((HIDDEN,), 2.0)


class GlobalContextModel(nn.Module):
    """Reads a per-step tensor from a global forward context instead of its arguments."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * ForwardContext.scale  # HAZARD: outside_tensor


class ItemModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # HAZARD: host_sync
        return x / scale


class TolistModel(nn.Module):
    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        longest = max(lengths.tolist())  # HAZARD: host_sync
        return x * longest


class NonzeroModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(x[:, 0] > 0)  # HAZARD: host_sync
        return x.sum() + rows.sum()  # HAZARD: value_dependent_branch (the shape nonzero returned)


class MaskIndexModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[x < 0] = 0.0  # HAZARD: host_sync
        return out


class UniqueModel(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + torch.unique(ids).numel()  # HAZARD: host_sync


class BranchModel(nn.Module):
    """A branch on a tensor value: a host read, and an op graph that depends on the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0:  # HAZARD: host_sync
            return x * 2  # HAZARD: value_dependent_branch
        return x - 1


class InputWriteModel(nn.Module):
    def forward(self, x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)  # HAZARD: input_written
        return x * 2


class RebindModel(nn.Module):
    """Keeps a running offset by assigning a new tensor: a graph keeps reading the first one."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.zeros(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.offset = self.offset + 1  # HAZARD: rebound_tensor
        return x + self.offset


class PythonCounterModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # HAZARD: python_state
        return x * 2


class GeneratorModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=self.generator)  # HAZARD: random_generator


class NoiseModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)  # HAZARD: random_op


class InputViewModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2]  # HAZARD: output_aliases_input


class SharedOutputsModel(nn.Module):
    def forward(self, x: torch.Tensor):
        hidden = x * 2
        return hidden, hidden[:, :1]  # HAZARD: outputs_alias


class BatchStatsModel(nn.Module):
    """Normalizes over the batch: padding rows change every real row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=0)  # HAZARD: rows_interact
        return centered * 2


class BatchSumModel(nn.Module):
    """Sums over the batch: the output has no batch dim, so padded calls cannot be cut (eager)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum(dim=0)  # HAZARD: unsliceable_output


class FixedBatchModel(nn.Module):
    """State with the batch baked in (like a StaticCache): padded batches do not fit."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.ones(BATCH, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias  # HAZARD: batch_not_padded


def no_batch_dim(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # HAZARD: no_batch_dim (a 0-d tensor has no batch dimension)


def raises(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("this step always raises")  # HAZARD: step_raised


class NumpyModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.numpy().max())  # HAZARD: host_sync
        return x * scale


class EqualModel(nn.Module):
    def forward(self, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        same = torch.equal(x, reference)  # HAZARD: host_sync
        return x * 2 if same else x + 1


class NestedMaskModel(nn.Module):
    """Packs the rows a mask keeps into a nested tensor (as nn.TransformerEncoder's fast path does)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        packed = torch._nested_tensor_from_mask(x, keep)  # HAZARD: host_sync
        return packed.to_padded_tensor(0.0, x.shape)


# ---- factories: (callable, example_args) -------------------------------------------------


def mlp():
    torch.manual_seed(0)
    return Mlp(), (_rows(),)


def kv_cache(device: str = "cpu"):
    """The model moved to ``device`` before it is wrapped: ``scratch_state`` names the tensor the step writes
    (a wrapper's ``.cuda()`` is the module's, which moves it into new tensors and returns the bare module)."""
    torch.manual_seed(0)
    model = KvCacheModel().to(device)
    return (wrap(model, max_batch_size=16, pad_values={"slots": model.scratch_slot}, scratch_state=[model.k_cache]),
            (_rows().to(device), torch.tensor([3, 5, 7, 9], device=device)))


def padded_store():
    return PaddedStoreModel(), (_rows(), torch.tensor([3, 5, 7, 9]))


def lengths():
    return TolistModel(), (_rows(), torch.tensor([3, 1, 4, 1]))


def unique_ids():
    return UniqueModel(), (_rows(), torch.tensor([3, 1, 3, 2]))


def numpy():
    return NumpyModel(), (_rows().abs(),)


def equal():
    return EqualModel(), (_rows(), _rows(seed=1))


def nested_mask():
    keep = torch.ones(BATCH, 3, dtype=torch.bool)
    keep[1:, 2] = False
    return NestedMaskModel(), (torch.randn(BATCH, 3, HIDDEN, generator=torch.Generator().manual_seed(0)), keep)


def input_write():
    return InputWriteModel(), (_rows(), torch.zeros(1))


def branch():
    x = _rows()
    x[0, 0], x[-1, -1] = 1.0, -1.0  # the rolled variant moves -1 to [0, 0]: the other branch
    return BranchModel(), (x,)


def no_batch():
    return no_batch_dim, (torch.tensor(2.0),)


def rows_only(model_class):
    """A factory for a model that takes one batch of rows."""
    return lambda: (model_class(), (_rows(),))


item = rows_only(ItemModel)
global_context = rows_only(GlobalContextModel)
nonzero = rows_only(NonzeroModel)
mask_index = rows_only(MaskIndexModel)
rebind = rows_only(RebindModel)
python_counter = rows_only(PythonCounterModel)
generator = rows_only(GeneratorModel)
noise = rows_only(NoiseModel)
input_view = rows_only(InputViewModel)
shared_outputs = rows_only(SharedOutputsModel)
batch_stats = rows_only(BatchStatsModel)
batch_sum = rows_only(BatchSumModel)
fixed_batch = rows_only(FixedBatchModel)


def raising():
    return raises, (_rows(),)


HAZARD_FACTORIES = {
    "item": item, "lengths": lengths, "nonzero": nonzero, "mask_index": mask_index, "unique_ids": unique_ids,
    "branch": branch, "input_write": input_write, "rebind": rebind, "python_counter": python_counter,
    "generator": generator, "noise": noise, "input_view": input_view, "shared_outputs": shared_outputs,
    "batch_stats": batch_stats, "batch_sum": batch_sum, "fixed_batch": fixed_batch,
    "no_batch": no_batch, "raising": raising, "numpy": numpy, "equal": equal, "nested_mask": nested_mask,
    "padded_store": padded_store, "global_context": global_context,
}
