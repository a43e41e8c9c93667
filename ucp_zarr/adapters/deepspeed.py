"""A running DeepSpeed engine saved straight into the universal format, and loaded back into
an engine of any world size and ZeRO stage: no ``ds_to_universal`` step, no temporary files.

.. code-block:: python

    from ucp_zarr.adapters import deepspeed as ucp_ds

    ucp_ds.save_checkpoint(engine, "ckpt/step_1000", client_state={"epoch": 3})
    ...
    client_state = ucp_ds.load_checkpoint(engine, "ckpt/step_1000")  # any world size, ZeRO-1/2/3

Both are collectives over the engine's data-parallel group: every rank calls them.

Each rank describes what it holds as :class:`~ucp_zarr.FlatShard` values (its ZeRO partition of
each parameter is a flat range of the consolidated parameter) whose local tensors ARE the
engine's own buffers (views into ZeRO's flat fp32 partitions, optimizer states and
low-precision partitions). Saving writes only those ranges; loading reads into the views in
place, only the chunks this rank's partition overlaps, and then lets DeepSpeed refresh the
low-precision weights from the fp32 masters, as its own ``load_universal`` path does.

Keys (the same as :mod:`ucp_zarr.converters.deepspeed` writes for an ``engine.save_checkpoint``
folder, so the two are interchangeable; tensors are equal bit for bit):

=====================================  ====================================================
``model.<name>``                       parameters in the training dtype (the fp32 master
                                       when training in fp32), frozen parameters, buffers,
                                       tied copies (``head.weight`` beside ``embed.weight``)
``optim.state.<name>.fp32``            the fp32 master, when training is not in fp32
``optim.state.<name>.<key>``           every optimizer state of the parameter's partition
                                       (``exp_avg``, ``momentum_buffer``...), and the group's
                                       scalars (``step``) per parameter
``optim.param_groups``                 one JSON value: hyper-parameters per group,
                                       ``params`` as names
``lr_scheduler``                       one JSON value: the scheduler's ``state_dict()``
``client_state.<key>``                 what the caller passed as ``client_state`` (JSON
                                       values, or tensors held whole)
``deepspeed.<key>``                    ``global_steps``, ``global_samples``,
                                       ``skipped_steps``, ``dp_world_size``, ``ds_config``,
                                       ``ds_version``, ``zero_stage``, ``loss_scaler``, ...
=====================================  ====================================================

The JSON values are stored under single keys (``lr_scheduler``, not ``lr_scheduler.last_epoch``)
as the converter stores them; :func:`ucp_zarr.save` flattens every mapping, so the save goes
through the same two calls as ``ucp_zarr.save`` (``saver.prepare(...).finish()``) with the
values added to what ``collect.collect`` gathered (see :func:`_save`).

DeepSpeed internals relied on (checked against DeepSpeed 0.19.8)
-----------------------------------------------------------------
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``round_robin_bit16_groups`` (flat order),
  ``round_robin_bit16_offsets`` (0.19; before, offsets are cumulative), ``bit16_groups_flat``,
  ``single_partition_of_fp32_groups``, ``real_dp_process_group``; the base optimizer's state
  keyed by the fp32 partition; after a load ``update_lp_params()`` (bit16 <- fp32 partition,
  all-gather) and the optimizer-state fragments re-linked
  (``_lazy_init_hp_params_optimizer_state``), as ``engine.load_checkpoint`` does after
  ``load_universal``. Fragments are computed from the flat layout, not from
  ``param._hp_mapping`` (which 0.19 links in model order even when ``round_robin_gradients``
  reorders the flat groups).
* ``BF16_Optimizer`` (ZeRO-1 with fp32 gradient accumulation, or bf16 without ZeRO):
  ``bf16_groups``, ``bf16_groups_flat``, ``fp32_groups_flat_partition``, ``update_lp_params()``.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``fp16_groups`` (sub-groups),
  ``fp16_partitioned_groups_flat`` / ``fp32_partitioned_groups_flat`` (each parameter's
  partition of ``partition_numel()`` elements, in order), ``sub_group_to_group_id``,
  ``param.ds_tensor`` for frozen parameters; after a load
  ``_reassign_or_swap_out_partitioned_parameters(i)`` (the post-step fp32 -> low-precision
  copy) between ``checkpoint_event_prologue`` / ``checkpoint_event_epilogue``.
  The offsets are those of ``set_grad_positions`` (cumulative ``partition_numel()``), which
  ``safe_get_local_fp32_param`` / ``safe_get_local_optimizer_state`` also use; those helpers are
  not used because they return a copy when the partition is offloaded (``.to(device)``),
  include the last partition's padding, and need the optimizer state to exist already.
* Missing optimizer states (an engine that has not stepped yet) are created as DeepSpeed's
  ``map_to_flat_opt_states`` does: zero flat tensors like the fp32 partition, then filled.

Pipeline engines (``deepspeed.pipe.PipelineModule``, ZeRO-0 in bf16 or ZeRO-1): parameters
are named by global layer index, so a checkpoint saved at one pipeline degree loads at
another; save and load are collectives over every stage (the world); a parameter tied across
stages (``tied_modules.*``) is written by the first stage holding it. MoE engines
(``deepspeed.moe.layer.MoE``, ZeRO-1/2): experts are stored under their global index (expert-
parallel rank x local experts + local index, as DeepSpeed names its expert files), each
group partitioned over its own (expert-)data-parallel group, so a checkpoint loads at another
expert-parallel degree. ``optim.param_groups`` lists every stage's and expert-parallel rank's
parameters.

Not supported: tensor parallelism (AutoTP; pipeline x tensor), MoE with ZeRO-3 or inside a
pipeline, ZeRO-3 NVMe swapping of parameters or optimizer states, asynchronous saves.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..protocol.loader import load as ucp_load
from ..protocol.saving import wait_for_pending_save
from ..protocol.reader import open_reader
from ..protocol.distributed import Comm
from ..format.dtypes import stored_dtype_by_name
from ..errors import KeyMismatchError, LayoutError, NotJSONableError
from ..protocol.fragments import FlatShard, PerRank
from ..protocol.collect import collect
from ..protocol.saver import SaveOptions, SaveResult, prepare
from ..format.statedict import from_json, holds_tensor, to_json
from ..io.factory import open_store
from .deepspeed_layout import _Layout, _Param, _layout, _writes_tie

log = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint"]

_SAVE_OPTIONS = ("chunk_bytes", "shard_bytes", "max_workers", "overwrite", "overwrite_incomplete", "lease_s", "hmac_key")
_ENGINE_VALUES = ("global_steps", "global_samples", "skipped_steps")
_OPTIMIZER_VALUES = ("dynamic_loss_scale", "overflow", "clip_grad", "partition_count")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def save_checkpoint(engine: Any, path: str | os.PathLike[str], *, client_state: Mapping[str, Any] | None = None,
                    **save_kwargs: Any) -> SaveResult:
    """Save ``engine`` (model, fp32 masters, optimizer, scheduler, counters, ``client_state``)
    at ``path`` in the universal format; every rank of the engine's data-parallel group calls it.

    Each rank writes only its own partition of every parameter and optimizer state. A failure
    on any rank fails the save on every rank, and no committed checkpoint is left behind.
    ``save_kwargs`` are those of :func:`ucp_zarr.save`: ``storage_options``, ``overwrite``,
    ``overwrite_incomplete``, ``hmac_key``, ``chunk_bytes``, ``shard_bytes``, ``max_workers``,
    ``lease_s`` (not ``async_save``: the buffers saved are the live ones, changed by the next step).
    Returns this rank's :class:`~ucp_zarr.protocol.saver.SaveResult`.
    """
    storage_options = save_kwargs.pop("storage_options", None)
    if save_kwargs.pop("async_save", False):
        raise TypeError("save_checkpoint: async_save is not supported (it would save the live ZeRO buffers, "
                        "which the next step changes)")
    unknown = sorted(set(save_kwargs) - set(_SAVE_OPTIONS))
    if unknown:
        raise TypeError(f"save_checkpoint: unexpected keyword arguments {unknown} (accepted: storage_options, "
                        f"{', '.join(_SAVE_OPTIONS)})")
    layout = _layout(engine)  # the same on every rank; raises (on every rank) for an unsupported engine
    return _save(lambda: _save_state(engine, layout, dict(client_state or {})), path, layout.group,
                 storage_options, SaveOptions(**save_kwargs))


def load_checkpoint(engine: Any, path: str | os.PathLike[str], *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, strict: bool = True, **load_kwargs: Any) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``engine`` and return its client state; every rank of
    the engine's data-parallel group calls it.

    The checkpoint may come from :func:`save_checkpoint` on any world size and ZeRO stage, or from
    ``ucp_zarr.convert`` of an ``engine.save_checkpoint`` folder. Each rank reads only what its
    partition needs, straight into the engine's fp32 partitions and optimizer states; then the
    low-precision weights are refreshed from the fp32 masters (one all-gather, as DeepSpeed does
    after a step). Masters come from ``optim.state.<name>.fp32``, else from ``model.<name>``
    (a checkpoint trained in fp32, or weights only).

    ``load_optimizer_states=False`` keeps the engine's optimizer states and hyper-parameters (the
    masters are still loaded); ``load_lr_scheduler_states=False`` keeps its scheduler. With
    ``strict``, a checkpoint tensor this engine has no place for, or a tensor it needs that the
    checkpoint lacks, raises :class:`~ucp_zarr.KeyMismatchError` before anything is read.
    ``load_kwargs``: ``storage_options``, ``hmac_key``, ``max_workers``, ``allow_lossy_cast``
    (as for :func:`ucp_zarr.load`).
    """
    allowed = {"storage_options", "hmac_key", "max_workers", "allow_lossy_cast"}
    unknown = sorted(set(load_kwargs) - allowed)
    if unknown:
        raise TypeError(f"load_checkpoint: unexpected keyword arguments {unknown} (accepted: {sorted(allowed)})")
    layout = _layout(engine)
    comm = Comm(layout.group)
    _prologue(layout)
    plan: _LoadPlan | None = None
    error: BaseException | None = None
    try:
        ck = open_reader(path, storage_options=load_kwargs.get("storage_options"), hmac_key=load_kwargs.get("hmac_key"))
        plan = _load_plan(layout, ck, load_optimizer_states, strict)
    except BaseException as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    comm.agree(error, f"preparing to load {path}", own=True)
    assert plan is not None
    error = None
    try:
        # (the plan checked the keys; values are read from the plan, not through load)
        ucp_load(plan.tensors, path, strict=False, return_incompatible_keys=True, process_group=layout.group, **load_kwargs)
        for fn in plan.after:
            fn()
    except BaseException as e:  # noqa: BLE001
        error = e
    comm.agree(error, f"loading {path}", own=True)
    # refresh the low-precision weights from the masters (collective) and the engine's counters
    _refresh(layout, optimizer_states=load_optimizer_states and plan.loaded_optimizer)
    _epilogue(layout)
    values = plan.values
    for key in _ENGINE_VALUES:
        if f"deepspeed.{key}" in values and hasattr(engine, key):
            setattr(engine, key, values[f"deepspeed.{key}"])
    if "deepspeed.global_samples" not in values and "deepspeed.global_steps" in values:
        engine.global_samples = values["deepspeed.global_steps"] * engine.train_batch_size()
    if "deepspeed.dp_world_size" in values:
        engine.loaded_checkpoint_dp_world_size = values["deepspeed.dp_world_size"]
    if "deepspeed.mp_world_size" in values:
        engine.loaded_checkpoint_mp_world_size = values["deepspeed.mp_world_size"]
    _restore_loss_scaler(layout.optimizer, values.get("deepspeed.loss_scaler"))
    if load_lr_scheduler_states and getattr(engine, "lr_scheduler", None) is not None:
        sched = values.get("lr_scheduler")
        if sched is not None:
            engine.lr_scheduler.load_state_dict(_like(engine.lr_scheduler.state_dict(), sched))
    return plan.client_state


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _save(build: Callable[[], tuple[dict[str, Any], dict[str, Any]]], path: str | os.PathLike[str], group: Any,
          storage_options: dict[str, Any] | None, options: SaveOptions) -> SaveResult:
    """``ucp_zarr.save`` of the tensors ``build()`` returns, plus its JSON values each under its
    own key, unflattened (``ucp_zarr.save`` flattens every mapping: ``lr_scheduler`` would be
    stored as ``lr_scheduler.<field>``, unlike the converter). ``build`` runs inside the save's
    first agreement, so an error there fails the save on every rank."""
    wait_for_pending_save()

    def collected() -> Any:
        tensors, values = build()
        col = collect(tensors)
        for key, value in values.items():
            if key in col.values or key in col.fragments:
                raise LayoutError(f"key {key!r} is both a value and a tensor of the state")
            col.values[key] = to_json(value, key)
        return col

    return prepare(collected, open_store(path, storage_options), Comm(group), options, copy=False).finish()


