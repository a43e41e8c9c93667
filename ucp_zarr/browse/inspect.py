"""Looking into checkpoints without torch: listings, values block by block, statistics, diffs.

Pure functions on a :class:`~ucp_zarr.Checkpoint` (the CLI and the Jupyter reprs are thin
faces over them). Memory stays bounded by ``max_bytes`` (or one chunk, when a chunk is
larger) whatever the tensor's size, and torch is never imported: values come as numpy,
bfloat16 and float8 widened to float32 (:func:`widen`), other dtypes as stored.
"""

from __future__ import annotations

import fnmatch
import functools
import html
import itertools
import math
import os
import re
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..protocol.checkpoint import Checkpoint, _index_to_box
from ..protocol.checkpoint import open as open_checkpoint
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
    """Stored values (:meth:`Checkpoint.read_numpy`) of torch dtype ``dtype`` (a name) as numpy
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


def _blocks_of(ck: Checkpoint, key: str, max_bytes: int, rank: int | None) -> tuple[Box, ...]:
    meta = ck.array_meta(key, rank)
    return tuple(block_boxes(meta.shape, block_shape(meta.shape, meta.grid.chunk_shape,
                                                     _value_itemsize(meta.dtype.name), max_bytes)))


def iter_blocks(
    ck: Checkpoint, key: str, *, max_bytes: int = MAX_BYTES, rank: int | None = None
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
    box, post = _index_to_box(index, shape)
    return tuple(-(-n // abs(p.step)) for n, p in zip(box.shape, post) if isinstance(p, slice))


# --- listing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a listing (:func:`list_tensors`)."""

    key: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: tuple[int, ...]
    """The chunk shape (the unit of reading)."""
    shard_shape: tuple[int, ...]
    shards: int
    """How many shard objects hold it (per copy, for per-rank state)."""
    group: str
    ranks: tuple[int, ...] | None = None
    """The saving ranks of per-rank state (one array each), else None."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "path": self.path, "shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes,
            "chunks": list(self.chunks), "shard_shape": list(self.shard_shape), "shards": self.shards,
            "group": self.group, "ranks": None if self.ranks is None else list(self.ranks),
        }


def matches(key: str, pattern: str | None) -> bool:
    """Whether ``key`` is selected by ``pattern``: a glob (``*``, ``?``, ``[...]``, matched
    with :func:`fnmatch.fnmatchcase`; ``*`` crosses dots), or a plain key that selects itself
    and everything under it (``model.layers.0`` selects ``model.layers.0.weight``); None
    selects everything."""
    if pattern is None:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return key == pattern or key.startswith(pattern + ".")


def select_keys(ck: Checkpoint, patterns: Iterable[str] | None) -> list[str]:
    """The keys of ``ck`` selected by any of ``patterns`` (see :func:`matches`), in order."""
    if patterns is None:
        return ck.keys()
    pats = list(patterns)
    globs = [p for p in pats if any(c in p for c in "*?[")]
    plain = set(pats).difference(globs)  # (many exact keys: each key's dotted prefixes looked up, not every pattern tried)

    def hit(key: str) -> bool:
        parts = key.split(".")
        return (any(".".join(parts[:i]) in plain for i in range(1, len(parts) + 1)) if plain else False) or any(
            fnmatch.fnmatchcase(key, g) for g in globs)

    return [k for k in ck.keys() if hit(k)]


def list_tensors(ck: Checkpoint, pattern: str | None = None) -> list[TensorRow]:
    """The tensors of ``ck`` selected by ``pattern`` (see :func:`matches`; None: all), with
    their chunking (each array's document is read once, checked against its digest)."""
    keys = select_keys(ck, None if pattern is None else [pattern])

    def row(key: str) -> TensorRow:
        e = ck.meta.tensors[key]
        grid = ck.array_meta(key).grid
        return TensorRow(
            key=key, path=e.path, shape=tuple(e.shape), dtype=e.dtype, nbytes=e.nbytes, chunks=grid.chunk_shape,
            shard_shape=grid.shard_shape, shards=math.prod(grid.shard_counts), group=e.path.partition("/")[0],
            ranks=None if e.ranks is None else tuple(sorted(e.ranks)),
        )

    with ThreadPoolExecutor(8) as pool:  # one document per array: overlap the requests of remote stores
        return list(pool.map(row, keys))


def checkpoint_info(ck: Checkpoint) -> dict[str, Any]:
    """A checkpoint's facts as JSON data: where, step, size, saving layout, values, tensors."""
    meta = ck.meta
    return {
        "url": ck.store.url,
        "step": meta.values.get("step", meta.values.get("deepspeed.global_steps")),
        "created": meta.created,
        "library": meta.library,
        "world_size": meta.world_size,
        "tensors": len(ck),
        "nbytes": ck.nbytes(),
        "authenticated": meta.authenticated,
        "layout": meta.layout,
        "values": meta.values,
        "rank_values": meta.rank_values,
        "index": {k: {"path": e.path, "shape": list(e.shape), "dtype": e.dtype, "nbytes": e.nbytes}
                  for k, e in meta.tensors.items()},
    }


# --- summary ------------------------------------------------------------------------------

KINDS = ("model", "optimizer", "other")
"""What a tensor is, for :func:`checkpoint_summary` (see :func:`tensor_kind`)."""


def tensor_kind(key: str, ranks: Any = None) -> str:
    """``"optimizer"`` for ``<top>.state.<param>.<name>`` keys (moments, step counts, fp32
    masters: the keys optimizers' ``state_dict()`` and the converters give), ``"other"`` for
    per-rank state (``ranks`` given) and top-level tensors (``"step"``), else ``"model"``
    (parameters and buffers)."""
    parts = key.split(".")
    if ranks is not None or len(parts) == 1:
        return "other"
    return "optimizer" if len(parts) >= 4 and parts[1] == "state" else "model"


def module_of(group: str, depth: int) -> str:
    """The module of a parameter group (its FQN) cut to ``depth`` names, never the parameter's
    own name: ``("blocks.0.attn.qkv.weight", 2)`` -> ``"blocks.0"``, ``("head.weight", 2)`` ->
    ``"head"``; ``""`` for a top-level name."""
    parts = group.split(".")
    return ".".join(parts[: min(depth, len(parts) - 1)])


def group_of(path: str) -> str:
    """The parameter group (the parameter's FQN) of an array path ``<group>/<array>``."""
    return urllib.parse.unquote(path.partition("/")[0])


@dataclass
class SummaryRow:
    """The tensors of one module (or of one dtype) in a :class:`CheckpointSummary`:
    elements by kind (see :func:`tensor_kind`), bytes, and the dtypes seen."""

    name: str
    tensors: int = 0
    model: int = 0
    optimizer: int = 0
    other: int = 0
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    """Bytes by dtype."""

    def add(self, kind: str, numel: int, nbytes: int, dtype: str) -> None:
        self.tensors += 1
        setattr(self, kind, getattr(self, kind) + numel)
        self.nbytes += nbytes
        self.dtypes[dtype] = self.dtypes.get(dtype, 0) + nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tensors": self.tensors, "model": self.model, "optimizer": self.optimizer,
                "other": self.other, "nbytes": self.nbytes, "dtypes": dict(self.dtypes)}


