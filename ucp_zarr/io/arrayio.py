"""Moving one array's bytes: encode shards from tensor memory, decode boxes into tensors.

This is the only module that knows the byte layout of stored chunks (via :mod:`..format.codec`).
Writes stream chunk by chunk straight from tensor memory (a copy only for non-contiguous
or edge chunks, bounded by one chunk). Reads fetch only the chunks that overlap the
requested box, coalesce neighbouring chunks into one request, and land whole chunks
directly in the destination array when its memory allows. The read side is numpy only
(a torch destination is read through its ``.numpy()`` view), so readers need no torch.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import numpy as np

from ..format.codec import (
    CRC_BYTES,
    MISSING,
    Trailer,
    checksum,
    chunk_key,
    decode_index,
    decode_trailer,
    empty_index,
    encode_index,
    encode_trailer,
    index_nbytes,
    trailer_nbytes,
    verify_chunk,
)
from ..errors import CorruptChunkError, FormatError
from ..format.documents import ArrayMeta
from ..layout import Box, ChunkGrid
from .direct import aligned_empty, reserve
from .store import ShortReadError, Store, WriteGuard, copy_bytes

if TYPE_CHECKING:
    import torch

MAX_REQUEST_BYTES = 64 << 20
"""Neighbouring chunks are fetched in one request up to this size."""
MAX_STAGED_BYTES = 16 << 20
"""...or up to this size when some of them land in the staging buffer (see :func:`_stage`)."""
WRITE_BATCH_BYTES = 1 << 20
"""A shard's chunks that need a copy are written in runs of up to this size (see
:func:`_tiled_batches`)."""
PACE_PIECE_BYTES = 1 << 20
"""A paced write (:func:`write_shard`'s ``pace``) waits for the slot of each piece of at most
this size, so that one large shard is spread over its time too."""
MAX_UNREAD_HEAD_BYTES = 1 << 20
"""A shard whose trailer and index take more (over ~50,000 chunks) is read after its index:
:func:`read_whole_shard` would allocate what its array document claims before the object's
size is known, and a forged grid claims gigabytes for a shard of a few bytes."""

_local = threading.local()
_T = TypeVar("_T")


def _stage(nbytes: int) -> np.ndarray:
    """This thread's reusable uint8 staging buffer (page-aligned: a direct read may land in
    it, :mod:`.direct`), of at least ``nbytes``.

    Chunks that cannot land directly in the destination are read here and copied out, so a
    load touches no fresh memory per chunk; the buffer dies with its (worker) thread.
    """
    buf = getattr(_local, "stage", None)
    if buf is None or buf.size < nbytes:
        buf = _local.stage = aligned_empty(max(nbytes, 1 << 20))
    return buf


def as_storage(t: "torch.Tensor", meta: ArrayMeta) -> "torch.Tensor":
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


def writable_view(t: "torch.Tensor", meta: ArrayMeta) -> np.ndarray | None:
    """A numpy array in the storage dtype over exactly the memory of ``t``, element for
    element, so that filling it fills ``t``; None when there is none: ``t`` is off the CPU,
    of another dtype, empty, a conjugate or negative view (whose memory holds other values
    than it shows), or a tensor subclass without plain memory. A read then fills ``t``
    through a temporary and ``copy_``, which handles every such view."""
    if t.device.type != "cpu" or t.dtype != meta.dtype.torch_dtype or t.is_conj() or t.is_neg() or not t.numel():
        return None
    try:
        raw = as_storage(t, meta).numpy()
        ptr, strides = t.data_ptr(), tuple(s * t.element_size() for s in t.stride())
    except (RuntimeError, TypeError):  # a subclass without plain memory
        return None
    if raw.__array_interface__["data"][0] != ptr or raw.strides != strides or not raw.flags.writeable:
        return None
    return raw


def _array_bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(a.reshape(-1).view(np.uint8))


# --- write ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seal:
    """What binds a shard to its checkpoint (see :mod:`..format.codec`): the save id, whether the
    checkpoint is authenticated, and the key (writers: always when authenticated; readers:
    when they have it)."""

    save_id: str
    authenticated: bool = False
    hmac_key: bytes | None = None


def _chunk_buffers(
    chunk_shape: tuple[int, ...], part: np.ndarray, stage: Callable[[], np.ndarray]
) -> tuple[memoryview, int]:
    """The stored form of a chunk whose part inside the array is ``part`` (padded with zeros
    to ``chunk_shape`` at the array's edge) and its crc32c.

    A chunk that is a contiguous block of its source is returned as a view of it (no copy);
    any other chunk is copied into ``stage()`` (valid until the next call with it)."""
    if part.shape == chunk_shape and part.flags.c_contiguous:
        data = _array_bytes(part)
        return data, checksum(data)
    nbytes = math.prod(chunk_shape) * part.itemsize
    buf = stage()[:nbytes]
    full = buf.view(part.dtype).reshape(chunk_shape)
    if part.shape != chunk_shape:
        full[...] = 0
        full[tuple(slice(0, n) for n in part.shape)] = part
    else:
        full[...] = part
    data = memoryview(buf)
    return data, checksum(data)


def _shard_chunks(grid: "ChunkGrid", shard: Sequence[int], src_box: Box) -> Iterator[tuple[slice, ...] | None]:
    """Every chunk of ``shard`` in C order (its row in the index): the part of the source
    (holding ``src_box``) that it covers, or None for a chunk wholly beyond the array's edge.
    Per dim first, then combined (a shard may hold thousands of chunks)."""
    if grid.shard_shape == grid.chunk_shape and grid.shard_shape == grid.shape:  # (one chunk, the array)
        yield tuple(slice(-so, n - so) for n, so in zip(grid.shape, src_box.offset))
        return
    per_dim: list[list[slice | None]] = []
    for si, ss, cs, n, so in zip(shard, grid.shard_shape, grid.chunk_shape, grid.shape, src_box.offset):
        dim: list[slice | None] = []
        for o in range(si * ss, si * ss + ss, cs):
            dim.append(slice(o - so, min(o + cs, n) - so) if o < n else None)
        per_dim.append(dim)
    for combo in itertools.product(*per_dim):
        yield None if None in combo else combo  # type: ignore[misc]


class _Replayable:
    """An iterable that starts ``make()`` afresh each time it is iterated (a store may
    replay a failed write), of ``nbytes`` bytes in all (see :meth:`.Store.write`)."""

    def __init__(self, make: Callable[[], Iterator[memoryview | bytes]], nbytes: int) -> None:
        self._make = make
        self.nbytes = nbytes

    def __iter__(self) -> Iterator[memoryview | bytes]:
        return self._make()


def write_shard(
    store: Store,
    path: str,
    meta: ArrayMeta,
    shard: Sequence[int],
    src: "torch.Tensor",
    src_box: Box,
    seal: Seal,
    guard: WriteGuard | None = None,
    pace: Callable[[int], None] | None = None,
) -> bytes:
    """Write shard ``shard`` of the array at ``path`` from ``src``, which holds ``src_box``
    of the global tensor (in the storage dtype, see :func:`as_storage`) and must contain the
    shard's part of the array, behind ``guard`` (see :meth:`.store.Store.write`). With
    ``pace`` (:meth:`..io.pace.Pace.take`), each piece of at most :data:`PACE_PIECE_BYTES`
    waits for its slot before the store takes it. Returns the shard's seal (see
    :func:`..format.codec.array_digest`)."""
    # numpy from here on: a torch call releases the GIL (each one a handoff between the
    # writer threads), numpy's indexing does not
    return write_shard_array(store, path, meta, shard, src.numpy(), src_box, seal, guard, pace)[0]


def write_shard_array(
    store: Store,
    path: str,
    meta: ArrayMeta,
    shard: Sequence[int],
    array: np.ndarray,
    src_box: Box,
    seal: Seal,
    guard: WriteGuard | None = None,
    pace: Callable[[int], None] | None = None,
) -> tuple[bytes, int]:
    """:func:`write_shard` from a numpy array (torch-free); returns the seal and the size of
    the object written."""
    grid = meta.grid
    sbox = grid.shard_box(shard)
    if not src_box.contains(sbox):
        raise ValueError(f"tensor {meta.key!r}: source {src_box} does not cover shard {sbox}")
    key = f"{path}/{chunk_key(shard)}"
    tiles = _tiled_source(grid, array[sbox.relative_to(src_box).slices()])
    sealed: list[bytes] = []

    def buffers() -> Iterator[memoryview | bytes]:
        crcs: list[int] = []
        shas: list[bytes] | None = [] if seal.authenticated else None
        if tiles is not None:
            yield from _tiled_batches(grid, tiles, crcs, shas)
        else:
            yield from _chunks_one_by_one(grid, shard, src_box, array, crcs, shas)
        trailer = encode_trailer(seal.save_id, key, crcs, shas, seal.hmac_key)
        sealed[:] = [trailer[-32:]]
        yield trailer
        yield _written_layout(meta, shard)[1]

    make = buffers if pace is None else lambda: _paced(buffers(), pace)
    nbytes = store.write(key, _Replayable(make, _written_nbytes(meta, shard, seal)), guard)
    return sealed[0], nbytes


def _paced(buffers: Iterator[memoryview | bytes], pace: Callable[[int], None]) -> Iterator[memoryview | bytes]:
    """``buffers``, each piece of at most :data:`PACE_PIECE_BYTES` once ``pace`` gave it its
    slot (a buffer that size or smaller as itself: one filled in place stays that view)."""
    for buf in buffers:
        view = memoryview(buf)
        if view.nbytes <= PACE_PIECE_BYTES or not view.c_contiguous:
            pace(view.nbytes)
            yield buf
            continue
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        for start in range(0, view.nbytes, PACE_PIECE_BYTES):
            piece = view[start : start + PACE_PIECE_BYTES]
            pace(piece.nbytes)
            yield piece


def _tiled_source(grid: ChunkGrid, region: np.ndarray) -> np.ndarray | None:
    """``region`` (a shard's part of the source), when its chunks tile it exactly (the shard
    lies inside the array), unless every chunk is a contiguous block of it already (then
    each is written from the source, with no copy); else None."""
    if not region.ndim or region.shape != grid.shard_shape or any(s % c for s, c in zip(grid.shard_shape, grid.chunk_shape)):
        return None
    if grid.chunk_shape[1:] == grid.shard_shape[1:] and region.flags.c_contiguous:
        return None
    return region


def _tiled_runs(grid: ChunkGrid, region: np.ndarray, limit: int) -> Iterator[tuple[int, np.ndarray]]:
    """The chunks of a tiled shard (:func:`_tiled_source`) in runs of consecutive chunks (C
    order of its chunk grid) of at most ``limit`` stored bytes (or one chunk): each run's
    number of chunks and a view of them in ``region``, shaped ``(run, chunk shape)`` with
    the run's chunk axes first (``(k, n1, ..., c0, c1, ...)``)."""
    cps, chunk = grid.chunks_per_shard, grid.chunk_shape
    stored = math.prod(chunk) * region.itemsize + CRC_BYTES
    # the first axis whose trailing chunk grid fits the limit: a run varies it, fixes those before
    axis = next((d for d in range(len(cps)) if math.prod(cps[d + 1 :]) * stored <= limit), len(cps) - 1)
    tail = math.prod(cps[axis + 1 :])
    step = max(1, limit // (tail * stored))
    shape_tail = [*cps[axis + 1 :], *chunk]
    strides_tail = [c * st for c, st in zip(chunk[axis + 1 :], region.strides[axis + 1 :])] + list(region.strides)
    for lead in itertools.product(*map(range, cps[:axis])):
        for k0 in range(0, cps[axis], step):
            k1 = min(cps[axis], k0 + step)
            start = region[tuple(slice(i * c, None) for i, c in zip((*lead, k0), chunk))]
            view = np.lib.stride_tricks.as_strided(
                start, [k1 - k0, *shape_tail], [chunk[axis] * region.strides[axis], *strides_tail], writeable=False
            )
            yield (k1 - k0) * tail, view


def _tiled_batches(
    grid: ChunkGrid, region: np.ndarray, crcs: list[int], shas: list[bytes] | None
) -> Iterator[memoryview]:
    """The stored chunks of a tiled shard (:func:`_tiled_source`), a run of them at a time
    (:func:`_tiled_runs`, up to ``WRITE_BATCH_BYTES``: small enough to stay in the CPU's
    cache from the copy to the write): one strided copy of the run into this thread's
    staging buffer laid out as stored (each chunk followed by its crc32c), whose crc32c (and
    SHA-256) are appended to ``crcs`` (``shas``). One buffer per run, valid until the next
    is pulled: one write, not one per chunk. The mirror of :func:`_land_tiled`."""
    nbytes = math.prod(grid.chunk_shape) * region.itemsize
    stored = nbytes + CRC_BYTES
    for n, run in _tiled_runs(grid, region, WRITE_BATCH_BYTES):
        stage = reserve(n * stored)  # (a store's staged write takes the run where it is gathered)
        stage = _stage(n * stored)[: n * stored] if stage is None else stage
        chunks = stage.reshape(n, stored)
        chunks[:, :nbytes].view(region.dtype).reshape(run.shape)[...] = run
        raw = memoryview(stage)
        batch = [checksum(raw[i * stored : i * stored + nbytes]) for i in range(n)]
        chunks[:, nbytes:] = np.asarray(batch, dtype="<u4").view(np.uint8).reshape(n, CRC_BYTES)
        if shas is not None:
            shas.extend(hashlib.sha256(raw[i * stored : i * stored + nbytes]).digest() for i in range(n))
        crcs.extend(batch)
        yield raw


def _chunks_one_by_one(
    grid: ChunkGrid, shard: Sequence[int], src_box: Box, array: np.ndarray, crcs: list[int], shas: list[bytes] | None
) -> Iterator[memoryview | bytes]:
    """The stored chunks of ``shard``, each with its crc32c (appended to ``crcs``, and its
    SHA-256 to ``shas``): a chunk that is a contiguous block of ``array`` straight from it,
    any other (an edge chunk, padded) through this thread's staging buffer, valid until the
    next is pulled. A chunk beyond the array's edge is absent (zero in ``crcs``)."""
    chunk_nbytes = math.prod(grid.chunk_shape) * array.itemsize
    for where in _shard_chunks(grid, shard, src_box):
        if where is None:
            crcs.append(0)
            if shas is not None:
                shas.append(bytes(32))
            continue
        data, crc = _chunk_buffers(grid.chunk_shape, array[where], lambda: _stage(chunk_nbytes))
        if shas is not None:
            shas.append(hashlib.sha256(data).digest())
        crcs.append(crc)
        yield data
        yield crc.to_bytes(CRC_BYTES, "little")


# --- read ----------------------------------------------------------------------------------


class _Piece:
    """One stored chunk to fetch: where it lands, and how."""

    __slots__ = ("offset", "nbytes", "row", "origin", "src", "dst", "direct", "scratch", "crc")

    def __init__(
        self, offset: int, nbytes: int, row: int, origin: tuple[int, ...] = (),
        src: tuple[slice, ...] = (), dst: tuple[slice, ...] = (), direct: np.ndarray | None = None,
    ) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self.row = row  # the chunk's row in the shard index (and trailer)
        self.origin = origin  # the chunk's first element in the array (for messages)
        self.src = src  # the part of the chunk that is read...
        self.dst = dst  # ...and where it lands in the destination
        self.direct = direct  # the destination view, when the chunk lands there whole
        self.scratch: np.ndarray | None = None
        self.crc: bytearray | None = None

    def buffers(self) -> list[memoryview]:
        self.crc = bytearray(CRC_BYTES)
        target = self.direct if self.direct is not None else self.scratch
        assert target is not None
        return [_array_bytes(target), memoryview(self.crc)]


def _chunk_pieces(meta: ArrayMeta, box: Box, out: np.ndarray, shard: Sequence[int], index: np.ndarray) -> list[_Piece]:
    """The chunks of ``shard`` that overlap ``box``, each with the part of it to read and
    where that lands in ``out`` (which holds ``box``). Per dim first, then combined: a
    shard of thousands of chunks costs a few microseconds per chunk."""
    grid = meta.grid
    per_dim: list[list[tuple[int, int, slice, slice, bool]]] = []
    for si, ss, cs, n, bo, bn in zip(shard, grid.shard_shape, grid.chunk_shape, grid.shape, box.offset, box.stop):
        s0 = si * ss
        lo, hi = max(bo, s0), min(bn, s0 + ss, n)
        if hi <= lo:
            return []
        dim = []
        for g in range(lo // cs, -(-hi // cs)):
            o = g * cs
            i0, i1 = max(o, lo), min(o + cs, hi)
            dim.append((g - s0 // cs, o, slice(i0 - o, i1 - o), slice(i0 - bo, i1 - bo), i0 == o and i1 == o + cs))
        per_dim.append(dim)
    cps = grid.chunks_per_shard
    strides = [math.prod(cps[d + 1 :]) for d in range(len(per_dim))]
    rows = index.tolist()
    pieces = []
    for combo in itertools.product(*per_dim):
        row = sum(c[0] * st for c, st in zip(combo, strides))
        dst = tuple(c[3] for c in combo)
        direct = None
        if out.ndim and all(c[4] for c in combo):
            view = out[dst]
            direct = view if view.flags.c_contiguous else None
        off, nbytes = rows[row]
        pieces.append(_Piece(off, nbytes, row, tuple(c[1] for c in combo), tuple(c[2] for c in combo), dst, direct))
    return pieces


@dataclass(frozen=True)
class ShardHead:
    """A shard's index and trailer, read together from its end and checked."""

    index: np.ndarray
    trailer: Trailer


def _shard_where(store: Store, path: str, shard: Sequence[int]) -> tuple[str, str]:
    key = f"{path}/{chunk_key(shard)}"
    return key, f"{store.url}/{key}"


def _inside_rows(meta: ArrayMeta, shard: Sequence[int]) -> np.ndarray:
    """Which index rows of ``shard`` are chunks inside the array (the others lie wholly
    beyond its edge and are absent)."""
    mask = np.zeros(meta.grid.chunks_per_shard, dtype=bool)
    mask[tuple(slice(0, c) for c in _inside_counts(meta, shard))] = True
    return mask.reshape(-1)


def read_shard_head(store: Store, path: str, meta: ArrayMeta, shard: Sequence[int], seal: Seal) -> ShardHead:
    """Read and check the trailer and index of a shard (one request from its end).

    Raises :class:`CorruptChunkError` when the shard is missing, damaged, marks a chunk
    inside the array absent, or belongs to another array or another save."""
    key, where = _shard_where(store, path, shard)
    try:
        raw = store.read_tail(key, _head_nbytes(meta, seal))
    except FileNotFoundError:
        raise CorruptChunkError(f"{where} (tensor {meta.key!r}) is missing") from None
    except FormatError as e:  # a directory or special file where the shard belongs
        raise CorruptChunkError(f"{where} (tensor {meta.key!r}): {e}") from None
    except ShortReadError as e:  # (any other OSError is the store's: no damage found)
        raise CorruptChunkError(f"{where} (tensor {meta.key!r}) is truncated: {e}") from None
    return decode_shard_head(store, path, meta, shard, seal, raw)


def _head_nbytes(meta: ArrayMeta, seal: Seal) -> int:
    cps = meta.grid.chunks_per_shard
    return trailer_nbytes(math.prod(cps), seal.authenticated) + index_nbytes(cps)


def decode_shard_head(
    store: Store,
    path: str,
    meta: ArrayMeta,
    shard: Sequence[int],
    seal: Seal,
    raw: bytes | memoryview,
    written: bool = False,
) -> ShardHead:
    """Check the trailer and index at the end of ``raw`` (the shard's tail, or all of it).
    With ``written``, an index stored byte for byte as this library writes it (the index
    of :func:`written_index`, which meets every check of the index's layout, and its
    crc32c) is taken as it is; the head then holds that very index."""
    grid = meta.grid
    cps = grid.chunks_per_shard
    n = math.prod(cps)
    key, where = _shard_where(store, path, shard)
    where = f"{where} (tensor {meta.key!r})"
    tn = trailer_nbytes(n, seal.authenticated)
    tail = memoryview(raw)[len(raw) - _head_nbytes(meta, seal) :]
    layout, stored = _written_layout(meta, shard) if written else (None, None)
    index = layout if layout is not None and tail[tn:].tobytes() == stored else decode_index(tail[tn:], cps, where)
    trailer = decode_trailer(
        tail[:tn], n, seal.save_id, key, where, authenticated=seal.authenticated, hmac_key=seal.hmac_key
    )
    if index is layout:
        return ShardHead(index, trailer)
    inside = _inside_rows(meta, shard)
    absent = index[:, 0] == MISSING
    wrong = np.flatnonzero(absent == inside)
    if wrong.size:
        row = int(wrong[0])
        what = "marked absent" if inside[row] else "present beyond the array's edge"
        raise CorruptChunkError(f"{where}: chunk {row} of the shard is {what}: the shard is corrupt")
    chunk_nbytes = math.prod(grid.chunk_shape) * meta.dtype.itemsize + CRC_BYTES
    if (index[inside, 1] != chunk_nbytes).any():
        raise CorruptChunkError(f"{where}: the shard index records chunks of a size other than {chunk_nbytes} bytes")
    return ShardHead(index, trailer)


def read_small_shard(
    store: Store, path: str, meta: ArrayMeta, shard: Sequence[int], seal: Seal, limit: int
) -> memoryview | None:
    """The whole object of ``shard`` in one request, when it is at most ``limit`` bytes (its
    size follows from the grid: every chunk inside the array is stored). None when larger,
    when the store cannot read a small object whole, or when the object is not exactly that
    size: the two-request path then names what is wrong."""
    size = _written_nbytes(meta, shard, seal)
    if size > limit:
        return None
    key, _ = _shard_where(store, path, shard)
    try:
        raw = store.read_small(key, size)
    except (OSError, FormatError):
        return None
    return memoryview(raw) if raw is not None and len(raw) == size else None


def read_box(
    store: Store,
    path: str,
    meta: ArrayMeta,
    box: Box,
    out: np.ndarray,
    shard: Sequence[int],
    head: ShardHead,
    whole: memoryview | None = None,
) -> None:
    """Fill the part of ``out`` (a numpy array of any strides that holds ``box``, in the
    storage dtype: :attr:`.StoredDtype.numpy_dtype`) that shard
    ``shard`` covers, reading only the chunks that overlap ``box``; ``head`` is the shard's
    checked index and trailer (:func:`read_shard_head`); ``whole``, when given, the shard's
    object already read (:func:`read_small_shard`), which the chunks are copied from."""
    key, where = _shard_where(store, path, shard)
    if whole is None:
        target = _tiled_target(meta, box, out, shard, head.trailer.shas is not None)
        if target is not None and _read_tiled_bands(store, key, where, meta, shard, head, target):
            return
    pieces = _chunk_pieces(meta, box, out, shard, head.index)
    if not pieces:
        return
    pieces.sort(key=lambda p: p.offset)
    for run in _runs(pieces, direct=all(p.direct is not None for p in pieces)):
        bufs = _run_buffers(run)
        if whole is None:
            _readv(store, key, where, meta, [(run[0].offset, bufs)])
        else:
            _copy_out(whole, run[0].offset, bufs, f"{where} (tensor {meta.key!r})")
        _land(run, out, meta, head, where)


def read_whole_shard(
    store: Store, path: str, meta: ArrayMeta, box: Box, out: np.ndarray, shard: Sequence[int], seal: Seal
) -> ShardHead | None:
    """Fill the part of ``out`` (as :func:`read_box`; ``box`` covers ``shard`` whole) that
    ``shard`` covers in one request, its index unread: the chunks, where this library's
    writer puts them (:func:`written_index`), straight into ``out`` where they land whole,
    then the trailer and index from the object's end. Returns the shard's checked head; a
    shard whose index records another layout is read again by it. None, with nothing read,
    where the store cannot read an object of a known size in one request, the object has
    another size, the chunks take more than one request or the index is large
    (:data:`MAX_UNREAD_HEAD_BYTES`): the caller then reads the index first
    (:func:`read_shard_head`)."""
    if _head_nbytes(meta, seal) > MAX_UNREAD_HEAD_BYTES:
        return None
    index, size = written_index(meta, shard, seal)
    grid_view = _tiled_target(meta, box, out, shard, seal.authenticated)
    if grid_view is not None:
        return _read_tiled_shard(store, path, meta, box, out, shard, seal, index, size, grid_view)
    pieces = _chunk_pieces(meta, box, out, shard, index)
    direct = all(p.direct is not None for p in pieces)
    if size - _head_nbytes(meta, seal) > (MAX_REQUEST_BYTES if direct else MAX_STAGED_BYTES):
        return None
    tail = bytearray(_head_nbytes(meta, seal))
    key, where = _shard_where(store, path, shard)
    try:
        if not store.readv_whole(key, [(0, [*_run_buffers(pieces), memoryview(tail)])], size):
            return None
    except (OSError, FormatError):
        return None  # (missing, short, not a file: the two-request path names what is wrong)
    head = decode_shard_head(store, path, meta, shard, seal, tail, written=True)
    if head.index is index:
        _land(pieces, out, meta, head, where)
    else:  # another layout than this library's writer gives: read again by its index
        read_box(store, path, meta, box, out, shard, head)
    return head


def _tiled_target(
    meta: ArrayMeta, box: Box, out: np.ndarray, shard: Sequence[int], authenticated: bool
) -> np.ndarray | None:
    """Where ``shard`` lands in ``out``, viewed as ``(shard chunks, chunk)`` per dim interleaved
    (``(n0, c0, n1, c1, ...)``), when its chunks tile it exactly (the shard lies inside the
    array), none of them can land in ``out`` directly (their rows are not whole rows of a
    contiguous target) and the shard is not authenticated (its chunks then have SHA-256s to
    check one by one); else None."""
    grid = meta.grid
    sbox = grid.shard_box(shard)
    if authenticated or not out.ndim or sbox.shape != grid.shard_shape or not box.contains(sbox):
        return None
    if any(s % c for s, c in zip(grid.shard_shape, grid.chunk_shape)):
        return None
    region = out[sbox.relative_to(box).slices()]
    if grid.chunk_shape[1:] == grid.shard_shape[1:] and region.flags.c_contiguous:
        return None  # every chunk lands directly: no copy at all
    shape, strides = [], []
    for n, c, st in zip(grid.chunks_per_shard, grid.chunk_shape, region.strides):
        shape += [n, c]
        strides += [c * st, st]
    return np.lib.stride_tricks.as_strided(region, shape, strides, writeable=True)


def _read_tiled_shard(
    store: Store, path: str, meta: ArrayMeta, box: Box, out: np.ndarray, shard: Sequence[int], seal: Seal,
    index: np.ndarray, size: int, target: np.ndarray,
) -> ShardHead | None:
    """:func:`read_whole_shard` of a shard whose chunks tile it (see :func:`_tiled_target`):
    the object in one request (into this thread's staging buffer, or the store's own buffer
    where reads come in one: no copy), every chunk's crc32c checked against the data and the
    trailer, then one strided copy of all chunks into ``target``."""
    if size - _head_nbytes(meta, seal) > (MAX_REQUEST_BYTES if store.own_buffers else MAX_STAGED_BYTES):
        return None
    key, where = _shard_where(store, path, shard)
    with store.holding(size):  # (the store's buffer, until landed)
        try:
            data = store.read_whole(key, size) if store.own_buffers else store.read_span(key, 0, size, _stage, size)
            if data is None:
                return None
            stage = np.frombuffer(data, dtype=np.uint8)
        except (OSError, FormatError):
            return None  # (missing, short, not a file: the two-request path names what is wrong)
        head = decode_shard_head(store, path, meta, shard, seal, stage, written=True)
        if head.index is index:
            _land_tiled(stage, 0, math.prod(meta.grid.chunks_per_shard), meta, head, shard, where, target)
            return head
    read_box(store, path, meta, box, out, shard, head)  # another layout than this library's writer gives
    return head


def _land_tiled(
    stage: np.ndarray, first: int, n: int, meta: ArrayMeta, head: ShardHead, shard: Sequence[int], where: str,
    target: np.ndarray,
) -> None:
    """Check chunks ``first`` to ``first + n`` of a tiled shard (C order of its chunk grid,
    whole bands along its first dim), stored back to back at the start of ``stage``, against
    their crc32c and the trailer; then copy them into ``target`` (those bands of
    :func:`_tiled_target`'s view) in one strided pass."""
    grid = meta.grid
    stored = _stored_nbytes(meta)
    nbytes = stored - CRC_BYTES
    raw = memoryview(stage)
    chunks = stage[: n * stored].reshape(n, stored)
    crcs = chunks[:, nbytes:].copy().view("<u4").reshape(n)
    computed = np.fromiter((checksum(raw[i * stored : i * stored + nbytes]) for i in range(n)), dtype=np.uint32, count=n)
    recorded = head.trailer.crcs[first : first + n]
    for i in np.flatnonzero((computed != crcs) | (crcs != recorded)):  # (the checks that name it)
        at, row = int(i) * stored, first + int(i)
        local = np.unravel_index(row, grid.chunks_per_shard)
        origin = tuple(int(a) * s + int(b) * c for a, s, b, c in zip(shard, grid.shard_shape, local, grid.chunk_shape))
        chunk_where = f"{where} (tensor {meta.key!r}, chunk at {origin})"
        verify_chunk(raw[at : at + nbytes], raw[at + nbytes : at + stored], chunk_where)
        head.trailer.check_chunk(row, raw[at + nbytes : at + stored], raw[at : at + nbytes], chunk_where)
    ndim = len(grid.chunk_shape)
    data = chunks[:, :nbytes].view(target.dtype).reshape(-1, *grid.chunks_per_shard[1:], *grid.chunk_shape)
    target[...] = data.transpose([a for d in range(ndim) for a in (d, ndim + d)])


def _read_tiled_bands(
    store: Store, key: str, where: str, meta: ArrayMeta, shard: Sequence[int], head: ShardHead, target: np.ndarray
) -> bool:
    """Fill ``target`` (:func:`_tiled_target`) from a shard laid out as this library's writer
    lays it out (False, nothing read, for any other index), a few whole bands of its chunk
    grid per request (at most ``MAX_STAGED_BYTES``), each landed by :func:`_land_tiled`."""
    cps = meta.grid.chunks_per_shard
    stored = _stored_nbytes(meta)
    if not np.array_equal(head.index, _written_layout(meta, shard)[0]):
        return False
    band = math.prod(cps[1:]) * stored
    if band > MAX_STAGED_BYTES:
        return False
    step = MAX_STAGED_BYTES // band
    for b0 in range(0, cps[0], step):
        b1 = min(cps[0], b0 + step)
        stage = np.frombuffer(_read_span(store, key, where, meta, b0 * band, (b1 - b0) * band), dtype=np.uint8)
        _land_tiled(stage, b0 * (band // stored), (b1 - b0) * (band // stored), meta, head, shard, where, target[b0:b1])
    return True


def written_index(meta: ArrayMeta, shard: Sequence[int], seal: Seal) -> tuple[np.ndarray, int]:
    """The index :func:`write_shard` gives ``shard`` (every chunk inside the array, in C
    order, back to back from the object's start; read-only) and the size of its object."""
    return _written_layout(meta, shard)[0], _written_nbytes(meta, shard, seal)


def _written_nbytes(meta: ArrayMeta, shard: Sequence[int], seal: Seal) -> int:
    """The size of the object :func:`write_shard` gives ``shard`` (:func:`written_index`'s),
    by arithmetic: every chunk inside the array stored, then the trailer and index."""
    return math.prod(_inside_counts(meta, shard)) * _stored_nbytes(meta) + _head_nbytes(meta, seal)


def _inside_counts(meta: ArrayMeta, shard: Sequence[int]) -> tuple[int, ...]:
    """How many of the chunks of ``shard`` lie inside the array, per dim."""
    grid = meta.grid
    return tuple(
        -(-(min((s + 1) * ss, n) - s * ss) // cs)
        for s, ss, n, cs in zip(shard, grid.shard_shape, grid.shape, grid.chunk_shape)
    )


SHARED_INDEX_CHUNKS = 4096
"""Indexes of up to this many chunks (64 KiB) are made once per layout and shared."""


def _written_layout(meta: ArrayMeta, shard: Sequence[int]) -> tuple[np.ndarray, bytes]:
    """The index of :func:`written_index` and its bytes as stored (:func:`encode_index`)."""
    cps = meta.grid.chunks_per_shard
    make = _layout_index if math.prod(cps) <= SHARED_INDEX_CHUNKS else _layout_index.__wrapped__
    return make(cps, _inside_counts(meta, shard), _stored_nbytes(meta))


@functools.lru_cache(maxsize=128)
def _layout_index(chunks_per_shard: tuple[int, ...], inside: tuple[int, ...], stored: int) -> tuple[np.ndarray, bytes]:
    """The index (read-only) and its encoding of a shard of ``chunks_per_shard`` chunks of
    ``stored`` bytes each whose first ``inside`` per dim lie inside the array, stored back to
    back in C order (small ones made once per layout, at most 16 MiB in all: the arrays of a
    model repeat their layouts)."""
    mask = np.zeros(chunks_per_shard, dtype=bool)
    mask[tuple(slice(0, c) for c in inside)] = True
    mask = mask.reshape(-1)
    index = empty_index(chunks_per_shard)
    index[mask, 0] = np.arange(int(mask.sum()), dtype="<u8") * stored
    index[mask, 1] = stored
    index.flags.writeable = False
    return index, encode_index(index)


def _stored_nbytes(meta: ArrayMeta) -> int:
    """A stored chunk's bytes: its data and its crc32c."""
    return math.prod(meta.grid.chunk_shape) * meta.dtype.itemsize + CRC_BYTES


def _run_buffers(run: list[_Piece]) -> list[memoryview]:
    """The buffers one request of ``run`` (adjacent chunks) reads into: each chunk straight
    into the destination when it lands there whole, else into this thread's staging buffer
    (every staged chunk 64-byte aligned), with its crc32c."""
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
            bufs.append(memoryview(p.scratch))
            at += _aligned(p.nbytes)
    return bufs


def _land(run: list[_Piece], out: np.ndarray, meta: ArrayMeta, head: ShardHead, where: str) -> None:
    """Check every chunk of ``run`` (just read) against its crc32c and the one its shard's
    trailer recorded; copy the staged ones into ``out``."""
    recorded = head.trailer.crcs
    for p in run:
        if p.direct is not None:
            assert p.crc is not None
            data, crc = _array_bytes(p.direct), p.crc
        else:
            assert p.scratch is not None
            n = p.nbytes - CRC_BYTES
            stored = memoryview(p.scratch)
            data, crc = stored[:n], stored[n:]
        value = checksum(data)
        if value != int.from_bytes(crc, "little") or value != recorded[p.row] or head.trailer.shas is not None:
            chunk_where = f"{where} (tensor {meta.key!r}, chunk at {p.origin})"  # (the checks that name it)
            verify_chunk(data, crc, chunk_where)
            head.trailer.check_chunk(p.row, crc, data, chunk_where)
        if p.direct is None:
            out[p.dst] = p.scratch[:n].view(out.dtype).reshape(meta.grid.chunk_shape)[p.src]
            p.scratch = None


def _copy_out(whole: memoryview, offset: int, bufs: list[memoryview], where: str) -> None:
    """Fill ``bufs`` in turn from ``whole`` at ``offset`` (as a read of that range would)."""
    for b in bufs:
        n = b.nbytes
        if offset + n > len(whole):
            raise CorruptChunkError(f"{where} is truncated: its index points beyond its {len(whole)} bytes")
        copy_bytes(b, whole[offset : offset + n])
        offset += n


def _read_span(store: Store, key: str, where: str, meta: ArrayMeta, offset: int, nbytes: int) -> memoryview:
    """:meth:`.Store.read_span` into this thread's staging buffer, its errors as :func:`_readv`'s."""
    view = _reading(store, key, where, meta, lambda: store.read_span(key, offset, nbytes, _stage))
    assert view is not None
    return view


def _readv(store: Store, key: str, where: str, meta: ArrayMeta, requests: list[tuple[int, list[memoryview]]]) -> None:
    _reading(store, key, where, meta, lambda: store.readv(key, requests))


def _reading(store: Store, key: str, where: str, meta: ArrayMeta, read: Callable[[], _T]) -> _T:
    """``read()``, its errors named for the tensor and object: a missing or truncated shard
    is a :class:`CorruptChunkError`."""
    try:
        return read()
    except FileNotFoundError:
        raise CorruptChunkError(f"tensor {meta.key!r}: {where} is missing") from None
    except FormatError as e:
        raise CorruptChunkError(f"tensor {meta.key!r}: {e}") from None
    except ShortReadError as e:
        raise CorruptChunkError(f"tensor {meta.key!r}: {where} is truncated ({e})") from None


def verify_shard(store: Store, path: str, meta: ArrayMeta, shard: Sequence[int], seal: Seal) -> bytes:
    """Read every chunk of a shard through one bounded buffer, checking its crc32c against
    the data and against the trailer (and its SHA-256 when authenticated); return the
    shard's seal. Memory: at most ``MAX_STAGED_BYTES`` plus one chunk."""
    head = read_shard_head(store, path, meta, shard, seal)
    key, where = _shard_where(store, path, shard)
    rows = np.flatnonzero(head.index[:, 0] != MISSING)
    pieces = sorted(
        (_Piece(int(head.index[r, 0]), int(head.index[r, 1]), int(r)) for r in rows),
        key=lambda p: p.offset,
    )
    stage = _stage(max(MAX_STAGED_BYTES, max((p.nbytes for p in pieces), default=0)) + 64)
    for run in _runs(pieces, direct=False):
        at, bufs, spans = 0, [], []
        for p in run:
            bufs.append(memoryview(stage[at : at + p.nbytes]))
            spans.append((p, at))
            at += p.nbytes
        _readv(store, key, where, meta, [(run[0].offset, bufs)])
        raw = memoryview(stage)
        for p, at in spans:
            n = p.nbytes - CRC_BYTES
            chunk_where = f"{where} (tensor {meta.key!r}, chunk {p.row} of the shard)"
            verify_chunk(raw[at : at + n], raw[at + n : at + p.nbytes], chunk_where)
            head.trailer.check_chunk(p.row, raw[at + n : at + p.nbytes], raw[at : at + n], chunk_where)
    return head.trailer.seal


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
