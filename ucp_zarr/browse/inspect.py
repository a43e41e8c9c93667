"""Looking into checkpoints without torch: listings, values block by block, statistics, diffs.

Pure functions on a :class:`~ucp_zarr.protocol.reader.CheckpointReader` (the CLI and the Jupyter reprs are thin
faces over them). Memory stays bounded by ``max_bytes`` (or one chunk, when a chunk is
larger) whatever the tensor's size, and torch is never imported: values come as numpy,
bfloat16 and float8 widened to float32 (:func:`widen`), other dtypes as stored.
"""

from __future__ import annotations

import fnmatch
import math
import urllib.parse
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..io.store import at_once, in_order
from ..protocol.reader import CheckpointReader
from .values import MAX_BYTES, Progress, _PIECE, iter_blocks


# --- listing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a listing (:func:`list_tensors`)."""

    key: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    """The bytes stored: every saving rank's copy of per-rank state."""
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


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def selector(patterns: Iterable[str] | None, keys: Iterable[str]) -> Callable[[str], bool]:
    """Whether a key is selected by any of ``patterns`` (None: every key), among ``keys``. A
    pattern is a plain key that selects itself and everything under it (``model.layers.0``
    selects ``model.layers.0.weight``), or a glob (``*``, ``?``, ``[...]``, matched with
    :func:`fnmatch.fnmatchcase`; ``*`` crosses dots); one that spells one of ``keys``, or a
    dotted prefix of one, is a plain key even where it holds glob characters (the key
    ``model.w[0]`` selects itself, not ``model.w0``)."""
    if patterns is None:
        return lambda key: True
    pats = list(patterns)
    spelled = {".".join(parts[:i]) for parts in (k.split(".") for k in keys) for i in range(1, len(parts) + 1)}
    plain = {p for p in pats if not _is_glob(p) or p in spelled}
    globs = [p for p in pats if p not in plain]

    def hit(key: str) -> bool:  # (many exact keys: each key's dotted prefixes looked up, not every pattern tried)
        parts = key.split(".")
        return (any(".".join(parts[:i]) in plain for i in range(1, len(parts) + 1)) if plain else False) or any(
            fnmatch.fnmatchcase(key, g) for g in globs)

    return hit


def select_keys(ck: CheckpointReader, patterns: Iterable[str] | None, *, ties: bool = False) -> list[str]:
    """The keys of ``ck`` selected by any of ``patterns`` (see :func:`selector`), in order;
    with ``ties``, the aliases of tied tensors too (after the stored tensors)."""
    keys = ck.keys() + list(ck.meta.ties) if ties else ck.keys()
    if patterns is None:
        return keys
    hit = selector(patterns, keys)
    return [k for k in keys if hit(k)]


def list_tensors(ck: CheckpointReader, pattern: str | None = None) -> list[TensorRow]:
    """The tensors of ``ck`` selected by ``pattern`` (see :func:`selector`; None: all; the key
    of a tied alias: the tensor it reads, under that key), with their chunking (each array's
    document is read once, checked against its digest)."""
    keys = select_keys(ck, None if pattern is None else [pattern])
    if pattern in ck.meta.ties:  # (a tied alias spelled out: the tensor it reads, under that name)
        keys.append(pattern)

    def row(key: str) -> TensorRow:
        e = ck.meta.tensors[ck.meta.canonical(key)]
        grid = ck.array_meta(key).grid
        return TensorRow(
            key=key, path=e.path, shape=tuple(e.shape), dtype=e.dtype, nbytes=e.nbytes * e.copies, chunks=grid.chunk_shape,
            shard_shape=grid.shard_shape, shards=math.prod(grid.shard_counts), group=e.path.partition("/")[0],
            ranks=None if e.ranks is None else tuple(sorted(e.ranks)),
        )

    return at_once(ck.store, row, keys)  # (one document per array: an object store's requests overlap)


def checkpoint_info(ck: CheckpointReader) -> dict[str, Any]:
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
        "ties": meta.ties,
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
    ``"head"``; ``""`` for a top-level name; a parameter's number (the optimizer state of a
    save that did not know the names) is its own module."""
    if group.isdigit():
        return group
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
    per-rank tensors once per saving rank (each copy is stored), tied tensors once."""

    url: str
    depth: int
    modules: list[SummaryRow]
    """By module (the parameter's FQN cut to ``depth`` names; ``""``: top level), in key order."""
    dtypes: list[SummaryRow]
    """By dtype, largest first."""
    total: SummaryRow
    html: Callable[["CheckpointSummary"], str] | None = field(default=None, repr=False, compare=False)
    """What renders it in Jupyter (``ck.summary()`` gives :func:`ucp_zarr.browse.notebook.summary_html`):
    the statistics never import the HTML layer."""

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

    def _repr_html_(self) -> str | None:
        return None if self.html is None else self.html(self)


