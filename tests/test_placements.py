"""``ucp_zarr.layout.placements`` against torch's own DTensor splits (``Shard``, and
``_StridedShard`` of FSDP2 x TP) as the oracle."""

from __future__ import annotations

from typing import Any

import torch


def test_placement_runs_are_torchs_own_splits() -> None:
    """``local_runs`` against torch's own ``Shard`` / ``_StridedShard`` splits (applied mesh
    dim by mesh dim, as a DTensor is made), for every coordinate of 2-D meshes, lengths 0-13
    (uneven and empty parts) and split factors 1-4: the indices each rank holds, in its local
    order (the placements module's docstring promised this check)."""
    import itertools

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ucp_zarr.layout.placements import DimSplit, local_runs, runs_to_boxes

    def split(placement: Any, t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        if isinstance(placement, _StridedShard):
            return placement._select_split_tensor(t, parts, index, with_padding=False)
        return list(torch.chunk(t, parts, placement.dim))[index] if index < len(torch.chunk(t, parts, 0)) else t[:0]

    for n, mesh, (sf1, sf2) in itertools.product(range(14), [(2, 2), (3, 2), (2, 3), (3, 3)],
                                                  itertools.product((1, 2, 3, 4), (1, 2, 3))):
        placements = [_StridedShard(0, split_factor=f) if f > 1 else Shard(0) for f in (sf1, sf2)]
        whole = torch.arange(n)
        for coord in itertools.product(*(range(m) for m in mesh)):
            held = whole
            for mesh_dim, placement in enumerate(placements):
                held = split(placement, held, mesh[mesh_dim], coord[mesh_dim])
            boxes = runs_to_boxes(local_runs((n,), mesh, coord, [DimSplit(0, sf1), DimSplit(0, sf2)]))
            ours = torch.cat([whole[b.slices()] for b, _ in boxes]) if boxes else whole[:0]
            assert torch.equal(ours, held), (n, mesh, placements, coord, held.tolist(), ours.tolist())
