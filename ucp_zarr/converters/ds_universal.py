"""DeepSpeed universal checkpoints (``ds_to_universal`` output) in, and out as a folder that
DeepSpeed's ``load_checkpoint`` reads with ``"checkpoint": {"load_universal": true}`` on any
data-parallel world size and ZeRO stage.

A universal folder, as DeepSpeed writes it::

    <parent>/latest_universal                 names <tag>_universal
    <parent>/<tag>_universal/
        zero/<param name>/fp32.pt             the fp32 master, {"param": tensor, "cat_dim": 0}
        zero/<param name>/<key>.pt            each optimizer state (exp_avg, exp_avg_sq, ...)
        zero/<param name>/step.pt             the step (ZeRO-1/2 outputs; a bare value)
        zero/optimizer_state.pt               param_groups, loss scaler, rank 0's ZeRO-3 state
        mp_rank_00_model_states.pt            (ZeRO-1/2) or zero_pp_rank_<r>_mp_rank_00_model_states.pt
                                              (ZeRO-3): copies of the source's model-states files

ZeRO-1/2 outputs hold each state in the parameter's shape; ZeRO-3 outputs hold bare flat
tensors (no dict, no ``step.pt``: the step is in ``optimizer_state.pt``).

**In** (:func:`read`): the keys are those of the ZeRO importer (see
:mod:`ucp_zarr.converters.deepspeed`), so a universal folder and the ZeRO checkpoint it was
made from convert to the same checkpoint: every ``zero/<name>/<key>.pt`` of a trainable
parameter becomes ``optim.state.<name>.<key>`` in the parameter's shape; the master goes to
``optim.state.<name>.fp32`` when the module's dtype is not fp32, else it is
``model.<name>``; ``model.<name>`` is the module's weight where the model-states file holds
it (ZeRO-1/2), else the master cast to the module's dtype. Each ``.pt`` is opened at import
only to learn its shape and dtype (memory-mapped, weights-only, DeepSpeed's classes rebuilt
as :class:`~.base.Opaque` records), and read again, one file at a time per writing thread,
when its shard is written.

**Out** (:func:`write`): ``dst/latest_universal`` and ``dst/<tag>_universal/`` with one
folder per trainable parameter (``fp32.pt`` and every ``optim.state.<name>.<key>`` the
checkpoint holds, whatever the optimizer), ``zero/optimizer_state.pt``, and the
model-states file under both names a loading engine looks for (``mp_rank_00_...`` for
ZeRO-1/2, ``zero_pp_rank_0_mp_rank_00_...`` for ZeRO-3), rebuilt from the values the ZeRO
importer keeps (``deepspeed.*``, ``lr_scheduler``, ``client_state.*``,
``optim.param_groups``) and the tensors' shapes; its module holds the non-trainable tensors
whole (buffers, frozen parameters, tied copies) and each trainable parameter as an empty
tensor of its training dtype (its values are in ``zero/``; imported again, ``model.<name>``
is the master cast to that dtype, as ``load_universal`` itself makes the module's weights).
Streamed one parameter at a time into a temporary folder renamed into place at the end.
Parameter names, state keys and the tag become file names, so each must be one plain file
name (:mod:`ucp_zarr.format.safe_paths`): ``model.../../x`` is refused with
:class:`~ucp_zarr.errors.UnsafePathError`, as are such names in an imported folder's files.

What ``load_universal`` reads from the model-states file (DeepSpeed 0.19): exactly one file
(its ``mp_world_size`` must be 1), ``dp_world_size``, ``global_steps``, ``skipped_steps``,
``mp_world_size``, ``global_samples`` (optional), ``lr_scheduler`` (when the engine has a
scheduler), ``data_sampler``/``random_ltd`` (when enabled); every other key comes back as
client state. It does not read the module: the weights come from ``zero/``; frozen
parameters and buffers are not restored by DeepSpeed at all (they keep the values the new
engine's model was built with). From ``optimizer_state.pt``: ``param_groups`` and
``ds_version`` (ZeRO-1/2), ``optimizer_state_dict.state[0].step`` and
``optimizer_state_dict.param_groups[0]`` (ZeRO-3, which applies group 0's hyper-parameters
to every group), the loss scaler and its flags.

A folder made from a pipeline checkpoint holds each stage's model-states file
(``mp_rank_XX``: ``mp_world_size`` counts the stages there); the parameters are those of
every stage, named by global layer index, in the dtype of the engine's ``ds_config`` (no
layer file is there: buffers and frozen parameters are not in such a folder, and DeepSpeed's
``load_universal`` does not restore them either).

Not supported (refused with :class:`~ucp_zarr.errors.ConversionError`): universal folders
made from tensor-parallel sources (``tp_degree > 1``). Limits of DeepSpeed
itself that an export cannot lift: a ZeRO-3 engine loads only ``fp32``, ``exp_avg`` and
``exp_avg_sq`` (so SGD's ``momentum_buffer`` loads only into ZeRO-1/2 engines) and gives
every group group 0's hyper-parameters; a per-parameter scalar other than ``step`` is
written as a bare value, which DeepSpeed's ZeRO-1/2 loader cannot take (no DeepSpeed
optimizer keeps one).
"""

