"""The bytes of one stored shard: its chunks, the ucp_zarr trailer, and the shard index.

Every array uses Zarr v3 ``sharding_indexed`` with the codec chain ``[bytes(little),
crc32c]`` for chunks and for the index, the index at the end. A shard object is

``[chunk 0][chunk 1]...[chunk n-1][trailer][index]``

* a **stored chunk** is the chunk's little-endian C-order bytes followed by their crc32c
  (uint32, little-endian); chunks appear in C order of their position in the shard;
* the **index** is ``uint64[n, 2]`` of ``(offset, nbytes)`` pairs in C order,
  little-endian, followed by its own crc32c. Every chunk inside the array is written, so
  an entry marked absent (``2**64-1`` twice) is legal only for a chunk wholly beyond the
  array's edge; anywhere else it means the shard is corrupt;
* the **trailer** (bytes no index entry points to, which every Zarr reader skips) binds
  the shard to its checkpoint: it records the save id, a hash of the object's key, and
  each chunk's crc32c (plus, for authenticated checkpoints, each chunk's SHA-256), sealed
  by a SHA-256 (or, with a key, an HMAC-SHA256) of everything before it. A shard copied
  from another array or left over from another save is therefore detected when read.

Trailer layout (little-endian)::

    magic    8 bytes   b"UCPZTRL\\x01"
    n        uint32    chunks in the shard
    flags    uint32    bit 0: per-chunk SHA-256 present (authenticated checkpoint)
    save_id  16 bytes  the save's id (a UUID's bytes)
    key      16 bytes  SHA-256 of the object's key (``<array path>/c/i/j``), first 16 bytes
    crc      uint32[n] each chunk's crc32c, as stored after the chunk (0 for a chunk
                       beyond the array's edge); n counts every index row
    sha      32 * n    each chunk's SHA-256 (zeros beyond the edge; flag bit 0 only)
    seal     32 bytes  SHA-256 (or HMAC-SHA256 with the key) of the bytes above
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import crc32c as _crc
import numpy as np

from ..errors import AuthenticationError, CorruptChunkError

CRC_BYTES = 4
MISSING = np.uint64(2**64 - 1)
TRAILER_MAGIC = b"UCPZTRL\x01"
_HEAD = struct.Struct("<8sII16s16s")
SEAL_BYTES = 32
SHA_BYTES = 32


CHECKSUM_KEEPS_GIL_BELOW = 1 << 20
"""Buffers smaller than this are checksummed holding the GIL (at most ~40 us). Releasing it
costs more than the checksum whenever another thread wants the GIL: the calling thread then
waits for it to come back (measured with one busy thread: 64 KiB took 680 us instead of 5)."""


def checksum(data: memoryview | bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``; releases the GIL only for large buffers."""
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    return _crc.crc32c(data, gil_release_mode=0 if nbytes < CHECKSUM_KEEPS_GIL_BELOW else 1)


def crc_bytes(data: memoryview | bytes) -> bytes:
    return checksum(data).to_bytes(CRC_BYTES, "little")


def verify_chunk(data: memoryview | bytes, stored_crc: memoryview | bytes, where: str) -> None:
    """Raise :class:`CorruptChunkError` naming ``where`` if ``data`` fails its checksum."""
    if checksum(data) != int.from_bytes(stored_crc, "little"):
        raise CorruptChunkError(f"crc32c mismatch in {where}: the data is corrupt")


def index_nbytes(chunks_per_shard: Sequence[int]) -> int:
    return math.prod(chunks_per_shard) * 16 + CRC_BYTES


def empty_index(chunks_per_shard: Sequence[int]) -> np.ndarray:
    return np.full((math.prod(chunks_per_shard), 2), MISSING, dtype="<u8")


