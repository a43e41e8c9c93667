"""The metadata documents of the format, as small dataclasses with JSON (de)serialisation.

Three kinds of ``zarr.json`` are written (specified in ``schema/``):

* each tensor's **array** document: standard Zarr v3 array metadata plus
  ``attributes.ucp_zarr`` (:class:`ArrayMeta`): key, torch dtype, global shape, and the
  regions the saving layout wrote with their writers and replicas;
* a plain Zarr **group** document per parameter group;
* the **root** group document, written last as the commit record, whose
  ``attributes.ucp_zarr`` (:class:`CheckpointMeta`) indexes the tensors and holds all
  non-tensor state as JSON.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .dtypes import StoredDtype, stored_dtype_by_name
from .errors import FormatError
from .layout import ChunkGrid

FORMAT_VERSION = 2
MAX_CHUNK_BYTES = 1 << 30
"""The largest chunk a reader accepts (a reader allocates one chunk at a time)."""
MAX_CHUNKS_PER_SHARD = 1 << 22
"""The most chunks per shard a reader accepts (it reads one shard index at a time)."""
ATTRIBUTE = "ucp_zarr"
METADATA_FILE = "zarr.json"


@dataclass(frozen=True)
class Region:
    """A part of the global tensor as the saving layout held it: a box (``offset``, ``shape``)
    or a flat range of the row-major flattened tensor (``flat``: start, stop). ``replicas``
    are the ranks that held it; ``writers`` the ranks that wrote its shards."""

    offset: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()
    replicas: tuple[int, ...] = (0,)
    writers: tuple[int, ...] = (0,)
    flat: tuple[int, int] | None = None

    @classmethod
    def flat_range(cls, start: int, stop: int, replicas: tuple[int, ...], writers: tuple[int, ...]) -> "Region":
        return cls(replicas=replicas, writers=writers, flat=(start, stop))

    def to_json(self) -> dict[str, Any]:
        where: dict[str, Any]
        if self.flat is not None:
            where = {"flat_offset": self.flat[0], "numel": self.flat[1] - self.flat[0]}
        else:
            where = {"offset": list(self.offset), "shape": list(self.shape)}
        return where | {"replicas": list(self.replicas), "writers": list(self.writers)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Region":
        replicas, writers = tuple(d["replicas"]), tuple(d.get("writers", ()))
        if "flat_offset" in d:
            return cls.flat_range(d["flat_offset"], d["flat_offset"] + d["numel"], replicas, writers)
        return cls(tuple(d["offset"]), tuple(d["shape"]), replicas, writers)


@dataclass(frozen=True)
class ArrayMeta:
    """One tensor's array: what ``attributes.ucp_zarr`` says plus the grid of its zarr.json."""

    key: str
    dtype: StoredDtype
    grid: ChunkGrid
    regions: tuple[Region, ...]
    rank: int | None = None
    """Set for per-rank state: the rank whose copy this array holds."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.grid.shape

    def to_zarr_json(self) -> dict[str, Any]:
        leaf_codecs: list[dict[str, Any]] = [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "crc32c"},
        ]
        codecs: list[dict[str, Any]] = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(self.grid.chunk_shape),
                    "codecs": leaf_codecs,
                    "index_codecs": leaf_codecs,
                    "index_location": "end",
                },
            }
        ]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.grid.shape),
            "data_type": self.dtype.zarr_dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(self.grid.shard_shape)},
            },
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": self.dtype.fill_value,
            "codecs": codecs,
            "attributes": {
                ATTRIBUTE: {
                    "format_version": FORMAT_VERSION,
                    "key": self.key,
                    "torch_dtype": self.dtype.name,
                    "global_shape": list(self.grid.shape),
                    "regions": [r.to_json() for r in self.regions],
                }
                | ({} if self.rank is None else {"rank": self.rank})
            },
        }

    @classmethod
    def from_zarr_json(cls, doc: Any, where: str) -> "ArrayMeta":
        """Parse and validate an array's zarr.json; :class:`FormatError` unless it is exactly
        what this library writes for the array it describes."""
        model = _zarr_model(doc, where)
        try:
            attrs = doc["attributes"][ATTRIBUTE]
            _check_version(attrs, where)
            dtype = stored_dtype_by_name(attrs["torch_dtype"])
            codec = model.codecs[0] if len(model.codecs) == 1 else None
            chunk_shape = getattr(codec, "chunk_shape", None)
            if chunk_shape is None:
                raise FormatError(f"{where}: arrays of this format use the sharding_indexed codec alone")
            grid = ChunkGrid(tuple(model.shape), tuple(model.chunk_grid.chunk_shape), tuple(chunk_shape))
            regions = tuple(Region.from_json(r) for r in attrs["regions"])
            rank = attrs.get("rank")
            if not isinstance(attrs["key"], str) or (rank is not None and not isinstance(rank, int)):
                raise TypeError("key must be a string and rank an integer")
            if tuple(attrs["global_shape"]) != grid.shape:
                raise ValueError(f"global_shape {attrs['global_shape']} differs from the array shape {list(grid.shape)}")
            meta = cls(attrs["key"], dtype, grid, regions, rank)
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise FormatError(f"malformed array metadata {where}: {e!r}") from e
        expected = _zarr_model(meta.to_zarr_json(), where)
        for name in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs",
                     "storage_transformers", "extra_fields"):
            got, want = getattr(model, name), getattr(expected, name)
            if got != want:
                raise FormatError(
                    f"{where}: {name} is {got!r}, but an array of torch dtype {dtype.name} in this format "
                    f"has {want!r}; refusing to read what this library did not write"
                )
        if math.prod(grid.chunk_shape) * dtype.itemsize > MAX_CHUNK_BYTES:
            raise FormatError(f"{where}: chunks of {list(grid.chunk_shape)} exceed {MAX_CHUNK_BYTES} bytes")
        if math.prod(grid.chunks_per_shard) > MAX_CHUNKS_PER_SHARD:
            raise FormatError(f"{where}: {math.prod(grid.chunks_per_shard)} chunks per shard exceed {MAX_CHUNKS_PER_SHARD}")
        return meta


def _zarr_model(doc: Any, where: str) -> Any:
    """zarr-python's own validation of a Zarr v3 array document."""
    from zarr.core.metadata.v3 import ArrayV3Metadata

    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise FormatError(f"{where} is not a Zarr v3 array document")
    try:
        return ArrayV3Metadata.from_dict(dict(doc))
    except Exception as e:  # zarr raises ValueError, TypeError, KeyError, ... on bad documents
        raise FormatError(f"{where} is not a valid Zarr v3 array document: {e}") from e