from __future__ import annotations

import copyreg
import math
import pickle
import re
import shutil
import types
import warnings
from collections import OrderedDict
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConversionError, Keyword
from ..layout import Box
from ..layout.zero import FlatPiece
from ..format.safe_paths import check_name, inside
from ..io.store import at_once
from ..protocol.writer import InMemory
from .base import Imported, Opaque, atomic_folder, int_keys, plain, read_ahead, release_pages, torch_load, torch_load_mapped
from .deepspeed_files import _EXPERT, OPAQUE, _check_rank_numbers, _get, _load, _rank, _scalar, parallel_degrees
from .deepspeed_zero import FlatParam, Mapped, _other_state, _rows

UNIVERSAL_OPAQUE = OPAQUE + ("deepspeed.checkpoint.universal_checkpoint.SubparamShape",)
"""DeepSpeed classes a universal folder pickles (``SubparamShape`` tags fused parameters of
tensor-parallel sources), rebuilt as records without importing them."""

LATEST = "latest_universal"
OPTIMIZER_STATE = "optimizer_state.pt"
MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""The model-states file names an exported folder holds: what a ZeRO-1/2 and a ZeRO-3
engine look for."""
DS_VERSION_FALLBACK = "0.19.8"
"""``ds_version`` written when the checkpoint records none and DeepSpeed is not installed
(DeepSpeed refuses a universal folder without one)."""
MASTER = "fp32"


# --- in ------------------------------------------------------------------------------------------


def read(src: Path, *, trust: bool = False) -> Imported:
    """Import the universal folder ``src`` (the ``<tag>_universal`` folder, or the folder
    holding ``latest_universal``). It takes no ``prefix`` (the keys are DeepSpeed's) and
    no ``rules`` (it is consolidated already)."""
    folder = universal_folder(Path(src))
    zero = folder / "zero"
    models, model_files = _model_states(folder, trust)
    model = models[0]
    stages = _pipeline_stages(folder, model, model_files[0], trust)
    osd_file = zero / OPTIMIZER_STATE
    osd = _load(osd_file, trust) if osd_file.is_file() else None
    if osd is None:
        raise ConversionError(f"{osd_file}: no such file: not a DeepSpeed universal checkpoint folder (or an incomplete one)")
    shapes: list[dict[str, tuple[int, ...]]] = []
    for m, f in stages or [(model, model_files[0])]:  # a pipeline: each stage's parameters, the tied ones once
        for g, group in enumerate(_get(m, "param_shapes", f)):
            shapes += [{}] * (g + 1 - len(shapes))
            shapes[g] |= {n: tuple(int(x) for x in s) for n, s in group.items() if n not in shapes[g]}
    stage = osd.get("zero_stage")
    out = Imported(layout={"source": {
        "format": "ds-universal", "folder": folder.name, "zero_stage": None if stage is None else int(_scalar(stage)),
        "world": model.get("dp_world_size"),
    } | ({"pp": len(stages)} if stages else {})})
    module = model.get("module") or {}
    if stages:  # the stages' weights are in layer files, which a universal folder does not hold
        module = {n: torch.empty(0, dtype=_training_dtype(model)) for g in shapes for n in g}
    group_states = _group_states(osd)
    for g, group in enumerate(shapes):
        scalars = group_states[g] if g < len(group_states) else {}
        for name, shape in group.items():
            where = inside(zero, name, f"{model_files[0]}: param_shapes names the parameter")
            _add_param(out, where, name, shape, module.get(name), scalars, trust)
    _frozen_zero3(out, models, model_files)
    if stages:
        buffers = [str(b) for m, _ in stages for b in m.get("buffer_names") or []]
        if buffers:
            warnings.warn(f"ucp_zarr: {folder.name}: the buffers {buffers[:3]}{' ...' * (len(buffers) > 3)} of the "
                          "pipeline's layer files are not in its universal folder, nor in the conversion (DeepSpeed's "
                          "load_universal keeps the model's own too); convert the pipeline checkpoint itself to keep "
                          "them", stacklevel=2)
        model = dict(model, buffer_names=[])
    _other_state(out, model, _as_zero_osd(osd), shapes)
    return out


def _pipeline_stages(folder: Path, model: dict[str, Any], f: Path, trust: bool) -> list[tuple[dict[str, Any], Path]]:
    """The model-states file of each pipeline stage (``mp_rank_XX``, as ``ds_to_universal``
    copies them from a pipeline checkpoint, whose ``mp_world_size`` counts its stages), or
    ``[]`` when the source was no pipeline; tensor-parallel sources are refused."""
    pp, tp = parallel_degrees(model.get("checkpoint_parallel_dimensions"), str(f))
    try:
        mp = int(model.get("mp_world_size", 1) or 1)
    except (TypeError, ValueError):
        raise ConversionError(f"{f}: mp_world_size {model.get('mp_world_size')!r} is not an integer") from None
    if tp > 1 or mp != pp * tp:
        raise ConversionError(f"{f}: made from a tensor-parallel checkpoint (mp_world_size {mp}, "
                              f"checkpoint_parallel_dimensions {model.get('checkpoint_parallel_dimensions')}), which this "
                              "converter does not read yet")
    if pp == 1:
        return []
    files = [folder / f"mp_rank_{s:02d}_model_states.pt" for s in range(pp)]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise ConversionError(f"{folder}: made from a pipeline of {pp} stages, but {missing} are missing: each stage's "
                              "model-states file names its parameters")
    return [(model, files[0])] + [(_load(p, trust), p) for p in files[1:]]


def _training_dtype(model: dict[str, Any]) -> torch.dtype:
    """The dtype the engine trained in, by its ``ds_config`` (``bf16``/``fp16`` enabled)."""
    config = model.get("ds_config")
    config = config if isinstance(config, dict) else {}
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return torch.float32


def universal_folder(src: Path) -> Path:
    """The ``<tag>_universal`` folder: ``src`` itself (it holds ``zero/``), or the tag that
    ``src/latest_universal`` names."""
    if not src.is_dir():
        raise ConversionError(f"{src}: not a folder (give the folder holding '{LATEST}', or a <tag>_universal folder)")
    if (src / "zero").is_dir():
        return src
    latest = src / LATEST
    if not latest.is_file():
        raise ConversionError(f"{src}: neither a zero/ folder nor a '{LATEST}' file: not a DeepSpeed universal checkpoint")
    folder = inside(src, latest.read_text(errors="replace").strip(), f"{latest}: the tag")
    if not (folder / "zero").is_dir():
        raise ConversionError(f"{latest} names {folder.name!r}, which is not a universal folder (with zero/) beside it")
    return folder


def _model_states(folder: Path, trust: bool) -> tuple[list[dict[str, Any]], list[Path]]:
    """The model-states file to read (``mp_rank_00`` when there, as ZeRO-1/2 and our exports
    hold it), else every ZeRO-3 rank's (their frozen-parameter fragments), in rank order."""
    plain_file = folder / MODEL_FILES[0]
    if plain_file.is_file():
        return [_load(plain_file, trust)], [plain_file]
    files = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=_rank)
    if not files:
        if any(folder.glob("*mp_rank_0[1-9]*model_states.pt")):
            raise ConversionError(f"{folder}: made from a tensor-parallel checkpoint, which this converter does not read yet")
        raise ConversionError(f"{folder}: no {MODEL_FILES[0]} nor zero_pp_rank_*_mp_rank_00_model_states.pt file: the "
                              "model-states files of the source checkpoint are missing")
    _check_rank_numbers(files, "model-states")
    return [_load(f, trust) for f in files], files


