"""Comparing two checkpoints without torch: every key's status, value differences by bits, and
relative update norms."""

from __future__ import annotations

import html
import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..io.store import in_order
from ..protocol.reader import CheckpointReader, open_reader
from .inspect import _json_float, select_keys, selector
from .values import MAX_BYTES, Progress, _PIECE, _value_itemsize, block_boxes, block_shape, widen


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


def _as_checkpoint(x: CheckpointReader | str | os.PathLike[str], storage_options: dict[str, Any] | None) -> CheckpointReader:
    return x if isinstance(x, CheckpointReader) else open_reader(x, storage_options=storage_options)


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
        elif wa.dtype.kind in "iu" and wb.dtype.kind in "iu":
            differ = _int_differ(wa, wb)
        else:
            na, nb = _numbers(wa), _numbers(wb)
            differ = (na != nb) & ~(np.isnan(na) & np.isnan(nb))
        n = int(differ.sum())
        if not n:
            return
        self.ndiff += n
        if wa.dtype.kind in "iu" and wb.dtype.kind in "iu":  # (exact: float64 loses integers beyond 2**53)
            delta = _int_distance(wa[differ], wb[differ])
            self.max_abs = max(self.max_abs, float(delta.max()))
            self.sq_delta += _sum_squares(delta)
            return
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


def _int_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where two integer arrays of other dtypes hold other numbers, exactly (numpy compares
    int64 with uint64 through float64, which loses integers beyond 2**53)."""
    if (a.dtype.kind == "i") == (b.dtype.kind == "i"):
        wide = np.int64 if a.dtype.kind == "i" else np.uint64
        return a.astype(wide) != b.astype(wide)
    signed, unsigned = (a, b) if a.dtype.kind == "i" else (b, a)
    return (signed < 0) | (signed.astype(np.int64).view(np.uint64) != unsigned.astype(np.uint64))


def _int_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b|`` of two integer arrays: exactly, as uint64, where both are signed or both
    unsigned (they are at most 2**64 - 1 apart); else rounded once to float64, from Python
    integers (int64 and uint64 values may be up to 2**64 + 2**63 - 1 apart)."""
    if (a.dtype.kind == "i") != (b.dtype.kind == "i"):
        return np.array([float(abs(int(x) - int(y))) for x, y in zip(a.tolist(), b.tolist())], dtype=np.float64)
    wide = np.int64 if a.dtype.kind == "i" else np.uint64
    wa, wb = a.astype(wide), b.astype(wide)
    ua, ub = wa.view(np.uint64), wb.view(np.uint64)
    return np.where(wa >= wb, ua - ub, ub - ua)  # (modulo 2**64: the true distance)


def _sum_squares(w: np.ndarray) -> float:
    """The sum of the squares of ``w``'s finite values (moduli for complex), in float64, in
    pieces of :data:`_PIECE` elements (bounded temporaries)."""
    total = 0.0
    for start in range(0, w.size, _PIECE):
        x = w[start : start + _PIECE]
        if x.dtype.kind == "c":
            x = np.abs(x.astype(np.complex128, copy=False))  # (complex64's moduli are float32)
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
        w = np.abs(w.astype(np.complex128, copy=False))
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
    a: CheckpointReader, b: CheckpointReader, key: str, ranks: tuple[int | None, int | None], max_bytes: int,
    tick: Callable[[int], None],
) -> DiffRow:
    """Tensor ``key`` of ``a`` against ``b``, each side's copy of the rank ``ranks`` gives it
    (None: not per-rank); the row names the per-rank side's rank."""
    ra, rb = ranks
    rank = ra if ra is not None else rb
    ma, mb = a.array_meta(key, ra), b.array_meta(key, rb)
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
        cmp.add(a.read_numpy(key, box, ra), b.read_numpy(key, box, rb), dta, dtb)
        tick(box.numel * ma.dtype.itemsize)
    return cmp.row(key, "equal" if dta == dtb else "dtype", ma.shape, dta, dtb, rank)


