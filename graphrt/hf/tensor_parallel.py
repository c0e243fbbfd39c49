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

A wrapped model (a PEFT model, any module holding the transformers model) is sharded by the plan of the
transformers model inside it, matched under that model's path (``base_model.model.`` in a PEFT model); a
plan none of whose entries matches a module is refused ("no plan entry matched"), never left unapplied.
A LoRA layer under a ``colwise`` or ``rowwise`` entry is sharded as PEFT shards it on a sharded model: its
base layer by the entry, ``lora_B`` by a ``colwise`` one (each rank its rows of the update) and ``lora_A``
by a ``rowwise`` one (its columns, the low-rank activations all-reduced); other adapter layers under a plan
entry are refused by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

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
    what cannot be sharded: no plan, a plan none of whose entries matches a module, a style graphrt cannot record,
    an adapter it cannot shard, heads the ranks do not divide; nothing is sharded then."""
    name = type(model).__name__
    ranks = tuple(dist.get_process_group_ranks(group))
    done: Optional[Sharding] = getattr(model, ATTRIBUTE, None)
    if done is not None:
        if done.ranks != ranks:
            raise ValueError(f"model: {name} is sharded over ranks {list(done.ranks)}, not process_group's {list(ranks)}")
        return done
    prefix, plan = _plan_owner(model)
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
    for path, module_name, module, style_name, param_styles in _planned(model, name, prefix, plan, tensor_parallel):
        if style_name is not None and hasattr(module, "base_layer"):
            _shard_adapter(module, path, style_name, styles, mesh, applied)
            continue
        if style_name == VOCAB_EMBEDDING:
            _vocab_parallel_embedding(module, module_name, mesh, group, rank, len(ranks))
            applied[path] = style_name
            continue
        for param_name, param_style in param_styles.items():
            style = styles["colwise" if param_style == GATHERED_HEAD else param_style]
            style.validate_param(module, param_name, mesh, parameter_name=_joined(module_name, param_name))
            style.shard_param(module, param_name, mesh)
            applied[_joined(path, param_name)] = param_style
        if style_name is not None:
            styles["colwise" if style_name == GATHERED_HEAD else style_name].install_forward(module, mesh)
            if style_name == GATHERED_HEAD:
                _gather_vocab(module, group, len(ranks))
            applied[path] = style_name
    sharding = Sharding(ranks, rank, tuple(applied.items()))
    setattr(model, ATTRIBUTE, sharding)
    logger.info("rank %d of %d: %s sharded by %d plan entries", rank, len(ranks), name, len(applied))
    return sharding


def _plan_owner(model: torch.nn.Module) -> Tuple[str, Dict[str, str]]:
    """The path of the module whose tensor-parallel plan shards ``model``, and that plan: the outermost
    transformers model with a plan inside ``model`` (a wrapper such as a PEFT model holds it under a prefix),
    else ``model``'s own ``tp_plan``."""
    from transformers import PreTrainedModel

    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            plan = dict(getattr(module, "tp_plan", None) or {})
            if plan:
                return path, plan
    return "", dict(getattr(model, "tp_plan", None) or {})