def _save_state(engine: Any, layout: _Layout, client_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's tensors (FlatShard views of the engine's buffers) and the JSON values."""
    from ..converters.base import plain

    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    state = layout.base.state
    for p in layout.params:
        if p.name in layout.not_written:
            continue
        master = FlatShard(p.hp, p.shape, p.start)
        if p.lp.dtype == p.hp.dtype:
            tensors[f"model.{p.name}"] = master
        else:
            tensors[f"model.{p.name}"] = FlatShard(p.lp, p.shape, p.start)
            tensors[f"optim.state.{p.name}.fp32"] = master
        hp_flat = layout.hp_flats[p.flat]
        for key, v in state.get(hp_flat, {}).items():
            k = f"optim.state.{p.name}.{key}"
            if _is_flat_state(v, hp_flat):
                tensors[k] = FlatShard(v.narrow(0, p.hp_offset, p.hp.numel()), p.shape, p.start)
            elif isinstance(v, torch.Tensor):
                tensors[k] = v.clone()  # a per-group scalar (torch Adam's step), one copy per parameter (no tie)
            else:
                values[k] = plain(v)
    tensors.update({f"model.{n}": t for n, t in layout.frozen.items()})
    # buffers as DeepSpeed saves them: data-parallel rank 0's (replicas may differ: running statistics of
    # their own batches), a tied module's from the first stage of its tie. With MoE every rank gives its own,
    # compared (an expert's buffers are named by its local index here: differing ones are refused, not lost)
    if layout.dp_rank == 0 or getattr(layout.engine, "has_moe_layers", False):
        tensors.update({f"model.{n}": t for n, t in layout.buffers.items() if _writes_tie(layout.engine, n)})
    for alias, canon in layout.aliases.items():  # (one object under both names: saved once, as a tie)
        for key in [k for k in tensors if k == f"model.{canon}" or k.startswith(f"optim.state.{canon}.")]:
            value = tensors[key]  # (the weight, its master and moments; not the group's scalar step)
            if value.global_shape if isinstance(value, FlatShard) else value.dim():
                tensors[key.replace(canon, alias, 1)] = value
    for key, v in client_state.items():
        k = f"client_state.{key}"
        if isinstance(v, (torch.Tensor, FlatShard, PerRank)):
            tensors[k] = v
        elif holds_tensor(v):
            raise NotJSONableError(
                f"client_state[{key!r}] holds a tensor inside a {type(v).__name__}: each client_state entry is stored as "
                "one JSON value, or as a tensor where the entry is one: give each tensor a client_state key of its own"
            )
        else:
            values[k] = v
    values["optim.param_groups"] = [
        {k: plain(v) for k, v in g.items() if k != "params"} | {"params": list(layout.group_names[i])}
        for i, g in enumerate(layout.base.param_groups)
    ]
    sched = getattr(engine, "lr_scheduler", None)
    values["lr_scheduler"] = plain(sched.state_dict()) if sched is not None else None
    for key in _ENGINE_VALUES:
        if hasattr(engine, key):
            values[f"deepspeed.{key}"] = _jsonable(getattr(engine, key))
    values["deepspeed.dp_world_size"] = layout.dp_world
    values["deepspeed.mp_world_size"] = int(getattr(engine, "mp_world_size", 1) or 1)
    try:
        from deepspeed.runtime.engine import _checkpoint_parallel_metadata

        values.update({f"deepspeed.{k}": _jsonable(v) for k, v in _checkpoint_parallel_metadata(engine.mpu).items()})
    except (ImportError, AttributeError, TypeError):
        pass
    values["deepspeed.ds_config"] = _jsonable(getattr(engine, "config", None))
    try:
        from deepspeed import __version__ as ds_version
    except ImportError:
        ds_version = None
    values["deepspeed.ds_version"] = ds_version
    opt = layout.optimizer
    values["deepspeed.zero_stage"] = {"zero12": int(getattr(opt, "partition_gradients", False)) + 1, "zero3": 3,
                                      "bf16": int(engine.zero_optimization_stage())}[layout.kind]
    if getattr(opt, "loss_scaler", None) is not None:
        values["deepspeed.loss_scaler"] = _jsonable(plain(opt.loss_scaler))
    for key in _OPTIMIZER_VALUES:
        if hasattr(opt, key):
            values[f"deepspeed.{key}"] = _jsonable(plain(getattr(opt, key)))
    return tensors, values


def _is_flat_state(v: Any, hp_flat: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == hp_flat.shape


def _jsonable(v: Any) -> Any:
    """``v`` with anything JSON cannot hold (a dtype, a device) as its ``str``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return str(v)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


