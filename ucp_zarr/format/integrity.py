"""Digests and authentication of a checkpoint's metadata and data (pure, no I/O).

* Every metadata document (group and array ``zarr.json``) has its SHA-256 recorded in the
  commit record (``documents``), so a replaced or edited document is detected when read.
* Every array has a digest in the commit record: SHA-256 over the seals of its shards (the
  last 32 bytes of each shard's trailer, see :mod:`.codec`) in C order of their grid
  position, which ``verify`` recomputes from every shard.
* The commit record carries the SHA-256 of its own canonical JSON (``record_digest``: sorted
  keys, no spaces, ASCII, without ``record_digest`` and ``signature``), so that a changed
  value, digest or entry of an unsigned record (a flipped bit) is detected when read.
* With a key, the commit record is signed: HMAC-SHA256 over its canonical JSON (sorted
  keys, no spaces, ASCII) without the ``signature`` member. The signed record covers the
  non-tensor values, the document digests and the array digests; the shard trailers are
  sealed with the same key and hold every chunk's SHA-256, so any change to data, metadata
  or values is refused by a reader holding the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Sequence

from ..errors import AuthenticationError, FormatError

SIGNATURE_ALG = "HMAC-SHA256"


def document_digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def array_digest(seals: Sequence[bytes]) -> str:
    """The digest of a whole array from its shards' seals, in C order of their position."""
    h = hashlib.sha256()
    for s in seals:
        h.update(s)
    return "sha256:" + h.hexdigest()


def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


RECORD_DIGEST = "record_digest"


def record_digest(attrs: dict[str, Any]) -> str:
    """The ``record_digest`` of the commit record's attributes ``attrs`` (what it holds but
    its ``record_digest`` and ``signature``)."""
    return document_digest(canonical({k: v for k, v in attrs.items() if k not in (RECORD_DIGEST, "signature")}))


def check_record_digest(attrs: dict[str, Any], where: str, members: frozenset[str]) -> None:
    """Raise :class:`FormatError` unless ``attrs`` match their ``record_digest``. Records
    written before it existed have none (nothing to check), but only ``members`` (the ones
    this reader knows): every record with a member added later carries one, so a record with
    an unknown member and none had its ``record_digest``'s name changed (a flipped bit). A
    FormatError, as for any other unreadable record: a manager skips the step, an overwrite
    leaves its objects in place."""
    if RECORD_DIGEST not in attrs:
        if unknown := sorted(set(attrs) - members):
            raise FormatError(
                f"{where}: the commit record has no record_digest but members this library does not know "
                f"({', '.join(map(repr, unknown[:3]))}); a record with newer members always carries one, so it was "
                "changed after it was written (a flipped bit in a member's name?) and cannot be trusted; restore it "
                "from a copy"
            )
        return
    try:
        same = record_digest(attrs) == attrs[RECORD_DIGEST]
    except (ValueError, TypeError, RecursionError):  # not canonical JSON (NaN, say): never written by this library
        same = False
    if not same:
        raise FormatError(
            f"{where}: the commit record does not match its record_digest: it was changed after it was written (a "
            "flipped bit, an edit), so its values, digests and entries cannot be trusted; restore it from a copy"
        )


def sign(attrs: dict[str, Any], key: bytes) -> dict[str, str]:
    """The ``signature`` member for the commit record's attributes ``attrs`` (which must
    not hold one yet)."""
    assert "signature" not in attrs
    mac = hmac.new(key, canonical(attrs), hashlib.sha256).hexdigest()
    return {"alg": SIGNATURE_ALG, "value": mac}


def check_signature(attrs: dict[str, Any], key: bytes, where: str) -> None:
    """Raise :class:`AuthenticationError` unless ``attrs`` carries a valid signature."""
    sig = attrs.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != SIGNATURE_ALG or not isinstance(sig.get("value"), str):
        raise AuthenticationError(f"{where} is not signed, but a key was given: refusing an unauthenticated checkpoint")
    body = {k: v for k, v in attrs.items() if k != "signature"}
    try:
        mac = hmac.new(key, canonical(body), hashlib.sha256).hexdigest()
    except (ValueError, RecursionError):  # not canonical JSON (NaN, say): never signed by this library
        raise AuthenticationError(f"{where}: the commit record is not canonical JSON, so its signature cannot verify") from None
    if not hmac.compare_digest(mac, sig["value"]):
        raise AuthenticationError(f"{where}: the signature does not verify with this key (changed, or another key)")