def _under(prefix: str, path: str) -> Optional[str]:
    """``path`` relative to the module at ``prefix`` ("" for that module itself), or None outside it."""
    if not prefix:
        return path
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else None


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _planned(model: torch.nn.Module, name: str, prefix: str, plan: Dict[str, str],
             tensor_parallel: Any) -> List[Tuple[str, str, torch.nn.Module, Optional[str], Dict[str, str]]]:
    """Every module the plan matches under ``prefix``: (its path, its name in the plan's model, the module, its
    style or None, its own parameters' styles), checked before anything is sharded: ValueError naming a module
    whose type the style cannot shard, or a plan none of whose entries matched."""
    planned = []
    for path, module in model.named_modules():
        module_name = _under(prefix, path)
        if module_name is None:
            continue
        style_name = _rule(module_name, plan, tensor_parallel, is_weight=False)
        if style_name is not None and hasattr(module, "base_layer"):  # an adapter layer (PEFT) over the planned module
            _check_adapter(module, f"{name}.{path}", style_name)
            planned.append((path, module_name, module, style_name, {}))
            continue
        if style_name in LINEAR_ONLY and not isinstance(module, torch.nn.Linear):
            raise ValueError(f"model: {name}.{path} is a {type(module).__name__} under the plan's "
                             f"{style_name!r}, whose local path is nn.Linear's")
        if style_name == VOCAB_EMBEDDING and not isinstance(module, torch.nn.Embedding):
            raise ValueError(f"model: {name}.{path} is a {type(module).__name__} under the plan's {VOCAB_EMBEDDING!r}, "
                             "which shards an nn.Embedding's vocabulary")
        param_styles = {} if style_name == VOCAB_EMBEDDING else {
            param_name: style for param_name, style in
            ((param_name, _rule(_joined(module_name, param_name), plan, tensor_parallel, is_weight=True))
             for param_name, param in module._parameters.items() if param is not None) if style is not None}
        if style_name is not None or param_styles:
            planned.append((path, module_name, module, style_name, param_styles))
    if not planned:
        where = f" under {prefix!r}" if prefix else ""
        raise ValueError(f"model: {name}: no plan entry matched its modules{where} (the plan names "
                         f"{', '.join(sorted(plan)[:3])}, ...); nothing would be sharded over process_group")
    return planned


def _check_adapter(module: torch.nn.Module, described: str, style_name: str) -> None:
    """ValueError naming ``module`` (an adapter layer over a planned module) unless it is a plain PEFT LoRA
    layer over an ``nn.Linear`` under ``colwise`` or ``rowwise``."""
    base = module.base_layer
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    plain = (isinstance(base, torch.nn.Linear) and isinstance(lora_a, torch.nn.ModuleDict)
             and isinstance(lora_b, torch.nn.ModuleDict) and not getattr(module, "lora_variant", None)
             and not any(dict(getattr(module, "use_dora", None) or {}).values())
             and all(isinstance(layer, torch.nn.Linear) for layer in (*lora_a.values(), *lora_b.values())))
    if style_name not in ("colwise", "rowwise") or not plain:
        raise ValueError(f"model: {described} is a {type(module).__module__}.{type(module).__name__} adapter over a "
                         f"{type(base).__name__} under the plan's {style_name!r}; graphrt shards LoRA adapters over "
                         "nn.Linear (no DoRA or other variant) under 'colwise' and 'rowwise' only: merge the adapter "
                         "into the weights (merge_and_unload()) or serve the model on one rank")


def _shard_adapter(module: torch.nn.Module, path: str, style_name: str, styles: Any, mesh: Any,
                   applied: Dict[str, str]) -> None:
    """A PEFT LoRA layer under a ``colwise``/``rowwise`` entry (``_check_adapter``), sharded as PEFT shards one on
    a sharded model: its base layer by the entry; ``lora_B`` by ``colwise`` (its rows: this rank's part of the
    update, beside the base layer's output shard), ``lora_A`` by ``rowwise`` (its columns of the sharded input:
    the low-rank activations all-reduced, ``lora_B`` whole)."""
    style = styles[style_name]
    side = "lora_B" if style_name == "colwise" else "lora_A"
    layers = [(f"{path}.base_layer", module.base_layer),
              *((f"{path}.{side}.{adapter}", layer) for adapter, layer in getattr(module, side).items())]
    for layer_path, layer in layers:
        for param_name, param in list(layer._parameters.items()):
            if param is None:
                continue
            style.validate_param(layer, param_name, mesh, parameter_name=_joined(layer_path, param_name))
            style.shard_param(layer, param_name, mesh)
            applied[_joined(layer_path, param_name)] = style_name
        style.install_forward(layer, mesh)
    applied[path] = style_name


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