@dataclass
class _LoadPlan:
    tensors: dict[str, Any]
    """What ``ucp_zarr.load`` fills in place: views of the engine's buffers."""
    after: list[Callable[[], None]]
    """Run on every rank after the read (optimizer scalars, JSON states, hyper-parameters)."""
    values: dict[str, Any]
    client_state: dict[str, Any]
    loaded_optimizer: bool = False


def _load_plan(layout: _Layout, ck: Any, load_optimizer_states: bool, strict: bool) -> _LoadPlan:
    meta = ck.meta
    saved = meta.tensors
    values = {k: from_json(v, k) for k, v in meta.values.items()}
    tensors: dict[str, Any] = {}
    after: list[Callable[[], None]] = []
    missing: list[str] = []
    known: set[str] = set()
    trainable = {p.name for p in layout.params}

    # 1. fp32 masters (the low-precision weights are refreshed from them afterwards)
    for p in layout.params:
        known |= {f"model.{p.name}", f"optim.state.{p.name}.fp32"}
        key = f"optim.state.{p.name}.fp32" if f"optim.state.{p.name}.fp32" in saved else f"model.{p.name}"
        if key in saved:
            tensors[key] = FlatShard(p.hp, p.shape, p.start)
        else:
            missing.append(f"optim.state.{p.name}.fp32")
    # 2. frozen parameters and buffers, held whole (ZeRO-1/2) or partitioned (ZeRO-3)
    for name, t in list(layout.frozen.items()) + list(layout.buffers.items()):
        key = f"model.{name}"
        known.add(key)
        if key in saved:
            tensors[key] = t
        else:
            missing.append(key)
    known |= {f"model.{a}" for a in layout.aliases}

    # 3. optimizer states
    loaded_optimizer = False
    if load_optimizer_states:
        state_missing, state_after, loaded_optimizer = _optimizer_plan(layout, saved, values, tensors)
        missing += state_missing
        after += state_after
        groups = values.get("optim.param_groups")
        if not isinstance(groups, list):  # (the engine's hyper-parameters would stay: a fresh lr, betas)
            missing.append("optim.param_groups")
        else:
            if strict and len(groups) != len(layout.base.param_groups):  # (before any read fills the engine)
                raise LayoutError(f"the checkpoint has {len(groups)} optimizer param groups, the engine "
                                  f"{len(layout.base.param_groups)}")
            after.append(lambda: _restore_param_groups(layout, groups))

    def is_known(key: str) -> bool:
        if key in known or key.startswith("client_state.") or (key.startswith("model.") and key[6:] in layout.elsewhere):
            return True
        if key.startswith("optim.state."):
            name = key[len("optim.state."):].rsplit(".", 1)[0]
            return name in trainable or name in layout.elsewhere
        return False

    unexpected = [k for k in saved if not is_known(k)]
    unexpected += [k for k in values if k.startswith(("optim.state.", "model.")) and not is_known(k)]
    if strict and (missing or unexpected):
        raise KeyMismatchError(sorted(set(missing)), unexpected)

    client_state: dict[str, Any] = {k[len("client_state."):]: v for k, v in values.items() if k.startswith("client_state.")}
    for k, by_rank in meta.rank_values.items():
        if k.startswith("client_state.") and layout.rank in by_rank:
            client_state[k[len("client_state."):]] = from_json(by_rank[layout.rank], k)
    for k, entry in saved.items():
        if k.startswith("client_state."):
            if entry.ranks is None:
                client_state[k[len("client_state."):]] = ck.read(k)
            elif layout.rank in entry.ranks:
                client_state[k[len("client_state."):]] = ck.read(k, rank=layout.rank)
    return _LoadPlan(tensors, after, values, client_state, loaded_optimizer)


