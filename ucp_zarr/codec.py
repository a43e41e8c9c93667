"""The bytes of one stored chunk and of one shard's index (Zarr v3 ``sharding_indexed``).

A stored chunk is the chunk's little-endian C-order bytes followed by their crc32c
(uint32, little-endian): the codec chain ``[bytes(little), crc32c]``. A shard object is its
stored chunks back to back followed by the index: ``uint64[*chunks_per_shard, 2]`` of
``(offset, nbytes)`` pairs in C order (``2**64-1`` twice for a chunk that is absent, read as
the fill value), little-endian, followed by the index's own crc32c.
"""

from __future__ import annotations

import math
from typing import Sequence

import crc32c as _crc
import numpy as np

from .errors import CorruptChunkError

CRC_BYTES = 4
MISSING = np.uint64(2**64 - 1)


def checksum(data: memoryview | bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``; releases the GIL for large buffers."""
    return _crc.crc32c(data)


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
    """Storage key of a shard (or unsharded chunk), relative to its array: ``c/i/j``."""
    return "/".join(["c", *map(str, index)])
