"""DeepSpeed ZeRO-1/2/3 checkpoints in: every parameter, fp32 master and optimizer state in
its real shape, streamed from the ranks' flat partitions (no temporary copy, no merge
worker holding a whole parameter). With tensor parallelism (``mp_rank_XX`` files: AutoTP,
Megatron-DeepSpeed), each TP rank's tensors are placed on the consolidated ones by the
``universal_checkpoint_info`` the checkpoint holds, or by ``rules`` given by the caller.

Pipeline checkpoints (``deepspeed.pipe.PipelineModule``: the weights in
``layer_XX[-model_00]-model_states.pt``, one ``mp_rank_SS`` model-states file and one set of
optimizer files per stage) are read stage by stage and merged: DeepSpeed names their
parameters by global layer index (``3.fc.weight``), and a module tied across stages
(``tied_modules.<key>.*``) is taken from the first stage. MoE checkpoints
(``deepspeed.moe.layer.MoE``) keep each expert-parallel rank's experts under local indices in
the optimizer files, each expert group partitioned over that rank's expert-data-parallel
group (``partition_count`` per group); they come out under global indices (expert-parallel
rank x local experts + local index), as DeepSpeed names its ``layer_L_expert_E`` files, which
hold the experts' weights.

``src`` is the folder holding ``latest`` (its tag is followed) or a ``global_stepN``
folder. Files are found by their names (:func:`catalogue`); what this converter does not
support is refused by name before any file is read. Files are read weights-only:
DeepSpeed's own classes in them (loss scaler, ZeRO stage, fragment addresses) are rebuilt as
:class:`~.base.Opaque` records, so no code from the files runs (``trust=True`` reads them
with full unpickling instead).

Keys of the result (loadable into ``{"model": model.state_dict(), "optim": ...}``):

=====================================  ====================================================
``model.<name>``                       parameters as the module holds them (training dtype),
                                       frozen parameters, buffers, tied copies
``optim.state.<name>.<key>``           every per-parameter optimizer state, whatever its key
                                       (``exp_avg``, ``momentum_buffer``, ``sum``...), and
                                       per-group scalars such as ``step``
``optim.state.<name>.fp32``            the fp32 master, when training is not in fp32
``optim.param_groups``                 hyper-parameters per group, ``params`` as names
``lr_scheduler``                       the scheduler's state dict
``client_state.<key>``                 what the trainer passed as ``client_state``
``deepspeed.<key>``                    the engine's bookkeeping (``global_steps``,
                                       ``global_samples``, ``skipped_steps``, ``ds_config``,
                                       ``zero_stage``, ``loss_scaler``, ...)
=====================================  ====================================================
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..adapters.deepspeed_rules import autoep_refusal
from ..errors import ConversionError, Keyword
from .base import Imported, Opaque
from .deepspeed_files import (
    Experts,
    Files,
    _EXPERT,
    _MODEL_ENTRIES,
    _OPTIMIZER_ENTRIES,
    _check_entries,
    _get,
    _load,
    _scalar,
    _world,
    catalogue,
    parallel_degrees,
    step_folder,
)
from .deepspeed_zero import Consolidated, Mapped, _other_state, _zero12, _zero3


def read(src: Path, *, trust: bool = False, rules: Any = None) -> Imported:
    """A DeepSpeed checkpoint folder: ZeRO-1/2/3 (and ZeRO-0 in bf16: DeepSpeed's
    BF16_Optimizer), pipeline stages, MoE experts over expert-data-parallel groups; with
    tensor parallelism (``mp_rank_XX`` files), each TP rank's parameters are placed on the
    consolidated ones by ``rules`` (a :class:`~ucp_zarr.Rules`), by default those of the
    ``universal_checkpoint_info`` the checkpoint holds (DeepSpeed AutoTP, Megatron-DeepSpeed).
    What is not supported is refused, naming the feature, before any tensor is read."""
    folder = step_folder(Path(src))
    files = catalogue(folder)
    models = {mp: _load(files.model_file(mp), trust) for mp in sorted(files.model)}
    for mp, model in models.items():
        _check_entries(model, _MODEL_ENTRIES, files.model_file(mp))
    first = models[0]
    pipeline = _topology(files, first)
    optims = {mp: [_load(f, trust) for _, f in sorted(files.optim.get(mp, {}).items())] for mp in models}
    for mp, loaded in optims.items():
        for (_, f), optim in zip(sorted(files.optim.get(mp, {}).items()), loaded):
            osd = _get(optim, "optimizer_state_dict", f)
            if not isinstance(osd, dict):
                raise ConversionError(f"{f}: its 'optimizer_state_dict' is {type(osd).__name__}, not a dict")
            _check_entries(osd, _OPTIMIZER_ENTRIES, f)
    for mp, model in models.items():
        if not optims[mp]:
            raise ConversionError(_no_optimizer_files(files.model_file(mp), model))
    experts = _experts(files, first, trust) if files.experts or first.get("num_experts") else None
    layers = _layer_weights(files, trust, models, optims) if pipeline else None
    parts = [_read_part(files, mp, models[mp], optims[mp], trust, layers, experts) for mp in models]
    if pipeline:
        assert layers is not None
        return _merge_stages(folder, parts, layers)
    if len(parts) == 1 and rules is None:
        return parts[0]
    return _consolidate(folder, parts, rules)


def _no_optimizer_files(f: Path, model: dict[str, Any]) -> str:
    opt = model.get("optimizer")
    if isinstance(opt, dict) and "state" in opt:
        return (f"{f}: ZeRO stage 0 with a torch optimizer is not supported: its state is keyed by position, and "
                "the checkpoint does not say which parameter each position is (save with ZeRO stage 1 or 2, or "
                "bf16, whose BF16_Optimizer names them)")
    if isinstance(opt, dict):
        return f"{f}: ZeRO stage 0 with DeepSpeed's {sorted(opt)[:3]}... optimizer state (fp16) is not supported"
    return f"{f.parent}: no *_optim_states.pt file beside {f.name}: not a DeepSpeed ZeRO checkpoint folder"


def _topology(files: Files, first: dict[str, Any]) -> bool:
    """Whether the folder holds pipeline stages (one ``mp_rank`` per stage, the weights in
    layer files); refuses the combinations this converter does not support."""
    pp, tp = parallel_degrees(first.get("checkpoint_parallel_dimensions"), str(files.model_file(0)))
    pipeline = bool(files.layers) or pp > 1
    moe = bool(files.experts or first.get("num_experts"))
    where = files.folder
    autoep = autoep_refusal(first)
    if autoep:  # (expert placements of their own, with affine maps: the experts would convert wrong)
        raise ConversionError(f"{files.model_file(0)}: {autoep}")
    if pipeline and tp > 1:
        raise ConversionError(f"{where}: pipeline parallelism combined with tensor parallelism (pp {pp} x tp {tp}) is "
                              "not supported")
    if pipeline and moe:
        raise ConversionError(f"{where}: MoE experts inside pipeline stages are not supported")
    if moe and len(files.model) > 1:
        raise ConversionError(f"{where}: MoE experts combined with tensor parallelism are not supported")
    if pipeline and len(files.model) != pp:
        raise ConversionError(f"{where}: a pipeline of {pp} stages, but model-states files of {len(files.model)} "
                              "mp ranks: a stage's file is missing or another save's is mixed in")
    if pipeline and not files.layers:
        raise ConversionError(f"{where}: a pipeline checkpoint without its layer_XX-model_states.pt files")
    return pipeline


# --- one tensor-parallel rank or pipeline stage ---------------------------------------------


def _read_part(files: Files, mp: int, model: dict[str, Any], optims: list[Any], trust: bool,
               layers: dict[str, torch.Tensor] | None, experts: "Experts | None") -> Imported:
    """The state of one tensor-parallel rank or pipeline stage, over its data-parallel group."""
    where = files.model_file(mp)
    optim_files = [f for _, f in sorted(files.optim[mp].items())]
    weights = dict(layers) if layers is not None else _module(model, where)
    if experts is not None:
        weights.update(experts.weights)
    osd = _get(optims[0], "optimizer_state_dict", optim_files[0])
    if "zero_stage" in osd:
        stage = int(_scalar(osd["zero_stage"]))
    elif "single_partition_of_fp32_groups" in osd:  # BF16_Optimizer (ZeRO-0/1 in bf16) records no stage
        stage = 1
    else:
        raise ConversionError(f"{optim_files[0]}: no 'zero_stage' entry: not a DeepSpeed ZeRO optimizer file")
    world = _world(osd, optim_files[0])
    if len(optim_files) != world:
        raise ConversionError(
            f"{files.folder}: the optimizer was partitioned over {world} ranks, but {len(optim_files)} optimizer files "
            f"are there ({[f.name for f in optim_files]}): a rank's file is missing or another save's is mixed in"
        )
    if stage == 3 and experts is not None:
        raise ConversionError(f"{files.folder}: MoE experts with ZeRO stage 3 are not supported (stages 1 and 2 are)")
    out = Imported(layout={"source": {"format": "deepspeed", "folder": files.folder.name, "zero_stage": stage,
                                      "world": world}})
    shapes = _shapes(model, osd, weights, where, optim_files[0])
    if layers is not None:  # a pipeline stage: its own parameters and buffers (the rest: _merge_stages)
        mine = {n for g in shapes for n in g} | set(model.get("buffer_names") or [])
        weights = {n: t for n, t in weights.items() if n in mine}
    if stage <= 2:
        names = _zero12(out, files.folder, optims, optim_files, shapes, weights, experts)
    else:
        models = [model] + [_load(f, trust) for _, f in sorted(files.model[mp].items())[1:]]
        for m, (_, f) in zip(models[1:], sorted(files.model[mp].items())[1:]):
            _check_entries(m, _MODEL_ENTRIES, f)
        if len(models) != world:
            raise ConversionError(f"{files.folder}: ZeRO-3 over {world} ranks, but {len(models)} model-states files of "
                                  f"mp_rank {mp:02d}")
        _zero3(out, optims, optim_files, models, shapes)
        names = shapes
    _other_state(out, model, osd, names, weights)
    return out


def _module(model: dict[str, Any], f: Path) -> dict[str, Any]:
    module = _get(model, "module", f)
    if not isinstance(module, dict):
        raise ConversionError(f"{f}: its 'module' is {type(module).__name__}, not a state dict (a pipeline stage's "
                              "file without its layer_XX files?)")
    return dict(module)


def _numels(model: dict[str, Any], osd: dict[str, Any]) -> dict[str, int]:
    """A stage's trainable parameters and their sizes, as its files record them."""
    shapes = model.get("param_shapes")
    if isinstance(shapes, (list, tuple)):
        return {str(n): math.prod(s) for g in shapes if isinstance(g, dict) for n, s in g.items()}
    out = {}
    for g in osd.get("param_slice_mappings") or ():
        for n, address in (g.items() if isinstance(g, dict) else ()):
            out[str(n)] = int(address.args[0]) if isinstance(address, Opaque) and address.args else -1
    return out


