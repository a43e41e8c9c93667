"""A DeepSpeed engine's layout: what each rank holds of each parameter (ZeRO-1/2 flat groups, ZeRO-3
partitions, pipeline stages, MoE experts, ties), read from the engine's own objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol.distributed import Comm
from ..errors import CheckpointError, LayoutError
from ..protocol.fragments import FlatShard


# ---------------------------------------------------------------------------------------------
# The engine's layout: what each rank holds of each parameter
# ---------------------------------------------------------------------------------------------


@dataclass
class _Param:
    """One trainable parameter's fragment on this rank."""

    name: str
    shape: tuple[int, ...]
    flat: int
    """Index of its flat fp32 partition (ZeRO-1/2 param group, ZeRO-3 sub-group)."""
    start: int
    """The first element held (row-major flat index into the consolidated parameter)."""
    hp_offset: int
    """Where that element is in the flat fp32 partition."""
    hp: torch.Tensor
    """View of the fp32 partition (``numel`` = elements held here, possibly 0)."""
    lp: torch.Tensor
    """View of the low-precision (training dtype) copy of the same elements."""


@dataclass
class _Layout:
    kind: str
    """``"zero12"``, ``"bf16"`` (DeepSpeed's BF16_Optimizer) or ``"zero3"``."""
    engine: Any
    optimizer: Any
    base: Any
    """The wrapped torch optimizer (its ``state`` is keyed by the flat fp32 partitions)."""
    group: Any
    rank: int
    world: int
    params: list[_Param]
    hp_flats: list[torch.Tensor]
    flat_group: list[int]
    """Param group index of each flat partition."""
    group_names: list[list[str]]
    """Per param group, its parameters on every rank (every stage, every expert)."""
    dp_world: int
    """The data-parallel world size (the engine's ``dp_world_size``)."""
    dp_rank: int = 0
    """This rank's place among its data-parallel replicas (0: it saves the buffers, as DeepSpeed does)."""
    frozen: dict[str, Any] = field(default_factory=dict)
    """name -> a plain tensor (held whole) or a FlatShard (ZeRO-3 partition)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied copies: alias name -> the name DeepSpeed stores it under."""
    not_written: set[str] = field(default_factory=set)
    """Parameters this rank loads but leaves to another to save (a pipeline tie's later stages)."""
    elsewhere: set[str] = field(default_factory=set)
    """Parameters and buffers only other ranks hold (other pipeline stages, other experts)."""