@dataclass(frozen=True)
class CheckpointSummary:
    """Parameter counts and bytes of a checkpoint by module and by dtype
    (:func:`checkpoint_summary`, ``ck.summary()``). Elements are counted per kind:
    ``model`` (parameters and buffers), ``optimizer`` (optimizer state) and ``other``;
    per-rank tensors once (one copy), tied tensors once."""

    url: str
    depth: int
    modules: list[SummaryRow]
    """By module (the parameter's FQN cut to ``depth`` names; ``""``: top level), in key order."""
    dtypes: list[SummaryRow]
    """By dtype, largest first."""
    total: SummaryRow

    @property
    def parameters(self) -> int:
        """Elements of the model's tensors (parameters and buffers)."""
        return self.total.model

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "depth": self.depth, "total": self.total.to_dict(),
                "modules": [r.to_dict() for r in self.modules], "dtypes": [r.to_dict() for r in self.dtypes]}

    def __repr__(self) -> str:
        t = self.total
        return (f"<CheckpointSummary {self.url}: {t.model:,} model values, {t.optimizer:,} optimizer values, "
                f"{t.other:,} other, {t.nbytes:,} bytes; {len(self.modules)} modules at depth {self.depth}>")

    def _repr_html_(self) -> str:
        from .notebook import summary_html

        return summary_html(self)