def _shapes(model: dict[str, Any], osd: dict[str, Any], weights: dict[str, Any], f: Path,
            optim_file: Path) -> list[dict[str, tuple[int, ...]]]:
    """The parameter shapes per flat group, in flat order: ``param_shapes``, or (DeepSpeed's
    BF16_Optimizer without ZeRO records none) the names of ``param_slice_mappings`` with the
    shapes of the module's weights."""
    shapes = model.get("param_shapes")
    if shapes is not None:
        if not isinstance(shapes, (list, tuple)) or not all(isinstance(g, dict) for g in shapes):
            raise ConversionError(f"{f}: 'param_shapes' is not a list of name -> shape dicts")
        return [{str(n): tuple(s) for n, s in g.items()} for g in shapes]
    mappings = osd.get("param_slice_mappings")
    if not isinstance(mappings, (list, tuple)) or not all(isinstance(g, dict) for g in mappings):
        raise ConversionError(f"{f}: records no param_shapes, and {optim_file.name} no param_slice_mappings")
    out = []
    for g in mappings:
        group = {}
        for name in g:
            w = weights.get(name)
            if not isinstance(w, torch.Tensor):
                raise ConversionError(f"{optim_file}: parameter {name!r} of its param_slice_mappings is in no weights "
                                      "file, so its shape is unknown")
            group[str(name)] = tuple(w.shape)
        out.append(group)
    return out