def _layout(engine: Any) -> _Layout:
    import torch.distributed as dist

    opt = getattr(engine, "optimizer", None)
    if opt is None:
        raise CheckpointError("the engine has no optimizer: use ucp_zarr.save/load on engine.module instead")
    pipeline = _is_pipeline(engine)
    if _tensor_parallel_size(engine, pipeline) > 1:
        raise CheckpointError("tensor-parallel DeepSpeed engines (AutoTP, or pipeline x tensor parallelism) are not "
                              "supported by the adapter: save with engine.save_checkpoint and ucp_zarr.convert it")
    unsaved = [what for what, on in (
        ("the curriculum learning data sampler", getattr(engine, "training_dataloader", None) is not None
         and _enabled(engine, "curriculum_learning_enabled")),
        ("the random-LTD scheduler", _enabled(engine, "random_ltd_enabled"))) if on]
    if unsaved:
        raise CheckpointError(f"the engine's state includes {' and '.join(unsaved)} (DeepSpeed's data efficiency), which "
                              "the adapter does not save or restore: a resume would start it over. Save and resume with "
                              "DeepSpeed's own save_checkpoint/load_checkpoint")
    moe = bool(getattr(engine, "has_moe_layers", False))
    if moe and pipeline:
        raise CheckpointError("DeepSpeed MoE layers inside a pipeline engine are not supported")
    if moe and hasattr(opt, "fp32_partitioned_groups_flat"):
        raise CheckpointError("DeepSpeed MoE engines with ZeRO stage 3 are not supported (stages 1 and 2 are)")
    base = getattr(opt, "optimizer", None)
    names: dict[Any, str] = _global_names(engine) if moe else engine.param_names
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        kind, params, hp_flats, flat_group, group = _zero3(opt, names)
    elif hasattr(opt, "single_partition_of_fp32_groups"):
        offsets = getattr(opt, "round_robin_bit16_offsets", None)
        kind = "zero12"
        params, hp_flats, flat_group, group = _flat12(
            opt, names, opt.round_robin_bit16_groups, offsets, opt.bit16_groups_flat, opt.single_partition_of_fp32_groups,
            opt.bit16_groups)
    elif hasattr(opt, "fp32_groups_flat_partition"):
        kind = "bf16"
        params, hp_flats, flat_group, group = _flat12(
            opt, names, opt.bf16_groups, None, opt.bf16_groups_flat, opt.fp32_groups_flat_partition, opt.bf16_groups)
    else:
        raise CheckpointError(f"unsupported DeepSpeed optimizer {type(opt).__name__}: ZeRO-1/2/3 or BF16_Optimizer "
                              "(no ZeRO, or ZeRO stage 0 with fp32/fp16, has no partitioned fp32 masters to save)")
    if base is None:
        raise CheckpointError(f"{type(opt).__name__} wraps no torch optimizer")
    trainable = {p.name for p in params}
    dp_world, dp_rank = dist.get_world_size(group), dist.get_rank(group)
    if pipeline:
        group = None  # every stage writes into one checkpoint
    group_names: list[list[str]] = [[] for _ in base.param_groups]
    for p in params:
        group_names[flat_group[p.flat]].append(p.name)
    layout = _Layout(kind, engine, opt, base, group, dist.get_rank(group), dist.get_world_size(group), params, hp_flats,
                     flat_group, group_names, dp_world, dp_rank)
    refusal = _untied(engine, [p.name for p in params]) if pipeline else None
    if pipeline:
        layout.not_written = {p.name for p in params if not _writes_tie(engine, p.name)}
    module = engine.module
    held = {id(t) for t in _trainable_tensors(layout)}
    for name, prm in module.named_parameters():
        canon = names.get(prm, name)
        if canon in trainable or id(prm) in held:
            continue
        if kind == "zero3" and hasattr(prm, "ds_tensor"):
            layout.frozen[canon] = _zero3_frozen(prm)
        else:
            layout.frozen[canon] = prm.data
    for name, prm in module.named_parameters(remove_duplicate=False):
        if engine.param_names.get(prm, name) != name:  # a second name of a parameter (experts renamed are not)
            layout.aliases[name] = names[prm]
    experts = _expert_prefixes(engine) if moe else {}
    for mod_name, mod in module.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                layout.buffers[_globally(f"{mod_name}.{bname}" if mod_name else bname, experts)] = buf
    if pipeline or moe:  # what the other stages and expert-parallel ranks hold
        _learn_others(layout, refusal)
    return layout


def _enabled(engine: Any, feature: str) -> bool:
    """``engine.<feature>()`` (DeepSpeed's ``random_ltd_enabled`` and the like), False where absent."""
    check = getattr(engine, feature, None)
    return bool(check()) if callable(check) else False


def _is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.module import PipelineModule

    return isinstance(getattr(engine, "module", None), PipelineModule)


def _tensor_parallel_size(engine: Any, pipeline: bool) -> int:
    """The engine's tensor-parallel degree (``mp_world_size`` counts pipeline stages too)."""
    mp = int(getattr(engine, "mp_world_size", 1) or 1)
    return mp // max(1, int(engine.num_stages)) if pipeline else mp


def _writes_tie(engine: Any, name: str) -> bool:
    """Whether this rank saves parameter or buffer ``name``: one of a module tied across
    pipeline stages (``tied_modules.<key>.*``) is saved by the first stage of its tie group only."""
    import torch.distributed as dist

    if not name.startswith("tied_modules."):
        return True
    tie = getattr(engine.module, "tied_comms", {}).get(name[len("tied_modules."):].partition(".")[0])
    return tie is None or dist.get_rank() == min(tie["ranks"])


