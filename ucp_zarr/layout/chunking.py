"""The chunk grid policy: which shard (file) and chunk shape each array gets.

Zarr v3 with the ``sharding_indexed`` codec has two levels:

* a **shard** is one storage object (file). The shard grid is aligned with the boundaries of
  the *saving* layout, so every shard is written by exactly one rank.
* a **chunk** is the unit of reading and of checksumming inside a shard. Chunks are aligned
  with the boundaries of common *target* degrees (8, 4, 2) along the dims that TP and FSDP
  split (dim 0, and dim 1 of matrices), so that a rank of another layout reads little more
  than its slice. Chunks are bounded to ``chunk_bytes``.

See ``schema/FORMAT.md`` ("Chunk grid policy") for the rule in prose and the measurements
behind the defaults.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .boxes import Box, grid_indices

DEFAULT_CHUNK_BYTES = 1 << 20
"""Upper bound of one chunk; see FORMAT.md for the measurement behind it."""
DEFAULT_SHARD_BYTES = 1 << 30
"""Upper bound of one shard object written by one rank."""
MIN_ALIGNED_CHUNK_BYTES = 64 << 10
"""Below this, a chunk is not split further just to align with target degrees."""
TARGET_DEGREES = (8, 4, 2)
ELASTIC_DEGREES = (6, 3)
"""Degrees dim 0 is also aligned with (a job of 4 or 8 ranks resumed on 3 or 6 reads no more
than its slice), while chunks stay above ``MIN_ALIGNED_CHUNK_BYTES``."""


@dataclass(frozen=True)
class ChunkGrid:
    """A regular two-level grid over an array of ``shape``.

    ``shard_shape`` is a multiple of ``chunk_shape`` in every dim. When a shard holds exactly
    one chunk the array is stored without the sharding codec (one object per chunk).
    """

    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if any(s % c for s, c in zip(self.shard_shape, self.chunk_shape)):
            raise ValueError(f"shard {self.shard_shape} is no multiple of chunk {self.chunk_shape}")
        if any(c <= 0 for c in self.shard_shape):
            raise ValueError(f"shard shape {self.shard_shape} must be positive")

    @property
    def sharded(self) -> bool:
        return self.shard_shape != self.chunk_shape

    @property
    def shard_counts(self) -> tuple[int, ...]:
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shard_shape))

    @functools.cached_property
    def chunks_per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape))

    def shard_box(self, index: Sequence[int]) -> Box:
        """The part of the array that shard ``index`` covers (clipped at the array's edge)."""
        off = tuple(i * s for i, s in zip(index, self.shard_shape))
        return Box(off, tuple(min(s, n - o) for s, n, o in zip(self.shard_shape, self.shape, off)))

    def chunk_box(self, shard: Sequence[int], local: Sequence[int]) -> Box | None:
        """The array part of chunk ``local`` inside shard ``shard``; None if beyond the edge."""
        off = tuple(
            si * ss + li * cs
            for si, ss, li, cs in zip(shard, self.shard_shape, local, self.chunk_shape)
        )
        if any(o >= n for o, n in zip(off, self.shape)):
            return None
        return Box(off, tuple(min(c, n - o) for c, n, o in zip(self.chunk_shape, self.shape, off)))

    def shards_overlapping(self, box: Box) -> Iterator[tuple[int, ...]]:
        """Indices of the shards that share elements with ``box``, in C order."""
        yield from _cells_overlapping(box, self.shard_shape)

    def chunks_overlapping(self, shard: Sequence[int], box: Box) -> Iterator[tuple[int, ...]]:
        """Shard-local indices of the chunks of ``shard`` that share elements with ``box``."""
        sbox = self.shard_box(shard)
        inner = box.intersect(sbox)
        if inner is None or inner.is_empty():
            return
        yield from _cells_overlapping(inner.relative_to(sbox), self.chunk_shape)

    def all_shards(self) -> Iterator[tuple[int, ...]]:
        yield from grid_indices(self.shard_counts)


def _cells_overlapping(box: Box, cell: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if box.is_empty():
        return
    lo = [o // c for o, c in zip(box.offset, cell)]
    hi = [-(-t // c) for t, c in zip(box.stop, cell)]
    for rel in grid_indices([h - l for l, h in zip(lo, hi)]):
        yield tuple(l + r for l, r in zip(lo, rel))


def split_dims(ndim: int) -> tuple[int, ...]:
    """The dims TP and FSDP commonly split: dim 0 (column-parallel, FSDP) and dim 1 (row-parallel)."""
    return tuple(range(min(ndim, 2)))


def choose_grid(
    shape: Sequence[int],
    itemsize: int,
    *,
    region_shape: Sequence[int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ChunkGrid:
    """Choose the shard and chunk shape of an array.

    ``region_shape`` is the regular size of the saving layout's regions (one writer's share);
    by default the whole array. Along a dim cut into several regions, chunks must divide the
    region size so that no chunk straddles two writers; along a dim held whole, chunks are
    free and the shard is rounded up to whole chunks.

    1. The chunk starts as the region, aligned with the boundaries of target degrees 8, 4, 2
       along :func:`split_dims`, and along dim 0 also 6 and 3 (elastic restarts on fewer
       ranks), when that keeps it above ``MIN_ALIGNED_CHUNK_BYTES``.
    2. It is divided (by 2 or another small factor, leading dims first) until it fits
       ``chunk_bytes``.
    3. The shard is the region, divided along leading dims in whole chunks (exactly, along
       dims cut between writers) while above ``shard_bytes``.
    """
    shape = tuple(int(n) for n in shape)
    region = tuple(
        max(1, min(int(r), n)) if n else 1
        for r, n in zip(region_shape if region_shape is not None else shape, shape)
    )
    whole = tuple(r >= n for r, n in zip(region, shape))

    chunk = list(region)
    for d in split_dims(len(shape)):
        for k in TARGET_DEGREES:
            if shape[d] % k:
                continue
            aligned = math.gcd(chunk[d], shape[d] // k)
            if math.prod(chunk[:d] + [aligned] + chunk[d + 1 :]) * itemsize >= MIN_ALIGNED_CHUNK_BYTES:
                chunk[d] = aligned
                break
    # then dim 0, where elastic restarts reshard (FSDP, ZeRO), to 6 and 3 ranks too
    for k in ELASTIC_DEGREES if shape else ():
        aligned = math.gcd(chunk[0], shape[0] // k) if shape[0] % k == 0 else chunk[0]
        if math.prod([aligned] + chunk[1:]) * itemsize >= MIN_ALIGNED_CHUNK_BYTES:
            chunk[0] = aligned
    while math.prod(chunk) * itemsize > chunk_bytes:
        for d in range(len(chunk)):
            if chunk[d] > 1:
                chunk[d] = _divide(chunk[d], free=whole[d])
                break
        else:
            break

    shard = [-(-r // c) * c if w else r for r, c, w in zip(region, chunk, whole)]
    while math.prod(shard) * itemsize > shard_bytes:
        for d in range(len(shard)):
            if shard[d] > chunk[d]:
                chunks = shard[d] // chunk[d]
                # a dim cut between writers keeps shards that divide the region exactly
                shard[d] = -(-chunks // 2) * chunk[d] if whole[d] else shard[d] // _smallest_factor(chunks)
                break
        else:
            break
    return ChunkGrid(shape, tuple(shard), tuple(chunk))


def _divide(n: int, *, free: bool) -> int:
    """A smaller chunk size along one dim: halve or divide by a small factor of ``n``.

    When ``free`` (the dim is not cut between writers) ``n`` need not be divided exactly.
    """
    f = _smallest_factor(n)
    if f <= 7 or not free:
        return n // f
    return -(-n // 2)


def _smallest_factor(n: int) -> int:
    """The smallest prime factor of ``n`` >= 2."""
    for f in range(2, math.isqrt(n) + 1):
        if n % f == 0:
            return f
    return n