def _layer_weights(files: Files, trust: bool, models: dict[int, dict[str, Any]],
                   optims: dict[int, list[Any]]) -> dict[str, torch.Tensor]:
    """A pipeline's weights in the names its stages give them: ``layer_XX``'s ``key`` is
    ``XX.key``, except in a tied module's layer, where it is ``tied_modules.<tie>.key`` (a
    layer none of whose entries is a parameter or buffer of a stage, whose entries include
    every parameter of one tie, in the same sizes; every such layer must hold the same values,
    else one of them is a frozen layer the files do not name, and the conversion is refused)."""
    known: dict[str, int] = {}
    for mp, model in models.items():
        osd = optims[mp][0].get("optimizer_state_dict") if isinstance(optims[mp][0], dict) else None
        known |= _numels(model, osd if isinstance(osd, dict) else {})
        known |= {str(b): -1 for b in model.get("buffer_names") or []}
    ties: dict[str, dict[str, int]] = {}
    for name, numel in known.items():
        if name.startswith("tied_modules."):
            tie, _, key = name[len("tied_modules."):].partition(".")
            ties.setdefault(tie, {})[key] = numel
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, list[tuple[Path, dict[str, torch.Tensor]]]] = {}
    for index, f in sorted(files.layers.items()):
        state = {str(k): t for k, t in _load(f, trust).items() if isinstance(t, torch.Tensor)}
        prefix = f"{index}."
        if not any(prefix + k in known for k in state):
            match = [t for t, keys in ties.items()
                     if all(k in state and n in (-1, state[k].numel()) for k, n in keys.items())]
            if len(match) > 1:
                raise ConversionError(f"{f}: its entries fit the tied modules {match} alike")
            if match:
                tied.setdefault(match[0], []).append((f, state))
                continue
        out.update({prefix + k: t for k, t in state.items()})
    for tie, held in tied.items():
        (first, state), *others = held
        other = next((f for f, s in others if s.keys() != state.keys() or
                      not all(torch.equal(s[k], t) for k, t in state.items())), None)
        if other is not None:  # copies of one tied module are equal where DeepSpeed ties all they hold
            theirs = dict(next(s for f, s in others if f == other))
            differ = sorted(k for k in state.keys() | theirs.keys()
                            if k not in state or k not in theirs or not torch.equal(state[k], theirs[k]))
            raise ConversionError(
                f"{first.name} and {other.name} both fit the tied module {tie!r} and hold other values for {differ}: "
                "either those are parameters of the tied module that its TiedLayerSpec's tied_weight_attr leaves out "
                "(each stage trains its own copy under one name, which one tensor cannot hold: list them in "
                "tied_weight_attr), or one file is a layer whose parameters are all frozen, which a pipeline checkpoint "
                "does not name, so it cannot be told from the tie (save the running engine with "
                "ucp_zarr.adapters.deepspeed.save_checkpoint, which names every parameter)"
            )
        out.update({f"tied_modules.{tie}.{k}": t for k, t in state.items()})
    return out