def _optimizer_plan(layout: _Layout, saved: Mapping[str, Any], values: Mapping[str, Any],
                    tensors: dict[str, Any]) -> tuple[list[str], list[Callable[[], None]], bool]:
    """Views of the optimizer states for ``tensors`` (states the engine does not have yet are
    created first, as DeepSpeed's universal load does), and what to set after the read."""
    state = layout.base.state
    missing: list[str] = []
    after: list[Callable[[], None]] = []
    by_flat: dict[int, list[_Param]] = {}
    for p in layout.params:
        by_flat.setdefault(p.flat, []).append(p)
    loaded = False
    for f, params in by_flat.items():
        hp_flat = layout.hp_flats[f]
        live = state.get(hp_flat) or {}
        if live:
            keys = list(live)
        else:  # a fresh engine: the keys the checkpoint holds for these parameters
            keys = []
            for p in params:
                prefix = f"optim.state.{p.name}."
                for k in list(saved) + list(values):
                    if k.startswith(prefix) and k != prefix + "fp32" and k[len(prefix):] not in keys and "." not in k[len(prefix):]:
                        keys.append(k[len(prefix):])
        group = layout.base.param_groups[layout.flat_group[f]]
        for key in keys:
            holders = [p for p in params if f"optim.state.{p.name}.{key}" in saved or f"optim.state.{p.name}.{key}" in values]
            missing += [f"optim.state.{p.name}.{key}" for p in params if p not in holders]
            if not holders:
                continue
            loaded = True
            first = f"optim.state.{holders[0].name}.{key}"
            if key in live:
                current = live[key]
            elif first in values:
                current = None
            else:
                entry = saved[first]
                dtype = stored_dtype_by_name(entry.dtype).torch_dtype
                flat = tuple(entry.shape) == holders[0].shape and len(entry.shape) > 0
                if flat:
                    current = torch.zeros(hp_flat.shape, dtype=dtype if dtype.is_floating_point else hp_flat.dtype,
                                          device=hp_flat.device)
                else:
                    on_device = group.get("capturable") or group.get("fused")
                    current = torch.zeros(entry.shape, dtype=dtype, device=hp_flat.device if on_device else "cpu")
                state.setdefault(hp_flat, {})[key] = current
            if isinstance(current, torch.Tensor) and _is_flat_state(current, hp_flat):
                for p in holders:
                    tensors[f"optim.state.{p.name}.{key}"] = FlatShard(current.narrow(0, p.hp_offset, p.hp.numel()),
                                                                       p.shape, p.start)
            elif isinstance(current, torch.Tensor) and first in saved:
                tensors[first] = current  # one scalar per group (step): read once, from its first parameter
            elif first in values:
                after.append(lambda s=state.setdefault(hp_flat, {}), k=key, v=values[first]: s.__setitem__(k, v))
            else:
                raise LayoutError(f"optimizer state {key!r} of {holders[0].name!r}: the engine holds a "
                                  f"{type(current).__name__}, the checkpoint a tensor of shape {list(saved[first].shape)}")
    return missing, after, loaded


