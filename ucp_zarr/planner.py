"""The save planner: which arrays exist, with which grid, and who writes which shard.

Pure and I/O-free, like ``torch.distributed.checkpoint``'s planners: it turns tensor specs
into a :class:`SavePlan` that :mod:`.api` executes against a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import stored_dtype
from .format import ArrayMeta, Region
from .layout import Box, ChunkGrid, choose_grid
from .layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .statedict import assign_array_paths


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to save: its key, global shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ShardTask:
    """Write shard ``shard`` of the array at ``path``; done by rank ``writer``."""

    key: str
    path: str
    shard: tuple[int, ...]
    writer: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    arrays: dict[str, tuple[str, ArrayMeta]]
    """key -> (array path, array metadata), in state-dict order."""
    shards: list[ShardTask]

    @property
    def groups(self) -> list[str]:
        """The parameter groups (first path component of every array), sorted."""
        return sorted({path.split("/")[0] for path, _ in self.arrays.values()})


def plan_save(
    specs: list[TensorSpec],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> SavePlan:
    """Plan a single-writer save: each tensor is one region written by rank 0."""
    paths = assign_array_paths([s.key for s in specs])
    arrays: dict[str, tuple[str, ArrayMeta]] = {}
    shards: list[ShardTask] = []
    for spec in specs:
        sd = stored_dtype(spec.dtype, key=spec.key)
        grid = choose_grid(spec.shape, sd.itemsize, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes)
        meta = ArrayMeta(spec.key, sd, grid, (Region(Box.whole(spec.shape).offset, spec.shape, 0, (0,)),))
        arrays[spec.key] = (paths[spec.key], meta)
        shards.extend(
            ShardTask(spec.key, paths[spec.key], idx, 0, _shard_nbytes(grid, idx, sd.itemsize))
            for idx in grid.all_shards()
        )
    shards.sort(key=lambda t: -t.nbytes)
    return SavePlan(arrays, shards)


def _shard_nbytes(grid: ChunkGrid, index: tuple[int, ...], itemsize: int) -> int:
    return grid.shard_box(index).numel * itemsize
