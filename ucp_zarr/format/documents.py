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

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from .dtypes import StoredDtype, stored_dtype_by_name
from .integrity import document_digest
from ..errors import FormatError
from ..layout import ChunkGrid

FORMAT_VERSION = 2
MAX_CHUNK_BYTES = 1 << 30
"""The largest chunk a reader accepts (a reader allocates one chunk at a time)."""
MAX_CHUNKS_PER_SHARD = 1 << 22
"""The most chunks per shard a reader accepts (it reads one shard index at a time)."""
MAX_WORLD_SIZE = 1 << 24
"""The most saving ranks a reader accepts."""
ATTRIBUTE = "ucp_zarr"
METADATA_FILE = "zarr.json"


def parse_document(raw: bytes, where: str, unique_keys: bool = False) -> Any:
    """A metadata document's JSON; :class:`FormatError` for anything but strict JSON (no
    ``NaN``/``Infinity`` literals, which this format never writes) of bounded nesting. With
    ``unique_keys``, a member named twice in one object is refused too (a signed record: JSON
    readers differ in which of the two they take, and the signature covers only one)."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise ValueError(f"the member {twice!r} is named twice in one object")
        return out

    try:
        return json.loads(raw, parse_constant=constant, object_pairs_hook=unique if unique_keys else None)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where} is not valid JSON: {str(e)[:200]}") from None


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
        return where | {"replicas": ranks_to_json(self.replicas), "writers": ranks_to_json(self.writers)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Region":
        replicas, writers = ranks_from_json(d["replicas"]), ranks_from_json(d.get("writers", ()))
        if "flat_offset" in d:
            return cls.flat_range(d["flat_offset"], d["flat_offset"] + d["numel"], replicas, writers)
        return cls(tuple(d["offset"]), tuple(d["shape"]), replicas, writers)


def ranks_to_json(ranks: tuple[int, ...]) -> list[int] | dict[str, int]:
    """A list of ranks, or ``{"start", "step", "count"}`` when it is an arithmetic
    progression of at least 3 (the replicas of a data-parallel group, strided by the
    model-parallel degree): metadata stays small however many ranks there are."""
    if len(ranks) >= 3:
        step = ranks[1] - ranks[0]
        if step >= 1 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return {"start": ranks[0], "step": step, "count": len(ranks)}
    return list(ranks)


def ranks_from_json(value: Any) -> tuple[int, ...]:
    if isinstance(value, dict):
        start, step, count = value["start"], value["step"], value["count"]
        if not all(type(v) is int for v in (start, step, count)) or start < 0 or step < 1 or not 3 <= count <= MAX_WORLD_SIZE:
            raise ValueError(f"rank range {value} is not start >= 0, step >= 1, 3 <= count <= {MAX_WORLD_SIZE}")
        return tuple(range(start, start + step * count, step))
    if not all(type(r) is int for r in value):
        raise TypeError(f"ranks {str(value)[:100]} are not integers")
    return tuple(value)


@dataclass(frozen=True)
class ArrayMeta:
    """One tensor's array: what ``attributes.ucp_zarr`` says plus the grid of its zarr.json."""

    key: str
    dtype: StoredDtype
    grid: ChunkGrid
    regions: tuple[Region, ...]
    rank: int | None = None
    """Set for per-rank state: the rank whose copy this array holds."""
    dims: tuple[str, ...] | None = None
    """Zarr ``dimension_names`` (see :func:`dimension_names`); None in older checkpoints."""

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
        doc: dict[str, Any] = {
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
        }
        if self.dims is not None:
            doc["dimension_names"] = list(self.dims)
        attributes: dict[str, Any] = {}
        if self.dtype.bits:
            attributes |= bit_dtype_hint(self.dtype)
        attributes[ATTRIBUTE] = {
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "torch_dtype": self.dtype.name,
            "global_shape": list(self.grid.shape),
            "regions": [r.to_json() for r in self.regions],
        } | ({} if self.rank is None else {"rank": self.rank})
        doc["attributes"] = attributes
        return doc

    @classmethod
    def from_zarr_json(cls, doc: Any, where: str) -> "ArrayMeta":
        """Parse and validate an array's zarr.json; :class:`FormatError` unless it is exactly
        what this library writes for the array it describes (every Zarr field equal, type
        for type, to the document :meth:`to_zarr_json` gives; no other field), which is a
        valid Zarr v3 document. Pure Python: a load parses a document per array."""
        meta = cls._parse(doc, where)
        expected = meta.to_zarr_json()
        if _zarr_text(doc) != _zarr_text(expected):  # (JSON text: C speed, and 1, 1.0, true differ)
            for name in sorted((set(doc) | set(expected)) - {"attributes"}):
                got, want = doc.get(name, _ABSENT), expected.get(name, _ABSENT)
                if _zarr_text({name: got}) != _zarr_text({name: want}):
                    shown = "absent" if got is _ABSENT else repr(got)[:200]
                    raise FormatError(
                        f"{where}: {name} is {shown}, but an array of torch dtype {meta.dtype.name} in this "
                        f"format has {'no ' + name if want is _ABSENT else repr(want)}; refusing to read what "
                        "this library did not write"
                    )
        return meta

    @classmethod
    def from_committed(cls, doc: Any, where: str, digest: str) -> "ArrayMeta | None":
        """``doc`` parsed, when the document this library writes for what it describes
        (:meth:`to_zarr_json`, as :func:`dump_document` serialises it) has ``digest``: that
        document is then, byte for byte, the committed one, so the result is what
        :meth:`from_zarr_json` gives for it, at one serialisation instead of three. None
        when not (another writer's key order, or ``doc`` is not the committed document): the
        caller then checks the committed document's bytes and parses them with
        :meth:`from_zarr_json`."""
        try:
            meta = cls._parse(doc, where)
        except FormatError:
            return None
        return meta if document_digest(dump_document(meta.to_zarr_json())) == digest else None

    @classmethod
    def _parse(cls, doc: Any, where: str) -> "ArrayMeta":
        """The fields of an array's zarr.json, each validated, and the grid within this
        format's limits; :class:`FormatError` where one is missing or malformed (the Zarr
        fields are compared with the document they imply by the callers)."""
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
            raise FormatError(f"{where} is not a Zarr v3 array document")
        try:
            attrs = doc["attributes"][ATTRIBUTE]
            check_version(attrs, where)
            dtype = stored_dtype_by_name(attrs["torch_dtype"])
            codecs = doc["codecs"]
            if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
                    and codecs[0].get("name") == "sharding_indexed"):
                raise FormatError(f"{where}: arrays of this format use the sharding_indexed codec alone")
            shape = _dims(doc["shape"], "shape", 0)
            grid = ChunkGrid(
                shape,
                _dims(doc["chunk_grid"]["configuration"]["chunk_shape"], "chunk_grid", 1, len(shape)),
                _dims(codecs[0]["configuration"]["chunk_shape"], "chunk_shape", 1, len(shape)),
            )
            regions = tuple(Region.from_json(r) for r in attrs["regions"])
            rank = attrs.get("rank")
            if not isinstance(attrs["key"], str) or (rank is not None and type(rank) is not int):
                raise TypeError("key must be a string and rank an integer")
            if attrs["global_shape"] != list(grid.shape):
                raise ValueError(f"global_shape {attrs['global_shape']} differs from the array shape {list(grid.shape)}")
            dims = doc.get("dimension_names")
            if dims is not None and not (
                isinstance(dims, list) and len(dims) == len(shape) and all(isinstance(d, str) for d in dims)
            ):
                raise TypeError(f"dimension_names {dims!r} must be {len(shape)} strings")
            meta = cls(attrs["key"], dtype, grid, regions, rank, None if dims is None else tuple(dims))
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
            raise FormatError(f"malformed array metadata {where}: {e!r}") from e
        if math.prod(grid.chunk_shape) * dtype.itemsize > MAX_CHUNK_BYTES:
            raise FormatError(f"{where}: chunks of {list(grid.chunk_shape)} exceed {MAX_CHUNK_BYTES} bytes")
        if math.prod(grid.chunks_per_shard) > MAX_CHUNKS_PER_SHARD:
            raise FormatError(f"{where}: {math.prod(grid.chunks_per_shard)} chunks per shard exceed {MAX_CHUNKS_PER_SHARD}")
        return meta