def checkpoint_summary(ck: Checkpoint, depth: int = 2) -> CheckpointSummary:
    """Elements (model, optimizer, other) and bytes of ``ck`` by module (each tensor's
    parameter group, cut to ``depth`` names by :func:`module_of`) and by dtype. Reads the
    commit record only."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth is a positive integer (how many names of the FQN make a module), got {depth!r}")
    modules: dict[str, SummaryRow] = {}
    dtypes: dict[str, SummaryRow] = {}
    total = SummaryRow("total")
    for key, e in ck.meta.tensors.items():
        name = module_of(group_of(e.path), depth)
        args = (tensor_kind(key, e.ranks), math.prod(e.shape), e.nbytes, e.dtype)
        for row in (modules.setdefault(name, SummaryRow(name)), dtypes.setdefault(e.dtype, SummaryRow(e.dtype)), total):
            row.add(*args)
    return CheckpointSummary(ck.store.url, depth, list(modules.values()),
                             sorted(dtypes.values(), key=lambda r: -r.nbytes), total)


# --- statistics ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor (:func:`tensor_stats`).

    ``count`` is the number of elements; ``min``, ``max``, ``mean``, ``std`` (population,
    ``ddof=0``) and ``norm`` (L2) are over its finite values only (``count - nan - inf`` of
    them; None when there are none, ``norm`` then 0). Complex tensors: over ``|z|`` (NaN/Inf
    counted when either part is); bool: over 0/1. ``min``/``max`` are exact (ints as ints)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    norm: float
    nan: int
    inf: int

    @property
    def finite(self) -> int:
        return self.count - self.nan - self.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "shape": list(self.shape), "dtype": self.dtype, "count": self.count, "min": self.min,
            "max": self.max, "mean": self.mean, "std": self.std, "norm": _json_float(self.norm), "nan": self.nan,
            "inf": self.inf,
        }

    def _repr_html_(self) -> str:
        from .notebook import stats_html

        return stats_html(self)


def _json_float(x: float | None) -> float | str | None:
    """A float for strict JSON: non-finite ones spelled as strings."""
    return x if x is None or math.isfinite(x) else str(x)


@dataclass
class _Moments:
    """Running count, mean, sum of squared deviations, sum of squares, min and max (Chan et
    al.'s pairwise update, in float64)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sq: float = 0.0
    lo: Any = None
    hi: Any = None
    scratch: np.ndarray = field(default_factory=lambda: np.empty(0))

    def add(self, x: np.ndarray, lo: Any, hi: Any) -> None:
        """Add the values ``x`` (1-D, finite), whose min and max are ``lo`` and ``hi``."""
        if not x.size:
            return
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)
        n = x.size
        if self.scratch.size < n:
            self.scratch = np.empty(n, dtype=np.float64)
        dev = self.scratch[:n]  # (reused: no fresh pages per piece)
        np.copyto(dev, x, casting="unsafe")
        mean = float(dev.sum()) / n
        dev -= mean
        np.square(dev, out=dev)  # (not np.dot: BLAS threads fight over a busy machine's cores)
        m2 = float(dev.sum())
        self.sq += m2 + n * mean * mean  # sum x^2 = sum (x - mean)^2 + n mean^2: no cancellation
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total


def _plain(x: Any) -> float | int | None:
    if x is None:
        return None
    return int(x) if isinstance(x, (np.integer, np.bool_)) else float(x)


