"""safetensors in and out: one file, or shards with a ``*.safetensors.index.json``.

In: every tensor under its own name (with ``prefix`` prepended), read lazily box by box
through ``safe_open`` (memory-mapped); the header's ``__metadata__`` (str -> str) becomes
the value ``__metadata__`` (ties and values an export recorded there become ties and values
again). Out: a
streaming writer of the format (an 8-byte header length, the JSON header, the raw
little-endian bytes), one tensor block at a time, into one file (a destination named
``*.safetensors``) or shards of at most ``max_shard_bytes`` with a Hugging Face style index;
every tensor under its checkpoint key (a tie once), an imported header's ``__metadata__``
entries back in place, the checkpoint's other values as JSON in
``__metadata__["ucp_zarr.values"]``. (A folder ``from_pretrained`` loads: :mod:`.hf`.)
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..protocol.reader import CheckpointReader
from ..errors import ConversionError
from ..layout import Box
from ..format.safe_paths import inside_relative
from ..format.statedict import from_json
from ..io.store import Store
from .base import Imported, atomic_file, atomic_folder, export_keys, read_ahead

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
"""The file ``from_pretrained`` reads first, before an index (``SAFE_WEIGHTS_NAME``)."""
DEFAULT_MAX_SHARD_BYTES = 4 << 30
_EXPORTED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The files an export to a folder writes (an earlier one is replaced with ``overwrite``)."""
TIES_METADATA = "ucp_zarr.ties"
"""The ``__metadata__`` entry where an export records tied names (JSON: alias -> the name it reads)."""
VALUES_METADATA = "ucp_zarr.values"
"""The ``__metadata__`` entry where an export records the checkpoint's other values (JSON), which an import reads back."""
BLOCK_BYTES = 64 << 20
"""Tensors are copied out in row blocks of about this size."""

_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class _File:
    """A safetensors file, opened (memory-mapped, its header parsed) once for all its tensors:
    opened per tensor, a file of n tensors parsed its header n times (20,000 tensors: minutes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None
        self._lock = threading.Lock()

    def handle(self) -> Any:
        with self._lock:
            if self._handle is None:
                from safetensors import safe_open

                try:
                    self._handle = safe_open(str(self.path), framework="pt")
                except Exception as e:  # (safetensors' own errors name no file)
                    raise ConversionError(f"{self.path}: safetensors cannot read it: {type(e).__name__}: {e}") from e
            return self._handle


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file, read lazily."""

    file: _File
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        f = self.file.handle()
        if not self.shape:
            return f.get_tensor(self.name), box
        return f.get_slice(self.name)[box.slices()], box