_ABSENT = object()


def _dims(value: Any, what: str, least: int, ndim: int | None = None) -> tuple[int, ...]:
    """A shape from JSON: a list of integers >= ``least`` (``ndim`` of them when given)."""
    if not (isinstance(value, list) and all(type(v) is int and v >= least for v in value)):
        raise ValueError(f"{what} {str(value)[:200]} is not a list of integers >= {least}")
    if ndim is not None and len(value) != ndim:
        raise ValueError(f"{what} {value} has {len(value)} dimensions, the array {ndim}")
    return tuple(value)


def _zarr_text(doc: dict[str, Any]) -> str:
    """The Zarr fields of a parsed array document as canonical JSON text, for comparing
    type for type; an empty ``storage_transformers`` is the same as none, and a fill value
    is compared by value (``0`` and ``0.0`` are the same zero)."""
    fields = {k: v for k, v in doc.items() if k != "attributes" and v is not _ABSENT}
    if fields.get("storage_transformers") == []:
        del fields["storage_transformers"]
    fill = fields.get("fill_value")
    if type(fill) is float and fill.is_integer():
        fields["fill_value"] = int(fill)
    return json.dumps(fields, sort_keys=True, allow_nan=False)


BIT_DTYPE_ATTRIBUTE = "bit_dtype"
"""The attribute, outside ucp_zarr's namespace, that tells generic readers a bit-stored
array's real dtype (``bfloat16``, ``float8_*``): the values are raw bits to reinterpret."""


