"""DeepSpeed ZeRO-1/2/3 checkpoints in: every parameter, fp32 master and optimizer state in
its real shape, streamed from the ranks' flat partitions (no temporary copy, no merge
worker holding a whole parameter). With tensor parallelism (``mp_rank_XX`` files: AutoTP,
Megatron-DeepSpeed), each TP rank's tensors are placed on the consolidated ones by the
``universal_checkpoint_info`` the checkpoint holds, or by ``rules`` given by the caller.

``src`` is the folder holding ``latest`` (its tag is followed) or a ``global_stepN``
folder. Files are read weights-only: DeepSpeed's own classes in them (loss scaler, ZeRO
stage, fragment addresses) are rebuilt as :class:`~.base.Opaque` records, so no code from
the files runs (``trust=True`` reads them with full unpickling instead).

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
from dataclasses import dataclass
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
from ..safe_paths import inside
from ..writer import InMemory
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
    "module", "universal_checkpoint_info",
)
"""Keys DeepSpeed's engine writes into a model-states file; the rest is client state."""
_OPTIMIZER_SCALARS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage", "partition_count")


def read(src: Path, *, trust: bool = False, rules: Any = None, **_: Any) -> Imported:
    """A DeepSpeed ZeRO checkpoint folder; with tensor parallelism (``mp_rank_XX`` files),
    each TP rank's parameters are placed on the consolidated ones by ``rules`` (a
    :class:`~ucp_zarr.Rules`), by default those of the ``universal_checkpoint_info`` the
    checkpoint holds (DeepSpeed AutoTP, Megatron-DeepSpeed)."""
    folder = step_folder(Path(src))
    optim_files = _rank_files(folder, "optim_states")
    model_files = _rank_files(folder, "model_states")
    tps = sorted({_mp(f) for f in optim_files})
    if tps != list(range(len(tps))):
        raise ConversionError(f"{folder}: optimizer files of tensor-parallel ranks {tps}: some are missing")
    parts = [_read_tp(folder, [f for f in optim_files if _mp(f) == t], [f for f in model_files if _mp(f) == t], trust)
             for t in tps]
    if len(parts) == 1 and rules is None:
        return parts[0]
    return _consolidate(folder, parts, rules)


def _read_tp(folder: Path, optim_files: list[Path], model_files: list[Path], trust: bool) -> Imported:
    """The state of one tensor-parallel rank's data-parallel group (all of it without TP)."""
    if not model_files:
        raise ConversionError(f"{folder}: no model-states file beside {optim_files[0].name}")
    first = _load(optim_files[0], trust)
    osd = _get(first, "optimizer_state_dict", optim_files[0])
    if "zero_stage" in osd:
        stage = int(_scalar(osd["zero_stage"]))
    elif "single_partition_of_fp32_groups" in osd:  # ZeRO-1's BF16_Optimizer records no stage
        stage = 1
    else:
        raise ConversionError(f"{optim_files[0]}: no 'zero_stage' entry: not a DeepSpeed ZeRO optimizer file")
    world = _world(osd, optim_files[0])
    if len(optim_files) != world:
        raise ConversionError(
            f"{folder}: the optimizer was partitioned over {world} ranks, but {len(optim_files)} optimizer files are "
            f"there ({[f.name for f in optim_files]}): a rank's file is missing or another save's is mixed in"
        )
    _check_rank_numbers(optim_files)
    optims = [first] + [_load(f, trust) for f in optim_files[1:]]
    model = _load(model_files[0], trust)
    out = Imported(layout={"source": {"format": "deepspeed", "folder": folder.name, "zero_stage": stage, "world": world}})
    shapes = [{n: tuple(s) for n, s in g.items()} for g in _get(model, "param_shapes", model_files[0])]
    if stage <= 2:
        _zero12(out, folder, optims, optim_files, model, shapes)
    else:
        models = [model] + [_load(f, trust) for f in model_files[1:]]
        _zero3(out, optims, optim_files, models, shapes)
    _other_state(out, model, osd, shapes)
    return out


