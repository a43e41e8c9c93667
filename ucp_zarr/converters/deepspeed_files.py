"""Which files a DeepSpeed checkpoint folder holds (found by name), what each must contain before it
is read (weights-only), and how its MoE experts are grouped."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConversionError
from ..format.safe_paths import inside
from .base import Opaque, torch_load_mapped


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


def parallel_degrees(dims: Any, where: str) -> tuple[int, int]:
    """The pipeline and tensor-parallel degrees a model-states file (``where``) records in
    ``checkpoint_parallel_dimensions`` (1 and 1 where it records none)."""
    dims = dims if isinstance(dims, dict) else {}
    try:
        return int(dims.get("pp_degree") or 1), int(dims.get("tp_degree") or 1)
    except (TypeError, ValueError):
        raise ConversionError(f"{where}: checkpoint_parallel_dimensions {dims!r} are not integers") from None


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
