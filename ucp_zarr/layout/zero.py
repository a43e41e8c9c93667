"""ZeRO's flat partitions: which range of which rank's flat buffer holds which elements of
each parameter (pure; read from a DeepSpeed checkpoint's metadata, no tensor data).

* **ZeRO-1/2**: each parameter group is one flat vector (parameters in order, each
  possibly followed by alignment padding) cut into one equal partition per rank. Rank
  ``r`` records, per group, ``name -> (numel, start)``: the part of the parameter its
  partition holds and where it starts in the partition. A parameter's parts, in rank
  order, are consecutive ranges of the parameter.
* **ZeRO-3**: every parameter is padded to a multiple of the world size and cut into
  equal parts; rank ``r`` holds part ``r`` of each parameter of a group, one after the
  other, in its group's flat buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence


class ZeroLayoutError(ValueError):
    """The partitions do not tile a parameter (the message names it and the ranks)."""


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[param_start, param_start + numel)`` of a parameter, held by ``rank`` in
    its flat buffer of ``group`` from ``start``."""

    rank: int
    group: int
    start: int
    param_start: int
    numel: int


def zero12_pieces(
    mappings: Sequence[Sequence[Mapping[str, tuple[int, int]]]], shapes: Sequence[Mapping[str, Sequence[int]]]
) -> dict[str, list[FlatPiece]]:
    """ZeRO-1/2: ``mappings[rank][group][name] = (numel, start)`` and the parameter shapes
    per group -> every parameter's pieces, in parameter order. Checks that each
    parameter's pieces add up to it and that no two pieces of a rank's group overlap."""
    out: dict[str, list[FlatPiece]] = {}
    for g, group_shapes in enumerate(shapes):
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for name, shape in group_shapes.items():
            pieces, at = [], 0
            for rank, groups in enumerate(mappings):
                if g >= len(groups):
                    raise ZeroLayoutError(f"rank {rank} has {len(groups)} parameter groups, rank 0 has {len(shapes)}")
                if name not in groups[g]:
                    continue
                numel, start = (int(x) for x in groups[g][name])
                if numel < 0 or start < 0:
                    raise ZeroLayoutError(f"parameter {name!r}: rank {rank} maps {numel} elements at {start}")
                if numel:
                    pieces.append(FlatPiece(rank, g, start, at, numel))
                    spans.setdefault(rank, []).append((start, start + numel, name))
                at += numel
            total = math.prod(shape)
            if at != total:
                ranks = [p.rank for p in pieces]
                raise ZeroLayoutError(
                    f"parameter {name!r} (group {g}, shape {list(shape)}) has {total} elements, but ranks {ranks} "
                    f"hold {at} of it: the optimizer files are not one checkpoint's partitions"
                )
            out[name] = pieces
        for rank, ranges in spans.items():
            ranges.sort()
            for (a0, a1, n0), (b0, b1, n1) in zip(ranges, ranges[1:]):
                if b0 < a1:
                    raise ZeroLayoutError(f"rank {rank}, group {g}: parameters {n0!r} and {n1!r} overlap in its partition")
    return out


def zero3_pieces(shapes: Sequence[Mapping[str, Sequence[int]]], world: int) -> dict[str, list[FlatPiece]]:
    """ZeRO-3: the parameter shapes per group and the number of ranks -> every
    parameter's pieces (rank ``r`` holds part ``r`` of ``ceil(numel / world)`` elements,
    the last parts cut short by the padding)."""
    if world < 1:
        raise ZeroLayoutError(f"world size {world}")
    out: dict[str, list[FlatPiece]] = {}
    for g, group_shapes in enumerate(shapes):
        at = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            pieces = []
            for rank in range(world):
                lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
                if hi > lo:
                    pieces.append(FlatPiece(rank, g, at, lo, hi - lo))
            out[name] = pieces
            at += part
    return out


def zero3_group_sizes(shapes: Sequence[Mapping[str, Sequence[int]]], world: int) -> list[int]:
    """ZeRO-3: the elements of each rank's flat buffer of each group (padding included)."""
    return [sum(-(-math.prod(s) // world) for s in group.values()) for group in shapes]


def pieces_in(pieces: Sequence[FlatPiece], start: int, stop: int) -> list[tuple[FlatPiece, int, int]]:
    """The pieces that hold elements ``[start, stop)`` of the parameter, each with the
    sub-range ``[a, b)`` (parameter coordinates) it contributes, in order."""
    out = []
    for p in pieces:
        a, b = max(start, p.param_start), min(stop, p.param_start + p.numel)
        if b > a:
            out.append((p, a, b))
    return out
