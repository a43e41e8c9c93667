"""Moving one array's bytes: encode shards from tensor memory, decode boxes into tensors.

This is the only module that knows the byte layout of stored chunks (via :mod:`.shard`).
Writes stream chunk by chunk straight from tensor memory (a copy only for non-contiguous
or edge chunks, bounded by one chunk). Reads fetch only the chunks that overlap the
requested box, coalesce neighbouring chunks into one request, and land whole chunks
directly in the destination tensor when its memory allows.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from .errors import CorruptChunkError
from .format import ArrayMeta
from .layout import Box, grid_indices
from .codec import (
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
from .storage import Store

MAX_REQUEST_BYTES = 64 << 20
"""Neighbouring chunks are fetched in one request up to this size."""
MAX_STAGED_BYTES = 16 << 20
"""...or up to this size when some of them land in the staging buffer (see :func:`_stage`)."""

_local = threading.local()


def _stage(nbytes: int) -> torch.Tensor:
    """This thread's reusable uint8 staging buffer, of at least ``nbytes``.

    Chunks that cannot land directly in the destination are read here and copied out, so a
    load touches no fresh memory per chunk; the buffer dies with its (worker) thread.
    """
    buf = getattr(_local, "stage", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.stage = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
    return buf


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


def _chunk_buffers(
    meta: ArrayMeta, box: Box, src: torch.Tensor, src_box: Box, stage: torch.Tensor | None = None
) -> list[memoryview]:
    """The stored form of the chunk covering ``box``: its bytes (padded to the full chunk
    shape at the array's edge) and their crc32c.

    A chunk that is a contiguous block of ``src`` is returned as a view of it (no copy). Any
    other chunk is copied into ``stage`` (a uint8 buffer of the stored chunk's size) when
    given, else into new memory; a staged result is valid until the next call with ``stage``.
    """
    grid = meta.grid
    part = src[box.relative_to(src_box).slices()]
    if box.shape == grid.chunk_shape and part.is_contiguous():
        data = _bytes_of(part)
        return [data, memoryview(crc_bytes(data))]
    nbytes = math.prod(grid.chunk_shape) * part.element_size()
    if stage is None:
        stage = torch.empty(nbytes + CRC_BYTES, dtype=torch.uint8)
    full = stage[:nbytes].view(part.dtype).view(grid.chunk_shape)
    if box.shape != grid.chunk_shape:
        full.zero_()
        full[Box.whole(box.shape).slices()] = part
    else:
        full.copy_(part)
    stored = memoryview(stage.numpy())[: nbytes + CRC_BYTES]
    stored[nbytes:] = crc_bytes(stored[:nbytes])
    return [stored]


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

    # One staging buffer per shard: Store.write consumes each buffer before pulling the next.
    stage = torch.empty(math.prod(grid.chunk_shape) * meta.dtype.itemsize + CRC_BYTES, dtype=torch.uint8)

    def buffers() -> Iterator[memoryview | bytes]:
        offset = 0
        for n, local in enumerate(grid_indices(cps)):
            cbox = grid.chunk_box(shard, local)
            if cbox is None:
                continue
            bufs = _chunk_buffers(meta, cbox, src, src_box, stage)
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
    for run in _runs(pieces, direct=all(p.direct is not None for p in pieces)):
        staged = sum(_aligned(p.nbytes) for p in run if p.direct is None)
        stage = _stage(staged) if staged else None
        bufs: list[memoryview] = []
        at = 0
        for p in run:
            if p.direct is not None:
                bufs.extend(p.buffers())
            else:
                assert stage is not None
                p.scratch = stage[at : at + p.nbytes]  # the stored chunk: its bytes, then its crc
                bufs.append(memoryview(p.scratch.numpy()))
                at += _aligned(p.nbytes)  # every staged chunk starts 64-byte aligned
        try:
            store.readv(key, [(run[0].offset, bufs)])
        except FileNotFoundError:
            raise CorruptChunkError(f"tensor {meta.key!r}: {store.url}/{key} is missing") from None
        for p in run:
            where = f"{store.url}/{key} (tensor {meta.key!r}, chunk at {p.cbox.offset})"
            if p.direct is not None:
                assert p.crc is not None
                verify_chunk(_bytes_of(p.direct), p.crc, where)
                continue
            assert p.scratch is not None
            n = p.nbytes - CRC_BYTES
            stored = memoryview(p.scratch.numpy())
            verify_chunk(stored[:n], stored[n:], where)
            inter = p.cbox.intersect(box)
            assert inter is not None
            chunk = p.scratch[:n].view(out.dtype).view(grid.chunk_shape)
            out[inter.relative_to(box).slices()] = chunk[inter.relative_to(p.cbox).slices()]
            p.scratch = None


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


def _runs(pieces: list[_Piece], direct: bool = True) -> Iterator[list[_Piece]]:
    """Group offset-sorted pieces into runs of adjacent bytes, each at most MAX_REQUEST_BYTES
    (MAX_STAGED_BYTES unless every piece lands directly in the destination)."""
    limit = MAX_REQUEST_BYTES if direct else MAX_STAGED_BYTES
    run: list[_Piece] = []
    size = 0
    for p in pieces:
        if run and (run[-1].offset + run[-1].nbytes != p.offset or size + p.nbytes > limit):
            yield run
            run, size = [], 0
        run.append(p)
        size += p.nbytes
    if run:
        yield run