def _group_states(osd: dict[str, Any]) -> list[dict[str, Any]]:
    """Per flat group, the per-group optimizer scalars (``step``...) of rank 0 (ZeRO-3
    outputs keep them here instead of in ``step.pt``)."""
    inner = osd.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        return []
    return [dict(state[g]) if isinstance(state[g], dict) else {} for g in sorted(state)]


def _as_zero_osd(osd: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_state.pt`` as the ZeRO importer's helpers read an optimizer file's
    ``optimizer_state_dict`` (ZeRO-1/2 outputs keep ``param_groups`` at the top)."""
    if isinstance(osd.get("param_groups"), list) and not isinstance(osd.get("base_optimizer_state"), dict):
        return dict(osd) | {"base_optimizer_state": {"param_groups": osd["param_groups"]}}
    return osd


def _add_param(out: Imported, folder: Path, name: str, shape: tuple[int, ...], held: Any, scalars: dict[str, Any],
               trust: bool) -> None:
    if not folder.is_dir():
        raise ConversionError(f"{folder}: missing: the universal checkpoint holds no state of parameter {name!r}")
    files = {f.name[:-3]: f for f in folder.iterdir() if f.name.endswith(".pt") and f.is_file()}
    if MASTER not in files:
        raise ConversionError(f"{folder / 'fp32.pt'}: missing: parameter {name!r} has no fp32 master")
    numel = math.prod(shape)
    for key in [MASTER] + sorted(k for k in files if k != MASTER):
        f = files[key]
        obj = _load_any(f, trust)
        t = _tensor_in(obj)
        if key == MASTER and t is None:
            raise ConversionError(f"{f}: holds no tensor (a {type(obj).__name__}), not the fp32 master of {name!r}")
        if key == "step" or t is None:  # a per-parameter scalar (DeepSpeed writes the bare step)
            if isinstance(obj, torch.Tensor):
                out.tensors[f"optim.state.{name}.{key}"] = InMemory(obj.detach().clone())
            else:
                out.values[f"optim.state.{name}.{key}"] = plain(obj)
            continue
        if t.numel() != numel:
            raise ConversionError(
                f"{f}: holds {t.numel()} elements, but parameter {name!r} has shape {list(shape)} ({numel}); the file "
                "belongs to another model or to a tensor-parallel source"
            )
        source = FileTensor(f, shape, t.dtype, trust, f"{key!r} of {name!r}")
        del obj, t
        if key != MASTER:
            out.tensors[f"optim.state.{name}.{key}"] = source
            continue
        if isinstance(held, torch.Tensor) and held.numel() == numel:  # ZeRO-1/2: the module's own weight
            out.tensors[f"model.{name}"] = Mapped(held.reshape(shape))
            if held.dtype != torch.float32:
                out.tensors[f"optim.state.{name}.fp32"] = source
        else:
            dtype = held.dtype if isinstance(held, torch.Tensor) else torch.float32
            out.tensors[f"model.{name}"] = source if dtype == source.dtype else source.cast(dtype)
            if dtype != torch.float32:
                out.tensors[f"optim.state.{name}.fp32"] = source
    for key, v in scalars.items():  # ZeRO-3: per-group scalars, where no file of the parameter holds them
        if key in files or (isinstance(v, torch.Tensor) and v.dim() > 0):
            continue
        if isinstance(v, torch.Tensor):
            out.tensors[f"optim.state.{name}.{key}"] = InMemory(v.detach().clone())
        else:
            out.values[f"optim.state.{name}.{key}"] = plain(v)


def _frozen_zero3(out: Imported, models: list[dict[str, Any]], files: list[Path]) -> None:
    """Frozen parameters of ZeRO-3 outputs: each rank's model-states file holds its part."""
    if len(models) < 2:
        return  # one file holds them whole (read with the rest of the module)
    world = len(models)
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        frags = [(m.get("frozen_param_fragments") or {}).get(name) for m in models]
        if any(not isinstance(t, torch.Tensor) for t in frags):
            bad = next(f for f, t in zip(files, frags) if not isinstance(t, torch.Tensor))
            raise ConversionError(f"{bad}: no fragment of frozen parameter {name!r}")
        numel, part = math.prod(shape), frags[0].numel()
        pieces = [FlatPiece(r, 0, 0, r * part, max(0, min(part, numel - r * part))) for r in range(world)]
        out.tensors[f"model.{name}"] = FlatParam(tuple(shape), frags[0].dtype, [p for p in pieces if p.numel],
                                                 lambda r, g, fr=frags: fr[r], f"frozen parameter {name!r}")


def _load_any(f: Path, trust: bool) -> Any:
    return torch_load(f, trust=trust, opaque=UNIVERSAL_OPAQUE)


def _tensor_in(obj: Any) -> torch.Tensor | None:
    """The tensor of a ``zero/<name>/<key>.pt`` file: ``{"param": t, ...}`` or a bare ``t``."""
    if isinstance(obj, dict):
        t = obj.get("param")
        return t if isinstance(t, torch.Tensor) else None
    return obj if isinstance(obj, torch.Tensor) and obj.dim() > 0 else None


@dataclass(frozen=True)
class FileTensor:
    """One ``zero/<name>/<key>.pt`` tensor in the parameter's shape (the file may hold it
    flat), read in ``dtype`` when a box is asked: the file is memory-mapped and only the rows
    covering the box are copied."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    trust: bool
    what: str

    def cast(self, dtype: torch.dtype) -> "FileTensor":
        return FileTensor(self.path, self.shape, dtype, self.trust, self.what)

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        obj, mapped = torch_load_mapped(self.path, trust=self.trust, opaque=UNIVERSAL_OPAQUE)
        t = _tensor_in(obj)
        numel = math.prod(self.shape)
        if t is None or t.numel() != numel:
            raise ConversionError(f"{self.path}: no longer holds the {numel} elements of {self.what} (changed since import)")
        rows = _rows(self.shape, box)
        row = math.prod(self.shape[1:]) if self.shape else 1
        start = rows.offset[0] * row if self.shape else 0
        src = t.detach().reshape(-1)[start : start + rows.numel]
        out = src.to(self.dtype, copy=True)
        if mapped:
            release_pages(src)
        return out.reshape(rows.shape), rows


# --- out -----------------------------------------------------------------------------------------


def _exported(name: str) -> bool:
    """Whether an entry of a folder is one an export writes (an earlier one is replaced with
    ``overwrite``): ``latest_universal`` and ``<tag>_universal`` folders."""
    return name == LATEST or name.endswith("_universal")


def write(
    ck: Any,
    dst: Path,
    *,
    overwrite: bool = False,
    tag: str | None = None,
    ep_size: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Export ``ck`` (keys as the ZeRO importer names them) into the folder ``dst``:
    ``dst/latest_universal`` naming ``<tag>_universal`` (``tag`` defaults to
    ``global_step<deepspeed.global_steps>``), which DeepSpeed's ``load_checkpoint(dst)``
    reads with ``load_universal`` on any world size and ZeRO stage. A pipeline engine's stage
    ``s`` reads ``mp_rank_<s>_model_states.pt``: the folder holds one (a link to the first)
    for each stage of a pipeline source, as ``ds_to_universal`` copies the source's, with
    ``mp_world_size`` their count (DeepSpeed checks it, for ZeRO-3's names too).

    MoE experts (``...deepspeed_experts.<E>...``) are written under their global index, and
    ``load_universal`` opens ``zero/<name>`` by each engine's *local* names: expert-parallel
    rank 1 of an ``ep_size=2`` engine would take global experts 0 and 1 for its own (2 and
    3). A checkpoint with experts is exported only with ``ep_size=1``, the engines such a
    folder loads right (as DeepSpeed's ``ds_to_universal`` makes none for ``ep_size > 1``)."""
    values = ck.metadata["values"]
    tensors = ck.meta.tensors
    dims = values.get("deepspeed.checkpoint_parallel_dimensions")
    pp, tp = parallel_degrees(dims, f"checkpoint {ck.store.url}")
    if tp > 1 or int(values.get("deepspeed.mp_world_size", 1) or 1) != pp * tp:
        raise ConversionError(f"a tensor-parallel DeepSpeed checkpoint (mp_world_size "
                              f"{values.get('deepspeed.mp_world_size')}, {dims}) cannot be exported yet")
    groups = values.get("optim.param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ConversionError(
            f"checkpoint {ck.store.url} has no value 'optim.param_groups' listing the trainable parameters by name per "
            "group: a universal checkpoint needs them (convert from DeepSpeed, or save optimizer state dicts with "
            "parameter names)"
        )
    names = [n for g in groups for n in g["params"]]
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ConversionError(f"'optim.param_groups' lists a parameter twice, or not by name: {names}")
    experts = [n for n in names if _EXPERT.fullmatch(n)]
    if experts and ep_size != 1:
        raise ConversionError(
            f"checkpoint {ck.store.url} holds MoE experts ({experts[0]!r}, ...): DeepSpeed's load_universal finds each "
            "expert's folder by the engine's local expert index, so a universal folder loads right only into engines "
            f"with ep_size 1{'' if ep_size is None else f' (not {ep_size})'}; for those, pass ", Keyword("ep_size", 1))
    if ep_size is not None and ep_size != 1:
        raise ConversionError(f"ep_size {ep_size!r}: a universal folder loads right only into engines with ep_size 1")
    models = {k[len("model."):] for k in tensors if k.startswith("model.")}
    state_keys = _state_keys(list(tensors) + list(values), set(names) | models)
    unlisted = [n for n in state_keys if n not in set(names)]
    if unlisted:
        # DeepSpeed's loader reads only the groups' hyper-parameters by index, never which
        # parameters a group lists: write them all rather than drop state
        warnings.warn(f"parameters {unlisted} hold optimizer state but no group of 'optim.param_groups' lists them; "
                      "they are written (in the last group's param_shapes)", stacklevel=2)
    shapes: list[OrderedDict[str, torch.Size]] = []
    dtypes: dict[str, torch.dtype] = {}
    for i, g in enumerate(groups):
        shapes.append(OrderedDict())
        for name in g["params"] + (unlisted if i == len(groups) - 1 else []):
            holder = f"model.{name}" if f"model.{name}" in tensors else f"optim.state.{name}.fp32"
            if holder not in tensors:
                raise ConversionError(f"parameter {name!r} of 'optim.param_groups' has no tensor 'model.{name}' in "
                                      f"checkpoint {ck.store.url}")
            shapes[-1][name] = torch.Size(tensors[holder].shape)
            dtypes[name] = getattr(torch, tensors[holder].dtype if holder.startswith("model.") else "float32")
    steps = values.get("deepspeed.global_steps", values.get("step", 0))
    folder_name = check_name(f"{tag or f'global_step{steps}'}_universal",
                             "the tag's folder" if tag else f"checkpoint {ck.store.url}: the folder of its step")
    with atomic_folder(Path(dst), overwrite=overwrite, ours=_exported, what="an export to ds-universal") as tmp:
        folder = tmp / folder_name
        zero = folder / "zero"
        zero.mkdir(parents=True)
        group_steps: list[Any] = [None] * len(shapes)
        params = [(i, name, shape, _param_tensors(ck, name, state_keys.get(name, [])))
                  for i, group in enumerate(shapes) for name, shape in group.items()]
        read = read_ahead(ck.store, lambda p: {k: ck.read(k) for k in p[3]}, params,
                          lambda p: sum(tensors[ck.meta.canonical(k)].nbytes for k in p[3]))
        with closing(read) as ahead:
            for (i, name, shape, _), got in zip(params, ahead):
                where = f"checkpoint {ck.store.url}: the parameter of 'optim.param_groups' (or of its optimizer state)"
                step = _write_param(ck, values, inside(zero, name, where, write=True), name, shape,
                                    state_keys.get(name, []), progress, got or {})
                if group_steps[i] is None:
                    group_steps[i] = step
        _save(_optimizer_state(values, groups, group_steps), zero / OPTIMIZER_STATE)
        model = _model_state(ck, values, shapes, dtypes, pp, progress)
        _save(model, folder / MODEL_FILES[0])
        lean = dict(model) | {"module": OrderedDict((n, torch.empty(0, dtype=t.dtype)) for n, t in model["module"].items())}
        _save(lean, folder / MODEL_FILES[1])
        for stage in range(1, pp):  # a pipeline engine's stage s reads mp_rank_<s>: as many as the source had
            for name in MODEL_FILES:
                copy = folder / name.replace("mp_rank_00", f"mp_rank_{stage:02d}")
                try:
                    copy.hardlink_to(folder / name)
                except OSError:  # (a file system without links)
                    shutil.copyfile(folder / name, copy)
        (tmp / LATEST).write_text(folder_name)
    return Path(dst)


def _state_keys(keys: list[str], names: set[str]) -> dict[str, list[str]]:
    """``optim.state.<name>.<key>`` -> ``{name: [key, ...]}`` (the longest parameter name
    that fits wins, so ``fc1`` and ``fc1.weight`` can both be parameters)."""
    out: dict[str, list[str]] = {}
    for k in keys:
        if not k.startswith("optim.state."):
            continue
        rest = k[len("optim.state."):]
        for i in (m.start() for m in reversed(list(re.finditer(r"\.", rest)))):
            if rest[:i] in names:
                out.setdefault(rest[:i], []).append(rest[i + 1:])
                break
    return out


def _master_key(name: str, keys: list[str]) -> str:
    """The stored tensor ``fp32.pt`` of parameter ``name`` (optimizer state ``keys``) holds."""
    return f"optim.state.{name}.fp32" if MASTER in keys else f"model.{name}"


def _param_tensors(ck: Any, name: str, keys: list[str]) -> list[str]:
    """The stored tensors :func:`_write_param` reads for parameter ``name`` (those it finds:
    it reads any other itself, and names what is missing)."""
    wanted = [_master_key(name, keys), *(f"optim.state.{name}.{k}" for k in keys if k != MASTER)]
    return [k for k in wanted if ck.meta.canonical(k) in ck.meta.tensors]


def _write_param(ck: Any, values: dict[str, Any], folder: Path, name: str, shape: torch.Size, keys: list[str],
                 progress: Callable[[int], None] | None, read: dict[str, torch.Tensor]) -> Any:
    """``folder/fp32.pt`` and one file per optimizer state; returns the step (or None).
    ``read``: those of its tensors already read (:func:`~.base.read_ahead`)."""
    folder.mkdir()
    tensors = ck.meta.tensors
    numel = math.prod(shape)

    def tensor(key: str) -> torch.Tensor:
        t = read[key] if key in read else ck.read(key)
        if progress is not None:
            progress(t.numel() * t.element_size())
        return t

    master_key = _master_key(name, keys)
    _save({"param": tensor(master_key).float().reshape(shape), "cat_dim": 0}, folder / "fp32.pt")
    if progress is not None and master_key != f"model.{name}" and f"model.{name}" in tensors:
        progress(tensors[f"model.{name}"].nbytes)  # the training-dtype copy: the master stands for it
    step = None
    for key in keys:
        if key == MASTER:
            continue
        full = f"optim.state.{name}.{key}"
        file = inside(folder, f"{key}.pt", f"checkpoint {ck.store.url}: the file of {full!r}", write=True)
        if full in tensors:
            t = tensor(full)
            if key != "step" and t.dim() > 0 and t.numel() == numel:
                _save({"param": t.reshape(shape), "cat_dim": 0}, file)
                continue
            v: Any = t
        else:
            v = values.get(full)
        _save(v, file)  # a per-parameter scalar: DeepSpeed keeps the bare step
        if key == "step":
            step = v
    return step


def _optimizer_state(values: dict[str, Any], groups: list[dict[str, Any]], steps: list[Any]) -> dict[str, Any]:
    """``zero/optimizer_state.pt``: what both loaders read (ZeRO-1/2: ``param_groups`` and
    ``ds_version``; ZeRO-3: ``optimizer_state_dict``), and the loss scaler's state."""
    param_groups = []
    for i, g in enumerate(groups):
        hyper = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in g.items() if k != "params"}
        param_groups.append(hyper | {"params": [i]})
    out: dict[str, Any] = {}
    scaler = _record(values.get("deepspeed.loss_scaler"))
    if scaler is not None:
        out["loss_scaler"] = scaler
    for key in ("dynamic_loss_scale", "overflow", "clip_grad", "zero_stage", "partition_count"):
        if f"deepspeed.{key}" in values:
            out[key] = values[f"deepspeed.{key}"]
    out["ds_version"] = values.get("deepspeed.ds_version") or _ds_version()
    out["param_groups"] = param_groups
    out["optimizer_state_dict"] = {
        "state": {i: ({} if s is None else {"step": s}) for i, s in enumerate(steps)},
        "param_groups": param_groups,
    }
    return out


