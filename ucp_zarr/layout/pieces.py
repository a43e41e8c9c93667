"""Pieces: how one rank's local tensor maps onto a consolidated tensor (pure, no torch).

A :class:`Piece` says that a region of the local tensor *is* a box of the consolidated
(global) tensor. The region is a box of a *base* view of the local tensor, taken with a step
per dim where needed: the local tensor itself, or a run of its flattened elements reshaped
(a flat range of a distributed optimizer's partition). Every layout the rule language knows
compiles to a list of pieces:

* :func:`split`: an even split along one dim (column- and row-parallel, experts stacked);
* :func:`sub_params`: several fused sub-parameters, each split along one dim, with even or
  uneven per-rank widths (fused QKV with grouped-query attention, SwiGLU's ``[gate; up]``);
* :func:`clip`: padding beyond the consolidated size dropped (padded vocabularies);
* :func:`flat_range`: a flat range of the local tensor composed with its pieces (ZeRO and
  Megatron's distributed optimizer hold flat ranges of TP-local slabs);
* explicit pieces (the escape hatch), checked by :func:`check_pieces` and
  :func:`check_cover`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .boxes import Box
from .flat import box_flat_start, flat_range_boxes


class PieceError(ValueError):
    """Pieces that do not describe a valid mapping (the caller adds the tensor's name)."""


@dataclass(frozen=True)
class Piece:
    """Box ``dst`` of the consolidated tensor is the region ``src`` (taken with ``step``) of
    the base view of the local tensor: the local tensor itself when ``base`` is None, else
    its flattened elements ``[base[0], base[0] + prod(base[1]))`` viewed as shape ``base[1]``.
    """

    dst: Box
    src: Box
    step: tuple[int, ...] | None = None
    base: tuple[int, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if self.src.shape != self.dst.shape:
            raise PieceError(f"piece {self}: source shape {list(self.src.shape)} != destination {list(self.dst.shape)}")
        if self.step is not None and (len(self.step) != self.src.ndim or any(s < 1 for s in self.step)):
            raise PieceError(f"piece {self}: steps must be positive, one per dim")

    @property
    def extent(self) -> Box:
        """The box of the base view that the source region spans (steps included)."""
        if self.step is None:
            return self.src
        return Box(self.src.offset, tuple((n - 1) * s + 1 if n else 0 for n, s in zip(self.src.shape, self.step)))

    def to_json(self) -> dict:
        d: dict = {"dst": {"offset": list(self.dst.offset), "shape": list(self.dst.shape)},
                   "src": {"offset": list(self.src.offset), "shape": list(self.src.shape)}}
        if self.step is not None:
            d["src"]["step"] = list(self.step)
        if self.base is not None:
            d["src"]["base"] = {"start": self.base[0], "shape": list(self.base[1])}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Piece":
        src, dst = d["src"], d["dst"]
        step, base = src.get("step"), src.get("base")
        return cls(Box(tuple(dst["offset"]), tuple(dst["shape"])), Box(tuple(src["offset"]), tuple(src["shape"])),
                   None if step is None else tuple(step),
                   None if base is None else (int(base["start"]), tuple(base["shape"])))


def whole(shape: Sequence[int], offset: Sequence[int] | None = None) -> list[Piece]:
    """The local tensor is the whole consolidated tensor (or its box at ``offset``)."""
    src = Box.whole(tuple(shape))
    dst = src if offset is None else Box(tuple(offset), src.shape)
    return [Piece(dst, src)] if src.numel else []


def split(local_shape: Sequence[int], dim: int, rank: int, size: int) -> tuple[tuple[int, ...], list[Piece]]:
    """Even split along ``dim``: rank ``rank`` of ``size`` holds block ``rank``. Returns the
    consolidated shape and the pieces."""
    local_shape = tuple(local_shape)
    _check_dim(local_shape, dim)
    glob = local_shape[:dim] + (local_shape[dim] * size,) + local_shape[dim + 1 :]
    src = Box.whole(local_shape)
    dst = Box(tuple(rank * local_shape[dim] if d == dim else 0 for d in range(len(local_shape))), local_shape)
    return glob, ([Piece(dst, src)] if src.numel else [])


def even_widths(sizes: Sequence[int], size: int) -> list[list[int]]:
    """Per sub-parameter, the width each of ``size`` ranks holds of it (equal shares)."""
    for j, n in enumerate(sizes):
        if n % size:
            raise PieceError(f"sub-parameter {j} of size {n} cannot be split evenly over {size} ranks")
    return [[n // size] * size for n in sizes]


def sub_params(
    local_shape: Sequence[int], dim: int, sizes: Sequence[int], widths: Sequence[Sequence[int]], rank: int
) -> tuple[tuple[int, ...], list[Piece]]:
    """Fused sub-parameters along ``dim``: the consolidated tensor is the sub-parameters of
    ``sizes`` concatenated; rank ``r`` holds, in order, ``widths[j][r]`` rows of each
    sub-parameter ``j`` (its rows after those of ranks ``< r``)."""
    local_shape = tuple(local_shape)
    _check_dim(local_shape, dim)
    if len(widths) != len(sizes):
        raise PieceError(f"{len(sizes)} sub-parameter sizes but {len(widths)} lists of widths")
    if len({len(w) for w in widths}) > 1 or not 0 <= rank < len(widths[0] if widths else [0]):
        raise PieceError(f"widths {[list(w) for w in widths]} do not give one width per rank, or rank {rank} has none")
    for j, (n, w) in enumerate(zip(sizes, widths)):
        if sum(w) != n or any(x < 0 for x in w):
            raise PieceError(f"sub-parameter {j}: the ranks' widths {list(w)} do not add up to its size {n}")
    held = sum(w[rank] for w in widths)
    if held != local_shape[dim]:
        raise PieceError(
            f"rank {rank} holds {local_shape[dim]} along dim {dim}, but its sub-parameter widths "
            f"{[w[rank] for w in widths]} add up to {held}"
        )
    glob = local_shape[:dim] + (sum(sizes),) + local_shape[dim + 1 :]
    pieces, src_at, dst_base = [], 0, 0
    for n, w in zip(sizes, widths):
        width = w[rank]
        if width and math.prod(local_shape):
            off = [0] * len(local_shape)
            shape = list(local_shape)
            shape[dim] = width
            off[dim] = src_at
            src = Box(tuple(off), tuple(shape))
            off[dim] = dst_base + sum(w[:rank])
            pieces.append(Piece(Box(tuple(off), tuple(shape)), src))
        src_at += width
        dst_base += n
    return glob, pieces


def clip(pieces: Sequence[Piece], dim: int, size: int) -> tuple[list[Piece], list[Piece]]:
    """Pieces cut to the consolidated size ``size`` along ``dim`` (the rows beyond it are
    padding): returns the kept pieces and the padding (with ``dst`` beyond ``size``), which
    a load fills with zeros."""
    kept, pad = [], []
    for p in pieces:
        lo, n = p.dst.offset[dim], p.dst.shape[dim]
        keep = max(0, min(n, size - lo))
        for part, a, b in ((kept, 0, keep), (pad, keep, n)):
            if b > a:
                part.append(_narrow(p, dim, a, b - a))
    return kept, pad


def _narrow(p: Piece, dim: int, start: int, length: int) -> Piece:
    def cut(box: Box, scale: int) -> Box:
        off, shape = list(box.offset), list(box.shape)
        off[dim] += start * scale
        shape[dim] = length
        return Box(tuple(off), tuple(shape))

    step = 1 if p.step is None else p.step[dim]
    return Piece(cut(p.dst, 1), cut(p.src, step), p.step, p.base)


def flat_range(local_shape: Sequence[int], pieces: Sequence[Piece], start: int, stop: int) -> list[Piece]:
    """The pieces of a 1-D tensor holding elements ``[start, stop)`` of the flattened local
    tensor (of ``local_shape``, mapped by ``pieces``): each is a run of the 1-D tensor viewed
    as a box, intersected with a piece."""
    local_shape = tuple(local_shape)
    out = []
    for run in flat_range_boxes(local_shape, start, stop):
        base = (box_flat_start(local_shape, run) - start, run.shape)
        for p in pieces:
            if p.base is not None or p.step is not None:
                raise PieceError("a flat range of a strided or flat piece is not supported")
            inter = run.intersect(p.src)
            if inter is None or inter.is_empty():
                continue
            dst = Box(tuple(d + i - s for d, i, s in zip(p.dst.offset, inter.offset, p.src.offset)), inter.shape)
            out.append(Piece(dst, inter.relative_to(run), None, base))
    return out


def check_pieces(
    pieces: Sequence[Piece], local_shape: Sequence[int], global_shape: Sequence[int], pad: Sequence[Piece] = ()
) -> None:
    """Each piece lies inside the local tensor (its base view) and the consolidated tensor,
    and no local element or consolidated element is used by two pieces; ``pad`` pieces
    (padding: their destinations lie beyond the consolidated tensor) use local elements no
    piece uses."""
    local_shape, glob = tuple(local_shape), Box.whole(tuple(global_shape))
    total = math.prod(local_shape)
    for p in list(pieces) + list(pad):
        if p not in pad and not glob.contains(p.dst):
            raise PieceError(f"piece destination {_fmt(p.dst)} lies outside the consolidated shape {list(glob.shape)}")
        base_shape = local_shape if p.base is None else p.base[1]
        if p.base is not None and not (0 <= p.base[0] and p.base[0] + math.prod(p.base[1]) <= total):
            raise PieceError(f"piece base {p.base} lies outside the {total} local elements")
        if not Box.whole(base_shape).contains(p.extent):
            raise PieceError(f"piece source {_fmt(p.extent)} lies outside the local shape {list(base_shape)}")
    _no_overlap([p.dst for p in pieces if p.dst.numel], "consolidated")
    every = list(pieces) + list(pad)
    if any(p.step is not None for p in every):  # strided sources: compare element sets (explicit pieces are small)
        seen: set[int] = set()
        for p in every:
            for i in _flat_elements(p, local_shape):
                if i in seen:
                    raise PieceError(f"local element {i} is used by two pieces")
                seen.add(i)
        return
    groups: dict[tuple[int, tuple[int, ...]] | None, list[Box]] = {}
    for p in every:
        groups.setdefault(p.base, []).append(p.src)
    for boxes in groups.values():
        _no_overlap([b for b in boxes if b.numel], "local")
    runs = sorted((b[0], b[0] + math.prod(b[1])) for b in groups if b is not None)
    if None in groups and runs:
        raise PieceError("pieces mix the local tensor and flat runs of it")
    for (_, stop), (start, _) in zip(runs, runs[1:]):
        if start < stop:
            raise PieceError(f"flat runs of the local tensor overlap at element {start}")


def check_cover(global_shape: Sequence[int], pieces_by_rank: Sequence[Sequence[Piece]]) -> None:
    """The ranks' pieces tile the consolidated tensor: every element is held by some rank,
    and ranks that overlap hold identical boxes (replicas)."""
    glob = tuple(global_shape)
    boxes = sorted({p.dst for ps in pieces_by_rank for p in ps if p.dst.numel}, key=lambda b: b.offset)
    outside = [b for b in boxes if not Box.whole(glob).contains(b)]
    if outside:
        raise PieceError(f"piece destination {_fmt(outside[0])} lies outside the consolidated shape {list(glob)}")
    _no_overlap(boxes, "consolidated")
    covered = sum(b.numel for b in boxes)
    if covered != math.prod(glob):
        raise PieceError(f"the ranks' pieces cover {covered} of the {math.prod(glob)} elements of {list(glob)}")


def _no_overlap(boxes: Sequence[Box], what: str) -> None:
    ordered = sorted(set(boxes), key=lambda b: b.offset)
    if len(ordered) < len(boxes):
        raise PieceError(f"two pieces use the same {what} box")
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if a.ndim and b.offset[0] >= a.stop[0]:
                break
            inter = a.intersect(b)
            if inter is not None and not inter.is_empty():
                raise PieceError(f"pieces overlap in the {what} tensor: {_fmt(a)} and {_fmt(b)}")


def _flat_elements(p: Piece, local_shape: tuple[int, ...]) -> list[int]:
    from .boxes import grid_indices

    base_off, base_shape = (0, local_shape) if p.base is None else p.base
    step = p.step or (1,) * p.src.ndim
    out = []
    for idx in grid_indices(p.src.shape):
        flat = 0
        for o, i, s, n in zip(p.src.offset, idx, step, base_shape):
            flat = flat * n + o + i * s
        out.append(base_off + flat)
    return out


def _check_dim(shape: tuple[int, ...], dim: int) -> None:
    if not 0 <= dim < len(shape):
        raise PieceError(f"cannot split dim {dim} of a tensor of shape {list(shape)}")


def _fmt(b: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(b.offset, b.shape)) + "]"