ENGINE_GROUP_KEYS = frozenset({"params", "param_names", "name", "moe"})
"""Param group members that describe the loading engine's own layout, not hyper-parameters:
kept as the engine has them (a MoE group's ``name``, ``ep_size_<n>``, is how DeepSpeed finds
its expert-parallel process group; a checkpoint of another ``ep_size`` names another)."""


def _restore_param_groups(layout: _Layout, groups: list[Any]) -> None:
    """Each engine group's hyper-parameters from the saved group that lists its parameters
    (DeepSpeed orders MoE groups by iterating a set of names: the order may change between
    runs), else by position, with a warning."""
    current = layout.base.param_groups
    if len(groups) != len(current):  # (refused by the plan when strict)
        return
    order = _groups_by_names(groups, layout.group_names)
    if order is None:
        log.warning("ucp_zarr: the checkpoint's optimizer param groups list other parameters than the engine's (%s...); "
                    "restoring their hyper-parameters by position", [g[:2] for g in layout.group_names])
        order = list(range(len(current)))
    for live, j in zip(current, order):
        for k, v in groups[j].items() if isinstance(groups[j], dict) else ():
            if k not in ENGINE_GROUP_KEYS:
                live[k] = _like(live.get(k), v)


def _groups_by_names(groups: list[Any], names: list[list[str]]) -> list[int] | None:
    """For each engine group (its parameters ``names``), the one saved group whose
    ``params`` hold them all (this rank's experts are some of a saved group's); empty engine
    groups (DeepSpeed's MoE split leaves a group of only experts empty) take the saved groups
    left, empty ones first; None unless that pairs every group with another."""
    saved = [set(g.get("params") or ()) if isinstance(g, dict) else set() for g in groups]
    order: list[int | None] = []
    for mine in names:
        fits = [j for j, s in enumerate(saved) if set(mine) <= s]
        if mine and len(fits) != 1:
            return None
        order.append(fits[0] if mine else None)
    left = sorted((j for j in range(len(groups)) if j not in order), key=lambda j: bool(saved[j]))
    if len(left) != order.count(None):  # (two engine groups took one saved group)
        return None
    return [j if j is not None else left.pop(0) for j in order]


