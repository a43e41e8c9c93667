"""Reading a committed checkpoint: :func:`open` and the lazy :class:`Checkpoint`."""

from __future__ import annotations

import html
import itertools
import json
import math
import os
import threading
from typing import Any, Iterator

import numpy as np
import torch

from .arrayio import as_storage, read_box, read_shard_index
from .dtypes import stored_dtype_by_name
from .errors import FormatError, IncompleteCheckpointError
from .format import METADATA_FILE, ArrayMeta, CheckpointMeta
from .layout import Box
from .statedict import from_json
from .storage import PENDING_MARKER, Store, open_store


class Checkpoint:
    """A read-only view of a committed checkpoint. Tensors are read lazily, by slice."""

    def __init__(self, store: Store, meta: CheckpointMeta) -> None:
        self.store = store
        self.meta = meta
        self._arrays: dict[str, ArrayMeta] = {}
        self._indexes: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self._lock = threading.Lock()

    # --- mapping face --------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The flattened tensor keys, spelled as DCP flattens them."""
        return list(self.meta.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta.tensors)

    def __len__(self) -> int:
        return len(self.meta.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.meta.tensors

    def __getitem__(self, key: str) -> "TensorView":
        self._entry(key)
        return TensorView(self, key)

    def array_path(self, key: str) -> str:
        """Where the tensor's Zarr array lives, relative to the checkpoint root."""
        return self._entry(key).path

    @property
    def metadata(self) -> dict[str, Any]:
        """Non-tensor state (by flattened key) and checkpoint facts, as plain data.

        ``rank_values`` holds the values that differed between the saving ranks, by rank."""
        values = {k: from_json(v) for k, v in self.meta.values.items()}
        return {
            "step": values.get("step"),
            "created": self.meta.created,
            "library": self.meta.library,
            "world_size": self.meta.world_size,
            "layout": self.meta.layout,
            "values": values,
            "rank_values": {k: {r: from_json(v) for r, v in per.items()} for k, per in self.meta.rank_values.items()},
            "per_rank_tensors": sorted(k for k, e in self.meta.tensors.items() if e.ranks is not None),
        }

    # --- reading -------------------------------------------------------------------------

    def _entry(self, key: str):
        try:
            return self.meta.tensors[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in checkpoint {self.store.url}") from None

    def array_meta(self, key: str, rank: int | None = None) -> ArrayMeta:
        """The array metadata of ``key`` (its zarr.json, read once); ``rank`` picks the copy
        of per-rank state."""
        path = self._path(key, rank)
        with self._lock:
            if path in self._arrays:
                return self._arrays[path]
        where = f"{self.store.url}/{path}/{METADATA_FILE}"
        try:
            doc = json.loads(self.store.read(f"{path}/{METADATA_FILE}"))
        except FileNotFoundError:
            raise FormatError(f"tensor {key!r}: array metadata {where} is missing") from None
        meta = ArrayMeta.from_zarr_json(doc, where)
        if meta.key != key:
            raise FormatError(f"{where} holds tensor {meta.key!r}, the index says {key!r}")
        with self._lock:
            self._arrays[path] = meta
        return meta

    def _path(self, key: str, rank: int | None) -> str:
        entry = self._entry(key)
        if rank is None or entry.ranks is None:
            return entry.path
        try:
            return entry.ranks[rank]
        except KeyError:
            raise KeyError(f"tensor {key!r} has no copy of rank {rank}; saved ranks: {sorted(entry.ranks)}") from None

    def _index(self, path: str, meta: ArrayMeta, shard: tuple[int, ...]) -> np.ndarray:
        with self._lock:
            idx = self._indexes.get((path, shard))
        if idx is None:
            idx = read_shard_index(self.store, path, meta, shard)
            with self._lock:
                self._indexes[(path, shard)] = idx
        return idx

    def read(
        self, key: str, box: Box | None = None, out: torch.Tensor | None = None, rank: int | None = None
    ) -> torch.Tensor:
        """Read ``box`` (default: all) of tensor ``key`` into ``out`` (allocated if None).

        ``out`` may have any dtype, device and strides; it is filled directly when it is a
        CPU tensor of the saved dtype, else through a temporary and ``copy_``. ``rank``
        picks the copy of per-rank state (default: the lowest saved rank's).
        """
        meta = self.array_meta(key, rank)
        box = box or Box.whole(meta.shape)
        if out is not None and tuple(out.shape) != box.shape:
            raise ValueError(f"tensor {key!r}: destination shape {tuple(out.shape)} != {box.shape}")
        direct = out is not None and out.device.type == "cpu" and out.dtype == meta.dtype.torch_dtype
        dest = out if direct else torch.empty(box.shape, dtype=meta.dtype.torch_dtype)
        assert dest is not None
        raw = as_storage(dest, meta)
        path = self._path(key, rank)
        for shard in meta.grid.shards_overlapping(box):
            index = self._index(path, meta, shard) if meta.grid.sharded else None
            read_box(self.store, path, meta, box, raw, shard, index)
        if out is None:
            return dest
        if not direct:
            with torch.no_grad():
                out.copy_(dest)
        return out

    def verify(self) -> int:
        """Read every chunk of every tensor, checking its crc32c; return the bytes checked.

        Raises :class:`~ucp_zarr.errors.CorruptChunkError` naming the first bad chunk.
        """
        total = 0
        for key in self.keys():
            t = self.read(key)
            total += t.numel() * t.element_size()
        return total

    # --- reprs ---------------------------------------------------------------------------

    def _groups(self) -> dict[str, list[tuple[str, str, Any]]]:
        groups: dict[str, list[tuple[str, str, Any]]] = {}
        for key, e in self.meta.tensors.items():
            group, _, name = e.path.partition("/")
            groups.setdefault(group, []).append((name, key, e))
        return groups

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.meta.tensors.values())

    def __repr__(self) -> str:
        lines = [
            f"<ucp_zarr.Checkpoint {self.store.url}: {len(self)} tensors, {_human(self.nbytes())}, "
            f"step={self.metadata['step']!r}, world_size={self.meta.world_size}>"
        ]
        for group, items in self._groups().items():
            lines.append(f"  {group}/")
            for name, _, e in items:
                lines.append(f"    {name:<16} {str(list(e.shape)):<16} {e.dtype}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = []
        for group, items in self._groups().items():
            inner = "".join(
                f"<tr><td><code>{html.escape(name)}</code></td><td>{list(e.shape)}</td>"
                f"<td>{e.dtype}</td><td title='{html.escape(key)}'>{_human(e.nbytes)}</td></tr>"
                for name, key, e in items
            )
            rows.append(
                f"<details><summary><code>{html.escape(group)}</code> ({len(items)})</summary>"
                f"<table>{inner}</table></details>"
            )
        head = (
            f"<b>ucp_zarr checkpoint</b> <code>{html.escape(self.store.url)}</code>: {len(self)} tensors, "
            f"{_human(self.nbytes())}, step {html.escape(repr(self.metadata['step']))}, "
            f"saved by {self.meta.world_size} rank(s) at {html.escape(self.meta.created)}"
        )
        return f"<div>{head}{''.join(rows)}</div>"


class TensorView:
    """A lazy tensor of a checkpoint: ``view[0:128, :]`` reads only the overlapping chunks."""

    def __init__(self, checkpoint: Checkpoint, key: str) -> None:
        self.checkpoint = checkpoint
        self.key = key
        entry = checkpoint.meta.tensors[key]
        self.shape = torch.Size(entry.shape)
        self.dtype: torch.dtype = stored_dtype_by_name(entry.dtype).torch_dtype
        self.path = entry.path

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self) -> torch.Tensor:
        return self.checkpoint.read(self.key)

    def __getitem__(self, index: Any) -> torch.Tensor:
        box, post = _index_to_box(index, tuple(self.shape))
        steps = [p.step if isinstance(p, slice) else 1 for p in post]
        if all(s == 1 for s in steps):
            return self.checkpoint.read(self.key, box)[post]
        # a stepped selection: read, per chunk row/column, only the span of selected indices
        chunk = self.checkpoint.array_meta(self.key).grid.chunk_shape
        spans = [_spans(o, n, st, c) for o, n, st, c in zip(box.offset, box.shape, steps, chunk)]
        out = torch.empty([sum(k for *_, k in sp) for sp in spans], dtype=self.dtype)
        for combo in itertools.product(*spans):
            part = Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo))
            data = self.checkpoint.read(self.key, part)[tuple(slice(None, None, st) for st in steps)]
            out[tuple(slice(c[2], c[2] + c[3]) for c in combo)] = data
        return out[tuple(0 if isinstance(p, int) else slice(None) for p in post)]

    def __repr__(self) -> str:
        return f"<TensorView {self.key!r} shape={list(self.shape)} dtype={self.dtype} at {self.path}>"


