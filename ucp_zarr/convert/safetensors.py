"""safetensors in and out: one file, or shards with a ``*.safetensors.index.json``.

In: every tensor under its own name (with ``prefix`` prepended), read lazily box by box
through ``safe_open`` (memory-mapped); the header's ``__metadata__`` (str -> str) becomes
the value ``__metadata__``. Out: a streaming writer of the format (an 8-byte header length,
the JSON header, the raw little-endian bytes), one tensor block at a time, shards of at
most ``max_shard_bytes`` with a Hugging Face style index; the checkpoint's values travel as
JSON in ``__metadata__["ucp_zarr.values"]``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint import Checkpoint
from ..errors import ConversionError
from ..layout import Box
from ..safe_paths import inside_relative
from .base import Imported, atomic_folder

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
BLOCK_BYTES = 64 << 20
"""Tensors are copied out in row blocks of about this size."""

_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file, read lazily."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            if not self.shape:
                return f.get_tensor(self.name), box
            return f.get_slice(self.name)[box.slices()], box


def read(src: Path, *, prefix: str = "", **_: Any) -> Imported:
    """The tensors of a safetensors file, or of every shard an index names (``src`` is the
    file, the index, or a folder holding exactly one of either)."""
    files = _files(Path(src))
    out = Imported(layout={"source": {"format": "safetensors", "files": [f.name for f in files]}})
    for file in files:
        header, _ = _header(file)
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
            out.tensors[key] = _Entry(file, name, tuple(info["shape"]), dtype)
    return out


def _files(src: Path) -> list[Path]:
    if src.is_dir():
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
        return files
    if not src.is_file():
        raise ConversionError(f"{src}: no such file")
    return [src]


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
    end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConversionError(f"{file}: truncated: its header needs {8 + n + end} bytes, it has {size}")
    return header, 8 + n


def write(
    ck: Checkpoint,
    dst: Path,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    keys: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
    **_: Any,
) -> Path:
    """Export the tensors of ``ck`` (or only ``keys``) into the folder ``dst``:
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards and
    ``model.safetensors.index.json`` when they exceed ``max_shard_bytes``."""
    keys = list(ck) if keys is None else keys
    for k in keys:
        if ck.meta.tensors[k].ranks is not None:
            raise ConversionError(f"tensor {k!r} is per-rank state (one copy per rank); safetensors holds one tensor per name")
    dtypes = {k: getattr(torch, ck.meta.tensors[k].dtype) for k in keys}
    bad = [k for k, d in dtypes.items() if d not in _CODES]
    if bad:
        raise ConversionError(f"safetensors cannot hold the dtypes of {bad} ({sorted({str(dtypes[k]) for k in bad})})")
    shards: list[list[str]] = [[]]
    size = 0
    for k in keys:
        n = math.prod(ck.meta.tensors[k].shape) * dtypes[k].itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    metadata = {"format": "pt", "ucp_zarr.values": json.dumps(ck.meta.values, sort_keys=True)}
    with atomic_folder(Path(dst), overwrite=overwrite) as tmp:
        if len(shards) == 1:
            _write_file(ck, tmp / "model.safetensors", shards[0], dtypes, metadata, progress)
        else:
            weight_map = {}
            for i, names in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_file(ck, tmp / fname, names, dtypes, metadata, progress)
                weight_map |= {k: fname for k in names}
            total = sum(math.prod(ck.meta.tensors[k].shape) * dtypes[k].itemsize for k in keys)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / ("model" + INDEX_SUFFIX)).write_text(json.dumps(index, indent=1))
    return Path(dst)


def _write_file(
    ck: Checkpoint, file: Path, keys: list[str], dtypes: dict[str, torch.dtype], metadata: dict[str, str],
    progress: Callable[[int], None] | None,
) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for k in keys:
        shape = ck.meta.tensors[k].shape
        n = math.prod(shape) * dtypes[k].itemsize
        header[k] = {"dtype": _CODES[dtypes[k]], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in keys:
            for block in _blocks(ck, k):
                f.write(memoryview(block.contiguous().view(torch.uint8).numpy()))
                if progress is not None:
                    progress(block.numel() * block.element_size())


def _blocks(ck: Checkpoint, key: str) -> Any:
    """The tensor ``key`` in row blocks of about :data:`BLOCK_BYTES` (row-major order)."""
    shape = ck.meta.tensors[key].shape
    if not shape or math.prod(shape) == 0:
        yield ck.read(key).reshape(-1)
        return
    row = math.prod(shape[1:]) * getattr(torch, ck.meta.tensors[key].dtype).itemsize
    step = max(1, BLOCK_BYTES // max(row, 1))
    for a in range(0, shape[0], step):
        box = Box((a,) + (0,) * (len(shape) - 1), (min(step, shape[0] - a),) + tuple(shape[1:]))
        yield ck.read(key, box).reshape(-1)