def read(src: Path, *, prefix: str = "") -> Imported:
    """The tensors of a safetensors file, or of every shard an index names (``src`` is the
    file, the index, or a folder holding exactly one of either)."""
    files, weight_map = _files(Path(src))
    out = Imported(layout={"source": {"format": "safetensors", "files": [f.name for f in files]}})
    for file in files:
        header, _ = _header(file)
        opened = _File(file)
        for name, info in header.items():
            if name == "__metadata__":
                out.values.setdefault("__metadata__", {}).update(info or {})
                continue
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ConversionError(f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, which ucp_zarr cannot store")
            key = prefix + name
            if key in out.tensors:
                raise ConversionError(f"{file}: tensor {name!r} is also in another shard")
            out.tensors[key] = _Entry(opened, name, tuple(info["shape"]), dtype)
    absent = sorted(name for name in weight_map or () if prefix + name not in out.tensors)
    if absent:
        raise ConversionError(f"{src}: the index names tensors that no shard holds: {absent[:10]}"
                              + (f" (and {len(absent) - 10} more)" if len(absent) > 10 else ""))
    out.ties = _ties(out, prefix, files)
    for k, v in _values(out, files).items():
        if prefix + k in out.tensors or prefix + k in out.values:
            raise ConversionError(f"{files[0]}: __metadata__[{VALUES_METADATA!r}] names {k!r}, which is also a tensor or value")
        out.values[prefix + k] = v
    return out


def _values(out: Imported, files: list[Path]) -> dict[str, Any]:
    """The values an export of this module recorded (``__metadata__["ucp_zarr.values"]``),
    taken out of the value ``__metadata__``."""
    raw = out.values.get("__metadata__", {}).pop(VALUES_METADATA, None)
    if raw is None:
        return {}
    try:
        stored = json.loads(raw)
        if not isinstance(stored, dict):
            raise ValueError("not an object")
        return {k: from_json(v, k) for k, v in stored.items()}
    except Exception as e:
        raise ConversionError(f"{files[0]}: __metadata__[{VALUES_METADATA!r}] is not the values an export "
                              f"recorded ({e})") from None


def _ties(out: Imported, prefix: str, files: list[Path]) -> dict[str, str]:
    """The ties an export of this module recorded (``__metadata__["ucp_zarr.ties"]``), of
    tensors the files hold, taken out of the value ``__metadata__``."""
    raw = out.values.get("__metadata__", {}).pop(TIES_METADATA, None)
    if raw is None:
        return {}
    try:
        ties = json.loads(raw)
        if not (isinstance(ties, dict) and all(isinstance(a, str) and isinstance(c, str) for a, c in ties.items())):
            raise ValueError("not an object of names")
    except ValueError as e:
        raise ConversionError(f"{files[0]}: __metadata__[{TIES_METADATA!r}] is not a map of tied names ({e})") from None
    return {prefix + a: prefix + c for a, c in ties.items() if prefix + c in out.tensors and prefix + a not in out.tensors}


def _files(src: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files ``src`` names, and the index's weight map where it is (or names) an index."""
    folder = src if src.is_dir() else None
    if folder is not None:
        found = sorted(src.glob("*" + INDEX_SUFFIX)) or sorted(src.glob("*.safetensors"))
        if len(found) != 1:
            raise ConversionError(
                f"{src}: expected one safetensors file or one index in the folder, found {[f.name for f in found]}"
            )
        src = found[0]
    if src.name.endswith(INDEX_SUFFIX):
        try:
            weight_map = json.loads(src.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{src}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{src}: not a safetensors index (its weight_map is a {type(weight_map).__name__})")
        files = sorted({inside_relative(src.parent, f, f"{src}: the weight_map of {k!r} names the file")
                        for k, f in weight_map.items()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{src}: names shard files that do not exist: {missing}")
        if folder is not None and (folder / SINGLE_FILE).is_file() and folder / SINGLE_FILE not in files:  # (which one is meant?)
            raise ConversionError(f"{folder}: holds {SINGLE_FILE}, which from_pretrained reads before the index "
                                  f"{src.name} (which does not name it): give the file or the index to convert")
        return files, weight_map
    if not src.is_file():
        raise ConversionError(f"{src}: no such file")
    return [src], None


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConversionError(f"{file}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ConversionError(f"{file}: header of {n} bytes in a file of {size}: truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConversionError(f"{file}: malformed safetensors header ({e})") from None
    _check_header(file, header)
    end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConversionError(f"{file}: truncated: its header needs {8 + n + end} bytes, it has {size}")
    return header, 8 + n


def _check_header(file: Path, header: Any) -> None:
    """Refuse a header that is not what the format says: an object whose ``__metadata__`` maps
    strings to strings and whose every other entry has a dtype, a shape of sizes and the
    two data offsets its shape and dtype need."""
    if not isinstance(header, dict):
        raise ConversionError(f"{file}: malformed safetensors header (a JSON {type(header).__name__}, not an object)")
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise ConversionError(f"{file}: malformed safetensors header: __metadata__ is not a map of strings")
            continue
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str)
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not ok or not 0 <= offsets[0] <= offsets[1]:
            raise ConversionError(
                f"{file}: malformed safetensors header: tensor {name!r} needs a dtype, a shape of sizes and two "
                f"ascending data_offsets, not {info!r}"[:500]
            )
        dtype = _DTYPES.get(info["dtype"])
        if dtype is not None and offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ConversionError(
                f"{file}: tensor {name!r} of shape {shape} {info['dtype']} needs {math.prod(shape) * dtype.itemsize} "
                f"bytes, its data_offsets {offsets} hold {offsets[1] - offsets[0]}"
            )


def write(
    ck: CheckpointReader,
    dst: Path,
    *,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
    keys: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Export the tensors and values of ``ck`` (or only ``keys``) under their keys: into the file
    ``dst`` when its name ends in ``.safetensors`` (one file: ``max_shard_bytes`` is refused),
    else into the folder ``dst`` as ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    shards and ``model.safetensors.index.json`` when they exceed ``max_shard_bytes`` (default
    ``DEFAULT_MAX_SHARD_BYTES``). A tie is written
    once (its alias recorded in ``__metadata__["ucp_zarr.ties"]``, which an import reads back).
    Per-rank state (one copy per saving rank) is refused: name the other keys."""
    meta = ck.meta
    keys = export_keys(ck, keys, "safetensors holds")
    values = [k for k in keys if meta.canonical(k) not in meta.tensors]
    asked = [k for k in keys if meta.canonical(k) in meta.tensors]
    tensors = [k for k in asked if meta.ties.get(k) not in asked]  # (a tie once)
    items = [OutTensor(k, tuple(ck[k].shape), ck[k].dtype, lambda k=k: blocks(ck, k)) for k in tensors]
    ties = {a: c for a, c in meta.ties.items() if c in tensors and a in asked and a not in tensors}
    metadata = _metadata(ck, values)
    if ties:
        metadata[TIES_METADATA] = json.dumps(ties, sort_keys=True)
    if Path(dst).name.endswith(".safetensors"):
        if max_shard_bytes is not None:
            raise ConversionError(f"{dst}: a destination named *.safetensors is one file, which max_shard_bytes does not "
                                  "cut: export into a folder for shards, or leave the limit out")
        with atomic_file(Path(dst), overwrite=overwrite) as tmp:
            write_file(tmp, items, metadata, progress, ck.store)
        return Path(dst)
    with atomic_folder(Path(dst), overwrite=overwrite, ours=_EXPORTED.fullmatch, what="an export to safetensors") as tmp:
        write_shards(tmp, items, DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes, metadata,
                     progress, None, ck.store)
    return Path(dst)


def _metadata(ck: CheckpointReader, keys: list[str]) -> dict[str, str]:
    """The ``__metadata__`` of an export of the values ``keys``: a safetensors import's own
    header entries as they were (the value ``__metadata__``), ``format`` (``"pt"`` unless they
    name one) and the other values as JSON (``ucp_zarr.values``, where there are any)."""
    values = {k: from_json(ck.meta.values[k], k) for k in keys}
    header = values.get("__metadata__")
    if isinstance(header, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in header.items()):
        del values["__metadata__"]
        header = {k: v for k, v in header.items() if not k.startswith("ucp_zarr.")}  # (an earlier export's: redone)
    else:
        header = {}
    out = {"format": "pt"} | header
    if values:
        out[VALUES_METADATA] = json.dumps({k: ck.meta.values[k] for k in values}, sort_keys=True)
    return out


@dataclass(frozen=True)
class OutTensor:
    """One tensor of a safetensors file being written: its name, shape, dtype and data, as
    flat blocks in row-major order (``blocks()``, each of ``dtype``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _check_dtypes(items: list[OutTensor]) -> None:
    """Refuse ``items`` of a dtype safetensors has no code for, naming them."""
    bad = sorted({str(t.dtype) for t in items if t.dtype not in _CODES})
    if bad:
        raise ConversionError(f"safetensors cannot hold the dtypes {bad} (of {[t.name for t in items if t.dtype not in _CODES][:5]})")


def write_shards(
    folder: Path, items: list[OutTensor], max_shard_bytes: int, metadata: dict[str, str],
    progress: Callable[[int], None] | None, index_metadata: dict[str, Any] | None = None, source: Store | None = None,
) -> list[str]:
    """``items`` into ``folder`` as Hugging Face names them: ``model.safetensors``, or shards
    ``model-00001-of-0000n.safetensors`` of at most ``max_shard_bytes`` each (split as
    ``huggingface_hub.split_torch_state_dict_into_shards`` splits: in order, a tensor larger
    than the limit alone) and ``model.safetensors.index.json`` (``total_size``, with
    ``index_metadata``, and the weight map). Returns the file names written. ``source``: the
    store the items are read from (see :func:`write_file`)."""
    _check_dtypes(items)  # (before any file is written)
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    size = 0
    for t in items:
        if t.nbytes > max_shard_bytes:
            shards.append([t])
            continue
        if size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        write_file(folder / "model.safetensors", shards[0], metadata, progress, source)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_file(folder / name, shard, metadata, progress, source)
    index = {"metadata": (index_metadata or {}) | {"total_size": sum(t.nbytes for t in items)},
             "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
    (folder / ("model" + INDEX_SUFFIX)).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, "model" + INDEX_SUFFIX]


def write_file(
    file: Path, items: list[OutTensor], metadata: dict[str, str], progress: Callable[[int], None] | None,
    source: Store | None = None,
) -> None:
    """One safetensors file of ``items``, streamed block by block; the small ones read ahead
    from ``source``, the store they come from (:func:`~.base.read_ahead`)."""
    _check_dtypes(items)
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for t in items:
        if t.name in header:
            raise ConversionError(f"{file.name}: two tensors are named {t.name!r}")
        header[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f, closing(read_ahead(source, lambda t: list(t.blocks()), items, lambda t: t.nbytes)) as got:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t, ahead in zip(items, got):
            written = 0
            for block in t.blocks() if ahead is None else ahead:
                if block.dtype != t.dtype:
                    raise ConversionError(f"tensor {t.name!r}: a block of {block.dtype}, announced {t.dtype}")
                f.write(memoryview(block.contiguous().view(torch.uint8).numpy()))
                written += block.numel() * block.element_size()
                if progress is not None:
                    progress(block.numel() * block.element_size())
            if written != t.nbytes:
                raise ConversionError(f"tensor {t.name!r}: wrote {written} bytes, announced {t.nbytes}")


def blocks(ck: CheckpointReader, key: str, rows: tuple[int, int] | None = None) -> Iterator[torch.Tensor]:
    """Tensor ``key`` (rows ``[start, stop)`` of it along dim 0, when given) as flat blocks
    of about :data:`BLOCK_BYTES`, in row-major order."""
    view = ck[key]
    shape = tuple(view.shape)
    if not shape or math.prod(shape) == 0:
        yield ck.read(key).reshape(-1)
        return
    start, stop = rows or (0, shape[0])
    row = math.prod(shape[1:]) * view.dtype.itemsize
    step = max(1, BLOCK_BYTES // max(row, 1))
    for a in range(start, stop, step):
        box = Box((a,) + (0,) * (len(shape) - 1), (min(step, stop - a),) + tuple(shape[1:]))
        yield ck.read(key, box).reshape(-1)