def encode_index(index: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(index, dtype="<u8").tobytes()
    return raw + crc_bytes(raw)


def decode_index(buf: bytes | memoryview, chunks_per_shard: Sequence[int], where: str) -> np.ndarray:
    """The ``(n, 2)`` index of a shard, checked; chunk ``i`` in C order is row ``i``."""
    n = math.prod(chunks_per_shard)
    if len(buf) != n * 16 + CRC_BYTES:
        raise CorruptChunkError(f"shard index of {where} has {len(buf)} bytes, expected {n * 16 + CRC_BYTES}")
    raw = memoryview(buf)[: n * 16]
    verify_chunk(raw, memoryview(buf)[n * 16 :], f"the shard index of {where}")
    return np.frombuffer(raw, dtype="<u8").reshape(n, 2)


def local_chunk_number(local: Sequence[int], chunks_per_shard: Sequence[int]) -> int:
    """Row of chunk ``local`` (shard-local grid index) in the shard index."""
    n = 0
    for i, c in zip(local, chunks_per_shard):
        n = n * c + i
    return n


def chunk_key(index: Sequence[int]) -> str:
    """Storage key of a shard, relative to its array: ``c/i/j``."""
    return "/".join(["c", *map(str, index)])


# --- the trailer -----------------------------------------------------------------------------


def trailer_nbytes(n_chunks: int, authenticated: bool) -> int:
    return _HEAD.size + n_chunks * (CRC_BYTES + (SHA_BYTES if authenticated else 0)) + SEAL_BYTES


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]


def _seal(body: bytes, hmac_key: bytes | None) -> bytes:
    if hmac_key is None:
        return hashlib.sha256(body).digest()
    return hmac.new(hmac_key, body, hashlib.sha256).digest()


def encode_trailer(
    save_id: str, key: str, crcs: Sequence[int], shas: Sequence[bytes] | None, hmac_key: bytes | None
) -> bytes:
    """The trailer of shard object ``key`` (``shas`` exactly when ``hmac_key`` is given)."""
    flags = 1 if hmac_key is not None else 0
    assert (shas is not None) == bool(flags)
    body = _HEAD.pack(TRAILER_MAGIC, len(crcs), flags, bytes.fromhex(save_id), key_hash(key))
    body += np.asarray(crcs, dtype="<u4").tobytes()
    if shas is not None:
        body += b"".join(shas)
    return body + _seal(body, hmac_key)


@dataclass(frozen=True)
class Trailer:
    """A decoded, checked trailer."""

    crcs: np.ndarray
    shas: tuple[bytes, ...] | None
    seal: bytes

    def check_chunk(self, n: int, stored_crc: bytes | memoryview, data: memoryview, where: str) -> None:
        """Chunk ``n`` read from the shard must be the one the trailer recorded."""
        if int.from_bytes(stored_crc, "little") != int(self.crcs[n]):
            raise CorruptChunkError(
                f"{where} does not belong to this checkpoint (its crc32c differs from the one its "
                "shard recorded when it was written): a chunk was replaced"
            )
        if self.shas is not None and hashlib.sha256(data).digest() != self.shas[n]:
            raise AuthenticationError(f"{where}: SHA-256 mismatch; the data was changed after signing")


def decode_trailer(
    buf: bytes | memoryview,
    n_chunks: int,
    save_id: str,
    key: str,
    where: str,
    *,
    authenticated: bool,
    hmac_key: bytes | None,
) -> Trailer:
    """Check the trailer of shard object ``key`` and return what it records.

    Raises :class:`CorruptChunkError` when the trailer is damaged or belongs to another
    array or another save; :class:`AuthenticationError` when ``hmac_key`` is given and the
    seal does not verify."""
    buf = bytes(buf)
    if len(buf) != trailer_nbytes(n_chunks, authenticated) or buf[:8] != TRAILER_MAGIC:
        raise CorruptChunkError(f"{where} has no ucp_zarr trailer: it was not written by this checkpoint's save")
    body, seal = buf[:-SEAL_BYTES], buf[-SEAL_BYTES:]
    _, n, flags, sid, khash = _HEAD.unpack_from(body)
    if n != n_chunks or flags != (1 if authenticated else 0):
        raise CorruptChunkError(f"{where}: trailer for {n} chunks (flags {flags}), expected {n_chunks}")
    if hmac_key is not None or not authenticated:
        if not hmac.compare_digest(_seal(body, hmac_key), seal):
            if hmac_key is not None:
                raise AuthenticationError(f"{where}: the shard's HMAC does not verify with this key")
            raise CorruptChunkError(f"{where}: the shard's trailer is corrupt (seal mismatch)")
    if khash != key_hash(key):
        raise CorruptChunkError(f"{where} holds the shard of another array or position (copied or swapped)")
    if sid.hex() != save_id:
        raise CorruptChunkError(f"{where} was written by another save ({sid.hex()}), not this checkpoint's")
    at = _HEAD.size
    crcs = np.frombuffer(body, dtype="<u4", count=n, offset=at)
    shas = None
    if authenticated:
        at += 4 * n
        shas = tuple(body[at + i * SHA_BYTES : at + (i + 1) * SHA_BYTES] for i in range(n))
    return Trailer(crcs, shas, seal)
