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
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import StoredDtype, stored_dtype_by_name
from ..errors import FormatError
from ..layout import ChunkGrid
from .statedict import Structure, from_json

FORMAT_VERSION = 2
MAX_CHUNK_BYTES = 1 << 30
"""The largest chunk a reader accepts (a reader allocates one chunk at a time)."""
MAX_CHUNKS_PER_SHARD = 1 << 22
"""The most chunks per shard a reader accepts (it reads one shard index at a time)."""
MAX_WORLD_SIZE = 1 << 24
"""The most saving ranks a reader accepts."""
ATTRIBUTE = "ucp_zarr"
METADATA_FILE = "zarr.json"


def parse_document(raw: bytes, where: str) -> Any:
    """A metadata document's JSON; :class:`FormatError` for anything but strict JSON (no
    ``NaN``/``Infinity`` literals, which this format never writes) of bounded nesting."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw, parse_constant=constant)
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
        if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
            raise FormatError(f"{where} is not a Zarr v3 array document")
        try:
            attrs = doc["attributes"][ATTRIBUTE]
            _check_version(attrs, where)
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
        expected = meta.to_zarr_json()
        if _zarr_text(doc) != _zarr_text(expected):  # (JSON text: C speed, and 1, 1.0, true differ)
            for name in sorted((set(doc) | set(expected)) - {"attributes"}):
                got, want = doc.get(name, _ABSENT), expected.get(name, _ABSENT)
                if _zarr_text({name: got}) != _zarr_text({name: want}):
                    shown = "absent" if got is _ABSENT else repr(got)[:200]
                    raise FormatError(
                        f"{where}: {name} is {shown}, but an array of torch dtype {dtype.name} in this format "
                        f"has {'no ' + name if want is _ABSENT else repr(want)}; refusing to read what this "
                        "library did not write"
                    )
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


def dimension_names(names_shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, ...]]:
    """The ``dimension_names`` of the arrays of one group (``(name, shape)`` each, in order).

    The group's *reference shape* is the most common shape among its arrays (ties go to the
    shape of the first array whose name has no dot, such as the parameter ``model``; then to
    the first name). Arrays of that shape get ``dim_0, dim_1, ...`` (a parameter and its
    moments share dimensions, so xarray opens them as one dataset); any other array gets
    ``<name>_dim_0, ...``, which no other array in the group uses."""
    count: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], tuple[bool, str]] = {}
    for name, shape in names_shapes:
        count[shape] = count.get(shape, 0) + 1
        rank = ("." in name, name)
        first[shape] = min(first.get(shape, rank), rank)
    ref = min(count, key=lambda s: (-count[s], first[s])) if count else ()
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


def _check_digest(digest: Any, where: str) -> str:
    if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        raise FormatError(f"{where}: {str(digest)[:100]!r} is not a digest (sha256:<64 hex digits>)")
    return digest


def _check_rank(r: Any, world_size: int, where: str) -> int:
    if not (isinstance(r, str) and _RANK.fullmatch(r) and int(r) < world_size):
        raise FormatError(f"{where}: {str(r)[:50]!r} is not a rank of the {world_size} saving ranks")
    return int(r)


def _check_key(key: Any, where: str) -> str:
    try:
        key.encode("utf-8")
    except (AttributeError, UnicodeEncodeError):
        raise FormatError(f"{where}: key {key!r} is not valid Unicode text") from None
    return key


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
    rule: dict[str, Any] | None = None
    """For a tensor placed by rules: what its consolidated tensor is (the rule's kind,
    sub-parameter sizes and dim, unpadded vocabulary size)."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "digest": self.digest}
        if self.ranks is not None:
            d["ranks"] = {str(r): a.to_json() for r, a in sorted(self.ranks.items())}
        if self.rule is not None:
            d["rule"] = self.rule
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
    def from_json(cls, d: Any, where: str, world_size: int = 1) -> "TensorEntry":
        ranks = None
        if "ranks" in d:
            ranks = {
                _check_rank(r, world_size, where): ArrayRef(check_array_path(a["path"], where), _check_digest(a["digest"], where))
                for r, a in d["ranks"].items()
            }
            if not ranks:
                raise ValueError("per-rank state without any rank's copy")
        shape = tuple(d["shape"])
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"shape {list(shape)} is not a list of non-negative integers")
        stored_dtype_by_name(d["dtype"])
        rule = d.get("rule")
        if rule is not None and not (isinstance(rule, dict) and isinstance(rule.get("kind"), str)):
            raise ValueError(f"rule {str(rule)[:100]} is not a rule description")
        return cls(check_array_path(d["path"], where), shape, d["dtype"], _check_digest(d["digest"], where), ranks, rule)


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
    consolidated: dict[str, Any] = field(default_factory=dict)
    """The root's consolidated metadata: node path (``<group>/<array>``) -> its document,
    as written. Not trusted by itself: a reader checks each against ``documents``."""
    structure: Structure | None = None
    """How the saved state dict nested (None: not recorded, by an older ucp_zarr or a
    converter)."""

    ties: dict[str, str] = field(default_factory=dict)
    """Tied tensors: alias key -> the canonical key whose array holds its values (stored
    once; see :data:`TIES_FORMAT`). Empty in checkpoints without ties and older ones."""

    @property
    def authenticated(self) -> bool:
        return self.signature is not None

    def canonical(self, key: str) -> str:
        """The key whose array holds tensor ``key``: itself, or the canonical key of a tie."""
        return self.ties.get(key, key)

    def consolidated_document(self, path: str) -> bytes | None:
        """The bytes of the document ``path`` (``.../zarr.json``) as the consolidated copy
        holds it, or None; the caller checks them against :attr:`documents`."""
        node = self.consolidated.get(path.removesuffix("/" + METADATA_FILE))
        return None if node is None else dump_document(node)

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
        if self.structure is not None:
            attrs["structure"] = self.structure.to_json()
        if self.ties:
            attrs["ties"] = {"format": TIES_FORMAT, "aliases": dict(self.ties)}
        if self.signature is not None:
            attrs["signature"] = self.signature
        return attrs

    def to_zarr_json(self, attributes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The root document, with ``attributes`` (default :meth:`attributes`) and the
        consolidated metadata of every node (zarr-python's inline form)."""
        doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group", "attributes": {ATTRIBUTE: attributes or self.attributes()}}
        if self.consolidated:
            doc["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": self.consolidated}
        return doc

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
            world_size = attrs["world_size"]
            if not (type(world_size) is int and 1 <= world_size <= MAX_WORLD_SIZE):
                raise ValueError(f"world_size {world_size!r} is not an integer in [1, {MAX_WORLD_SIZE}]")
            meta = cls(
                tensors={_check_key(k, where): TensorEntry.from_json(t, where, world_size) for k, t in attrs["tensors"].items()},
                values={_check_key(k, where): v for k, v in attrs["values"].items()},
                created=str(attrs["created"]),
                library=str(attrs["library"]),
                save_id=save_id,
                world_size=world_size,
                layout=dict(attrs["layout"]),
                rank_values={
                    _check_key(k, where): {_check_rank(r, world_size, where): v for r, v in per.items()}
                    for k, per in attrs["rank_values"].items()
                },
                documents={check_document_path(k, where): _check_digest(v, where) for k, v in attrs["documents"].items()},
                signature=signature,
                consolidated=_consolidated(doc, where),
            )
            if "ties" in attrs:
                meta = replace(meta, ties=_ties(attrs["ties"], meta.tensors, where))
            if "structure" in attrs:
                keys = set(meta.tensors) | set(meta.values) | set(meta.rank_values) | set(meta.ties)
                meta = replace(meta, structure=Structure.from_json(attrs["structure"], keys, where))
            meta._check_values(where)
            meta._check_paths(where)
            return meta
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise FormatError(f"malformed checkpoint metadata {where}: {str(e)[:300]}") from e

    def _check_values(self, where: str) -> None:
        """Every value decodes (``statedict.from_json`` raises FormatError otherwise)."""
        for k, v in self.values.items():
            from_json(v, k)
        for k, per in self.rank_values.items():
            for r, v in per.items():
                from_json(v, f"{k} (rank {r})")
        others = set(self.values) | set(self.rank_values)
        overlap = set(self.values) & set(self.rank_values) | (set(self.tensors) | set(self.ties)) & others
        if overlap:
            raise FormatError(f"{where}: keys {sorted(overlap)[:10]} are listed twice (tensor or tie, value, per-rank value)")

    def _check_paths(self, where: str) -> None:
        """No two index entries (per-rank copies included) name one array."""
        owner: dict[str, str] = {}
        for key, t in self.tensors.items():
            paths = {t.path} | {a.path for a in (t.ranks or {}).values()}
            if t.ranks is not None and t.path != t.ranks[min(t.ranks)].path:
                raise FormatError(f"{where}: tensor {key!r}: path {t.path!r} is not its lowest rank's copy")
            for p in paths:
                if owner.setdefault(p, key) != key:
                    raise FormatError(f"{where}: tensors {owner[p]!r} and {key!r} both name the array {p!r}")


TIES_FORMAT = "ucp_zarr.ties/1"
"""The ``format`` of the root's ``ties`` member, ``{"format": ..., "aliases": {alias:
canonical}}``: each alias names a tensor stored once, under its canonical key (tied weights:
a language model's output layer and its embedding, DeepSpeed's ``shared_params``, a rules
``rename``); reading an alias reads the canonical key's array."""


def _ties(doc: Any, tensors: dict[str, TensorEntry], where: str) -> dict[str, str]:
    """The root's ``ties`` member, checked: each alias a key that is no tensor of the index,
    each canonical key a tensor of it (not per-rank state)."""
    if not (isinstance(doc, dict) and doc.get("format") == TIES_FORMAT and isinstance(doc.get("aliases"), dict)):
        raise FormatError(f"{where}: ties is not a {TIES_FORMAT} object with aliases")
    out: dict[str, str] = {}
    for alias, canonical in doc["aliases"].items():
        _check_key(alias, where)
        if not isinstance(canonical, str) or canonical not in tensors or alias in tensors:
            raise FormatError(f"{where}: tie {alias!r} -> {str(canonical)[:200]!r}: an alias must be no tensor of the "
                              "index and name one that is")
        if tensors[canonical].ranks is not None:
            raise FormatError(f"{where}: tie {alias!r} -> {canonical!r}: per-rank state cannot be tied")
        out[alias] = canonical
    return out


def _consolidated(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """The array documents of the root's consolidated metadata (empty when absent)."""
    cm = doc.get("consolidated_metadata")
    if cm is None:
        return {}
    nodes = cm.get("metadata") if isinstance(cm, dict) else None
    if not isinstance(nodes, dict):
        raise FormatError(f"{where}: consolidated_metadata has no metadata object")
    return {k: v for k, v in nodes.items() if isinstance(v, dict) and v.get("node_type") == "array"}


def group_zarr_json() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": {}}


def consolidated_nodes(documents: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The root's consolidated metadata from every group and array document (``<path>/
    zarr.json`` -> document): zarr-python's flat inline form, where a group lists its
    children through the root."""
    nodes: dict[str, Any] = {}
    for path, doc in documents:
        node = path.removesuffix("/" + METADATA_FILE)
        if doc.get("node_type") == "group":
            doc = doc | {"consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
        nodes[node] = doc
    # in path order: zarr-python (3.1) groups a parent's children with itertools.groupby
    # after sorting by depth only, so they must already be adjacent
    return dict(sorted(nodes.items()))


def dump_document(doc: dict[str, Any]) -> bytes:
    """A metadata document's bytes as written (the digests in the commit record are of these):
    compact JSON, which Python encodes in C (indented JSON takes its pure-Python encoder,
    milliseconds per document)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _check_version(attrs: Any, where: str) -> None:
    v = attrs.get("format_version") if isinstance(attrs, dict) else None
    if v != FORMAT_VERSION:
        raise FormatError(f"{where} has ucp_zarr format_version {v!r}; this library reads {FORMAT_VERSION}")