def tensor_stats(
    ck: Checkpoint, key: str, *, max_bytes: int = MAX_BYTES, rank: int | None = None, progress: Progress | None = None
) -> TensorStats:
    """Statistics of tensor ``key`` (see :class:`TensorStats`), computed block by block in
    float64 with memory bounded by about ``max_bytes``."""
    meta = ck.array_meta(key, rank)
    dtype = meta.dtype.name
    m = _Moments()
    nan = inf = 0
    done, total = 0, math.prod(meta.shape) * meta.dtype.itemsize
    for _, block in iter_blocks(ck, key, max_bytes=max_bytes, rank=rank):
        flat = block.reshape(-1)
        for start in range(0, flat.size, _PIECE):
            x = flat[start : start + _PIECE]
            if x.dtype == np.bool_:
                x = x.view(np.uint8)
            elif x.dtype.kind == "c":
                bad_nan = np.isnan(x)
                bad_inf = np.isinf(x) & ~bad_nan
                nan, inf = nan + int(bad_nan.sum()), inf + int(bad_inf.sum())
                x = np.abs(x[~(bad_nan | bad_inf)])
            lo, hi = (x.min(), x.max()) if x.size else (None, None)
            if x.size and x.dtype.kind == "f" and not (np.isfinite(lo) and np.isfinite(hi)):  # (NaN: min is NaN)
                finite = np.isfinite(x)
                n_nan = int(np.isnan(x).sum())
                nan, inf = nan + n_nan, inf + int(x.size - finite.sum()) - n_nan
                x = x[finite]
                lo, hi = (x.min(), x.max()) if x.size else (None, None)
            m.add(x, lo, hi)
        done += block.size * meta.dtype.itemsize
        if progress is not None:
            progress(done, total)
    return TensorStats(
        key=key, shape=meta.shape, dtype=dtype, count=math.prod(meta.shape), min=_plain(m.lo), max=_plain(m.hi),
        mean=m.mean if m.n else None, std=math.sqrt(m.m2 / m.n) if m.n else None, norm=math.sqrt(m.sq),
        nan=nan, inf=inf,
    )


def _finite(block: np.ndarray) -> np.ndarray:
    """A block's finite values, flattened (ints and bools as float64)."""
    if block.dtype.kind == "c":
        raise TypeError("complex tensors have no histogram here: plot their abs or real part")
    flat = block.reshape(-1)
    return flat[np.isfinite(flat)] if flat.dtype.kind == "f" else flat.astype(np.float64)


@dataclass(frozen=True)
class ValueRange:
    """The finite values of a tensor (:func:`value_range`): their range and count, and how many
    elements are NaN or Inf (``skipped``). ``lo``/``hi`` are None when no value is finite."""

    lo: float | None
    hi: float | None
    count: int
    skipped: int


def value_range(ck: Checkpoint, key: str, *, max_bytes: int = MAX_BYTES) -> ValueRange:
    """The range of tensor ``key``'s finite values, streamed block by block."""
    lo, hi, skipped, count = math.inf, -math.inf, 0, 0
    for _, block in iter_blocks(ck, key, max_bytes=max_bytes):
        finite = _finite(block)
        skipped += block.size - finite.size
        count += finite.size
        if finite.size:
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    return ValueRange(lo if count else None, hi if count else None, count, skipped)


def histogram_edges(lo: float | None, hi: float | None, bins: int) -> np.ndarray:
    """``bins + 1`` equal bins over ``[lo, hi]`` (one unit wide around a single value; ``[0, 1]``
    without values)."""
    if lo is None or hi is None:
        lo, hi = 0.0, 1.0
    elif lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return np.linspace(lo, hi, bins + 1)


def histogram_counts(ck: Checkpoint, key: str, edges: np.ndarray, *, max_bytes: int = MAX_BYTES) -> np.ndarray:
    """How many finite values of tensor ``key`` fall in each bin of ``edges`` (as
    :func:`numpy.histogram` counts them), streamed block by block."""
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    for _, block in iter_blocks(ck, key, max_bytes=max_bytes):
        counts += np.histogram(_finite(block), bins=edges)[0]
    return counts


# --- diff ---------------------------------------------------------------------------------

STATUSES = ("equal", "differs", "only_a", "only_b", "shape", "dtype")