def _merge_stages(folder: Path, parts: list[Imported], layers: dict[str, torch.Tensor]) -> Imported:
    """Pipeline stages' states as one: their parameters are named by global layer index
    already; a parameter tied across stages (``tied_modules.*``) is taken from the first stage
    holding it; the layer files' other tensors (frozen parameters) are added. Optimizer param
    groups are merged by index (their parameters joined); every other value must be the same
    in every stage."""
    out = Imported(values=dict(parts[0].values), layout=dict(parts[0].layout))
    out.layout["source"] = dict(out.layout["source"], pp=len(parts))
    for name, t in layers.items():
        if not any(f"model.{name}" in part.tensors for part in parts):
            out.tensors[f"model.{name}"] = Mapped(t)
    for s, part in enumerate(parts):
        for key, source in part.tensors.items():
            out.tensors.setdefault(key, source)
        out.ties.update(part.ties)
        if s == 0:
            continue
        for key, v in part.values.items():
            mine = out.values.get(key)
            if key == "optim.param_groups" and isinstance(mine, list) and isinstance(v, list) and len(mine) == len(v):
                out.values[key] = [_merge_group(folder, s, i, a, b) for i, (a, b) in enumerate(zip(mine, v))]
            elif key == "deepspeed.buffer_names" and isinstance(mine, list) and isinstance(v, list):
                out.values[key] = mine + [x for x in v if x not in mine]
            elif key == "deepspeed.shared_params" and isinstance(mine, dict) and isinstance(v, dict):
                out.values[key] = mine | v
            elif key.startswith("optim.state.") and key not in out.values:
                out.values[key] = v
            elif mine != v:
                raise ConversionError(f"{folder}: pipeline stage {s} records {key!r} as {v!r}, stage 0 as {mine!r}")
    return out


