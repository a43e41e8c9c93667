"""What a save owns: the objects it writes, named before it writes any.

A save, an abort, a takeover, an overwrite and a deletion remove only objects they can name
as their own, never what a pattern over the directory happens to match (a checkpoint nested
in a subfolder, a foreign Zarr group and any other file look alike to a pattern):

* a save records its :class:`Owned` objects (``.ucp_zarr_owned.<save id>``) right after it
  claims the path and before it writes any data; its abort, or a takeover of it once it is
  dead, deletes exactly those (and their temporary names, ``<key>.tmp-<save id>``);
* an overwrite or a deletion removes what the replaced checkpoint's commit record names:
  its documents and the shard objects of its arrays (:meth:`Owned.from_commit_record`).

Keys read back from storage are checked to be object names of this format inside the
checkpoint (:func:`~ucp_zarr.format.documents.check_document_path`, :func:`~ucp_zarr.format.documents.check_array_path`),
so a forged record can never name anything outside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from ..format.codec import chunk_key
from ..errors import FormatError
from ..format.documents import METADATA_FILE, check_array_path, check_document_path, parse_document
from ..format.commit_record import CheckpointMeta
from ..io.store import folders_of
from ..layout.boxes import grid_indices

if TYPE_CHECKING:
    from .planner import SavePlan

MAX_SHARDS_PER_ARRAY = 1 << 24
"""A record naming more shards than this for one array is malformed (never enumerated)."""


@dataclass(frozen=True)
class OwnedArray:
    """An array's shard objects: ``<path>/c/i/j`` over its shard grid."""

    path: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]

    def keys(self) -> Iterator[str]:
        counts = [-(-n // s) for n, s in zip(self.shape, self.shard_shape)]
        for index in grid_indices(counts):
            yield f"{self.path}/{chunk_key(index)}"


@dataclass(frozen=True)
class Owned:
    """The objects of one save or one checkpoint (besides the protocol's own files)."""

    documents: tuple[str, ...] = ()
    """Group and array ``zarr.json`` keys."""
    arrays: tuple[OwnedArray, ...] = ()

    def data_keys(self) -> Iterator[str]:
        for array in self.arrays:
            yield from array.keys()

    def deletion_phases(self) -> tuple[list[str], list[str]]:
        """The documents, then the data, each deleted in full before the next: a reader never
        finds an array whose data is gone."""
        return list(self.documents), list(self.data_keys())

    def to_bytes(self) -> bytes:
        arrays = [[a.path, list(a.shape), list(a.shard_shape)] for a in self.arrays]
        return json.dumps({"documents": list(self.documents), "arrays": arrays}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "Owned":
        """A record written by :meth:`to_bytes`; :class:`FormatError` if malformed."""
        doc = parse_document(raw, where)
        if not isinstance(doc, dict) or not isinstance(doc.get("documents"), list) or not isinstance(doc.get("arrays"), list):
            raise FormatError(f"{where}: not a record of owned objects")
        arrays = []
        for item in doc["arrays"]:
            if not (isinstance(item, list) and len(item) == 3):
                raise FormatError(f"{where}: {str(item)[:100]} is not [path, shape, shard shape]")
            arrays.append(_array(item[0], item[1], item[2], where))
        return cls(tuple(check_document_path(d, where) for d in doc["documents"]), tuple(arrays))

    @classmethod
    def from_commit_record(cls, raw: bytes, where: str, read: Any = None) -> "Owned":
        """What the committed checkpoint whose root document is ``raw`` consists of: every
        document its ``documents`` lists and the shards of each of its arrays (grids from
        the consolidated metadata, or from the array documents through ``read(key)`` where
        a node is not consolidated). :class:`FormatError` if the record is malformed."""
        meta = CheckpointMeta.from_zarr_json(parse_document(raw, where), where)
        documents = sorted(meta.documents) or _documents_of_entries(meta)
        groups = folders_of(d.removesuffix("/" + METADATA_FILE) for d in documents)  # (an array holds no node)
        arrays = []
        for doc_key in documents:
            node = meta.consolidated.get(doc_key.removesuffix("/" + METADATA_FILE))
            if node is None and read is not None and doc_key.removesuffix("/" + METADATA_FILE) not in groups:
                try:
                    node = parse_document(read(doc_key), f"{where}: {doc_key}")
                except FileNotFoundError:
                    continue
            if isinstance(node, dict) and node.get("node_type") == "array":
                path = doc_key.removesuffix("/" + METADATA_FILE)
                try:
                    shard_shape = node["chunk_grid"]["configuration"]["chunk_shape"]
                except (KeyError, TypeError):
                    raise FormatError(f"{where}: the document of {path} has no chunk grid") from None
                arrays.append(_array(path, node.get("shape"), shard_shape, where))
        return cls(tuple(documents), tuple(arrays))


def _documents_of_entries(meta: CheckpointMeta) -> list[str]:
    """The documents of a commit record that predates ``documents``: its arrays' and groups'."""
    paths = {t.path for t in meta.tensors.values()}
    for t in meta.tensors.values():
        paths |= {c.path for c in (t.ranks or {}).values()}
    docs = {f"{p}/{METADATA_FILE}" for p in paths} | {f"{p.split('/')[0]}/{METADATA_FILE}" for p in paths}
    return sorted(docs)


def _array(path: Any, shape: Any, shard_shape: Any, where: str) -> OwnedArray:
    check_array_path(path, where)
    ok = (
        isinstance(shape, list) and isinstance(shard_shape, list) and len(shape) == len(shard_shape)
        and all(type(n) is int and n >= 0 for n in shape) and all(type(s) is int and s > 0 for s in shard_shape)
    )
    if not ok or math.prod(-(-n // s) for n, s in zip(shape, shard_shape)) > MAX_SHARDS_PER_ARRAY:
        raise FormatError(f"{where}: array {path}: shape {str(shape)[:80]} / shards {str(shard_shape)[:80]} are not a grid")
    return OwnedArray(path, tuple(shape), tuple(shard_shape))


def owned_by(plan: "SavePlan") -> Owned:
    """Every object a save of ``plan`` writes: its documents and its arrays' shards."""
    docs = [f"{g}/{METADATA_FILE}" for g in plan.groups] + [f"{p}/{METADATA_FILE}" for p, _ in plan.arrays.values()]
    arrays = [OwnedArray(p, m.shape, m.grid.shard_shape) for p, m in plan.arrays.values()]
    return Owned(tuple(docs), tuple(arrays))