@dataclass(frozen=True)
class DiffRow:
    """How one tensor differs between two checkpoints (:func:`diff`).

    ``status``: ``equal`` (same shape, dtype and bits), ``differs`` (same shape and dtype,
    other bits), ``only_a``/``only_b``, ``shape`` (values not compared) or ``dtype`` (same
    shape, other dtype: values compared as numbers). For compared values: ``ndiff`` elements
    differ; ``max_abs`` is the largest ``|a - b|`` over those where neither is NaN (inf when
    an Inf meets a finite value); ``max_rel = max_abs / max |b|`` over b's finite values, one
    scale per tensor, so tiny elements do not blow it up (inf when b is all zeros and a not);
    ``nan_mismatch`` counts elements NaN in one and not the other. ``rank``: the saving rank
    of a per-rank copy, else None.

    ``norm_a`` is the L2 norm of a's finite values and ``norm_delta`` that of ``b - a`` over
    the elements finite in both (in float64; complex: moduli); :attr:`rel_update` is their
    ratio, the relative update ``‖Δw‖/‖w‖`` from a to b."""

    key: str
    status: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    ndiff: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    nan_mismatch: int | None = None
    rank: int | None = None
    norm_a: float | None = None
    norm_delta: float | None = None

    @property
    def rel_update(self) -> float | None:
        """``norm_delta / norm_a`` (0 when nothing changed, inf from all zeros); None when the
        values were not compared."""
        if self.norm_a is None or self.norm_delta is None:
            return None
        if self.norm_delta == 0.0:
            return 0.0
        return self.norm_delta / self.norm_a if self.norm_a > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "status": self.status,
            "shape_a": None if self.shape_a is None else list(self.shape_a),
            "shape_b": None if self.shape_b is None else list(self.shape_b),
            "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "ndiff": self.ndiff,
            "max_abs": _json_float(self.max_abs), "max_rel": _json_float(self.max_rel),
            "nan_mismatch": self.nan_mismatch, "rank": self.rank, "norm_a": _json_float(self.norm_a),
            "norm_delta": _json_float(self.norm_delta), "rel_update": _json_float(self.rel_update),
        }


@dataclass(frozen=True)
class ValueDiff:
    """A non-tensor value (as stored JSON) that differs: ``status`` is ``differs``,
    ``only_a`` or ``only_b`` (the missing side is None). Per-rank values are keyed
    ``"<key> (rank <r>)"``."""

    key: str
    status: str
    a: Any = None
    b: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "status": self.status, "a": self.a, "b": self.b}


@dataclass(frozen=True)
class CheckpointDiff:
    """The differences between checkpoints ``a`` and ``b`` (:func:`diff`)."""

    a: str
    b: str
    rows: list[DiffRow]
    values: list[ValueDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """True when every tensor is bit-identical and every value equal."""
        return not self.values and all(r.status == "equal" for r in self.rows)

    def counts(self) -> dict[str, int]:
        """How many tensor rows have each status."""
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal, "counts": self.counts(),
                "rows": [r.to_dict() for r in self.rows], "values": [v.to_dict() for v in self.values]}

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        return f"<CheckpointDiff {self.a} vs {self.b}: {counts or 'no tensors'}, {len(self.values)} value(s) differ>"

    def _repr_html_(self) -> str:
        try:
            from .changes import diff_html
        except ImportError:
            return f"<pre>{html.escape(repr(self))}</pre>"
        return diff_html(self)