def _untied(engine: Any, names: list[str]) -> str | None:
    """Why a parameter of a module tied across pipeline stages cannot be saved, where DeepSpeed
    does not tie it (not in its ``tied_weight_attr``): each stage trains its own copy under one
    name, which one consolidated tensor cannot hold (saved once, the other stages' were lost)."""
    for name in names:
        if not name.startswith("tied_modules."):
            continue
        key, _, attr = name[len("tied_modules."):].partition(".")
        tie = engine.module.tied_comms.get(key)
        if tie is not None and attr not in tie["weight_attr"]:
            return (f"parameter {name!r} of the module {key!r} tied across the pipeline stages of ranks {tie['ranks']} "
                    f"is not tied (its tied_weight_attr is {list(tie['weight_attr'])}): each stage trains its own copy "
                    "under this one name, which one consolidated tensor cannot hold; list it in the TiedLayerSpec's "
                    "tied_weight_attr, or keep it out of the tied module")
    return None


def _expert_prefixes(engine: Any) -> dict[str, str]:
    """Each local expert's name prefix -> its global one: a MoE layer's local expert ``j`` on
    expert-parallel rank ``e`` is expert ``e * num_local_experts + j`` (DeepSpeed's expert
    files)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    out: dict[str, str] = {}
    for mod_name, mod in engine.module.named_modules():
        if not isinstance(mod, MoE):
            continue
        first = groups._get_expert_parallel_rank(mod.expert_group_name) * mod.num_local_experts
        prefix = f"{mod_name}.deepspeed_moe.experts.deepspeed_experts." if mod_name else "deepspeed_moe.experts.deepspeed_experts."
        for j in range(len(mod.deepspeed_moe.experts.deepspeed_experts)):
            out[f"{prefix}{j}."] = f"{prefix}{first + j}."
    return out


def _globally(name: str, experts: dict[str, str]) -> str:
    """``name``, an expert's under its global index (``experts``: :func:`_expert_prefixes`)."""
    local = next((p for p in experts if name.startswith(p)), None)
    return name if local is None else experts[local] + name[len(local):]


def _global_names(engine: Any) -> dict[Any, str]:
    """Parameter -> name, experts under their global index (:func:`_expert_prefixes`)."""
    experts = _expert_prefixes(engine)
    return {prm: _globally(name, experts) for prm, name in engine.param_names.items()}


def _learn_others(layout: _Layout, refusal: str | None = None) -> None:
    """``group_names`` of every rank of the group (in rank order) and ``elsewhere``: the
    parameters and buffers other ranks hold (collective); a ``refusal`` of any rank raised on
    every rank (:class:`LayoutError`)."""
    mine = set(layout.frozen) | set(layout.buffers) | set(layout.aliases) | {p.name for p in layout.params}
    groups: list[list[str]] = [[] for _ in layout.group_names]
    everyone: set[str] = set()
    gathered = Comm(layout.group).all_gather((layout.group_names, sorted(mine), refusal))
    refused = next((r for *_, r in gathered if r is not None), None)
    if refused is not None:
        raise LayoutError(refused)
    for theirs, names, _ in gathered:
        if len(theirs) != len(groups):
            raise CheckpointError(f"ranks hold {len(theirs)} and {len(groups)} optimizer param groups")
        for into, more in zip(groups, theirs):
            into += [n for n in more if n not in into]
        everyone.update(names)
    layout.group_names, layout.elsewhere = groups, everyone - mine


def _trainable_tensors(layout: _Layout) -> list[Any]:
    if layout.kind == "zero3":
        return [p for g in layout.optimizer.fp16_groups for p in g]
    groups = layout.optimizer.bit16_groups if layout.kind == "zero12" else layout.optimizer.bf16_groups
    return [p for g in groups for p in g]


