"""DTensor (FSDP2, TP, FSDP2 + TP) -> the boxes of the global tensor this rank holds."""

from __future__ import annotations

from typing import Any

import torch

from ..layout import Box
from ..layout.placements import DimSplit, local_runs, runs_to_boxes


def is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def dtensor_pieces(dt: Any, key: str) -> tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]:
    """The global shape of ``dt`` and ``(global box, local view)`` for each box it holds here.

    Raises for ``Partial`` placements (pending reductions are not state).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dt.device_mesh
    shape = tuple(dt.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        return shape, []
    splits: list[DimSplit | None] = []
    for p in dt.placements:
        if isinstance(p, _StridedShard):
            splits.append(DimSplit(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            splits.append(DimSplit(p.dim))
        elif isinstance(p, Replicate):
            splits.append(None)
        else:
            raise ValueError(f"tensor {key!r}: cannot checkpoint a DTensor with placement {p}; reduce it first")
    local = dt.to_local()
    pieces = []
    for gbox, lbox in runs_to_boxes(local_runs(shape, tuple(mesh.shape), coord, splits)):
        pieces.append((gbox, local[lbox.slices()]))
    return shape, pieces