def _consolidate(folder: Path, parts: list[Imported], rules: Any) -> Imported:
    """The consolidated tensors of tensor-parallel ranks' states, placed by ``rules``."""
    from ..place import place
    from ..rules import RuleError, Rules

    tp_size = len(parts)
    if rules is None:
        info = parts[0].values.get("deepspeed.universal_checkpoint_info")
        if not isinstance(info, dict):
            raise ConversionError(
                f"{folder}: a tensor-parallel checkpoint ({tp_size} mp_rank files) that records no "
                "universal_checkpoint_info: pass ", Keyword("rules"), " (a ucp_zarr.Rules) saying how its tensors are split",
            )
        rules = Rules.from_deepspeed(info)
    buffers = set(parts[0].values.get("deepspeed.buffer_names") or [])
    out = Imported(values=dict(parts[0].values), layout=dict(parts[0].layout))
    out.layout["source"] = dict(out.layout["source"], tp=tp_size)
    out.layout["rules"] = rules.to_dict()
    merged: dict[str, list[tuple[Any, Any]]] = {}
    for t, part in enumerate(parts):
        state: dict[str, Any] = {"model": {}, "optim": {"state": {}}}
        sources: dict[tuple[str, ...], Any] = {}
        for key, source in part.tensors.items():
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
            merged.setdefault(node.key, []).append((node, source))
    for key, held in merged.items():
        first = held[0][0]
        if first.average:
            raise ConversionError(f"{folder}: tensor {key!r} is averaged over tensor-parallel ranks, which the converter does not do")
        if first.replicated:
            out.tensors[key] = held[0][1]  # (TP rank 0's copy)
        else:
            out.tensors[key] = Consolidated(first.global_shape, first.local.dtype, [(p.pieces, src) for p, src in held], key)
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


def _rank_files(folder: Path, kind: str) -> list[Path]:
    files = sorted(folder.glob(f"*{kind}.pt"), key=lambda f: [int(x) for x in re.findall(r"\d+", f.name)])
    if not files:
        raise ConversionError(f"{folder}: no *_{kind}.pt file: not a DeepSpeed ZeRO checkpoint folder")
    return files


def _rank(f: Path) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", f.name)
    return int(m.group(1)) if m else 0


def _mp(f: Path) -> int:
    m = re.search(r"mp_rank_(\d+)", f.name)
    return int(m.group(1)) if m else 0


