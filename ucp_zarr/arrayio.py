"""Moving one array's bytes: encode shards from tensor memory, decode boxes into tensors.

This is the only module that knows the byte layout of stored chunks (via :mod:`.shard`).
Writes stream chunk by chunk straight from tensor memory (a copy only for non-contiguous
or edge chunks, bounded by one chunk). Reads fetch only the chunks that overlap the
requested box, coalesce neighbouring chunks into one request, and land whole chunks
directly in the destination tensor when its memory allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from .errors import CorruptChunkError
from .format import ArrayMeta
from .layout import Box, grid_indices
from .shard import (
    CRC_BYTES,
    MISSING,
    chunk_key,
    crc_bytes,
    decode_index,
    empty_index,
    encode_index,
    index_nbytes,
    local_chunk_number,
    verify_chunk,
)
from .storage import ReadRequest, Store

MAX_REQUEST_BYTES = 64 << 20
"""Neighbouring chunks are fetched in one request up to this size."""


def as_storage(t: torch.Tensor, meta: ArrayMeta) -> torch.Tensor:
    """``t`` (CPU) reinterpreted as the Zarr data type's torch dtype (bits for bf16/fp8)."""
    t = t.detach()
    if t.dtype != meta.dtype.torch_dtype:
        raise TypeError(f"tensor {meta.key!r} has dtype {t.dtype}, the array holds {meta.dtype.torch_dtype}")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    target = meta.dtype.storage_torch_dtype
    return t if t.dtype == target else t.view(target)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.numpy()).cast("B") if t.dim() else memoryview(t.reshape(1).numpy()).cast("B")


# --- write ---------------------------------------------------------------------------------


def _chunk_buffers(meta: ArrayMeta, box: Box, src: torch.Tensor, src_box: Box) -> list[memoryview]:
    """The stored form of the chunk covering ``box``: its bytes (padded to the full chunk
    shape at the array's edge) and their crc32c."""
    part = src[box.relative_to(src_box).slices()]
    if box.shape != meta.grid.chunk_shape:
        full = torch.zeros(meta.grid.chunk_shape, dtype=part.dtype)
        full[Box.whole(box.shape).slices()] = part
        part = full
    elif not part.is_contiguous():
        part = part.contiguous()
    data = _bytes_of(part)
    return [data, memoryview(crc_bytes(data))]


def write_shard(store: Store, path: str, meta: ArrayMeta, shard: Sequence[int], src: torch.Tensor, src_box: Box) -> int:
    """Write shard ``shard`` of the array at ``path`` from ``src``, which holds ``src_box``
    of the global tensor (in the storage dtype, see :func:`as_storage`) and must contain the
    shard's part of the array. Returns the bytes written."""
    grid = meta.grid
    sbox = grid.shard_box(shard)
    if not src_box.contains(sbox):
        raise ValueError(f"tensor {meta.key!r}: source {src_box} does not cover shard {sbox}")
    key = f"{path}/{chunk_key(shard)}"
    if not grid.sharded:
        return store.write(key, _chunk_buffers(meta, sbox, src, src_box))

    cps = grid.chunks_per_shard
    index = empty_index(cps)

    def buffers() -> Iterator[memoryview | bytes]:
        offset = 0
        for n, local in enumerate(grid_indices(cps)):
            cbox = grid.chunk_box(shard, local)
            if cbox is None:
                continue
            bufs = _chunk_buffers(meta, cbox, src, src_box)
            size = sum(b.nbytes for b in bufs)
            index[n] = (offset, size)
            offset += size
            yield from bufs
        yield encode_index(index)

    return store.write(key, buffers())


# --- read ----------------------------------------------------------------------------------