def _model_state(ck: Any, values: dict[str, Any], shapes: list[OrderedDict[str, torch.Size]],
                 dtypes: dict[str, torch.dtype], pp: int, progress: Callable[[int], None] | None) -> dict[str, Any]:
    """The model-states file: the engine's bookkeeping and the client state; the module
    holds every non-trainable tensor whole (buffers, frozen parameters, tied copies, as
    ZeRO-1/2 files do) and each trainable parameter as an empty tensor of its training
    dtype (as ZeRO-3 files do: the values are in ``zero/``)."""
    trainable = {n for g in shapes for n in g}
    whole = [k for k in ck.meta.tensors if k.startswith("model.") and k[len("model."):] not in trainable]
    read = dict(zip(whole, at_once(ck.store, ck.read, whole)))  # (all are held: read at once on an object store)
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key in ck.meta.tensors:
        if not key.startswith("model."):
            continue
        name = key[len("model."):]
        if name in trainable:
            module[name] = torch.empty(0, dtype=dtypes[name])
        else:
            module[name] = read[key]
            if progress is not None:
                progress(module[name].numel() * module[name].element_size())
    for name in trainable - set(module):
        module[name] = torch.empty(0, dtype=dtypes[name])
    for alias, canonical in ck.meta.ties.items():  # tied copies: the module holds the one tensor under each name
        if alias.startswith("model.") and canonical[len("model."):] in module:
            module[alias[len("model."):]] = module[canonical[len("model."):]]
    frozen = values.get("deepspeed.frozen_param_shapes")
    out: dict[str, Any] = {
        "module": module,
        "buffer_names": list(values.get("deepspeed.buffer_names") or []),
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None if frozen is None else OrderedDict((n, torch.Size(s)) for n, s in frozen.items()),
        "shared_params": dict(values.get("deepspeed.shared_params") or {}),
        "frozen_param_fragments": None,
        "lr_scheduler": int_keys(values.get("lr_scheduler")),  # (MultiStepLR's milestones: keyed by int)
        "data_sampler": values.get("deepspeed.data_sampler"),
        "random_ltd": values.get("deepspeed.random_ltd"),
        "skipped_steps": values.get("deepspeed.skipped_steps", 0),
        "global_steps": values.get("deepspeed.global_steps", values.get("step", 0)),
        "global_samples": values.get("deepspeed.global_samples", 0),
        "dp_world_size": values.get("deepspeed.dp_world_size", 1),
        "mp_world_size": pp,  # (DeepSpeed's loader checks it against the count of mp_rank files)
        "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": 1},
        "ds_config": values.get("deepspeed.ds_config"),
        "ds_version": values.get("deepspeed.ds_version") or _ds_version(),
    }
    if "deepspeed.universal_checkpoint_info" in values:
        out["universal_checkpoint_info"] = values["deepspeed.universal_checkpoint_info"]
    for key, v in values.items():
        if key.startswith("client_state."):
            out.setdefault(key[len("client_state."):], v)
    return out


