"""DeepSpeed's affine maps as :class:`~.pieces.Piece` lists (pure, no torch).

DeepSpeed 0.19.8 (``deepspeed/checkpoint/affine.py``) describes how a parameter is spread
over its tensor-parallel ranks geometrically, in ``universal_checkpoint_info["affine_map"]``
(``{"version": 1, "params": {pattern: map}}``). A map is ``{"logical_shape": [...],
"ranks": {rank: {"shard_shape": [...], "pieces": [piece, ...]}}}``; a piece is a block of
elements given by ``torch.as_strided`` arguments on both sides: ``source`` = ``[offset,
strides]`` into the full (logical) tensor, ``dest`` = ``[offset, strides]`` into the rank's
flattened shard, its ``shape``, the ``locations`` (ranks) holding that block and an optional
``scale`` (``shard == full * scale``).

Every map kind DeepSpeed writes serialises to that one form, and is read here:
``replicated_map``, ``contiguous_split_map`` (even or uneven), ``sub_param_map`` (fused
sub-parameters with per-rank widths), ``segmented_map`` (GPTBigCode's fused QKV: query rows
split, the key/value block held whole by every rank), ``block_gather_map`` (equal blocks
gathered out of order: CodeGen's fused QKV, Yuan's shared QK) and AutoEP's expert placements
(``autoep_affine.py``).

:func:`affine_layout` turns one serialised map into each rank's pieces, placing every
element where DeepSpeed's ``ParamAffineMap.rebuild`` puts it, after the checks ``rebuild``
makes (``validate``: each rank's pieces account for its whole shard, no shard element twice)
and those of ``validate_coverage`` (every element of the full tensor held; a block held by
several ranks names exactly those ranks in ``locations``). What cannot be expressed exactly
is refused, by name, with :class:`AffineMapError`: a format version above
:data:`AFFINE_MAP_VERSION`, unknown fields, a scaled piece (a pre-divided value; DeepSpeed
itself refuses to move optimizer state through one), a piece whose strides are not a box of
the tensor or of the shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .boxes import Box
from .pieces import Piece, PieceError, check_cover, check_pieces

AFFINE_MAP_VERSION = 1
"""The highest ``affine_map`` format version read (DeepSpeed 0.19.8's ``AFFINE_MAP_FORMAT_VERSION``)."""
_MAP_KEYS = {"logical_shape", "ranks"}
_RANK_KEYS = {"shard_shape", "pieces"}
_PIECE_KEYS = {"shape", "source", "dest", "locations", "scale"}


class AffineMapError(PieceError):
    """An affine map that is malformed, or that this library cannot place exactly."""


@dataclass(frozen=True)
class AffineLayout:
    """One parameter's layout over ``len(shard_shapes)`` tensor-parallel ranks."""

    shape: tuple[int, ...]
    """The consolidated (logical) shape."""
    shard_shapes: tuple[tuple[int, ...], ...]
    """Each rank's local shape."""
    pieces: tuple[tuple[Piece, ...], ...]
    """Each rank's pieces (empty blocks dropped)."""


def affine_layout(entry: Mapping[str, Any]) -> AffineLayout:
    """The pieces of a serialised DeepSpeed ``ParamAffineMap`` (``ParamAffineMap.to_dict()``)."""
    if not isinstance(entry, Mapping):
        raise AffineMapError(f"an affine map must be a mapping, not {type(entry).__name__}")
    _known(entry, _MAP_KEYS, "affine map")
    shape = _shape(entry.get("logical_shape"), "logical_shape")
    ranks = entry.get("ranks")
    if not isinstance(ranks, Mapping) or not ranks:
        raise AffineMapError(f"affine map 'ranks' must be a non-empty mapping, not {ranks!r}")
    by_rank: dict[int, Any] = {}
    for key, value in ranks.items():
        rank = _int(key, "rank")
        if rank in by_rank:
            raise AffineMapError(f"affine map: rank {rank} is given twice")
        by_rank[rank] = value
    tp = len(by_rank)
    if sorted(by_rank) != list(range(tp)):
        raise AffineMapError(f"affine map ranks {sorted(by_rank)} are not 0..{tp - 1}")
    shard_shapes, pieces, holders = [], [], {}
    for rank in range(tp):
        value = by_rank[rank]
        if not isinstance(value, Mapping):
            raise AffineMapError(f"affine map rank {rank}: a mapping with shard_shape and pieces, not {value!r}")
        _known(value, _RANK_KEYS, f"affine map rank {rank}")
        local = _shape(value.get("shard_shape"), f"rank {rank} shard_shape")
        raw = value.get("pieces")
        if not isinstance(raw, (list, tuple)):
            raise AffineMapError(f"affine map rank {rank}: 'pieces' must be a list, not {raw!r}")
        mine, held = [], 0
        for i, piece in enumerate(raw):
            where = f"affine map rank {rank} piece {i}"
            p, locations = _piece(piece, shape, local, rank, where)
            held += 0 if p is None else p.dst.numel
            if p is not None:
                mine.append(p)
                prior = holders.setdefault(p.dst, (locations, set()))
                if prior[0] != locations:
                    raise AffineMapError(f"{where}: block {_fmt(p.dst)} is held by ranks {sorted(locations)} here, "
                                         f"by {sorted(prior[0])} in another piece")
                prior[1].add(rank)
        if held != math.prod(local):
            raise AffineMapError(f"affine map rank {rank}: its pieces hold {held} elements, its shard "
                                 f"{list(local)} has {math.prod(local)}")
        try:
            check_pieces(mine, local, shape)
        except PieceError as e:
            raise AffineMapError(f"affine map rank {rank}: {e}") from None
        shard_shapes.append(local)
        pieces.append(tuple(mine))
    for box, (locations, seen) in holders.items():
        if seen != locations:
            raise AffineMapError(f"affine map: block {_fmt(box)} names ranks {sorted(locations)} as its holders, "
                                 f"but ranks {sorted(seen)} hold it")
    try:
        check_cover(shape, pieces)
    except PieceError as e:
        raise AffineMapError(f"affine map over {tp} ranks: {e}") from None
    return AffineLayout(shape, tuple(shard_shapes), tuple(pieces))


def _piece(piece: Any, shape: tuple[int, ...], local: tuple[int, ...], rank: int,
           where: str) -> tuple[Piece | None, frozenset[int]]:
    """One serialised piece as a :class:`Piece` (None when it holds no element) and its locations."""
    if not isinstance(piece, Mapping):
        raise AffineMapError(f"{where}: a mapping, not {piece!r}")
    _known(piece, _PIECE_KEYS, where)
    size = _shape(piece.get("shape"), f"{where} shape")
    locations = piece.get("locations")
    if not isinstance(locations, (list, tuple)) or not locations:
        raise AffineMapError(f"{where}: 'locations' must be a non-empty list of ranks, not {locations!r}")
    held = frozenset(_int(r, f"{where} location") for r in locations)
    if rank not in held:
        raise AffineMapError(f"{where}: listed under rank {rank}, but its locations are {sorted(held)}")
    scale = piece.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise AffineMapError(f"{where}: scale {scale!r} is not a number")
    if scale != 1.0:
        raise AffineMapError(f"{where}: a scaled piece (scale {scale}: the shard holds the block pre-multiplied) is "
                             "not supported; DeepSpeed itself cannot move optimizer state through one")
    full = _box(piece.get("source"), size, shape, f"{where} source (full tensor {list(shape)})")
    shard = _box(piece.get("dest"), size, local, f"{where} dest (shard {list(local)})")
    if math.prod(size) == 0:
        return None, held
    return Piece(dst=full, src=shard), held


def _box(view: Any, size: tuple[int, ...], of: tuple[int, ...], where: str) -> Box:
    """``[offset, strides]`` of a block of ``size`` as a box of a row-major tensor of shape ``of``."""
    if not isinstance(view, (list, tuple)) or len(view) != 2 or not isinstance(view[1], (list, tuple)):
        raise AffineMapError(f"{where}: must be [offset, [strides...]], not {view!r}")
    offset, strides = _int(view[0], where), tuple(_int(s, where) for s in view[1])
    if len(strides) != len(size) or len(size) != len(of):
        raise AffineMapError(f"{where}: a block of shape {list(size)} with strides {list(strides)} is not a box of a "
                             f"{len(of)}-d tensor")
    if math.prod(size) == 0:
        return Box((0,) * len(of), size)
    row_major = _row_major(of)
    if any(n > 1 and s != r for n, s, r in zip(size, strides, row_major)):
        raise AffineMapError(f"{where}: strides {list(strides)} are not the tensor's own {list(row_major)}, so the "
                             f"block of shape {list(size)} is not a box of it")
    start, rest = [], offset
    for r in row_major:
        start.append(rest // r if r else 0)
        rest = rest % r if r else rest
    box = Box(tuple(start), size) if offset >= 0 else None
    if box is None or rest or not Box.whole(of).contains(box):
        raise AffineMapError(f"{where}: a block of shape {list(size)} at offset {offset} lies outside the tensor")
    return box


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, at = [], 1
    for n in reversed(shape):
        strides.append(at)
        at *= n
    return tuple(reversed(strides))


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise AffineMapError(f"affine map {what} must be a list of sizes, not {value!r}")
    shape = tuple(_int(n, what) for n in value)
    if any(n < 0 for n in shape):
        raise AffineMapError(f"affine map {what} {list(shape)} has a negative size")
    return shape


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise AffineMapError(f"{what}: {value!r} is not an integer")
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    if not isinstance(value, int):
        raise AffineMapError(f"{what}: {value!r} is not an integer")
    return value


def _known(d: Mapping[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise AffineMapError(f"{what}: unknown field(s) {unknown} (this library reads affine map format version "
                             f"{AFFINE_MAP_VERSION}: {sorted(known)})")


def _fmt(b: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(b.offset, b.shape)) + "]"