def _merge_group(folder: Path, stage: int, i: int, a: Any, b: Any) -> dict[str, Any]:
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise ConversionError(f"{folder}: optimizer param group {i} is not a dict")
    hyper = {k: v for k, v in a.items() if k != "params"}
    if hyper != {k: v for k, v in b.items() if k != "params"}:
        raise ConversionError(f"{folder}: pipeline stage {stage}'s optimizer param group {i} has other "
                              f"hyper-parameters than stage 0's ({b} vs {a})")
    params = list(a.get("params", []))
    return hyper | {"params": params + [n for n in b.get("params", []) if n not in params]}


def _consolidate(folder: Path, parts: list[Imported], rules: Any) -> Imported:
    """The consolidated tensors of tensor-parallel ranks' states, placed by ``rules``."""
    from ..rules.place import place
    from ..rules.language import Rules
    from ..rules.params import RuleError

    tp_size = len(parts)
    if rules is None:
        info = parts[0].values.get("deepspeed.universal_checkpoint_info")
        if not isinstance(info, dict):
            raise ConversionError(
                f"{folder}: a tensor-parallel checkpoint ({tp_size} mp_rank files) that records no "
                "universal_checkpoint_info: pass ", Keyword("rules"), " (a ucp_zarr.Rules) saying how its tensors are split",
            )
        try:
            rules = Rules.from_deepspeed(info)
        except RuleError as e:
            raise ConversionError(f"{folder}: its universal_checkpoint_info: {e}") from None
    buffers = set(parts[0].values.get("deepspeed.buffer_names") or [])
    out = Imported(values=dict(parts[0].values), layout=dict(parts[0].layout))
    out.layout["source"] = dict(out.layout["source"], tp=tp_size)
    out.layout["rules"] = rules.to_dict()
    merged: dict[str, list[tuple[Any, Any]]] = {}
    for t, part in enumerate(parts):
        state: dict[str, Any] = {"model": {}, "optim": {"state": {}}}
        sources: dict[tuple[str, ...], Any] = {}
        for key, source in part.tensors.items():
            if key in parts[0].ties:  # an alias on rank 0 (DeepSpeed records shared_params in rank 0's file only)
                continue
            meta = torch.empty(source.shape, dtype=source.dtype, device="meta")
            if key.startswith("model.") and key[6:] in buffers:  # buffers: whole on every rank
                if t == 0:
                    out.tensors[key] = source
                continue
            if key.startswith("model."):
                path: tuple[str, ...] = ("model", key[6:])
                state["model"][key[6:]] = meta
            elif key.startswith("optim.state."):
                name, state_key = key[len("optim.state."):].rsplit(".", 1)
                path = ("optim", "state", name, state_key)
                state["optim"]["state"].setdefault(name, {})[state_key] = meta
            else:
                raise ConversionError(f"{folder}: cannot place tensor {key!r} of tensor-parallel rank {t}")
            sources[path] = source
        try:
            placed = place(state, rules, tp_rank=t, tp_size=tp_size)
        except RuleError as e:
            raise ConversionError(f"{folder}, tensor-parallel rank {t}: {e}") from None
        for path, source in sources.items():
            node = placed
            for k in path:
                node = node[k]
            used = sum(p.src.numel for p in list(node.pieces) + list(node.pad))
            if node.meaning.get("kind") == "pieces" and used != math.prod(source.shape):
                raise ConversionError(f"{folder}, tensor-parallel rank {t}: {node.key!r} is {list(source.shape)}, but "
                                      f"its rule's pieces place {used} elements of it (another shard shape)")
            merged.setdefault(node.key, []).append((node, source))
    for key, held in merged.items():
        first = held[0][0]
        if first.average:
            raise ConversionError(f"{folder}: tensor {key!r} is averaged over tensor-parallel ranks, which the converter does not do")
        # (a replicated tensor too: each rank's copy covers it whole, and must equal the first, as
        # DeepSpeed's ds_to_universal asserts of its TP-replicated parameters)
        out.tensors[key] = Consolidated(first.global_shape, first.local.dtype, [(p.pieces, src) for p, src in held], key)
    out.ties = {a: c for a, c in parts[0].ties.items() if c in out.tensors}
    return out