def _ds_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return DS_VERSION_FALLBACK


# --- DeepSpeed objects written without importing DeepSpeed -----------------------------------------


class _Record:
    """A DeepSpeed object (its class named by ``_qual``), pickled as ``cls.__new__(cls, *args)``
    then ``state``, so that loading it with DeepSpeed installed builds the real object."""

    _qual = ""

    def __init__(self, args: tuple[Any, ...], state: Any) -> None:
        self.args, self.state = args, state

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (copyreg.__newobj__, (type(self), *self.args), self.state)


def _record(v: Any) -> _Record | None:
    """The ``{"class", "args", "state"}`` form of an :class:`~.base.Opaque` value back as a
    record to pickle (None for anything else)."""
    if isinstance(v, Opaque):
        v = v.to_value()
    if not (isinstance(v, dict) and set(v) == {"class", "args", "state"} and isinstance(v["class"], str)
            and re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", v["class"]) and isinstance(v["args"], list)):
        return None
    module, _, name = v["class"].rpartition(".")
    cls = type(name, (_Record,), {"__module__": module, "__qualname__": name, "_qual": v["class"]})
    return cls(tuple(v["args"]), v["state"])


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """The pure-Python pickler, naming a record's class by ``_qual`` (no import, no lookup)."""

    def save_global(self, obj: Any, name: Any = None) -> None:
        qual = obj.__dict__.get("_qual") if isinstance(obj, type) and issubclass(obj, _Record) else None
        if not qual:
            return super().save_global(obj, name)
        module, _, cls_name = qual.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(cls_name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode() + b"\n" + cls_name.encode() + b"\n")
        self.memoize(obj)


_PICKLE = types.ModuleType("ucp_zarr_ds_pickle")
_PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]


def _has_record(v: Any) -> bool:
    if isinstance(v, _Record):
        return True
    if isinstance(v, dict):
        return any(_has_record(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_record(x) for x in v)
    return False


def _save(obj: Any, path: Path) -> None:
    """``torch.save``; through the pure-Python pickler when ``obj`` holds records."""
    try:
        if _has_record(obj):
            torch.save(obj, path, pickle_module=_PICKLE)
        else:
            torch.save(obj, path)
    except (OSError, pickle.PicklingError, RuntimeError) as e:
        raise ConversionError(f"{path}: cannot be written: {e}") from None
