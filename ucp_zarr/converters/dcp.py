"""torch.distributed.checkpoint (DCP) folders in and out.

A DCP folder (``FileSystemWriter``) is a pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`
in ``.metadata`` and data files ``__<rank>_<n>.distcp``. The metadata lists, per
fully-qualified key, either a tensor (global size, dtype, and the chunks the saving ranks
held: offsets and sizes, whatever the parallelism: FSDP2, TP, FSDP2+TP, DDP) or a byte
entry (any other leaf, ``torch.save``-d); ``storage_data`` maps each chunk or byte entry to
``(file, offset, length)``. Each tensor chunk is stored as its own ``torch.save`` archive (a
zip of ``data.pkl`` and one raw, uncompressed storage record), each byte entry as the
``torch.save`` of the object.

In: every tensor becomes one consolidated tensor under its DCP key (``prefix`` prepended).
Nothing is read but the small headers of the chunk archives until a box is asked for; a box
then reads, from each chunk overlapping it, only the byte range of the storage record that
covers the box. Byte entries become JSON values (``io.BytesIO`` ones as ``bytes``, noted in
``layout.dcp``) when they load weights-only; the nesting DCP's planner recorded
(``planner_data``) is kept there too, so that ``read_state_dict`` nests as ``dcp_to_torch_save``
does and gives ``BytesIO`` back. ``.metadata`` is unpickled by an allow-list of the classes DCP's metadata
is made of (:class:`_MetadataUnpickler`); anything else is refused (:class:`UntrustedInputError`)
unless ``trust``.

Out: a folder ``dcp.load`` reads with its default reader and planner: ``.metadata`` (DCP's
own classes, pickled as ``FileSystemWriter.finish`` pickles them) and one ``__0_0.distcp``
holding each value as a ``torch.save``-d byte entry and each tensor as chunks of at most
``block_bytes`` (row blocks), each chunk ``torch.save``-d the way ``FileSystemWriter`` writes
one; a tensor is streamed block by block from the checkpoint, never whole. ``planner_data``
records the nesting of the state dict the checkpoint was saved from (where it records one), so
that ``dcp_to_torch_save`` and DCP's loaders nest it as ``dcp.save`` of it would; ``BytesIO``
values are written as ``BytesIO`` again.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import re
import uuid
import zipfile
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, Callable, Iterator

import torch

from ..protocol.reader import CheckpointReader
from ..errors import ConversionError, Keyword, NotJSONableError, UntrustedInputError
from ..layout import Box
from ..format.safe_paths import inside_relative
from ..format.statedict import from_json, to_json
from ..protocol.read_state import dcp_blobs
from ..adapters.dcp_plans import dcp_layout, merged_planner_data, planner_data_of
from ..protocol.writer import InMemory
from . import megatron_dist
from .base import Imported, atomic_folder, export_keys, prefix_key, read_ahead

METADATA_FILE = ".metadata"
DATA_FILE = "__0_0.distcp"
_EXPORTED = re.compile(r"\.metadata|.*\.distcp")
"""The files of a DCP folder (an earlier export is replaced with ``overwrite``)."""
BLOCK_BYTES = 64 << 20
"""Tensors are exported in chunks (row blocks) of about this size."""
DCP_VERSION = "1.0.0"
"""``Metadata.version`` as ``FileSystemWriter`` of torch 2.6+ writes it."""


# --- .metadata: an allow-listed unpickler -----------------------------------------------------


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout`` (how a ``torch.layout`` pickles), for strings only."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return layouts[name]


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> what ``find_class`` returns: the classes a DCP ``Metadata`` is made
    of (this torch's, and the names older ones pickled), DCP's own plan records, and nothing
    that runs code."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    md = "torch.distributed.checkpoint.metadata"
    allowed: dict[tuple[str, str], Any] = {
        (md, name): getattr(metadata, name)
        for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
        if hasattr(metadata, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    # the plans a planner may keep in Metadata (Megatron's keeps every rank's: all_local_plans)
    allowed |= {("torch.distributed.checkpoint.planner", name): getattr(planner, name)
                for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
                             "LoadItemType") if hasattr(planner, name)}
    try:  # torch <= 2.1 pickled TensorProperties from its sharded-tensor home
        from torch.distributed._shard.sharded_tensor import metadata as st

        for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):
            if hasattr(st, name):
                allowed[("torch.distributed._shard.sharded_tensor.metadata", name)] = getattr(st, name)
    except ImportError:  # pragma: no cover - a torch without it
        pass
    allowed[("torch", "Size")] = torch.Size
    for name, v in vars(torch).items():
        if isinstance(v, torch.dtype):
            allowed[("torch", name)] = v
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    # StorageMeta.checkpoint_id: the Path the writer was given (a Windows one stays pure)
    allowed[("pathlib", "PosixPath")] = PurePosixPath
    allowed[("pathlib", "PurePosixPath")] = PurePosixPath
    allowed[("pathlib", "WindowsPath")] = PureWindowsPath
    allowed[("pathlib", "PureWindowsPath")] = PureWindowsPath
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: only the globals of :func:`_allowed`; no persistent ids."""

    def __init__(self, file: IO[bytes], where: Path) -> None:
        super().__init__(file)
        self.where = where
        self.allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise UntrustedInputError(
                f"{self.where}: holds a pickled {module}.{name}, which DCP metadata is not made of; "
                "unpickling it could run code from the file: pass ", Keyword("trust", True),
                " only if you trust where it came from",
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {str(pid)[:100]!r}")


def read_metadata(path: Path, *, trust: bool = False) -> Any:
    """The DCP ``Metadata`` pickled in the file ``path``: unpickled through the allow-list
    (:class:`_MetadataUnpickler`) unless ``trust``."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not path.is_file():
        raise ConversionError(f"{path}: no such file (not a DCP checkpoint folder)")
    try:
        with open(path, "rb") as f:
            md = pickle.Unpickler(f).load() if trust else _MetadataUnpickler(f, path).load()
    except UntrustedInputError:
        raise
    except Exception as e:  # a malformed pickle raises anything from its allowed constructors
        raise ConversionError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ConversionError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.storage_data, dict):
        raise ConversionError(f"{path}: its Metadata has no storage_data (not written by a FileSystemWriter)")
    return md


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- the data files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    """Where ``storage_data`` puts one chunk or byte entry."""

    file: Path
    offset: int
    length: int
    transforms: tuple[str, ...] = ()

    def read_all(self) -> bytes:
        """The entry's bytes, with DCP's stream transforms (compression) undone."""
        try:
            with open(self.file, "rb") as f:
                f.seek(self.offset)
                raw = f.read(self.length)
        except OSError as e:
            raise ConversionError(f"{self.file}: unreadable ({e.strerror or e})") from None
        if len(raw) != self.length:
            raise ConversionError(f"{self.file}: truncated: {self.length} bytes at {self.offset} are not all there")
        if not self.transforms:
            return raw
        try:
            stream: IO[bytes] = io.BytesIO(raw)
            for ex in _registry().from_descriptor_list(list(self.transforms)):
                stream = ex.transform_from(stream)
            return stream.read()
        except Exception as e:
            raise ConversionError(
                f"{self.file}: the entry at {self.offset} is stored with transforms {list(self.transforms)} "
                f"this torch cannot undo ({type(e).__name__}: {_first_line(e)})"
            ) from None


def _registry() -> Any:
    """DCP's registry of stream transforms (its ZStandard compression, if installed)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    return ExtensionRegistry()


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file: one
    ``torch.save`` archive inside a ``.distcp`` file, as ``torch.load`` and ``zipfile`` see it."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


@dataclass(frozen=True)
class _Chunk:
    """One saved chunk of a tensor: its box, and where its storage's raw bytes are."""

    box: Box
    stored: _Stored
    data: int = 0
    """Absolute offset in the file of the storage record's first byte."""
    nbytes: int = 0
    stride: tuple[int, ...] = ()
    storage_offset: int = 0
    conj: bool = False
    """Saved as a conjugate view: the storage holds the values before conjugation."""
    neg: bool = False
    """Saved as a negative view (``.conj().imag``): the storage holds the values negated."""

    def part(self, local: Box, dtype: torch.dtype, f: IO[bytes] | None) -> torch.Tensor:
        """``local`` (in the chunk's coordinates) of the chunk, read from the file."""
        if self.stored.transforms:  # compressed: the whole archive must be decoded
            t = _load_chunk(self.stored.read_all(), self.stored, self.box, dtype)
            return t[local.slices()]
        size = dtype.itemsize
        lo = self.storage_offset + sum(o * s for o, s in zip(local.offset, self.stride))
        hi = lo + sum((n - 1) * s for n, s in zip(local.shape, self.stride)) + 1
        buf = torch.empty((hi - lo) * size, dtype=torch.uint8)
        assert f is not None
        f.seek(self.data + lo * size)
        if f.readinto(memoryview(buf.numpy())) != buf.numel():
            raise ConversionError(f"{self.stored.file}: truncated: the chunk at {self.stored.offset} ends early")
        t = buf.view(dtype).as_strided(local.shape, self.stride)
        t = torch.conj_physical(t) if self.conj else t
        return -t if self.neg else t  # (a view may be both: -conj(storage))


def _load_chunk(raw: bytes, stored: _Stored, box: Box, dtype: torch.dtype) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConversionError(f"{stored.file}: the chunk at {stored.offset} is not a tensor archive: {_first_line(e)}") from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != box.shape or t.dtype != dtype:
        raise ConversionError(f"{stored.file}: the chunk at {stored.offset} does not hold {list(box.shape)} {dtype}")
    return t


_DATA_RECORD = re.compile(r"[^/]+/data/\d+")


def _chunk(stored: _Stored, box: Box, dtype: torch.dtype, f: IO[bytes]) -> _Chunk:
    """The chunk stored at ``stored`` (a ``torch.save`` archive of one tensor), located
    without reading its data: the tensor's geometry from ``data.pkl`` (a weights-only load
    onto the meta device), its storage record's offset from the zip's local header."""
    if stored.transforms:
        return _Chunk(box, stored)
    where = f"{stored.file}: the chunk at offset {stored.offset} ({stored.length} bytes)"
    win = _Window(f, stored.offset, stored.length)
    if win.read(4) != b"PK\x03\x04":
        raise ConversionError(
            f"{where} is not a torch.save archive (saved with another serialization_format, e.g. "
            "SAFETENSORS, which this converter does not read)"
        )
    try:
        win.seek(0)
        meta = torch.load(win, map_location="meta", weights_only=True)
        win.seek(0)
        with zipfile.ZipFile(win) as zf:
            records = [i for i in zf.infolist() if _DATA_RECORD.fullmatch(i.filename)]
            order = [i for i in zf.namelist() if i.endswith("/byteorder")]
            byteorder = zf.read(order[0]).decode() if order else "little"
    except ConversionError:
        raise
    except Exception as e:
        raise ConversionError(f"{where} is unreadable or truncated: {_first_line(e)}") from None
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != box.shape or meta.dtype != dtype:
        got = f"{list(meta.shape)} {meta.dtype}" if isinstance(meta, torch.Tensor) else type(meta).__name__
        raise ConversionError(f"{where} holds {got}, the metadata says {list(box.shape)} {dtype}")
    if byteorder != "little":
        raise ConversionError(f"{where} was saved on a {byteorder}-endian machine, which this converter does not read")
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].flag_bits & 1:
        raise ConversionError(f"{where}: expected one uncompressed storage record, found {[r.filename for r in records]}")
    info = records[0]
    win.seek(info.header_offset)
    head = win.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ConversionError(f"{where}: its storage record's header is damaged or truncated")
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    stride, offset = tuple(meta.stride()), meta.storage_offset()
    need = offset + sum((n - 1) * s for n, s in zip(box.shape, stride)) + 1 if box.numel else 0
    if info.file_size < need * dtype.itemsize or start + info.file_size > stored.length:
        raise ConversionError(f"{where}: its storage record is shorter than the tensor it holds, or truncated")
    return _Chunk(box, stored, stored.offset + start, info.file_size, stride, offset, meta.is_conj(), meta.is_neg())


