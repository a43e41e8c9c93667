"""ZeRO's flat partitions: which range of which rank's flat buffer holds which elements of
each parameter (pure; read from a DeepSpeed checkpoint's metadata, no tensor data).

* **ZeRO-1/2**: each parameter group is one flat vector (parameters in order, each
  possibly followed by alignment padding), padded to a multiple of ``2 * world`` and cut
  into one equal partition per rank. A parameter's parts, in rank order, are consecutive
  ranges of the parameter.
* **ZeRO-3**: every parameter is padded to a multiple of the world size and cut into
  equal parts; rank ``r`` holds part ``r`` of each parameter of a (sub-)group, one after
  the other, in its flat buffer of that group.
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


def zero12_group_numel(shapes: Mapping[str, Sequence[int]], paddings: Sequence[int] | None = None) -> int:
    """ZeRO-1/2: the elements of a group's flat vector before the end padding (parameters
    in flat order, each followed by its alignment padding)."""
    pads = list(paddings or [0] * len(shapes))
    return sum(math.prod(s) for s in shapes.values()) + sum(pads[: max(0, len(shapes) - 1)])


def zero12_partition_size(numel: int, world: int) -> int:
    """ZeRO-1/2: each rank's partition of a group of ``numel`` elements (DeepSpeed pads the
    group to a multiple of ``2 * world`` and splits it equally)."""
    align = 2 * world
    return -(-numel // align) * align // world


def zero12_pieces(
    shapes: Sequence[Mapping[str, Sequence[int]]], world: int, paddings: Sequence[Sequence[int]] | None = None
) -> dict[str, list[FlatPiece]]:
    """ZeRO-1/2: the parameter shapes per group (in flat order) and alignment paddings ->
    every parameter's pieces. Rank ``r`` holds elements ``[r * S, (r + 1) * S)`` of each
    group's flat vector (:func:`zero12_partition_size`). Derived from the shapes, as
    ``zero_to_fp32`` does: DeepSpeed's recorded ``param_slice_mappings`` are wrong when it
    orders gradients round-robin."""
    if world < 1:
        raise ZeroLayoutError(f"world size {world}")
    out: dict[str, list[FlatPiece]] = {}
    for g, group in enumerate(shapes):
        pads = list(paddings[g]) if paddings is not None and g < len(paddings) else [0] * len(group)
        if len(pads) != len(group):
            raise ZeroLayoutError(f"group {g}: {len(pads)} alignment paddings for {len(group)} parameters")
        size = zero12_partition_size(zero12_group_numel(group, pads), world)
        at = 0
        for (name, shape), pad in zip(group.items(), pads):
            numel = math.prod(shape)
            pieces = []
            for rank in range(world):
                lo, hi = max(at, rank * size), min(at + numel, (rank + 1) * size)
                if hi > lo:
                    pieces.append(FlatPiece(rank, g, lo - rank * size, lo - at, hi - lo))
            out[name] = pieces
            at += numel + pad
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
