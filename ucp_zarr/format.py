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
from dataclasses import dataclass, field
from typing import Any

from .dtypes import StoredDtype, stored_dtype_by_name
from .errors import FormatError
from .layout import ChunkGrid

FORMAT_VERSION = 1
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
        if self.grid.sharded:
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
        else:
            codecs = leaf_codecs
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
    def from_zarr_json(cls, doc: dict[str, Any], where: str) -> "ArrayMeta":
        try:
            attrs = doc["attributes"][ATTRIBUTE]
            _check_version(attrs, where)
            dtype = stored_dtype_by_name(attrs["torch_dtype"])
            shard_shape = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
            codecs = doc["codecs"]
            if codecs[0]["name"] == "sharding_indexed":
                chunk_shape = tuple(codecs[0]["configuration"]["chunk_shape"])
            else:
                chunk_shape = shard_shape
            grid = ChunkGrid(tuple(doc["shape"]), shard_shape, chunk_shape)
            regions = tuple(Region.from_json(r) for r in attrs["regions"])
            return cls(attrs["key"], dtype, grid, regions, attrs.get("rank"))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise FormatError(f"malformed array metadata {where}: {e!r}") from e


@dataclass(frozen=True)
class TensorEntry:
    """The root document's index entry of one tensor.

    Per-rank state (a plain tensor that differed between the saving ranks) has one array
    per rank: ``ranks`` maps each saving rank to its array path, and ``path`` is the lowest
    rank's."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    ranks: dict[int, str] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype}
        if self.ranks is not None:
            d["ranks"] = {str(r): p for r, p in sorted(self.ranks.items())}
        return d

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * stored_dtype_by_name(self.dtype).itemsize

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorEntry":
        ranks = {int(r): p for r, p in d["ranks"].items()} if "ranks" in d else None
        return cls(d["path"], tuple(d["shape"]), d["dtype"], ranks)


@dataclass(frozen=True)
class CheckpointMeta:
    """The root document: the commit record of a checkpoint."""

    tensors: dict[str, TensorEntry]
    values: dict[str, Any]
    """Non-tensor leaves by flattened key, JSON-encoded (see ``statedict.to_json``)."""
    created: str
    library: str
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, dict[int, Any]] = field(default_factory=dict)
    """Per-rank non-tensor leaves (they differed between the saving ranks): key -> rank -> value."""

    def to_zarr_json(self) -> dict[str, Any]:
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {
                ATTRIBUTE: {
                    "format_version": FORMAT_VERSION,
                    "created": self.created,
                    "library": self.library,
                    "world_size": self.world_size,
                    "layout": self.layout,
                    "tensors": {k: t.to_json() for k, t in self.tensors.items()},
                    "values": self.values,
                    "rank_values": {
                        k: {str(r): v for r, v in sorted(per.items())} for k, per in self.rank_values.items()
                    },
                }
            },
        }

    @classmethod
    def from_zarr_json(cls, doc: dict[str, Any], where: str) -> "CheckpointMeta":
        try:
            attrs = doc["attributes"][ATTRIBUTE]
        except (KeyError, TypeError):
            raise FormatError(f"{where} is a Zarr group but not a ucp_zarr checkpoint") from None
        _check_version(attrs, where)
        try:
            return cls(
                tensors={k: TensorEntry.from_json(t) for k, t in attrs["tensors"].items()},
                values=attrs["values"],
                created=attrs["created"],
                library=attrs["library"],
                world_size=attrs["world_size"],
                layout=attrs["layout"],
                rank_values={k: {int(r): v for r, v in per.items()} for k, per in attrs.get("rank_values", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"malformed checkpoint metadata {where}: {e!r}") from e


def group_zarr_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def _check_version(attrs: dict[str, Any], where: str) -> None:
    v = attrs.get("format_version")
    if v != FORMAT_VERSION:
        raise FormatError(f"{where} has ucp_zarr format_version {v!r}; this library reads {FORMAT_VERSION}")