@dataclass(frozen=True)
class _Tensor:
    """One DCP tensor, consolidated: a box reads the overlapping chunks' bytes only."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        out = torch.empty(box.shape, dtype=self.dtype)
        covered = 0
        with ExitStack() as files:
            handles: dict[Path, IO[bytes]] = {}
            for c in self.chunks:
                part = c.box.intersect(box)
                if part is None or part.is_empty():
                    continue
                f = handles.get(c.stored.file)
                if f is None and not c.stored.transforms:
                    try:
                        f = handles[c.stored.file] = files.enter_context(open(c.stored.file, "rb"))
                    except OSError as e:
                        raise ConversionError(f"{c.stored.file}: unreadable ({e.strerror or e})") from None
                out[part.relative_to(box).slices()].copy_(c.part(part.relative_to(c.box), self.dtype, f))
                covered += part.numel
        if covered != box.numel:
            raise ConversionError(f"tensor {self.key!r}: its DCP chunks do not cover {box}")
        return out, box


# --- in ------------------------------------------------------------------------------------------


def read(src: Path, *, trust: bool = False, prefix: str = "") -> Imported:
    """The tensors and values of the DCP checkpoint folder ``src`` (or its ``.metadata``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    src = Path(src)
    if src.is_file() and src.name == METADATA_FILE:
        src = src.parent
    mfile = src / METADATA_FILE
    md = read_metadata(mfile, trust=trust)
    stored = _storage(md, src, mfile)
    megatron = megatron_dist.is_torch_dist(src)
    out = Imported(layout={"source": {"format": "dcp"} | ({"megatron": "torch_dist"} if megatron else {})})
    blobs: list[str] = []
    left_out: list[str] = []
    with ExitStack() as files:
        handles: dict[Path, IO[bytes]] = {}

        def handle(p: Path) -> IO[bytes]:
            if p not in handles:
                try:
                    handles[p] = files.enter_context(open(p, "rb"))
                except OSError as e:
                    raise ConversionError(f"{p}: unreadable ({e.strerror or e})") from None
            return handles[p]

        for fqn, entry in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise ConversionError(f"{mfile}: a key is a {type(fqn).__name__}, not a string")
            key = prefix + fqn
            if isinstance(entry, BytesStorageMetadata):
                s = stored.get((fqn, None))
                if s is None:
                    raise ConversionError(f"{mfile}: names no storage for the value {fqn!r}")
                if megatron and megatron_dist.left_out(fqn):
                    left_out.append(fqn)
                    continue
                value, blob = _value(s, fqn, key, trust, megatron_dist.refusal(fqn) if megatron else None)
                if megatron and megatron_dist.empty(fqn, value):
                    continue
                out.values[key] = value
                if blob:
                    blobs.append(key)
            elif isinstance(entry, TensorStorageMetadata):
                shape, dtype, boxes = _tensor_entry(entry, fqn, mfile)
                chunks = []
                for b in boxes:
                    s = stored.get((fqn, b.offset))
                    if s is None:
                        raise ConversionError(f"{mfile}: names no storage for the chunk of {fqn!r} at {list(b.offset)}")
                    chunks.append(_chunk(s, b, dtype, handle(s.file)) if not b.is_empty() else _Chunk(b, s))
                out.tensors[key] = _Tensor(key, shape, dtype, tuple(chunks))
            else:
                raise ConversionError(f"{mfile}: the entry {fqn!r} is a {type(entry).__name__}, which DCP does not write")
    if megatron:
        megatron_dist.warn_left_out(src, left_out)
        tensors, values = megatron_dist.common_state(src, trust)
        for k in [*tensors, *values]:
            if prefix + k in out.tensors or prefix + k in out.values:
                raise ConversionError(f"{src / megatron_dist.COMMON_FILE}: its {k!r} is also a key of the DCP folder")
        out.tensors |= {prefix + k: InMemory(t) for k, t in tensors.items()}
        out.values |= {prefix + k: v for k, v in values.items()}
    # the nesting DCP's planner recorded, and which values were BytesIO, kept as the DCP adapter keeps
    # them (layout.dcp), so that read_state_dict and the DCP reader give them back as dcp.load does;
    # under the prefix's key (see prefix_key)
    above = prefix_key(prefix)
    planner = None if above is None else merged_planner_data([md.planner_data])
    if planner is not None and above:
        planner = {prefix + k: (above, *p) for k, p in planner.items()}
    layout = dcp_layout(planner, blobs)
    if layout:
        out.layout["dcp"] = layout
    return out


def _storage(md: Any, src: Path, mfile: Path) -> dict[tuple[str, tuple[int, ...] | None], _Stored]:
    """``storage_data`` checked: (key, chunk offsets or None) -> where it is; every file
    exists inside ``src`` and holds every entry's bytes."""
    sizes: dict[str, int] = {}
    out: dict[tuple[str, tuple[int, ...] | None], _Stored] = {}
    for index, info in md.storage_data.items():
        try:
            fqn, offset = index.fqn, index.offset
            where = (fqn, None if offset is None else tuple(int(o) for o in offset))
            rel, start, length = info.relative_path, info.offset, info.length
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            ok = isinstance(fqn, str) and isinstance(rel, str) and all(isinstance(t, str) for t in transforms)
            ok = ok and type(start) is int and type(length) is int and start >= 0 and length >= 0
        except Exception:
            ok = False
        if not ok:
            raise ConversionError(f"{mfile}: a malformed storage entry {str(index)[:200]}: {str(info)[:200]}") from None
        file = inside_relative(src, rel, f"{mfile}: the entry of {fqn!r} names the file")
        if rel not in sizes:
            if not file.is_file():
                raise ConversionError(f"{file}: missing (the checkpoint's .metadata names it)")
            sizes[rel] = file.stat().st_size
        if start + length > sizes[rel]:
            raise ConversionError(
                f"{file}: truncated: it has {sizes[rel]} bytes, the entry of {fqn!r} needs {start + length}"
            )
        out[where] = _Stored(file, start, length, transforms)
    return out


def _tensor_entry(entry: Any, fqn: str, mfile: Path) -> tuple[tuple[int, ...], torch.dtype, list[Box]]:
    """A tensor entry's shape, dtype and chunk boxes, checked: in bounds, disjoint, covering."""
    try:
        shape = tuple(int(n) for n in entry.size)
        dtype = entry.properties.dtype
        boxes = [Box(tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes)) for c in entry.chunks]
        ok = isinstance(dtype, torch.dtype) and all(n >= 0 for n in shape)
    except Exception:
        ok = False
    if not ok:
        raise ConversionError(f"{mfile}: the tensor entry of {fqn!r} is malformed: {str(entry)[:300]}") from None
    whole = Box.whole(shape)
    for b in boxes:
        if b.ndim != len(shape) or not whole.contains(b):
            raise ConversionError(f"{mfile}: a chunk of {fqn!r} ({b}) lies outside its shape {list(shape)}")
    filled = [b for b in boxes if not b.is_empty()]
    if sum(b.numel for b in filled) != whole.numel or _overlap(filled):
        raise ConversionError(f"{mfile}: the chunks of {fqn!r} do not tile its shape {list(shape)} (gaps or overlaps)")
    return shape, dtype, boxes