@dataclass
class _Piece:
    """One stored chunk to fetch: where it lands, and how."""

    offset: int
    nbytes: int
    cbox: Box
    direct: torch.Tensor | None  # the destination view, when the chunk lands there whole
    scratch: torch.Tensor | None = None
    crc: bytearray | None = None

    def buffers(self) -> list[memoryview]:
        self.crc = bytearray(CRC_BYTES)
        target = self.direct if self.direct is not None else self.scratch
        return [_bytes_of(target), memoryview(self.crc)]


def read_shard_index(store: Store, path: str, meta: ArrayMeta, shard: Sequence[int]) -> np.ndarray:
    key = f"{path}/{chunk_key(shard)}"
    try:
        raw = store.read_tail(key, index_nbytes(meta.grid.chunks_per_shard))
    except FileNotFoundError:
        raise CorruptChunkError(f"tensor {meta.key!r}: shard {store.url}/{key} is missing") from None
    return decode_index(raw, meta.grid.chunks_per_shard, f"{store.url}/{key}")


def read_box(
    store: Store,
    path: str,
    meta: ArrayMeta,
    box: Box,
    out: torch.Tensor,
    shard: Sequence[int],
    index: np.ndarray | None = None,
) -> None:
    """Fill the part of ``out`` (which holds ``box``, in the storage dtype) that shard
    ``shard`` covers, reading only the chunks that overlap ``box``. ``index`` is the shard's
    decoded index (read here when None)."""
    grid = meta.grid
    key = f"{path}/{chunk_key(shard)}"
    chunk_nbytes = math.prod(grid.chunk_shape) * meta.dtype.itemsize + CRC_BYTES
    pieces: list[_Piece] = []
    for local in grid.chunks_overlapping(shard, box):
        cbox = grid.chunk_box(shard, local)
        assert cbox is not None
        inter = cbox.intersect(box)
        assert inter is not None
        if grid.sharded:
            if index is None:
                index = read_shard_index(store, path, meta, shard)
            off, nbytes = index[local_chunk_number(local, grid.chunks_per_shard)]
        else:
            off, nbytes = 0, chunk_nbytes
        dest = out[inter.relative_to(box).slices()]
        if off == MISSING:
            dest.zero_()
            continue
        if int(nbytes) != chunk_nbytes:
            raise OSError(f"{store.url}/{key}: chunk {local} has {nbytes} bytes, expected {chunk_nbytes}")
        whole = inter == cbox and cbox.shape == grid.chunk_shape and dest.is_contiguous()
        pieces.append(_Piece(int(off), int(nbytes), cbox, dest if whole else None))
    if not pieces:
        return
    pieces.sort(key=lambda p: p.offset)
    for run in _runs(pieces):
        for p in run:
            if p.direct is None:
                p.scratch = torch.empty(grid.chunk_shape, dtype=out.dtype)
        requests: list[ReadRequest] = [(run[0].offset, [b for p in run for b in p.buffers()])]
        try:
            store.readv(key, requests)
        except FileNotFoundError:
            raise CorruptChunkError(f"tensor {meta.key!r}: {store.url}/{key} is missing") from None
        for p in run:
            data = p.direct if p.direct is not None else p.scratch
            assert data is not None and p.crc is not None
            verify_chunk(_bytes_of(data), p.crc, f"{store.url}/{key} (tensor {meta.key!r}, chunk at {p.cbox.offset})")
            if p.scratch is not None:
                inter = p.cbox.intersect(box)
                assert inter is not None
                out[inter.relative_to(box).slices()] = p.scratch[inter.relative_to(p.cbox).slices()]
                p.scratch = None


def _runs(pieces: list[_Piece]) -> Iterator[list[_Piece]]:
    """Group offset-sorted pieces into runs of adjacent bytes, each at most MAX_REQUEST_BYTES."""
    run: list[_Piece] = []
    size = 0
    for p in pieces:
        if run and (run[-1].offset + run[-1].nbytes != p.offset or size + p.nbytes > MAX_REQUEST_BYTES):
            yield run
            run, size = [], 0
        run.append(p)
        size += p.nbytes
    if run:
        yield run