def _diff_values(a: CheckpointReader, b: CheckpointReader, patterns: list[str] | None) -> list[ValueDiff]:
    def flat(ck: CheckpointReader) -> dict[str, Any]:
        out = dict(ck.meta.values)
        for k, per in ck.meta.rank_values.items():
            out.update({f"{k} (rank {r})": v for r, v in per.items()})
        hit = selector(patterns, out)
        return {k: v for k, v in out.items() if hit(k)}

    va, vb = flat(a), flat(b)
    rows = []
    for k in list(va) + [k for k in vb if k not in va]:
        if k not in vb:
            rows.append(ValueDiff(k, "only_a", va[k], None))
        elif k not in va:
            rows.append(ValueDiff(k, "only_b", None, vb[k]))
        elif json.dumps(va[k], sort_keys=True) != json.dumps(vb[k], sort_keys=True):  # (1, 1.0 and true differ)
            rows.append(ValueDiff(k, "differs", va[k], vb[k]))
    return rows


def diff(
    a: CheckpointReader | str | os.PathLike[str],
    b: CheckpointReader | str | os.PathLike[str],
    *,
    keys: str | Iterable[str] | None = None,
    max_bytes: int = MAX_BYTES,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> CheckpointDiff:
    """Compare two checkpoints (objects, or paths/URLs opened with ``storage_options``)
    tensor by tensor and value by value (see :class:`DiffRow`, :class:`ValueDiff`).

    ``keys``: compare only the tensors and values these select (exact keys, subtrees or
    globs, see :func:`.inspect.selector`; one string is one pattern). Tensors are read block by block, the same boxes from both,
    with memory bounded by about ``max_bytes``; per-rank tensors are compared rank by rank."""
    ca, cb = _as_checkpoint(a, storage_options), _as_checkpoint(b, storage_options)
    patterns = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
    ka, kb = select_keys(ca, patterns, ties=True), select_keys(cb, patterns, ties=True)  # (a tie: under each key)
    in_b = set(kb)
    common = [ca.meta.tensors[ca.meta.canonical(k)] for k in ka if k in in_b]
    total = sum(e.nbytes * len(e.ranks or (None,)) for e in common)
    # an object store's requests overlap: as many tensors compared at once as it keeps
    # requests in flight (each within its share of max_bytes), the rows in order
    store = max((ca.store, cb.store), key=lambda s: s.request_concurrency or 0)
    budget = max(1, max_bytes // (store.request_concurrency or 1))
    lock, done = threading.Lock(), [0]

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    def compare(key: str, ra: int | None, rb: int | None) -> Callable[[], DiffRow]:
        return lambda: _compare(ca, cb, key, (ra, rb), budget, tick)

    rows: list[DiffRow | Callable[[], DiffRow]] = []
    in_a = set(ka)
    for key in ka + [k for k in kb if k not in in_a]:
        ea, eb = ca.meta.tensors.get(ca.meta.canonical(key)), cb.meta.tensors.get(cb.meta.canonical(key))
        if eb is None or ea is None:
            e = ea or eb
            assert e is not None
            status = "only_a" if eb is None else "only_b"
            shapes = (tuple(e.shape), None) if eb is None else (None, tuple(e.shape))
            dtypes = (e.dtype, None) if eb is None else (None, e.dtype)
            rows.append(DiffRow(key, status, *shapes, *dtypes))
            continue
        if ea.ranks is None and eb.ranks is None:
            rows.append(compare(key, None, None))
            continue
        if ea.ranks is None or eb.ranks is None:  # per-rank on one side: each copy against the other's tensor
            rows += [compare(key, None if ea.ranks is None else r, None if eb.ranks is None else r)
                     for r in sorted(ea.ranks or eb.ranks or ())]
            continue
        for r in sorted(set(ea.ranks) | set(eb.ranks)):
            if r in ea.ranks and r in eb.ranks:
                rows.append(compare(key, r, r))
            else:
                e, status = (ea, "only_a") if r in ea.ranks else (eb, "only_b")
                shapes = (tuple(e.shape), None) if status == "only_a" else (None, tuple(e.shape))
                dtypes = (e.dtype, None) if status == "only_a" else (None, e.dtype)
                rows.append(DiffRow(key, status, *shapes, *dtypes, rank=r))
    made = list(in_order(store, lambda row: row if isinstance(row, DiffRow) else row(), rows))
    return CheckpointDiff(ca.store.url, cb.store.url, made, _diff_values(ca, cb, patterns))