def _overlap(boxes: list[Box]) -> bool:
    """Whether two of ``boxes`` share an element (sorted sweep on dim 0, then pairwise)."""
    if not boxes or boxes[0].ndim == 0:
        return len(boxes) > 1
    boxes = sorted(boxes, key=lambda b: b.offset[0])
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if b.offset[0] >= a.stop[0]:
                break
            if a.intersect(b) is not None:
                return True
    return False


def _value(s: _Stored, fqn: str, key: str, trust: bool, refusal: str | None = None) -> tuple[Any, bool]:
    """A byte entry (``torch.save`` of a non-tensor leaf) as a JSON-able value, and whether
    it was an ``io.BytesIO`` (stored as its bytes); ``refusal``: what the value is, said
    when it cannot be stored."""
    raw = s.read_all()
    where = f"{s.file}: the value {fqn!r} (at offset {s.offset})"
    try:
        try:
            with torch.serialization.safe_globals([io.BytesIO]):
                v = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if not trust:
                raise UntrustedInputError(
                    f"{where} holds Python objects that a weights-only load refuses ({_first_line(e)}); reading "
                    "it runs code from the file: pass ", Keyword("trust", True), " only if you trust where it came from",
                ) from None
            v = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    except UntrustedInputError:
        raise
    except Exception as e:
        raise ConversionError(f"{where} is unreadable or truncated: {_first_line(e)}") from None
    blob = isinstance(v, io.BytesIO)
    if blob:
        v = v.getvalue()
    try:
        to_json(v, key)
    except NotJSONableError as e:
        raise ConversionError(f"{where}: {refusal or e}") from None
    return v, blob