def _like(current: Any, loaded: Any) -> Any:
    """``loaded`` (from JSON) in the container types of ``current``: tuples stay tuples, a
    ``Counter`` a ``Counter``, and the keys of a mapping keyed by integers (``MultiStepLR``'s
    milestones) integers again (JSON objects key by text)."""
    if isinstance(current, tuple) and isinstance(loaded, list) and len(current) == len(loaded):
        return tuple(_like(c, v) for c, v in zip(current, loaded))
    if isinstance(current, dict) and isinstance(loaded, dict):
        from ..converters.base import int_key

        ints = bool(current) and all(type(c) is int for c in current)
        out = {}
        for k, v in loaded.items():
            k = int_key(k) if ints else k
            out[k] = _like(current.get(k), v)
        return Counter(out) if isinstance(current, Counter) else out
    if isinstance(current, list) and isinstance(loaded, list) and len(current) == len(loaded):
        return [_like(c, v) for c, v in zip(current, loaded)]
    return loaded


def _restore_loss_scaler(opt: Any, saved: Any) -> None:
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is None or not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        return
    for k, v in saved["state"].items():  # (as saved: a fresh engine's int scale must not round a saved 0.5 to 0)
        if hasattr(scaler, k) and isinstance(getattr(scaler, k), (bool, int, float)) and isinstance(v, (bool, int, float)):
            setattr(scaler, k, v)


def _prologue(layout: _Layout) -> None:
    if layout.kind == "zero3" and hasattr(layout.optimizer, "checkpoint_event_prologue"):
        layout.optimizer.checkpoint_event_prologue()  # partition every parameter before their partitions change


def _epilogue(layout: _Layout) -> None:
    if layout.kind == "zero3" and hasattr(layout.optimizer, "checkpoint_event_epilogue"):
        layout.optimizer.checkpoint_event_epilogue()  # re-gather the persistent parameters


@torch.no_grad()
def _refresh(layout: _Layout, *, optimizer_states: bool) -> None:
    """DeepSpeed's own fp32 -> low-precision refresh (collective), and its optimizer-state
    fragment links (for ``safe_get_full_optimizer_state``) over the states now loaded."""
    opt = layout.optimizer
    if layout.kind == "zero3":
        for sg in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(sg)
        return
    if optimizer_states and hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    opt.update_lp_params()


