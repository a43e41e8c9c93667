"""The commit record: the root group document whose ``attributes.ucp_zarr``
(:class:`CheckpointMeta`) indexes every tensor (:class:`TensorEntry`, :class:`ArrayRef`),
holds all non-tensor state as JSON, the digests of every document and array, the ties and
the consolidated copy of the arrays' documents. Written last: a checkpoint is committed
once it exists (specified in ``schema/``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError
from .documents import (
    ATTRIBUTE,
    FORMAT_VERSION,
    MAX_WORLD_SIZE,
    METADATA_FILE,
    check_array_path,
    check_digest,
    check_document_path,
    check_key,
    check_rank,
    check_version,
    dump_document,
)
from .dtypes import stored_dtype_by_name
from .statedict import Structure, from_json
from .integrity import check_record_digest


RECORD_MEMBERS = frozenset({
    "format_version", "created", "library", "save_id", "world_size", "layout", "tensors", "values", "rank_values",
    "documents", "structure", "ties", "signature", "record_digest",
})
"""The members of ``attributes.ucp_zarr`` this library writes and reads."""


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
        """The bytes of one copy."""
        return math.prod(self.shape) * stored_dtype_by_name(self.dtype).itemsize

    @property
    def copies(self) -> int:
        """How many copies are stored: one per saving rank of per-rank state, else one."""
        return len(self.ranks) if self.ranks else 1

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
                check_rank(r, world_size, where): ArrayRef(check_array_path(a["path"], where), check_digest(a["digest"], where))
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
        return cls(check_array_path(d["path"], where), shape, d["dtype"], check_digest(d["digest"], where), ranks, rule)


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
        node = self.consolidated_node(path)
        return None if node is None else dump_document(node)

    def consolidated_node(self, path: str) -> Any:
        """The document ``path`` as the consolidated copy holds it (parsed JSON; not to be
        changed), or None; its bytes are :meth:`consolidated_document`'s."""
        return self.consolidated.get(path.removesuffix("/" + METADATA_FILE))

    def nbytes(self) -> int:
        """The bytes of every tensor's data, each saving rank's copy of per-rank state counted
        (what is stored)."""
        return sum(t.nbytes * t.copies for t in self.tensors.values())

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
        check_version(attrs, where)
        check_record_digest(attrs, where, RECORD_MEMBERS)
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
                tensors={check_key(k, where): TensorEntry.from_json(t, where, world_size) for k, t in attrs["tensors"].items()},
                values={check_key(k, where): v for k, v in attrs["values"].items()},
                created=str(attrs["created"]),
                library=str(attrs["library"]),
                save_id=save_id,
                world_size=world_size,
                layout=dict(attrs["layout"]),
                rank_values={
                    check_key(k, where): {check_rank(r, world_size, where): v for r, v in per.items()}
                    for k, per in attrs["rank_values"].items()
                },
                documents={check_document_path(k, where): check_digest(v, where) for k, v in attrs["documents"].items()},
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
        check_key(alias, where)
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