# --- out -----------------------------------------------------------------------------------------


def write(
    ck: CheckpointReader,
    dst: Path,
    *,
    overwrite: bool = False,
    keys: list[str] | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Export the tensors and values of ``ck`` (or only ``keys``) into the folder ``dst``,
    which ``torch.distributed.checkpoint.load`` reads (one process or many, any layout).

    Per-rank state (a tensor or value with one copy per saving rank) has no DCP form: it
    raises :class:`ConversionError` naming the keys (leave them out with ``keys``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    meta = ck.meta
    keys = export_keys(ck, keys, "a DCP checkpoint holds")
    if block_bytes < 1:
        raise ConversionError(f"block_bytes must be positive, not {block_bytes}")
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    tensor_keys = [k for k in keys if meta.canonical(k) in meta.tensors]
    firsts: dict[str, str] = {}  # stored key -> the key its data is written under (tied tensors: once)
    for k in tensor_keys:
        firsts.setdefault(meta.canonical(k), k)
    reads = [(k, box) for k in firsts.values() for box in _blocks(_shape(ck, k), _dtype(ck, k).itemsize, block_bytes)]
    ahead_of = read_ahead(ck.store, lambda r: ck.read(*r), reads, lambda r: r[1].numel * _dtype(ck, r[0]).itemsize)
    with atomic_folder(Path(dst), overwrite=overwrite, ours=_EXPORTED.fullmatch, what="an export to DCP") as tmp, \
            open(tmp / DATA_FILE, "wb") as f, closing(ahead_of) as read:
        blobs = dcp_blobs(meta)
        for k in (k for k in keys if k in meta.values):  # byte entries first, as FileSystemWriter writes them
            start = f.tell()
            value = from_json(meta.values[k], k)
            torch.save(io.BytesIO(value) if k in blobs and isinstance(value, bytes) else value, f)
            sdm[k] = BytesStorageMetadata()
            storage[MetadataIndex(k)] = _StorageInfo(DATA_FILE, start, f.tell() - start)
        written: dict[str, str] = {}
        for k in tensor_keys:
            if meta.canonical(k) in written:
                first = written[meta.canonical(k)]
                sdm[k] = sdm[first]
                storage |= {MetadataIndex(k, i.offset, i.index): info for i, info in list(storage.items()) if i.fqn == first}
                continue
            written[meta.canonical(k)] = k
            dtype, shape = _dtype(ck, k), _shape(ck, k)
            chunks = []
            for i, box in enumerate(_blocks(shape, dtype.itemsize, block_bytes)):
                ahead = next(read)  # (this block, when small: read ahead, see read_ahead)
                t = ck.read(k, box) if ahead is None else ahead
                start = f.tell()
                torch.save(t, f)
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape)))
                storage[MetadataIndex(k, box.offset, i)] = _StorageInfo(DATA_FILE, start, f.tell() - start)
                if progress is not None:
                    progress(t.numel() * t.element_size())
                del t
            sdm[k] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        f.flush()
        os.fsync(f.fileno())
        planner_data = planner_data_of(ck.meta, list(sdm), f"{ck.store.url}/zarr.json")
        md = Metadata(
            state_dict_metadata={k: sdm[k] for k in planner_data},
            planner_data=planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(dst), save_id=str(uuid.uuid4())),
            version=DCP_VERSION,
        )
        with open(tmp / METADATA_FILE, "wb") as mf:
            pickle.dump(md, mf)
    return Path(dst)


def _shape(ck: CheckpointReader, key: str) -> tuple[int, ...]:
    return tuple(ck.meta.tensors[ck.meta.canonical(key)].shape)


def _dtype(ck: CheckpointReader, key: str) -> torch.dtype:
    return getattr(torch, ck.meta.tensors[ck.meta.canonical(key)].dtype)


def _blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> Iterator[Box]:
    """Boxes tiling ``shape`` in row-major order, each of about ``block_bytes`` (at least
    one element): ranges of the first dim whose trailing block fits, single indices before it."""
    if not shape or math.prod(shape) == 0:
        yield Box.whole(shape)
        return
    d = 0
    while d < len(shape) - 1 and math.prod(shape[d + 1 :]) * itemsize > block_bytes:
        d += 1
    step = max(1, block_bytes // (math.prod(shape[d + 1 :]) * itemsize))
    for outer in itertools.product(*(range(n) for n in shape[:d])):
        for a in range(0, shape[d], step):
            n = min(step, shape[d] - a)
            yield Box(outer + (a,) + (0,) * (len(shape) - d - 1), (1,) * d + (n,) + tuple(shape[d + 1 :]))