def bit_dtype_hint(dtype: StoredDtype) -> dict[str, Any]:
    """The readable hint of a bit-stored dtype for tools that do not know ucp_zarr."""
    if dtype.name == "bfloat16":
        how = "numpy: (a.astype(np.uint32) << 16).view(np.float32); ml_dtypes: a.view(ml_dtypes.bfloat16)"
    else:
        how = f"ml_dtypes: a.view(ml_dtypes.{dtype.name}); torch: torch.from_numpy(a).view(torch.{dtype.name})"
    return {
        BIT_DTYPE_ATTRIBUTE: {
            "dtype": dtype.name,
            "stored_as": dtype.zarr_dtype,
            "note": f"the {dtype.zarr_dtype} values are the raw bits of {dtype.name}: reinterpret them, do not "
            f"convert them ({how})",
        }
    }


def reference_shape(names_shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """The *reference shape* of a group's arrays (``(name, shape)`` each; see
    :func:`dimension_names`): its parameter's shape, not that of a step counter or a
    factored statistic beside it."""
    count: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], tuple[bool, str]] = {}
    for name, shape in names_shapes:
        count[shape] = count.get(shape, 0) + 1
        rank = ("." in name, name)
        first[shape] = min(first.get(shape, rank), rank)
    return min(count, key=lambda s: (-count[s], first[s])) if count else ()


def dimension_names(names_shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, ...]]:
    """The ``dimension_names`` of the arrays of one group (``(name, shape)`` each, in order).

    The group's *reference shape* is the most common shape among its arrays (ties go to the
    shape of the first array whose name has no dot, such as the parameter ``model``; then to
    the first name). Arrays of that shape get ``dim_0, dim_1, ...`` (a parameter and its
    moments share dimensions, so xarray opens them as one dataset); any other array gets
    ``<name>_dim_0, ...``, which no other array in the group uses."""
    ref = reference_shape(names_shapes)
    return [
        tuple(f"dim_{i}" if shape == ref else f"{name}_dim_{i}" for i in range(len(shape))) for name, shape in names_shapes
    ]