_COMPONENT = re.compile(r"[A-Za-z0-9_%~\-][A-Za-z0-9_.%~\-]*")


def check_array_path(path: Any, where: str) -> str:
    """An array path from the root index: ``<group>/<array>`` of escaped names (see
    ``statedict.array_path``), so that it can never point outside the checkpoint."""
    parts = path.split("/") if isinstance(path, str) else []
    if len(parts) != 2 or not all(_COMPONENT.fullmatch(p) for p in parts):
        raise FormatError(f"{where}: {path!r} is not an array path of this format (<group>/<array>)")
    return path


@dataclass(frozen=True)
class ArrayRef:
    """Where one stored array lives and the digest of its data."""

    path: str
    digest: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "digest": self.digest}


@dataclass(frozen=True)
class TensorEntry:
    """The root document's index entry of one tensor.

    Per-rank state (:class:`~ucp_zarr.PerRank`) has one array per saving rank: ``ranks``
    maps each saving rank to its array, and ``path``/``digest`` are the lowest rank's."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    digest: str = ""
    ranks: dict[int, ArrayRef] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "digest": self.digest}
        if self.ranks is not None:
            d["ranks"] = {str(r): a.to_json() for r, a in sorted(self.ranks.items())}
        return d

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * stored_dtype_by_name(self.dtype).itemsize

    def array(self, rank: int | None) -> ArrayRef:
        """The array of rank ``rank``'s copy (per-rank state), else the tensor's array."""
        if rank is None or self.ranks is None:
            return ArrayRef(self.path, self.digest)
        return self.ranks[rank]

    @classmethod
    def from_json(cls, d: Any, where: str) -> "TensorEntry":
        ranks = None
        if "ranks" in d:
            ranks = {int(r): ArrayRef(check_array_path(a["path"], where), str(a["digest"])) for r, a in d["ranks"].items()}
        shape = tuple(d["shape"])
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"shape {list(shape)} is not a list of non-negative integers")
        stored_dtype_by_name(d["dtype"])
        return cls(check_array_path(d["path"], where), shape, d["dtype"], str(d["digest"]), ranks)


@dataclass(frozen=True)
class CheckpointMeta:
    """The root document: the commit record of a checkpoint."""

    tensors: dict[str, TensorEntry]
    values: dict[str, Any]
    """Non-tensor leaves by flattened key, JSON-encoded (see ``statedict.to_json``)."""
    created: str
    library: str
    save_id: str
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, dict[int, Any]] = field(default_factory=dict)
    """Per-rank non-tensor leaves: key -> saving rank -> value."""
    documents: dict[str, str] = field(default_factory=dict)
    """The SHA-256 of every group and array ``zarr.json`` (path -> ``sha256:<hex>``)."""
    signature: dict[str, str] | None = None
    """``{"alg": "HMAC-SHA256", "value": <hex>}`` for an authenticated checkpoint."""

    @property
    def authenticated(self) -> bool:
        return self.signature is not None

    def attributes(self) -> dict[str, Any]:
        """``attributes.ucp_zarr`` of the root document."""
        attrs: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "created": self.created,
            "library": self.library,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "layout": self.layout,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "values": self.values,
            "rank_values": {k: {str(r): v for r, v in sorted(per.items())} for k, per in self.rank_values.items()},
            "documents": dict(sorted(self.documents.items())),
        }
        if self.signature is not None:
            attrs["signature"] = self.signature
        return attrs

    def to_zarr_json(self) -> dict[str, Any]:
        return {"zarr_format": 3, "node_type": "group", "attributes": {ATTRIBUTE: self.attributes()}}

    @classmethod
    def from_zarr_json(cls, doc: Any, where: str) -> "CheckpointMeta":
        try:
            attrs = doc["attributes"][ATTRIBUTE]
            if not isinstance(attrs, dict):
                raise TypeError
        except (KeyError, TypeError):
            raise FormatError(f"{where} is a Zarr group but not a ucp_zarr checkpoint") from None
        _check_version(attrs, where)
        try:
            save_id = attrs["save_id"]
            if not (isinstance(save_id, str) and re.fullmatch(r"[0-9a-f]{32}", save_id)):
                raise ValueError(f"save_id {save_id!r} is not 32 hex digits")
            signature = attrs.get("signature")
            if signature is not None and not isinstance(signature, dict):
                raise TypeError("signature must be an object")
            return cls(
                tensors={str(k): TensorEntry.from_json(t, where) for k, t in attrs["tensors"].items()},
                values=dict(attrs["values"]),
                created=str(attrs["created"]),
                library=str(attrs["library"]),
                save_id=save_id,
                world_size=int(attrs["world_size"]),
                layout=dict(attrs["layout"]),
                rank_values={str(k): {int(r): v for r, v in per.items()} for k, per in attrs["rank_values"].items()},
                documents={str(k): str(v) for k, v in attrs["documents"].items()},
                signature=signature,
            )
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"malformed checkpoint metadata {where}: {e!r}") from e


def group_zarr_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def _check_version(attrs: Any, where: str) -> None:
    v = attrs.get("format_version") if isinstance(attrs, dict) else None
    if v != FORMAT_VERSION:
        raise FormatError(f"{where} has ucp_zarr format_version {v!r}; this library reads {FORMAT_VERSION}")