def _flat12(opt: Any, names: dict[Any, str], flat_order: list[list[Any]], offsets: list[list[int]] | None,
            lp_flats: list[torch.Tensor], hp_flats: list[torch.Tensor],
            model_order: list[list[Any]]) -> tuple[list[_Param], list[torch.Tensor], list[int], Any]:
    """ZeRO-1/2 and BF16_Optimizer: each param group is one flat vector (parameters at their
    offsets in flat order), cut into one equal partition per rank of the group's partition
    group (``real_dp_process_group``); this rank's fp32 partition covers
    ``[rank * size, (rank + 1) * size)``."""
    import torch.distributed as dist

    group = opt.dp_process_group
    params: list[_Param] = []
    for i, tensors in enumerate(flat_order):
        pg = opt.real_dp_process_group[i]  # the data-parallel group, or a MoE group's expert-data-parallel one
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        lp_flat, hp_flat = lp_flats[i], hp_flats[i]
        size = lp_flat.numel() // world
        if hp_flat.numel() != size:
            raise CheckpointError(f"param group {i}: the fp32 partition holds {hp_flat.numel()} elements, expected "
                                  f"{size} ({lp_flat.numel()} / {world} ranks)")
        lo, hi = rank * size, (rank + 1) * size
        if offsets is not None:
            offs = list(offsets[i])
        else:
            offs, at = [], 0
            for t in tensors:
                offs.append(at)
                at += t.numel()
        by_id: dict[int, _Param] = {}
        for t, off in zip(tensors, offs):
            numel = t.numel()
            a, b = max(off, lo), min(off + numel, hi)
            if a >= b:
                a = b = lo  # nothing held here: an empty view
                start = 0
            else:
                start = a - off
            by_id[id(t)] = _Param(names[t], tuple(t.shape), i, start, a - lo, hp_flat.narrow(0, a - lo, b - a),
                                  lp_flat.narrow(0, a, b - a))
        params += [by_id[id(t)] for t in model_order[i]]
    return params, list(hp_flats), list(range(len(flat_order))), group


def _zero3(opt: Any, names: dict[Any, str]) -> tuple[str, list[_Param], list[torch.Tensor], list[int], Any]:
    """ZeRO-3: each parameter is padded to ``world * partition_numel`` and cut into equal
    partitions; a sub-group's flat partition is its parameters' partitions one after the other."""
    import torch.distributed as dist

    if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
        raise CheckpointError("ZeRO-3 with NVMe swapping of parameters or optimizer states is not supported")
    group = opt.dp_process_group
    world = dist.get_world_size(group)
    params: list[_Param] = []
    flat_group: list[int] = []
    for sg, sub in enumerate(opt.fp16_groups):
        pg = opt._get_sub_group_process_group(sg) if hasattr(opt, "_get_sub_group_process_group") else group
        if dist.get_world_size(pg) != world:
            raise CheckpointError(f"ZeRO-3 sub-group {sg} is partitioned over another group than the data-parallel group")
        rank = dist.get_rank(pg)
        hp_flat, lp_flat = opt.fp32_partitioned_groups_flat[sg], opt.fp16_partitioned_groups_flat[sg]
        if lp_flat is None:
            raise CheckpointError("ZeRO-3 parameters swapped to NVMe are not supported")
        off = 0
        for p in sub:
            part, numel = p.partition_numel(), p.ds_numel
            held = max(0, min(part, numel - rank * part))
            params.append(_Param(names[p], tuple(p.ds_shape), sg, rank * part if held else 0, off,
                                 hp_flat.narrow(0, off, held), lp_flat.narrow(0, off, held)))
            off += part
        if off != hp_flat.numel():
            raise CheckpointError(f"ZeRO-3 sub-group {sg}: its parameters' partitions hold {off} elements, its fp32 "
                                  f"partition {hp_flat.numel()}")
        flat_group.append(int(opt.sub_group_to_group_id[sg]))
    return "zero3", params, list(opt.fp32_partitioned_groups_flat), flat_group, group


def _zero3_frozen(p: Any) -> FlatShard:
    import torch.distributed as dist

    pg = getattr(p, "ds_process_group", None)
    rank = dist.get_rank(pg)
    part, numel = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel(), p.ds_numel
    held = max(0, min(part, numel - rank * part))
    return FlatShard(p.ds_tensor.data.reshape(-1).narrow(0, 0, held), tuple(p.ds_shape), rank * part if held else 0)