def _index_to_box(index: Any, shape: tuple[int, ...]) -> tuple[Box, tuple[Any, ...]]:
    """The bounding box an index touches, and the index that picks the result out of it."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of {len(shape)} dims")
    index = index + (slice(None),) * (len(shape) - len(index))
    offset, size, post = [], [], []
    for i, n in zip(index, shape):
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step < 0:
                raise IndexError("negative slice steps are not supported")
            stop = max(start, stop)
            if stop > start:
                stop = start + ((stop - start - 1) // step) * step + 1
            offset.append(start)
            size.append(stop - start)
            post.append(slice(None, None, step))
        elif isinstance(i, (int, np.integer)):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for a dim of size {n}")
            offset.append(j)
            size.append(1)
            post.append(0)
        else:
            raise TypeError(f"unsupported index {i!r}: use ints, slices and ...")
    return Box(tuple(offset), tuple(size)), tuple(post)


def _spans(offset: int, size: int, step: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """The indices ``offset, offset + step, ... < offset + size`` grouped by chunk, as
    ``(first, extent, position in the result, count)``."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    i, stop = offset, offset + size
    while i < stop:
        end = min(stop, (i // chunk + 1) * chunk)
        count = -(-(end - i) // step)
        last = i + (count - 1) * step
        out.append((i, last - i + 1, pos, count))
        pos += count
        i += count * step
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def open(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """Open the committed checkpoint at ``path`` (a local path or fsspec URL), read-only."""
    store = open_store(path, storage_options)
    return open_store_checkpoint(store)


def open_store_checkpoint(store: Store) -> Checkpoint:
    where = f"{store.url}/{METADATA_FILE}"
    try:
        raw = store.read(METADATA_FILE)
    except FileNotFoundError:
        if store.exists(PENDING_MARKER) or not store.is_empty():
            raise IncompleteCheckpointError(
                f"{store.url} holds an incomplete checkpoint: its commit record {METADATA_FILE} "
                "was never written (the save failed or is still running)"
            ) from None
        raise FileNotFoundError(f"no checkpoint at {store.url}") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise FormatError(f"{where} is not valid JSON: {e}") from e
    return Checkpoint(store, CheckpointMeta.from_zarr_json(doc, where))