def _experts(files: Files, first: dict[str, Any], trust: bool) -> Experts:
    """The MoE layers, from the expert files (``layer_L_expert_E``: expert ``E``'s weights
    under their global names)."""
    layer_of: dict[str, int] = {}
    weights: dict[str, torch.Tensor] = {}
    counts = first.get("num_experts")
    for layer, by_expert in sorted(files.experts.items()):
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ConversionError(f"{files.folder}: the expert files of MoE layer {layer} are of experts "
                                  f"{sorted(by_expert)}: some are missing")
        if isinstance(counts, list) and (layer >= len(counts) or counts[layer] != len(by_expert)):
            raise ConversionError(f"{files.folder}: MoE layer {layer} has {len(by_expert)} expert files, its model-states "
                                  f"file records num_experts {counts}")
        for expert, f in sorted(by_expert.items()):
            for name, t in _load(f, trust).items():
                m = _EXPERT.fullmatch(str(name))
                if m is None or int(m.group(2)) != expert or not isinstance(t, torch.Tensor):
                    raise ConversionError(f"{f}: holds {name!r}, which is not a tensor of expert {expert}")
                if layer_of.setdefault(m.group(1), layer) != layer:
                    raise ConversionError(f"{f}: {name!r} belongs to MoE layer {layer_of[m.group(1)]}, not {layer}")
                weights[str(name)] = t
    if isinstance(counts, list) and len(counts) != len(files.experts):
        raise ConversionError(f"{files.folder}: the model-states file records {len(counts)} MoE layers "
                              f"(num_experts {counts}), the folder holds expert files of {len(files.experts)}")
    config = first.get("ds_config") if isinstance(first.get("ds_config"), dict) else {}
    return Experts(layer_of, {layer: len(e) for layer, e in files.experts.items()}, weights,
                   bool(config.get("use_data_before_expert_parallelism", False)))
