"""Which global indices a rank holds under DTensor placements, as runs per dim.

A DTensor on a device mesh holds, along each tensor dim, a list of global indices. Under
``Shard`` it is one contiguous range; under ``_StridedShard`` (FSDP2 + TP) it may be several.
We keep such lists as *runs* ``(start, length)`` in local order, so nothing here is O(size).
The semantics mirror ``torch.distributed.tensor`` exactly (``torch.chunk``-style uneven
splits: ``ceil(n / k)`` per part, the tail shorter or empty), applied left to right over
the mesh dims; tests check them against torch's own implementation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from .boxes import Box

Runs = list[tuple[int, int]]


@dataclass(frozen=True)
class DimSplit:
    """One mesh dim's sharding of a tensor dim: ``Shard(dim)`` or ``_StridedShard(dim, sf)``."""

    dim: int
    split_factor: int = 1


def take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions ``[lo, hi)`` of the index list that ``runs`` spell."""
    out: Runs = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
        if pos >= hi:
            break
    return _merge(out)


def _merge(runs: Runs) -> Runs:
    out: Runs = []
    for s, n in runs:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((s, n))
    return out


def _length(runs: Runs) -> int:
    return sum(n for _, n in runs)


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    total = _length(runs)
    size = -(-total // parts)
    return take(runs, min(index * size, total), min((index + 1) * size, total))


def split_runs(runs: Runs, split: DimSplit, parts: int, index: int) -> Runs:
    """The runs that mesh coordinate ``index`` (of ``parts``) keeps under ``split``."""
    if split.split_factor == 1:
        return _chunk(runs, parts, index)
    out: Runs = []
    for i in range(split.split_factor):
        out += _chunk(_chunk(runs, split.split_factor, i), parts, index)
    return _merge(out)


def local_runs(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    splits: Sequence[DimSplit | None],
) -> list[Runs]:
    """Per tensor dim, the global index runs held at ``coordinate`` (``None`` = replicated)."""
    runs: list[Runs] = [[(0, n)] if n else [] for n in shape]
    for mesh_dim, split in enumerate(splits):
        if split is not None:
            runs[split.dim] = split_runs(runs[split.dim], split, mesh_shape[mesh_dim], coordinate[mesh_dim])
    return runs


def runs_to_boxes(runs: list[Runs]) -> list[tuple[Box, Box]]:
    """``(global box, local box)`` pairs: the Cartesian product of the runs of every dim."""
    per_dim = []
    for dim_runs in runs:
        local, items = 0, []
        for start, length in dim_runs:
            items.append((start, local, length))
            local += length
        per_dim.append(items)
    out = []
    for combo in itertools.product(*per_dim):
        g = Box(tuple(c[0] for c in combo), tuple(c[2] for c in combo))
        out.append((g, Box(tuple(c[1] for c in combo), g.shape)))
    return out
