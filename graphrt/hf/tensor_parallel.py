"""A Hugging Face model sharded over a process group by its own tensor-parallel plan, for the engine path.

``shard_model(model, group)`` applies the model's plan (``model.tp_plan``: its config's
``base_model_tp_plan`` and its class's ``_tp_plan``) with transformers' own parallel styles (its
``ALL_PARALLEL_STYLES``: each style shards its parameters as DTensors, each rank keeping its shard, and
wraps the module's forward), as ``from_pretrained(tp_plan="auto")`` does. graphrt records a step's aten
ops (and CUDA-graphs its kernels), so a sharded module must compute on local tensors with plain
collectives: under ``no_grad`` transformers' ``colwise``/``rowwise`` linear layers, packed and MoE-expert
styles do (the ``rowwise`` output's ``dist.all_reduce`` is recorded inside the graph). Two styles compute
through DTensor dispatch instead, which reaches graphrt's recording as one DTensor op it cannot look
into: ``embedding_rowwise`` (a vocab-parallel embedding) runs here as DTensor runs it locally (each rank
looks up its own rows, masks the others to zero and the ranks' lookups are all-reduced: torch's
``MaskPartial``), and ``colwise_gather_output`` (a vocab-parallel head) as ``colwise`` with the vocab
shards gathered at the head's output (``all_gather_into_tensor``), so sampling sees the whole vocabulary.
Other styles, and attention heads the ranks do not divide, are refused by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Styles whose forward runs on local tensors under no_grad (or has no forward): applied as transformers has them.
LOCAL_STYLES = frozenset({"colwise", "rowwise", "packed_colwise", "packed_rowwise", "moe_tp_experts",
                          "replicated_with_grad_allreduce", "replicate", "local_params"})
VOCAB_EMBEDDING, GATHERED_HEAD = "embedding_rowwise", "colwise_gather_output"
LINEAR_ONLY = frozenset({"colwise", "rowwise", GATHERED_HEAD})  # their local path is nn.Linear's
KEY_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "query_key_value")
ATTRIBUTE = "_graphrt_sharding"  # set on a sharded model: the Sharding it was sharded with


@dataclass(frozen=True)
class Sharding:
    """How a model was sharded: the group's global ranks, this rank's index in it, the styles applied."""

    ranks: Tuple[int, ...]
    rank: int
    rules: Tuple[Tuple[str, str], ...]  # (plan entry, style) as applied


def shard_model(model: torch.nn.Module, group: Any) -> Sharding:
    """Shard ``model`` in place over ``group`` by its tensor-parallel plan (every rank calls it on the same
    unsharded model); the ``Sharding`` of a model already sharded over the same ranks. ValueError naming
    what cannot be sharded: no plan, a style graphrt cannot record, heads the ranks do not divide."""
    name = type(model).__name__
    ranks = tuple(dist.get_process_group_ranks(group))
    done: Optional[Sharding] = getattr(model, ATTRIBUTE, None)
    if done is not None:
        if done.ranks != ranks:
            raise ValueError(f"model: {name} is sharded over ranks {list(done.ranks)}, not process_group's {list(ranks)}")
        return done
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"model: {name} has no tensor-parallel plan (its config's base_model_tp_plan, its "
                         "_tp_plan): nothing says how to shard it over process_group")
    unknown = sorted({style for style in plan.values() if style not in LOCAL_STYLES | {VOCAB_EMBEDDING, GATHERED_HEAD}})
    if unknown:
        raise ValueError(f"model: {name}'s tensor-parallel plan uses {', '.join(map(repr, unknown))}, which compute "
                         "through DTensor operations graphrt cannot record; the engine serves the styles "
                         f"{', '.join(sorted(LOCAL_STYLES | {VOCAB_EMBEDDING, GATHERED_HEAD}))}")
    _check_heads(model, plan, len(ranks))
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed import tensor_parallel

    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    styles = tensor_parallel.ALL_PARALLEL_STYLES
    rank = dist.get_rank(group)
    applied: Dict[str, str] = {}
    for module_name, module in model.named_modules():
        style_name = _rule(module_name, plan, tensor_parallel, is_weight=False)
        if style_name in LINEAR_ONLY and not isinstance(module, torch.nn.Linear):
            raise ValueError(f"model: {name}.{module_name} is a {type(module).__name__} under the plan's "
                             f"{style_name!r}, whose local path is nn.Linear's")
        if style_name == VOCAB_EMBEDDING:
            _vocab_parallel_embedding(module, module_name, mesh, group, rank, len(ranks))
            applied[module_name] = style_name
            continue
        for param_name in list(module._parameters):
            full = f"{module_name}.{param_name}" if module_name else param_name
            param_style = _rule(full, plan, tensor_parallel, is_weight=True)
            if param_style is None or module._parameters[param_name] is None:
                continue
            style = styles["colwise" if param_style == GATHERED_HEAD else param_style]
            style.validate_param(module, param_name, mesh, parameter_name=full)
            style.shard_param(module, param_name, mesh)
            applied[full] = param_style
        if style_name is not None:
            styles["colwise" if style_name == GATHERED_HEAD else style_name].install_forward(module, mesh)
            if style_name == GATHERED_HEAD:
                _gather_vocab(module, group, len(ranks))
            applied[module_name] = style_name
    sharding = Sharding(ranks, rank, tuple(applied.items()))
    setattr(model, ATTRIBUTE, sharding)
    logger.info("rank %d of %d: %s sharded by %d plan entries", rank, len(ranks), name, len(applied))
    return sharding


def _rule(name: str, plan: Dict[str, str], tensor_parallel: Any, is_weight: bool) -> Optional[str]:
    """The plan's style for a module (or, ``is_weight``, a parameter: its own entry, else its module's), as
    transformers matches it (layer numbers as ``*``)."""
    generic = tensor_parallel.replace_layer_number_by_wildcard(name)
    if generic in plan:
        return plan[generic]
    if is_weight and "." in generic:
        return plan.get(generic.rsplit(".", 1)[0])
    return None


def _check_heads(model: torch.nn.Module, plan: Dict[str, str], world_size: int) -> None:
    """ValueError when the plan shards the key projections (so every rank must hold whole KV heads and whole
    groups of query heads) and the ranks do not divide the KV heads or the query heads."""
    if not any(entry.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style in ("colwise", "packed_colwise")
               for entry, style in plan.items()):
        return
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for field, count in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads)):
        if count % world_size:
            raise ValueError(f"model: {type(model).__name__} has {field}={count}, which {world_size} ranks do not "
                             "divide; its plan shards the attention heads, so each rank must hold whole KV heads "
                             "and their query heads (serve it on a number of ranks that divides both)")


def _vocab_parallel_embedding(module: torch.nn.Module, path: str, mesh: Any, group: Any, rank: int,
                              world_size: int) -> None:
    """``module`` (an embedding) keeps its rows of the vocabulary (DTensor's ``Shard(0)``: ``torch.chunk``'s
    split), looks up the ids in them, zeroes the rows of ids it does not hold and all-reduces: every rank
    gets every token's embedding, as DTensor's vocab-parallel lookup (``MaskPartial``) computes it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if not isinstance(module, torch.nn.Embedding):
        raise ValueError(f"model: {path} is a {type(module).__name__} under the plan's {VOCAB_EMBEDDING!r}, "
                         "which shards an nn.Embedding's vocabulary")
    vocab = module.weight.shape[0]
    shard = distribute_tensor(module.weight.detach(), mesh, [Shard(0)], src_data_rank=None).to_local()
    start = min(rank * -(-vocab // world_size), vocab)
    rows = shard.shape[0]
    module.weight = torch.nn.Parameter(shard, requires_grad=False)
    module.padding_idx = None  # it only masks gradients, and may lie outside this rank's rows
    original = module.forward

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - start
        outside = (local < 0) | (local >= rows)
        out = original(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=group)
        return out

    module.forward = forward


def _gather_vocab(module: torch.nn.Module, group: Any, world_size: int) -> None:
    """``module`` (a ``colwise`` head: this rank's slice of the vocabulary, ``torch.chunk``'s split, the last
    shorter) returns the whole vocabulary: the slices padded to one size, gathered and laid side by side."""
    original = module.forward
    vocab = module.out_features
    chunk = -(-vocab // world_size)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name since torch 2.12

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        local = original(*args, **kwargs)
        if local.shape[-1] != chunk:
            local = torch.nn.functional.pad(local, (0, chunk - local.shape[-1]))
        gathered = local.new_empty((world_size * local.numel(),))
        gather(gathered, local.reshape(-1), group=group)
        whole = torch.cat(gathered.view(world_size, *local.shape).unbind(0), dim=-1)
        return whole if whole.shape[-1] == vocab else whole[..., :vocab]

    module.forward = forward


__all__ = ["ATTRIBUTE", "LOCAL_STYLES", "Sharding", "shard_model"]