def _as_checkpoint(x: Checkpoint | str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Checkpoint:
    return x if isinstance(x, Checkpoint) else open_checkpoint(x, storage_options=storage_options)


def _bits(raw: np.ndarray) -> np.ndarray:
    """Each element's bits as an unsigned integer (a row of two for 16-byte complex)."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.dtype.itemsize > 8:
        return flat.view(np.uint64).reshape(flat.size, -1)
    return flat.view(f"u{flat.dtype.itemsize}")


def _numbers(values: np.ndarray) -> np.ndarray:
    """Values as float64 (complex128 for complex), flattened."""
    flat = values.reshape(-1)
    if flat.dtype.kind == "c":
        return flat.astype(np.complex128, copy=False)
    return flat.astype(np.float64, copy=False)


@dataclass
class _Compare:
    """Running comparison of one tensor's blocks."""

    ndiff: int = 0
    nan_mismatch: int = 0
    max_abs: float = 0.0
    max_b: float = 0.0
    sq_a: float = 0.0
    sq_delta: float = 0.0

    def add(self, ra: np.ndarray, rb: np.ndarray, dtype_a: str, dtype_b: str) -> None:
        wa, wb = widen(ra, dtype_a).reshape(-1), widen(rb, dtype_b).reshape(-1)
        self.max_b = max(self.max_b, _max_finite_abs(wb))
        self.sq_a += _sum_squares(wa)
        if dtype_a == dtype_b:
            bits = _bits(ra) != _bits(rb)
            differ = bits.any(axis=1) if bits.ndim == 2 else bits
        else:
            na, nb = _numbers(wa), _numbers(wb)
            differ = (na != nb) & ~(np.isnan(na) & np.isnan(nb))
        n = int(differ.sum())
        if not n:
            return
        self.ndiff += n
        da, db = _numbers(wa[differ]), _numbers(wb[differ])
        na, nb = np.isnan(da), np.isnan(db)
        self.nan_mismatch += int((na != nb).sum())
        both = ~(na | nb)
        if both.any():
            delta = np.abs(da[both] - db[both])
            self.max_abs = max(self.max_abs, float(delta.max()))
            self.sq_delta += _sum_squares(delta)

    def row(self, key: str, status: str, shape: tuple[int, ...], dtype_a: str, dtype_b: str, rank: int | None) -> DiffRow:
        if self.max_abs == 0.0:
            rel = 0.0
        else:
            rel = self.max_abs / self.max_b if self.max_b > 0 else math.inf
        if status == "equal" and self.ndiff:
            status = "differs"
        return DiffRow(key, status, shape, shape, dtype_a, dtype_b, self.ndiff, self.max_abs, rel, self.nan_mismatch, rank,
                       math.sqrt(self.sq_a), math.sqrt(self.sq_delta))


def _sum_squares(w: np.ndarray) -> float:
    """The sum of the squares of ``w``'s finite values (moduli for complex), in float64, in
    pieces of :data:`_PIECE` elements (bounded temporaries)."""
    total = 0.0
    for start in range(0, w.size, _PIECE):
        x = w[start : start + _PIECE]
        if x.dtype.kind == "c":
            x = np.abs(x)
        sq = np.square(x, dtype=np.float64)
        piece = float(sq.sum())
        if not math.isfinite(piece) and x.dtype.kind == "f":  # NaN/Inf left out (an overflowing square stays inf)
            piece = float(sq[np.isfinite(x)].sum())
        total += piece
    return total


def _max_finite_abs(w: np.ndarray) -> float:
    """The largest magnitude among the finite values of ``w`` (0 when there are none)."""
    if not w.size:
        return 0.0
    if w.dtype.kind == "c":
        w = np.abs(w)
    elif w.dtype == np.bool_:
        w = w.view(np.uint8)
    if w.dtype.kind in "iu":
        return float(max(abs(int(w.min())), abs(int(w.max()))))  # (np.abs of the lowest int overflows)
    lo, hi = float(w.min()), float(w.max())
    if math.isfinite(lo) and math.isfinite(hi):
        return max(-lo, hi)
    finite = w[np.isfinite(w)]
    return _max_finite_abs(finite) if finite.size else 0.0


def _compare(
    a: Checkpoint, b: Checkpoint, key: str, rank: int | None, max_bytes: int, tick: Callable[[int], None]
) -> DiffRow:
    ma, mb = a.array_meta(key, rank), b.array_meta(key, rank)
    dta, dtb = ma.dtype.name, mb.dtype.name
    if ma.shape != mb.shape:
        tick(math.prod(ma.shape) * ma.dtype.itemsize)
        return DiffRow(key, "shape", ma.shape, mb.shape, dta, dtb, rank=rank)
    # both sides are read in the same boxes (a's chunk-aligned blocks): the raw values of both
    # and their widened copies fit the budget together
    per_element = ma.dtype.itemsize + mb.dtype.itemsize + _value_itemsize(dta) + _value_itemsize(dtb)
    block = block_shape(ma.shape, ma.grid.chunk_shape, per_element, max_bytes)
    cmp = _Compare()
    for box in block_boxes(ma.shape, block):
        cmp.add(a.read_numpy(key, box, rank), b.read_numpy(key, box, rank), dta, dtb)
        tick(box.numel * ma.dtype.itemsize)
    return cmp.row(key, "equal" if dta == dtb else "dtype", ma.shape, dta, dtb, rank)


def _diff_values(a: Checkpoint, b: Checkpoint, patterns: list[str] | None) -> list[ValueDiff]:
    def flat(ck: Checkpoint) -> dict[str, Any]:
        out = dict(ck.meta.values)
        for k, per in ck.meta.rank_values.items():
            out.update({f"{k} (rank {r})": v for r, v in per.items()})
        return {k: v for k, v in out.items() if patterns is None or any(matches(k, p) for p in patterns)}

    va, vb = flat(a), flat(b)
    rows = []
    for k in list(va) + [k for k in vb if k not in va]:
        if k not in vb:
            rows.append(ValueDiff(k, "only_a", va[k], None))
        elif k not in va:
            rows.append(ValueDiff(k, "only_b", None, vb[k]))
        elif va[k] != vb[k] or type(va[k]) is not type(vb[k]):
            rows.append(ValueDiff(k, "differs", va[k], vb[k]))
    return rows


def diff(
    a: Checkpoint | str | os.PathLike[str],
    b: Checkpoint | str | os.PathLike[str],
    *,
    keys: str | Iterable[str] | None = None,
    max_bytes: int = MAX_BYTES,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> CheckpointDiff:
    """Compare two checkpoints (objects, or paths/URLs opened with ``storage_options``)
    tensor by tensor and value by value (see :class:`DiffRow`, :class:`ValueDiff`).

    ``keys``: compare only the tensors and values these select (exact keys, subtrees or
    globs, see :func:`matches`; one string is one pattern). Tensors are read block by block, the same boxes from both,
    with memory bounded by about ``max_bytes``; per-rank tensors are compared rank by rank."""
    ca, cb = _as_checkpoint(a, storage_options), _as_checkpoint(b, storage_options)
    patterns = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
    ka, kb = select_keys(ca, patterns), select_keys(cb, patterns)
    in_b = set(kb)
    common = [k for k in ka if k in in_b]
    total = sum(ca.meta.tensors[k].nbytes * len(ca.meta.tensors[k].ranks or (None,)) for k in common)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    rows: list[DiffRow] = []
    in_a = set(ka)
    for key in ka + [k for k in kb if k not in in_a]:
        ea, eb = ca.meta.tensors.get(key), cb.meta.tensors.get(key)
        if eb is None or ea is None:
            e = ea or eb
            assert e is not None
            status = "only_a" if eb is None else "only_b"
            shapes = (tuple(e.shape), None) if eb is None else (None, tuple(e.shape))
            dtypes = (e.dtype, None) if eb is None else (None, e.dtype)
            rows.append(DiffRow(key, status, *shapes, *dtypes))
            continue
        if ea.ranks is None or eb.ranks is None:
            rows.append(_compare(ca, cb, key, None, max_bytes, tick))
            continue
        for r in sorted(set(ea.ranks) | set(eb.ranks)):
            if r in ea.ranks and r in eb.ranks:
                rows.append(_compare(ca, cb, key, r, max_bytes, tick))
            else:
                e, status = (ea, "only_a") if r in ea.ranks else (eb, "only_b")
                shapes = (tuple(e.shape), None) if status == "only_a" else (None, tuple(e.shape))
                dtypes = (e.dtype, None) if status == "only_a" else (None, e.dtype)
                rows.append(DiffRow(key, status, *shapes, *dtypes, rank=r))
    return CheckpointDiff(ca.store.url, cb.store.url, rows, _diff_values(ca, cb, patterns))
