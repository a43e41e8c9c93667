"""Values without torch, block by block: bf16/fp8 widened to float32, block shapes bounded by bytes,
index text parsed and printed."""

from __future__ import annotations

import functools
import itertools
import math
import re
from typing import Any, Callable, Iterator

import numpy as np

from ..protocol.reader import CheckpointReader, index_to_box
from ..format.dtypes import stored_dtype_by_name
from ..layout import Box


Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes in all) as work proceeds."""

MAX_BYTES = 64 << 20
"""The default bound on the values held at once (per checkpoint, for a diff)."""

_PIECE = 1 << 22
"""Elements reduced at once in float64 (bounds the temporaries of a statistic)."""


# --- values -------------------------------------------------------------------------------

_FP8 = {  # exponent bits, mantissa bits, bias, how NaN/Inf are spelled
    "float8_e4m3fn": (4, 3, 7, "fn"),  # no Inf; NaN = S.1111.111
    "float8_e5m2": (5, 2, 15, "ieee"),  # Inf and NaN as IEEE 754
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),  # no Inf, no -0; NaN = 0x80
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}


@functools.cache
def _fp8_table(name: str) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of a float8 dtype."""
    bits = np.arange(256, dtype=np.int64)
    if name == "float8_e8m0fnu":  # unsigned powers of two, 0xFF is NaN
        table = np.ldexp(1.0, bits - 127)
        table[255] = np.nan
    else:
        e_bits, m_bits, bias, special = _FP8[name]
        exp = (bits >> m_bits) & ((1 << e_bits) - 1)
        man = bits & ((1 << m_bits) - 1)
        table = np.where(
            exp == 0, np.ldexp(man.astype(np.float64), 1 - bias - m_bits),
            np.ldexp(1.0 + man / (1 << m_bits), exp - bias),
        )
        table = np.where(bits >> 7, -table, table)
        top = exp == (1 << e_bits) - 1
        if special == "ieee":
            table[top & (man == 0)] = np.copysign(np.inf, table[top & (man == 0)])
            table[top & (man != 0)] = np.nan
        elif special == "fn":
            table[top & (man == (1 << m_bits) - 1)] = np.nan
        else:
            table[0x80] = np.nan
    out = table.astype(np.float32)
    out.flags.writeable = False
    return out


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values (:meth:`CheckpointReader.read_numpy`) of torch dtype ``dtype`` (a name) as numpy
    numbers: bfloat16 and float8 bits become float32 (exactly); other dtypes come back as is."""
    if dtype == "bfloat16":
        wide = raw.astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32)
    if dtype.startswith("float8_"):
        return _fp8_table(dtype)[raw]
    return raw


def _value_itemsize(dtype: str) -> int:
    """Bytes per value as :func:`widen` gives them."""
    stored = stored_dtype_by_name(dtype)
    return 4 if stored.bits else stored.itemsize


MIN_STRIP_BYTES = 1 << 20
"""Blocks one chunk wide (see :func:`block_shape`) are used when at least this large."""


def block_shape(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, max_bytes: int) -> tuple[int, ...]:
    """The shape of chunk-aligned blocks of at most ``max_bytes`` (at least one chunk).

    Preferably a strip of whole chunks stacked along dim 0 (the chunk's other dims), which
    read straight into the block, chunk by chunk, without a copy; when such strips would be
    small (under :data:`MIN_STRIP_BYTES`), the largest block cut from the leading dims first:
    whole trailing dims, rows in multiples of the chunk's."""
    if len(shape) > 1 and tuple(chunk[1:]) != tuple(shape[1:]):
        row = math.prod(chunk[1:]) * itemsize
        rows = min(shape[0], max(chunk[0], max_bytes // row // chunk[0] * chunk[0]))
        if rows * row >= min(max_bytes, MIN_STRIP_BYTES):
            return (rows, *chunk[1:])
    block = list(shape)
    for d in range(len(shape)):
        unit = math.prod(block[:d]) * math.prod(shape[d + 1 :]) * itemsize
        if unit * shape[d] <= max_bytes:
            break
        per = max_bytes // max(unit, 1)
        block[d] = min(shape[d], max(chunk[d], per // chunk[d] * chunk[d]))
        if per >= chunk[d]:
            break
    return tuple(max(b, 1) for b in block)


def block_boxes(shape: tuple[int, ...], block: tuple[int, ...]) -> Iterator[Box]:
    """The boxes of ``block`` tiling ``shape`` in row-major order (clipped at its edge)."""
    starts = [range(0, n, b) for n, b in zip(shape, block)]
    for offset in itertools.product(*starts):
        yield Box(tuple(offset), tuple(min(b, n - o) for o, b, n in zip(offset, block, shape)))


def _blocks_of(ck: CheckpointReader, key: str, max_bytes: int, rank: int | None) -> tuple[Box, ...]:
    meta = ck.array_meta(key, rank)
    return tuple(block_boxes(meta.shape, block_shape(meta.shape, meta.grid.chunk_shape,
                                                     _value_itemsize(meta.dtype.name), max_bytes)))


def iter_blocks(
    ck: CheckpointReader, key: str, *, max_bytes: int = MAX_BYTES, rank: int | None = None
) -> Iterator[tuple[Box, np.ndarray]]:
    """Tensor ``key`` in chunk-aligned blocks of at most about ``max_bytes`` (at least one
    chunk), row-major: ``(box, values)`` with values as numpy (bf16/float8 widened to float32,
    other dtypes native). ``rank`` picks the copy of per-rank state. An empty tensor yields
    nothing."""
    dtype = ck.array_meta(key, rank).dtype.name
    for box in _blocks_of(ck, key, max_bytes, rank):
        yield box, widen(ck.read_numpy(key, box, rank), dtype)


# --- selections ---------------------------------------------------------------------------

Index = tuple[Any, ...]
"""A basic numpy index: ints, slices and at most one ``...``."""

_INT = re.compile(r"[+-]?\d+")


def parse_index(text: str) -> Index:
    """Parse a numpy-style selection such as ``"3:5, 0:4"``, ``"-1"``, ``":, ::2"``,
    ``"..., 0"`` or ``"[2, 1:]"`` (no evaluation); ``""`` selects everything.

    Raises :class:`ValueError` naming the bad item."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1].strip()
    if not body:
        return ()
    items = [i.strip() for i in body.split(",")]
    if len(items) > 1 and items[-1] == "":  # "3," is "3", as in numpy
        items.pop()
    out: list[Any] = []
    for item in items:
        if item in ("...", "Ellipsis"):
            if any(i is Ellipsis for i in out):
                raise ValueError(f"bad selection {text!r}: more than one '...'")
            out.append(Ellipsis)
        elif ":" in item:
            parts = [p.strip() for p in item.split(":")]
            if len(parts) > 3 or any(p and not _INT.fullmatch(p) for p in parts):
                raise ValueError(f"bad selection {text!r}: {item!r} is not a slice start:stop:step of integers")
            bounds = [int(p) if p else None for p in parts]
            if len(bounds) == 3 and bounds[2] == 0:
                raise ValueError(f"bad selection {text!r}: slice step cannot be zero")
            out.append(slice(*bounds))
        elif _INT.fullmatch(item):
            out.append(int(item))
        else:
            raise ValueError(f"bad selection {text!r}: {item!r} is not an integer, a slice or '...'")
    return tuple(out)


def format_index(index: Index) -> str:
    """The selection spelled as numpy does (``"3:5, ::2, ..."``)."""

    def one(i: Any) -> str:
        if i is Ellipsis:
            return "..."
        if isinstance(i, slice):
            text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
            return text + ("" if i.step is None else f":{i.step}")
        return str(i)

    return ", ".join(one(i) for i in index)


def selection_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (:class:`IndexError` when an
    index is out of bounds or there are too many)."""
    box, post = index_to_box(index, shape)
    return tuple(-(-n // abs(p.step)) for n, p in zip(box.shape, post) if isinstance(p, slice))
