"""ZeRO-1/2/3 flat partitions of a DeepSpeed checkpoint as tensors: each parameter's fp32 master and
optimizer state streamed from the ranks' flat buffers (lazy sources, no temporary copy)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ConversionError
from ..format.statedict import holds_tensor
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
from ..protocol.writer import InMemory
from .base import Imported, plain, release_pages
from .deepspeed_files import ENGINE_KEYS, Experts, _OPTIMIZER_SCALARS, _get, _scalar


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
    if groups is None:
        warnings.warn(f"ucp_zarr: {out.layout['source']['folder']}: the optimizer files record no param_groups "
                      "(as ZeRO's elastic_checkpoint files): the hyper-parameters (lr, betas, weight decay) "
                      "are not converted; DeepSpeed's adapter refuses to load optimizer state without them (strict)",
                      stacklevel=2)
    else:  # "params" index the flat (sub-)groups, whose parameters ``names`` lists
        flat = [list(g) for g in names]
        out.values["optim.param_groups"] = [
            {k: plain(v) for k, v in grp.items() if k != "params"}
            | {"params": [n for i in grp.get("params", []) if isinstance(i, int) and i < len(flat) for n in flat[i]]}
            for grp in groups if isinstance(grp, dict)
        ]
    out.values["lr_scheduler"] = plain(model.get("lr_scheduler"))
    dropped = [k for k in ("data_sampler", "random_ltd") if model.get(k) is not None]
    if dropped:
        warnings.warn(f"ucp_zarr: {out.layout['source']['folder']}: DeepSpeed's {' and '.join(dropped)} state (data "
                      "efficiency: curriculum sampler, random-LTD) is not converted; a resume from the conversion starts "
                      "it over (DeepSpeed's own load_checkpoint of the folder restores it)", stacklevel=2)
    for key, v in model.items():  # (as the adapter saves client_state: a tensor as a tensor, the rest as JSON)
        if key in ENGINE_KEYS:
            continue
        if isinstance(v, torch.Tensor):
            out.tensors[f"client_state.{key}"] = Mapped(v)
        elif holds_tensor(v):
            raise ConversionError(
                f"{out.layout['source']['folder']}: client_state[{key!r}] holds tensors inside a "
                f"{type(v).__name__}; only a tensor that is a client_state entry itself is kept as a tensor (as the "
                "DeepSpeed adapter saves it), and converting the others into JSON would lose them"
            )
        else:
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