def checkpoint_summary(
    ck: CheckpointReader, depth: int = 2, *, html: Callable[[CheckpointSummary], str] | None = None
) -> CheckpointSummary:
    """Elements (model, optimizer, other) and bytes of ``ck`` by module (each tensor's
    parameter group, cut to ``depth`` names by :func:`module_of`) and by dtype. Reads the
    commit record only. ``html`` renders it in Jupyter."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth is a positive integer (how many names of the FQN make a module), got {depth!r}")
    modules: dict[str, SummaryRow] = {}
    dtypes: dict[str, SummaryRow] = {}
    total = SummaryRow("total")
    for key, e in ck.meta.tensors.items():
        name = module_of(group_of(e.path), depth)
        args = (tensor_kind(key, e.ranks), math.prod(e.shape) * e.copies, e.nbytes * e.copies, e.dtype)
        for row in (modules.setdefault(name, SummaryRow(name)), dtypes.setdefault(e.dtype, SummaryRow(e.dtype)), total):
            row.add(*args)
    return CheckpointSummary(ck.store.url, depth, list(modules.values()),
                             sorted(dtypes.values(), key=lambda r: -r.nbytes), total, html)


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
    html: Callable[["TensorStats"], str] | None = field(default=None, repr=False, compare=False)
    """What renders it in Jupyter (``view.stats()`` gives :func:`ucp_zarr.browse.notebook.stats_html`)."""

    @property
    def finite(self) -> int:
        return self.count - self.nan - self.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "shape": list(self.shape), "dtype": self.dtype, "count": self.count,
            **{k: _json_float(v) if isinstance(v, float) else v for k, v in
               (("min", self.min), ("max", self.max), ("mean", self.mean), ("std", self.std), ("norm", self.norm))},
            "nan": self.nan, "inf": self.inf,
        }

    def _repr_html_(self) -> str | None:
        return None if self.html is None else self.html(self)


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
        if self.n:  # (the first piece has no cross term: inf * 0 would make a finite std NaN)
            m2 += delta * delta * self.n * n / total
        self.m2 += m2
        self.n = total


def _plain(x: Any) -> float | int | None:
    if x is None:
        return None
    return int(x) if isinstance(x, (np.integer, np.bool_)) else float(x)


def tensor_stats(
    ck: CheckpointReader, key: str, *, max_bytes: int = MAX_BYTES, rank: int | None = None, progress: Progress | None = None,
    html: Callable[[TensorStats], str] | None = None,
) -> TensorStats:
    """Statistics of tensor ``key`` (see :class:`TensorStats`), computed block by block in
    float64 with memory bounded by about ``max_bytes``; ``html`` renders them in Jupyter."""
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
                x = np.abs(x[~(bad_nan | bad_inf)].astype(np.complex128))  # (moduli in float64, as documented)
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
        nan=nan, inf=inf, html=html,
    )


def stats_of(
    ck: CheckpointReader, keys: Iterable[str], *, max_bytes: int = MAX_BYTES, rank: int | None = None,
    progress: Progress | None = None,
) -> list[TensorStats]:
    """:func:`tensor_stats` of each of ``keys``, in order. Where the store keeps requests in
    flight (an object store), that many tensors are read at once, each within its share of
    ``max_bytes``; ``progress(done, total)`` counts bytes over all of them (called one call at
    a time). The first failure in the keys' order is raised."""
    keys = list(keys)
    budget = max(1, max_bytes // (ck.store.request_concurrency or 1))
    total = sum(ck.meta.tensors[ck.meta.canonical(k)].nbytes for k in keys)
    lock, done, each = threading.Lock(), [0], [0] * len(keys)

    def one(i: int) -> TensorStats:
        def moved(d: int, _total: int) -> None:
            with lock:
                done[0] += d - each[i]
                each[i] = d
                if progress is not None:
                    progress(done[0], total)

        return tensor_stats(ck, keys[i], max_bytes=budget, rank=rank, progress=moved)

    return list(in_order(ck.store, one, range(len(keys))))


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


def value_range(ck: CheckpointReader, key: str, *, max_bytes: int = MAX_BYTES) -> ValueRange:
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


def histogram_counts(ck: CheckpointReader, key: str, edges: np.ndarray, *, max_bytes: int = MAX_BYTES) -> np.ndarray:
    """How many finite values of tensor ``key`` fall in each bin of ``edges`` (as
    :func:`numpy.histogram` counts them), streamed block by block."""
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    for _, block in iter_blocks(ck, key, max_bytes=max_bytes):
        counts += np.histogram(_finite(block), bins=edges)[0]
    return counts