NAME_COMPONENT = re.compile(r"[A-Za-z0-9_%~\-][A-Za-z0-9_.%~\-]*")
"""One escaped group or array name (schema/FORMAT.md, section 1)."""


MAX_NAME_BYTES = 255
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")


def check_array_path(path: Any, where: str) -> str:
    """An array path from the root index: ``<group>/<array>`` of escaped names (see
    ``statedict.array_path``), so that it can never point outside the checkpoint."""
    parts = path.split("/") if isinstance(path, str) else []
    if len(parts) != 2 or not all(NAME_COMPONENT.fullmatch(p) and len(p) <= MAX_NAME_BYTES for p in parts):
        raise FormatError(f"{where}: {str(path)[:300]!r} is not an array path of this format (<group>/<array>)")
    return path


def check_document_path(path: Any, where: str) -> str:
    """A member of the root's ``documents``: ``<group>/zarr.json`` or
    ``<group>/<array>/zarr.json`` of escaped names."""
    parts = path.split("/") if isinstance(path, str) else []
    if not (2 <= len(parts) <= 3 and parts[-1] == METADATA_FILE) or not all(
        NAME_COMPONENT.fullmatch(p) and len(p) <= MAX_NAME_BYTES for p in parts[:-1]
    ):
        raise FormatError(f"{where}: {str(path)[:300]!r} is not a document path of this format")
    return path


def check_digest(digest: Any, where: str) -> str:
    if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        raise FormatError(f"{where}: {str(digest)[:100]!r} is not a digest (sha256:<64 hex digits>)")
    return digest


def check_rank(r: Any, world_size: int, where: str) -> int:
    if not (isinstance(r, str) and _RANK.fullmatch(r) and int(r) < world_size):
        raise FormatError(f"{where}: {str(r)[:50]!r} is not a rank of the {world_size} saving ranks")
    return int(r)


def check_key(key: Any, where: str) -> str:
    try:
        key.encode("utf-8")
    except (AttributeError, UnicodeEncodeError):
        raise FormatError(f"{where}: key {key!r} is not valid Unicode text") from None
    return key


def group_zarr_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def dump_consolidated(root: dict[str, Any], documents: Sequence[tuple[str, bytes]], groups: Collection[str]) -> bytes:
    """The root document's bytes (``dump_document(root)``) with zarr-python's inline
    consolidated metadata of every group and array document (``<path>/zarr.json`` -> its
    bytes as written; the paths in ``groups`` are groups, which list their children through
    the root) as its last member. The documents' bytes are spliced in, not decoded and
    encoded again: the same bytes as dumping the parsed documents, without keeping them
    parsed while a save runs. Nodes in path order: zarr-python (3.1) groups a parent's
    children with itertools.groupby after sorting by depth only, so they must already be
    adjacent."""
    head = dump_document(root)
    if not documents:
        return head
    inline = dump_document({"consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}})
    nodes = sorted(
        (path.removesuffix("/" + METADATA_FILE), raw[:-1] + b"," + inline[1:] if path in groups else raw)
        for path, raw in documents
    )
    body = b",".join(json.dumps(node).encode() + b":" + raw for node, raw in nodes)
    return head[:-1] + b"," + inline[1:-3] + body + b"}}}"


def dump_document(doc: dict[str, Any]) -> bytes:
    """A metadata document's bytes as written (the digests in the commit record are of these):
    compact JSON, which Python encodes in C (indented JSON takes its pure-Python encoder,
    milliseconds per document)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def check_version(attrs: Any, where: str) -> None:
    v = attrs.get("format_version") if isinstance(attrs, dict) else None
    if v != FORMAT_VERSION:
        raise FormatError(f"{where} has ucp_zarr format_version {v!r}; this library reads {FORMAT_VERSION}")