def _check_rank_numbers(files: list[Path], what: str = "optimizer") -> None:
    """``files`` (in rank order) are those of ranks 0, 1, ... without a gap."""
    ranks = [_rank(f) for f in files]
    if ranks != list(range(len(files))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise ConversionError(f"{files[0].parent}: {what} files of ranks {missing} are missing (found ranks {ranks})")


def _load(f: Path, trust: bool) -> Any:
    """A DeepSpeed file, its tensors memory-mapped (the sources below drop their pages once copied)."""
    obj, mapped = torch_load_mapped(f, trust=trust, opaque=OPAQUE)
    if not mapped:
        raise ConversionError(f"{f}: in torch's legacy (pre-1.6) file format, which cannot be memory-mapped")
    if not isinstance(obj, dict):
        raise ConversionError(f"{f}: holds a {type(obj).__name__}, not a DeepSpeed checkpoint dict")
    return obj


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


# --- ZeRO-1/2 ------------------------------------------------------------------------------


def _zero12(out: Imported, folder: Path, optims: list[Any], files: list[Path], model: dict[str, Any],
            shapes: list[dict[str, tuple[int, ...]]]) -> None:
    osds = [_get(o, "optimizer_state_dict", f) for o, f in zip(optims, files)]
    world = len(files)
    paddings = osds[0].get("param_alignment_paddings")
    try:
        pieces = zero12_pieces(shapes, world, paddings)
    except ZeroLayoutError as e:
        raise ConversionError(f"{folder}: {e}") from None
    masters = [list(_get(osd, "single_partition_of_fp32_groups", f)) for osd, f in zip(osds, files)]
    for g, group in enumerate(shapes):
        numel = zero12_group_numel(group, paddings[g] if paddings else None)
        size = zero12_partition_size(numel, world)
        for r, (parts, f) in enumerate(zip(masters, files)):
            held = max(0, min(size, numel - r * size))
            if g >= len(parts) or parts[g].numel() not in (held, size):
                raise ConversionError(
                    f"{f}: its fp32 partition of group {g} has {parts[g].numel() if g < len(parts) else 'no'} elements; "
                    f"{world} ranks sharing {numel} hold {size} each: the files are not one checkpoint's partitions"
                )
    base = [_get(osd, "base_optimizer_state", f) for osd, f in zip(osds, files)]
    states = [_group_states(b, f) for b, f in zip(base, files)]
    module = _get(model, "module", folder)
    _add_params(out, shapes, pieces, masters, states, files, module_of=lambda n: module.get(n))


def _group_states(base: Any, f: Path) -> list[dict[str, Any]]:
    """Per parameter group, the flat optimizer state (``key -> flat tensor or scalar``)."""
    state = base.get("state") if isinstance(base, dict) else None
    if isinstance(base, list):  # elastic checkpoints: one state dict per group
        return [dict(s) for s in base]
    if not isinstance(state, dict):
        raise ConversionError(f"{f}: the base optimizer state has no per-group 'state'")
    return [dict(state.get(g, {})) for g in sorted(state)]


# --- ZeRO-3 --------------------------------------------------------------------------------


def _zero3(out: Imported, optims: list[Any], files: list[Path], models: list[dict[str, Any]],
           shapes: list[dict[str, tuple[int, ...]]]) -> None:
    world = len(files)
    osds = [_get(o, "optimizer_state_dict", f) for o, f in zip(optims, files)]
    pieces = zero3_pieces(shapes, world)
    masters = [list(_get(osd, "fp32_flat_groups", f)) for osd, f in zip(osds, files)]
    states = [_group_states(_get(osd, "optimizer_state_dict", f), f) for osd, f in zip(osds, files)]
    module = models[0].get("module", {})
    dtypes = {n: t.dtype for n, t in module.items() if isinstance(t, torch.Tensor)}
    _add_params(out, shapes, pieces, masters, states, files, module_of=lambda n: None, dtypes=dtypes)
    # frozen parameters: each rank holds its part (training dtype), the last part padded
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        frags = [m.get("frozen_param_fragments", {}).get(name) for m in models]
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
            if held is not None and held.numel() == math.prod(shape):
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


def _other_state(out: Imported, model: dict[str, Any], osd: dict[str, Any], shapes: list[dict[str, Any]]) -> None:
    """Frozen parameters (ZeRO-1/2), buffers, tied copies, param groups, scheduler, client
    and engine state."""
    module = model.get("module") or {}
    for name in model.get("buffer_names") or []:
        if isinstance(module.get(name), torch.Tensor):
            out.tensors[f"model.{name}"] = Mapped(module[name])
    for name, t in (model.get("frozen_param_fragments") or {}).items():
        shape = tuple((model.get("frozen_param_shapes") or {}).get(name, ()))
        if f"model.{name}" not in out.tensors and isinstance(t, torch.Tensor) and t.numel() == math.prod(shape):
            out.tensors[f"model.{name}"] = Mapped(t.reshape(shape))
    for tied, source in (model.get("shared_params") or {}).items():
        if f"model.{source}" in out.tensors:
            out.tensors[f"model.{tied}"] = out.tensors[f"model.{source}"]
    known = {n for g in shapes for n in g} | set(model.get("frozen_param_shapes") or {}) | set(model.get("shared_params") or {})
    for name, t in module.items():  # the rest of the module (ZeRO-1 keeps frozen parameters only here)
        if f"model.{name}" not in out.tensors and isinstance(t, torch.Tensor) and not (name in known and t.numel() == 0):
            out.tensors[f"model.{name}"] = Mapped(t)
    groups = _param_groups(osd)
    if groups is not None:  # "params" index the flat (sub-)groups, whose parameters param_shapes lists
        names = [list(g) for g in shapes]
        out.values["optim.param_groups"] = [
            {k: plain(v) for k, v in grp.items() if k != "params"}
            | {"params": [n for i in grp.get("params", []) if isinstance(i, int) and i < len(names) for n in names[i]]}
            for grp in groups
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
    (``[(pieces, local source), ...]``, pieces as :func:`ucp_zarr.place` computes them)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Sequence[tuple[Sequence[Piece], Any]]
    what: str

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        rows = _rows(self.shape, box)
        out = torch.empty(rows.shape, dtype=self.dtype)
        covered = 0
        for pieces, source in self.parts:
            for p in pieces:
                inter = p.dst.intersect(rows)
                if inter is None or inter.is_empty():
                    continue
                if p.step is not None or p.base is not None:
                    raise ConversionError(f"tensor {self.what!r}: strided pieces are not supported by the converter")
                local = Box(tuple(s + i - d for s, i, d in zip(p.src.offset, inter.offset, p.dst.offset)), inter.shape)
                t, held = source.read(local)
                out[inter.relative_to(rows).slices()] = t[local.relative_to(held).slices()]
                if hasattr(source, "release"):
                    source.release(local)
                covered += inter.numel
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
