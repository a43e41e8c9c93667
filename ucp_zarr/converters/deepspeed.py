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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ConversionError, Keyword
from ..layout import Box
from ..layout.pieces import Piece
from ..layout.zero import (
    FlatPiece,
    ZeroLayoutError,
    pieces_in,
    zero3_pieces,
    zero12_group_numel,
    zero12_partition_size,
    zero12_pieces,
)
from ..format.safe_paths import inside
from ..protocol.writer import InMemory
from .base import Imported, Opaque, plain, release_pages, torch_load_mapped

OPAQUE = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""DeepSpeed classes its checkpoint files pickle, rebuilt as records without importing them."""

ENGINE_KEYS = (
    "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "module", "universal_checkpoint_info", "num_experts", "ds_autoep_layers",
)
"""Keys DeepSpeed's engine writes into a model-states file; the rest is client state."""
_OPTIMIZER_SCALARS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage", "partition_count")


def read(src: Path, *, trust: bool = False, rules: Any = None, **_: Any) -> Imported:
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


# --- the folder ----------------------------------------------------------------------------

_FILE_KINDS = (
    ("optim", re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")),
    ("model3", re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")),
    ("model", re.compile(r"mp_rank_(\d+)_model_states\.pt")),
    ("layer", re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")),
    ("expert", re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt")),
    ("expp", re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")),
    ("old_expert", re.compile(r"expert_(\d+)_mp_rank_(\d+)_model_states\.pt")),
)
"""The files ``engine.save_checkpoint`` writes into a step folder, by name."""


@dataclass
class Files:
    """A step folder's DeepSpeed files, by what their names say."""

    folder: Path
    optim: dict[int, dict[int, Path]] = field(default_factory=dict)
    """mp rank -> data-parallel rank -> ZeRO optimizer file."""
    model: dict[int, dict[int, Path]] = field(default_factory=dict)
    """mp rank -> data-parallel rank -> model-states file (rank 0 only below ZeRO-3)."""
    layers: dict[int, Path] = field(default_factory=dict)
    """Pipeline layer index -> its weights (``layer_XX[-model_00]-model_states.pt``)."""
    experts: dict[int, dict[int, Path]] = field(default_factory=dict)
    """MoE layer -> global expert id -> its weights (``layer_L_expert_E_mp_rank_00_model_states.pt``)."""

    def model_file(self, mp: int) -> Path:
        by_dp = self.model.get(mp) or {}
        if 0 not in by_dp:
            raise ConversionError(f"{self.folder}: no model-states file of mp_rank {mp:02d} (data-parallel rank 0)")
        return by_dp[0]


def catalogue(folder: Path) -> Files:
    """Every DeepSpeed file of ``folder`` by kind and ranks, from the names a listing gives
    (the only paths this converter opens). Refuses what it cannot convert, by name, before
    any file is read: MoE without ZeRO, old expert files, pipeline or MoE files of
    tensor-parallel ranks, two files for one rank, a ``*_states.pt`` file it does not know."""
    out = Files(folder)
    for f in sorted(folder.iterdir()):
        kind, m = next(((k, m) for k, rx in _FILE_KINDS if (m := rx.fullmatch(f.name))), (None, None))
        if m is None:
            if f.name.endswith("_states.pt"):
                raise ConversionError(f"{f}: a DeepSpeed file this converter does not know (from a newer DeepSpeed, or "
                                      "another tool's)")
            continue
        n = [int(x) if x is not None else 0 for x in m.groups()]
        if kind == "expp":
            raise ConversionError(f"{f}: MoE experts trained without ZeRO (expp_rank optimizer files) are not supported: "
                                  "save with ZeRO stage 1 or 2")
        if kind == "old_expert":
            raise ConversionError(f"{f}: MoE expert files without a layer index (DeepSpeed before 0.5) are not supported")
        if kind == "layer" and n[1]:
            raise ConversionError(f"{f}: pipeline parallelism combined with tensor parallelism (layer files of model "
                                  f"rank {n[1]}) is not supported")
        if kind == "expert" and n[2]:
            raise ConversionError(f"{f}: MoE experts combined with tensor parallelism (mp_rank {n[2]:02d}) are not supported")
        slot: dict[int, Path]
        if kind == "optim":
            slot, key = out.optim.setdefault(n[1], {}), n[0]
        elif kind == "model3":
            slot, key = out.model.setdefault(n[1], {}), n[0]
        elif kind == "model":
            slot, key = out.model.setdefault(n[0], {}), 0
        elif kind == "layer":
            slot, key = out.layers, n[0]
        else:
            slot, key = out.experts.setdefault(n[0], {}), n[1]
        if key in slot:
            raise ConversionError(f"{folder}: {slot[key].name} and {f.name} are two files for the same rank: the folder "
                                  "mixes two saves (or bf16 and fp32 optimizer files)")
        slot[key] = f
    if not out.model:
        raise ConversionError(f"{folder}: no *_model_states.pt file: not a DeepSpeed checkpoint folder")
    _check_ranks(folder, sorted(out.model), "model-states (mp_rank)")
    for mp, by_dp in out.model.items():
        _check_ranks(folder, sorted(by_dp), f"mp_rank {mp:02d}'s model-states")
    for mp, by_dp in out.optim.items():
        if mp not in out.model:
            raise ConversionError(f"{folder}: optimizer files of mp_rank {mp:02d}, but no model-states file of it")
        _check_ranks(folder, sorted(by_dp), f"mp_rank {mp:02d}'s optimizer")
    return out


def _rank(f: Path) -> int:
    """The data-parallel rank a ``zero_pp_rank_R_...`` file name gives (0 for others)."""
    m = re.search(r"zero_pp_rank_(\d+)_", f.name)
    return int(m.group(1)) if m else 0


def _check_rank_numbers(files: list[Path], what: str) -> None:
    """``files`` (in rank order) are those of ranks 0, 1, ... without a gap."""
    _check_ranks(files[0].parent, [_rank(f) for f in files], what)


def _check_ranks(folder: Path, ranks: list[int], what: str) -> None:
    """``ranks`` are 0, 1, ... without a gap."""
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise ConversionError(f"{folder}: {what} files of ranks {missing} are missing (found ranks {ranks})")


def _topology(files: Files, first: dict[str, Any]) -> bool:
    """Whether the folder holds pipeline stages (one ``mp_rank`` per stage, the weights in
    layer files); refuses the combinations this converter does not support."""
    dims = first.get("checkpoint_parallel_dimensions")
    dims = dims if isinstance(dims, dict) else {}
    try:
        pp, tp = int(dims.get("pp_degree") or 1), int(dims.get("tp_degree") or 1)
    except (TypeError, ValueError):
        raise ConversionError(f"{files.model_file(0)}: checkpoint_parallel_dimensions {dims!r} are not integers") from None
    pipeline = bool(files.layers) or pp > 1
    moe = bool(files.experts or first.get("num_experts"))
    where = files.folder
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
    every parameter of one tie, in the same sizes)."""
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
    for index, f in sorted(files.layers.items()):
        state = {str(k): t for k, t in _load(f, trust).items() if isinstance(t, torch.Tensor)}
        prefix = f"{index}."
        if not any(prefix + k in known for k in state):
            match = [t for t, keys in ties.items()
                     if all(k in state and n in (-1, state[k].numel()) for k, n in keys.items())]
            if len(match) > 1:
                raise ConversionError(f"{f}: its entries fit the tied modules {match} alike")
            if match:
                prefix = f"tied_modules.{match[0]}."
        out.update({prefix + k: t for k, t in state.items()})
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
        if first.replicated:
            out.tensors[key] = held[0][1]  # (TP rank 0's copy)
        else:
            out.tensors[key] = Consolidated(first.global_shape, first.local.dtype, [(p.pieces, src) for p, src in held], key)
    out.ties = {a: c for a, c in parts[0].ties.items() if c in out.tensors}
    return out


def step_folder(src: Path) -> Path:
    """The ``global_stepN`` folder of a DeepSpeed checkpoint (``src`` or the tag its ``latest`` names)."""
    if not src.is_dir():
        raise ConversionError(f"{src}: not a folder (give the folder holding 'latest', or a global_step folder)")
    latest = src / "latest"
    if latest.is_file() and not any(src.glob("*_optim_states.pt")):
        src = inside(src, latest.read_text(errors="replace").strip(), f"{latest}: the tag")
        if not src.is_dir():
            raise ConversionError(f"{latest} names {src.name!r}, which is not a folder beside it")
    return src


def _load(f: Path, trust: bool) -> Any:
    """A DeepSpeed file, its tensors memory-mapped (the sources below drop their pages once copied)."""
    obj, mapped = torch_load_mapped(f, trust=trust, opaque=OPAQUE)
    if not mapped:
        raise ConversionError(f"{f}: in torch's legacy (pre-1.6) file format, which cannot be memory-mapped")
    if not isinstance(obj, dict):
        raise ConversionError(f"{f}: holds a {type(obj).__name__}, not a DeepSpeed checkpoint dict")
    return obj


_MODEL_ENTRIES: dict[str, Any] = {
    "module": ("dict", "any"), "buffer_names": ("list", "str"), "param_shapes": ("list", ("dict", "shape")),
    "frozen_param_shapes": ("dict", "shape"), "frozen_param_fragments": ("dict", "tensor"),
    "shared_params": ("dict", "str"), "checkpoint_parallel_dimensions": ("dict", "int"), "num_experts": ("list", "int"),
    "ds_config": ("dict", "any"), "universal_checkpoint_info": ("dict", "any"), "global_steps": "int",
    "global_samples": "int", "skipped_steps": "int", "dp_world_size": "int", "mp_world_size": "int",
}
"""The model-states entries this converter reads, and what each must be (or None)."""
_OPTIMIZER_ENTRIES: dict[str, Any] = {
    "partition_count": ("either", "int", ("list", "int")), "single_partition_of_fp32_groups": ("list", "tensor"),
    "fp32_flat_groups": ("list", "tensor"), "base_optimizer_state": ("either", ("dict", "any"), ("list", ("dict", "any"))),
    "optimizer_state_dict": ("dict", "any"), "param_alignment_paddings": ("list", ("list", "int")),
    "param_slice_mappings": ("list", ("dict", "any")), "param_groups": ("list", ("dict", "any")),
}
"""The same for a ZeRO optimizer file's ``optimizer_state_dict``."""


def _conforms(value: Any, spec: Any) -> bool:
    if spec == "any":
        return True
    if spec == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spec == "str":
        return isinstance(value, str)
    if spec == "tensor":
        return isinstance(value, torch.Tensor)
    if spec == "shape":
        return isinstance(value, (list, tuple)) and all(_conforms(n, "int") and n >= 0 for n in value)
    kind, *inner = spec
    if kind == "either":
        return any(_conforms(value, s) for s in inner)
    if kind == "list":
        return isinstance(value, (list, tuple)) and all(_conforms(v, inner[0]) for v in value)
    return isinstance(value, dict) and all(isinstance(k, (str, int)) and _conforms(v, inner[0]) for k, v in value.items())


def _check_entries(d: dict[str, Any], entries: dict[str, Any], f: Path) -> None:
    """Each entry of ``d`` named in ``entries`` is what this converter expects there (or None)."""
    for key, spec in entries.items():
        if d.get(key) is not None and not _conforms(d[key], spec):
            raise ConversionError(f"{f}: its {key!r} entry is not {_describe(spec)} (it is {type(d[key]).__name__}): "
                                  "the file is damaged, or from a DeepSpeed this converter does not know")


def _describe(spec: Any) -> str:
    if isinstance(spec, str):
        return {"any": "anything", "int": "an integer", "str": "a string", "tensor": "a tensor",
                "shape": "a shape"}[spec]
    kind, *inner = spec
    if kind == "either":
        return " or ".join(_describe(s) for s in inner)
    return f"a {kind} of {_describe(inner[0])} values" if kind == "dict" else f"a list of {_describe(inner[0])}"


def _get(d: Any, key: str, f: Path) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ConversionError(f"{f}: no {key!r} entry: not a DeepSpeed ZeRO checkpoint file (or another version's)")
    return d[key]


def _scalar(v: Any) -> Any:
    """An enum or named tuple read as :class:`Opaque` -> its value."""
    if isinstance(v, Opaque):
        return v.args[0] if v.args else v.state
    return int(v) if hasattr(v, "value") else v


def _world(osd: dict[str, Any], f: Path) -> int:
    count = _get(osd, "partition_count", f)
    return max(count) if isinstance(count, (list, tuple)) else int(count)


# --- MoE experts ---------------------------------------------------------------------------

_EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..+)")
"""An expert parameter's name: its MoE layer's prefix, its expert index, the rest."""


@dataclass
class Experts:
    """The MoE layers of a checkpoint (``deepspeed.moe.layer.MoE``): each layer's experts are
    spread over ``ep`` expert-parallel ranks, each holding ``num_experts / ep`` of them under
    local indices; their optimizer state is partitioned over each expert-parallel rank's
    expert-data-parallel group."""

    layer_of: dict[str, int]
    """An expert layer's name prefix -> its MoE layer id (the ``L`` of its files)."""
    count: dict[int, int]
    """MoE layer id -> its number of experts."""
    weights: dict[str, torch.Tensor]
    """Every expert's weights under its global name (training dtype)."""
    data_first: bool
    """``use_data_before_expert_parallelism``: the expert-data-parallel groups are runs of
    consecutive ranks (else strided, DeepSpeed's default)."""

    def global_name(self, name: str, ep_rank: int, ep: int, where: str) -> str:
        m = _EXPERT.fullmatch(name)
        layer = self.layer_of.get(m.group(1)) if m else None
        if m is None or layer is None:
            raise ConversionError(f"{where}: parameter {name!r} of an expert group is no expert of a MoE layer whose "
                                  "expert files are there")
        count = self.count[layer]
        if count % ep:
            raise ConversionError(f"{where}: MoE layer {layer} has {count} experts, which {ep} expert-parallel ranks "
                                  "cannot hold equally")
        local = int(m.group(2))
        if local >= count // ep:
            raise ConversionError(f"{where}: {name!r} is local expert {local}, but each of {ep} expert-parallel ranks "
                                  f"holds {count // ep} of MoE layer {layer}'s {count}")
        return f"{m.group(1)}{ep_rank * (count // ep) + local}{m.group(3)}"

    def ranks(self, ep_rank: int, ep: int, world: int) -> list[int]:
        """The data-parallel ranks of expert-parallel rank ``ep_rank``'s expert-data-parallel
        group, in partition order (DeepSpeed's ``_create_expert_and_data_parallel``)."""
        edp = world // ep
        if self.data_first:
            return [ep_rank * edp + k for k in range(edp)]
        return [ep_rank + k * ep for k in range(edp)]


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


# --- ZeRO-1/2 ------------------------------------------------------------------------------


def _zero12(out: Imported, folder: Path, optims: list[Any], files: list[Path], shapes: list[dict[str, tuple[int, ...]]],
            weights: dict[str, Any], experts: Experts | None) -> list[dict[str, tuple[int, ...]]]:
    """Sources of every parameter of a ZeRO-1/2 checkpoint; returns the parameters per flat
    group under their consolidated names (an expert group's parameters: every expert-parallel
    rank's experts, under their global indices)."""
    osds = [_get(o, "optimizer_state_dict", f) for o, f in zip(optims, files)]
    world = len(files)
    counts = _get(osds[0], "partition_count", files[0])
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts] * len(shapes)
    paddings = osds[0].get("param_alignment_paddings")
    masters = [list(_get(osd, "single_partition_of_fp32_groups", f)) for osd, f in zip(osds, files)]
    if len(counts) != len(shapes) or any(len(m) != len(shapes) for m in masters):
        raise ConversionError(f"{files[0]}: {len(shapes)} parameter groups, but partition counts {counts} and "
                              f"{[len(m) for m in masters]} fp32 partitions per rank")
    pieces: dict[str, list[FlatPiece]] = {}
    names: list[dict[str, tuple[int, ...]]] = []
    for g, group in enumerate(shapes):
        pads = [list(paddings[g])] if paddings else None
        count = int(counts[g])
        if count == world:
            holders = {0: list(range(world))}
        elif experts is None or count < 1 or world % count:
            raise ConversionError(f"{files[0]}: parameter group {g} is partitioned over {count} of the {world} ranks, "
                                  "and the checkpoint has no MoE expert files to say which")
        else:
            ep = world // count
            holders = {e: experts.ranks(e, ep, world) for e in range(ep)}
        try:
            local = zero12_pieces([group], count, pads)
        except ZeroLayoutError as e:
            raise ConversionError(f"{folder}: parameter group {g}: {e}") from None
        numel = zero12_group_numel(group, pads[0] if pads else None)
        size = zero12_partition_size(numel, count)
        names.append({})
        for e, ranks in holders.items():
            for k, r in enumerate(ranks):
                held, n = max(0, min(size, numel - k * size)), masters[r][g].numel()
                if n not in (held, size):
                    raise ConversionError(
                        f"{files[r]}: its fp32 partition of group {g} has {n} elements; {count} ranks sharing {numel} "
                        f"hold {size} each: the files are not one checkpoint's partitions")
            for name, ps in local.items():
                gname = name if count == world else experts.global_name(name, e, world // count, str(files[0]))
                pieces[gname] = [FlatPiece(ranks[p.rank], g, p.start, p.param_start, p.numel) for p in ps]
                names[g][gname] = group[name]
    base = [_get(osd, "base_optimizer_state", f) for osd, f in zip(osds, files)]
    states = [_group_states(b, f, len(shapes)) for b, f in zip(base, files)]
    _add_params(out, names, pieces, masters, states, files, module_of=weights.get)
    return names


def _group_states(base: Any, f: Path, groups: int) -> list[dict[str, Any]]:
    """Per parameter group, the flat optimizer state (``key -> flat tensor or scalar``; empty
    for a group the optimizer has not stepped)."""
    state = base.get("state") if isinstance(base, dict) else None
    if isinstance(base, list):  # elastic checkpoints: one state dict per group
        state = dict(enumerate(base))
    if not isinstance(state, dict) or set(state) - set(range(groups)):
        raise ConversionError(f"{f}: the base optimizer state is not one state per parameter group (of {groups}): "
                              f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    out = [state.get(g, {}) for g in range(groups)]
    if not all(isinstance(s, dict) for s in out):
        raise ConversionError(f"{f}: the base optimizer state of a parameter group is not a dict")
    return [dict(s) for s in out]


# --- ZeRO-3 --------------------------------------------------------------------------------


def _zero3(out: Imported, optims: list[Any], files: list[Path], models: list[dict[str, Any]],
           shapes: list[dict[str, tuple[int, ...]]]) -> None:
    world = len(files)
    osds = [_get(o, "optimizer_state_dict", f) for o, f in zip(optims, files)]
    pieces = zero3_pieces(shapes, world)
    masters = [list(_get(osd, "fp32_flat_groups", f)) for osd, f in zip(osds, files)]
    states = [_group_states(_get(osd, "optimizer_state_dict", f), f, len(shapes)) for osd, f in zip(osds, files)]
    module = models[0].get("module") or {}
    dtypes = {n: t.dtype for n, t in module.items() if isinstance(t, torch.Tensor)}
    _add_params(out, shapes, pieces, masters, states, files, module_of=lambda n: None, dtypes=dtypes)
    # frozen parameters: each rank holds its part (training dtype), the last part padded
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        frags = [(m.get("frozen_param_fragments") or {}).get(name) for m in models]
        if any(t is None for t in frags):
            raise ConversionError(f"frozen parameter {name!r}: a rank's model-states file lacks its fragment")
        numel = math.prod(shape)
        part = frags[0].numel()
        flat_pieces = [FlatPiece(r, 0, 0, r * part, max(0, min(part, numel - r * part))) for r in range(world)]
        out.tensors[f"model.{name}"] = FlatParam(tuple(shape), frags[0].dtype, [p for p in flat_pieces if p.numel],
                                                 lambda r, g, fr=frags: fr[r], f"frozen parameter {name!r}")


# --- shared --------------------------------------------------------------------------------


def _add_params(
    out: Imported,
    shapes: list[dict[str, tuple[int, ...]]],
    pieces: dict[str, list[FlatPiece]],
    masters: list[list[torch.Tensor]],
    states: list[list[dict[str, Any]]],
    files: list[Path],
    *,
    module_of: Callable[[str], torch.Tensor | None],
    dtypes: dict[str, torch.dtype] | None = None,
) -> None:
    """Sources for each trainable parameter, its fp32 master and its optimizer states."""
    for g, group in enumerate(shapes):
        _check_lengths(g, group, pieces, masters, files)
        keys = _flat_keys(g, states, masters, files)
        for name, shape in group.items():
            ps = pieces[name]
            master = FlatParam(shape, torch.float32, ps, lambda r, gg: masters[r][gg], f"fp32 master of {name!r}")
            held = module_of(name)
            if isinstance(held, torch.Tensor) and held.numel() == math.prod(shape):
                out.tensors[f"model.{name}"] = Mapped(held.reshape(shape))
                if held.dtype != torch.float32:
                    out.tensors[f"optim.state.{name}.fp32"] = master
            else:
                dtype = (dtypes or {}).get(name, torch.float32)
                out.tensors[f"model.{name}"] = master if dtype == torch.float32 else Cast(master, dtype)
                if dtype != torch.float32:
                    out.tensors[f"optim.state.{name}.fp32"] = master
            for key in keys:
                out.tensors[f"optim.state.{name}.{key}"] = FlatParam(
                    shape, states[0][g][key].dtype, ps, lambda r, gg, k=key: states[r][gg][k], f"{key!r} of {name!r}"
                )
            for key, v in states[0][g].items():
                if key in keys:
                    continue
                if isinstance(v, torch.Tensor):
                    out.tensors[f"optim.state.{name}.{key}"] = InMemory(v.clone())
                else:
                    out.values[f"optim.state.{name}.{key}"] = plain(v)


def _check_lengths(g: int, group: dict[str, Any], pieces: dict[str, list[FlatPiece]], masters: list[list[torch.Tensor]],
                   files: list[Path]) -> None:
    for name in group:
        for p in pieces[name]:
            if p.rank >= len(masters) or g >= len(masters[p.rank]):
                raise ConversionError(f"{files[min(p.rank, len(files) - 1)]}: no flat fp32 group {g} (parameter {name!r})")
            n = masters[p.rank][g].numel()
            if p.start + p.numel > n:
                raise ConversionError(
                    f"{files[p.rank]}: parameter {name!r} needs elements [{p.start}, {p.start + p.numel}) of flat group "
                    f"{g}, which has {n}: the partitions do not match the parameter shapes"
                )


def _flat_keys(g: int, states: list[list[dict[str, Any]]], masters: list[list[torch.Tensor]], files: list[Path]) -> list[str]:
    """The optimizer state keys of group ``g`` held as flat tensors like the fp32 partition
    (possibly longer: the state of a non-elastic checkpoint keeps the group's end padding)."""
    keys = []
    for key, v in states[0][g].items() if g < len(states[0]) else ():
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() >= masters[0][g].numel() and v.numel() > 1:
            keys.append(key)
    for r, st in enumerate(states):
        for key in keys:
            v = st[g].get(key) if g < len(st) else None
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.numel() < masters[r][g].numel():
                raise ConversionError(f"{files[r]}: optimizer state {key!r} of group {g} is missing or not flat like rank 0's")
    return keys


def _other_state(out: Imported, model: dict[str, Any], osd: dict[str, Any], names: list[dict[str, Any]],
                 weights: dict[str, Any] | None = None) -> None:
    """Frozen parameters (ZeRO-1/2), buffers, tied copies, param groups, scheduler, client
    and engine state (``weights``: the module's state dict, by default ``model["module"]``)."""
    if weights is None:
        weights = model.get("module") or {}
    for name in model.get("buffer_names") or []:
        if not isinstance(weights.get(name), torch.Tensor):
            raise ConversionError(f"{out.layout['source']['folder']}: buffer {name!r} (in buffer_names) is in no weights "
                                  "file (a layer file missing?)")
        out.tensors[f"model.{name}"] = Mapped(weights[name])
    for name, t in (model.get("frozen_param_fragments") or {}).items():
        shape = tuple((model.get("frozen_param_shapes") or {}).get(name, ()))
        if f"model.{name}" not in out.tensors and isinstance(t, torch.Tensor) and t.numel() == math.prod(shape):
            out.tensors[f"model.{name}"] = Mapped(t.reshape(shape))
    for tied, source in (model.get("shared_params") or {}).items():  # stored once: the alias, its master and
        for key in [k for k in out.tensors if k == f"model.{source}" or k.startswith(f"optim.state.{source}.")]:
            if out.tensors[key].shape:  # moments read the source's (a scalar such as the step is no tie)
                out.ties[key.replace(source, tied, 1)] = key
    known = {n for g in names for n in g} | set(model.get("frozen_param_shapes") or {}) | set(model.get("shared_params") or {})
    for name, t in weights.items():  # the rest of the module (ZeRO-1 keeps frozen parameters only here)
        if f"model.{name}" not in out.tensors and f"model.{name}" not in out.ties and isinstance(t, torch.Tensor) and not (
            name in known and t.numel() == 0
        ):
            out.tensors[f"model.{name}"] = Mapped(t)
    groups = _param_groups(osd)
    if groups is not None:  # "params" index the flat (sub-)groups, whose parameters ``names`` lists
        flat = [list(g) for g in names]
        out.values["optim.param_groups"] = [
            {k: plain(v) for k, v in grp.items() if k != "params"}
            | {"params": [n for i in grp.get("params", []) if isinstance(i, int) and i < len(flat) for n in flat[i]]}
            for grp in groups if isinstance(grp, dict)
        ]
    out.values["lr_scheduler"] = plain(model.get("lr_scheduler"))
    for key, v in model.items():
        if key not in ENGINE_KEYS:
            out.values[f"client_state.{key}"] = plain(v)
    for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version", "checkpoint_parallel_dimensions", "buffer_names", "frozen_param_shapes", "shared_params",
                "universal_checkpoint_info"):
        if key in model:
            out.values[f"deepspeed.{key}"] = plain(model[key])
    for key in _OPTIMIZER_SCALARS:
        if key in osd:
            v = osd[key]
            out.values[f"deepspeed.{key}"] = _scalar(v) if key == "zero_stage" else plain(v)


def _param_groups(osd: dict[str, Any]) -> list[dict[str, Any]] | None:
    for holder in (osd.get("base_optimizer_state"), osd.get("optimizer_state_dict")):
        if isinstance(holder, dict) and isinstance(holder.get("param_groups"), list):
            return holder["param_groups"]
    return None


# --- sources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatParam:
    """A parameter-shaped tensor held as flat pieces of the ranks' memory-mapped flat
    buffers (``flat(rank, group)``). A box is read as the whole rows that cover it: a view
    of the buffer when one piece holds them (its pages dropped once written, ``release``),
    else a copy of the pieces (their pages dropped at once)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Sequence[FlatPiece]
    flat: Callable[[int, int], torch.Tensor]
    what: str

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        rows, parts = self._parts(box)
        if len(parts) == 1:  # one rank's buffer holds the rows: a view, released once written
            return parts[0].reshape(rows.shape), rows
        out = torch.empty(rows.numel, dtype=self.dtype)
        at = 0
        for src in parts:
            out[at : at + src.numel()] = src
            at += src.numel()
            release_pages(src)
        return out.reshape(rows.shape), rows

    def release(self, box: Box) -> None:
        _, parts = self._parts(box)
        if len(parts) == 1:
            release_pages(parts[0])

    def _parts(self, box: Box) -> tuple[Box, list[torch.Tensor]]:
        """The rows covering ``box`` and the slices of the ranks' buffers holding them, in order."""
        rows = _rows(self.shape, box)
        row = math.prod(self.shape[1:]) if self.shape else 1
        start = rows.offset[0] * row if self.shape else 0
        stop = start + rows.numel
        held = pieces_in(self.pieces, start, stop)
        if sum(b - a for _, a, b in held) != stop - start:
            raise ConversionError(f"{self.what}: the ranks' partitions do not hold elements [{start}, {stop})")
        parts = []
        for p, a, b in held:
            src = self.flat(p.rank, p.group)[p.start + a - p.param_start : p.start + b - p.param_start]
            if src.dtype != self.dtype:
                raise ConversionError(f"{self.what}: rank {p.rank} holds {src.dtype}, rank 0 {self.dtype}")
            parts.append(src)
        return rows, parts


@dataclass(frozen=True)
class Mapped(InMemory):
    """A whole tensor memory-mapped from a file: a box is read as a view of the rows
    covering it, whose pages are dropped once written (resident memory stays at a few
    shards, not the file's size)."""

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        rows = _rows(self.shape, box)
        return (self.tensor[rows.slices()] if self.shape else self.tensor), rows

    def release(self, box: Box) -> None:
        rows = _rows(self.shape, box)
        release_pages(self.tensor[rows.slices()] if self.shape else self.tensor)


@dataclass(frozen=True)
class Consolidated:
    """A consolidated tensor assembled from the tensor-parallel ranks' local tensors
    (``[(pieces, local source), ...]``, pieces as :func:`ucp_zarr.place` computes them). A
    block several ranks hold (an affine map's replicated piece) is taken from the first and
    must be equal on the others, as DeepSpeed's ``rebuild`` requires."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Sequence[tuple[Sequence[Piece], Any]]
    what: str

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        rows = _rows(self.shape, box)
        out = torch.empty(rows.shape, dtype=self.dtype)
        covered = 0
        written: set[Box] = set()
        for t, (pieces, source) in enumerate(self.parts):
            for p in pieces:
                inter = p.dst.intersect(rows)
                if inter is None or inter.is_empty():
                    continue
                if p.step is not None or p.base is not None:
                    raise ConversionError(f"tensor {self.what!r}: strided pieces are not supported by the converter")
                local = Box(tuple(s + i - d for s, i, d in zip(p.src.offset, inter.offset, p.dst.offset)), inter.shape)
                held, at = source.read(local)
                block = held[local.relative_to(at).slices()]
                dst = out[inter.relative_to(rows).slices()]
                if p.dst in written:
                    if not torch.equal(dst, block):
                        raise ConversionError(f"tensor {self.what!r}: tensor-parallel rank {t} holds other values than "
                                              f"an earlier rank for the block {list(p.dst.offset)}+{list(p.dst.shape)} "
                                              "they both hold")
                else:
                    dst.copy_(block)
                    covered += inter.numel
                if hasattr(source, "release"):
                    source.release(local)
            written.update(p.dst for p in pieces)
        if covered != rows.numel:
            raise ConversionError(f"tensor {self.what!r}: the tensor-parallel ranks cover {covered} of {rows.numel} elements")
        return out, rows


@dataclass(frozen=True)
class Cast:
    """A source read in another dtype (ZeRO-3's low-precision weights are the fp32 masters
    rounded, as the engine rounds them after each step)."""

    source: FlatParam
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        t, held = self.source.read(box)
        out = t.to(self.dtype)
        self.source.release(box)
        return out, held


def _rows(shape: tuple[int, ...], box: Box) -> Box:
    """The whole rows (along dim 0) covering ``box``: one contiguous flat range."""
    if not shape:
        return Box((), ())
    return Box((box.offset[0],) + (0,) * (len(shape) - 1), (box.shape[0],) + tuple(shape[1:]))
