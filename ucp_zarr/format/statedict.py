"""State dicts: flattening to DCP-spelled keys, JSON values, and where each tensor is stored.

Flattening follows ``torch.distributed.checkpoint``: mappings are walked with ``str`` keys
joined by ``.``; a list is walked (``.0``, ``.1``, ...) only when it holds tensors, mappings
or such lists; tuples and other lists are leaves. A tensor leaf is stored as a Zarr array;
any other leaf must be JSON-able and is stored in the root document.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, MutableMapping

from ..errors import FormatError, LayoutError, NotJSONableError

Path = tuple[Any, ...]
"""The original keys and list indices from the state dict's root to a leaf."""


@dataclass(frozen=True)
class Leaf:
    key: str
    path: Path
    value: Any


def is_tensor(value: Any) -> bool:
    # No value is a tensor before torch is imported, so readers need not import it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or holds one in its dicts, lists and tuples."""
    if is_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(holds_tensor(v) for v in value)


MAX_DEPTH = 100
"""How deeply a state dict (and a JSON value inside it) may nest: far beyond any real one,
and well within what a JSON reader parses without running out of stack."""


def iter_leaves(state_dict: Mapping[str, Any], empty: list[tuple[int, Path]] | None = None) -> Iterator[Leaf]:
    """The leaves of a nested state dict with their DCP-style flattened keys; ``empty``, when
    given, receives ``(leaves before it, path)`` for every empty mapping below the root
    (which has no leaf to stand for it).

    Raises :class:`LayoutError` when two entries flatten to one key (``{"a.b": x, "a":
    {"b": y}}``, or keys ``1`` and ``"1"``) and :class:`NotJSONableError` for a state dict
    that contains itself or nests deeper than :data:`MAX_DEPTH`."""
    seen: dict[str, Path] = {}

    def walk(path: Path, value: Any, inside: tuple[int, ...]) -> Iterator[Leaf]:
        if isinstance(value, Mapping) or (isinstance(value, list) and not _is_terminal(value, len(path))):
            _check_nesting(path, value, inside)
            inside = inside + (id(value),)
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            if empty is not None and isinstance(value, Mapping) and not value:
                empty.append((len(seen), path))
            for k, v in items:
                yield from walk(path + (k,), v, inside)
        else:
            key = ".".join(str(p) for p in path)
            _check_text(key, key)
            yield Leaf(key, path, value)

    for k, v in state_dict.items():
        for leaf in walk((k,), v, (id(state_dict),)):
            if leaf.key in seen:
                raise LayoutError(
                    f"two entries of the state dict flatten to the key {leaf.key!r}: {_spell(seen[leaf.key])} "
                    f"and {_spell(leaf.path)}"
                )
            seen[leaf.key] = leaf.path
            yield leaf


def _spell(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _check_nesting(path: Path, value: Any, inside: tuple[int, ...]) -> None:
    where = ".".join(str(p) for p in path)
    if id(value) in inside:
        raise NotJSONableError(f"the state dict contains itself at key {where!r}")
    if len(inside) > MAX_DEPTH:
        raise NotJSONableError(f"the state dict nests deeper than {MAX_DEPTH} levels at key {where[:200]!r}...")


def _is_terminal(value: list, depth: int) -> bool:
    """A list that holds no tensor and no mapping at any depth (a JSON leaf)."""
    stack, seen = [(value, depth)], set()
    while stack:
        lst, d = stack.pop()
        if id(lst) in seen or d > MAX_DEPTH:
            return False  # a cycle or a runaway nesting: let the walk report it
        seen.add(id(lst))
        for v in lst:
            if isinstance(v, Mapping) or is_tensor(v):
                return False
            if isinstance(v, list):
                stack.append((v, d + 1))
    return True


def _check_text(text: str, key: str) -> None:
    """Strings are stored as UTF-8: refuse one that is not valid Unicode (lone or paired
    surrogates), which could not be stored or would come back as another string."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NotJSONableError(
            f"key {key.encode('utf-8', 'backslashreplace').decode()!r}: {text.encode('utf-8', 'backslashreplace').decode()!r}"
            " holds surrogate code points and is not valid Unicode"
        ) from None


def set_leaf(state_dict: Any, path: Path, value: Any) -> None:
    """Replace the leaf at ``path``."""
    parent = state_dict
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value


# --- JSON values ---------------------------------------------------------------------------

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_QUIET_NAN_BITS = 0x7FF8_0000_0000_0000
"""A NaN's bits but its sign: the one NaN Python and numpy arithmetic make (x86's 0/0
sets the sign too, which the format does not keep: readers of this format version know
one ``nan``)."""
MAX_INT_DIGITS = 4300
"""The most digits of an integer value: what Python parses from JSON by default
(``sys.get_int_max_str_digits``), so that every reader can read the commit record."""
_INT_TEXT_BITS = 14_000
"""Integers up to this many bits have fewer digits: larger ones are counted."""


def _digits(value: int) -> int:
    try:
        return len(str(abs(value)))
    except ValueError:  # (more than this process spells)
        return MAX_INT_DIGITS + 1


def to_json(value: Any, key: str) -> Any:
    """``value`` as JSON-able data, so that :func:`from_json` gives back an equal value of
    the same types at every depth:

    * ``None``, ``bool``, ``int``, ``str``, finite ``float``: themselves (numpy scalars and
      0-d arrays as the Python number of equal value: they come back as that number);
    * non-finite floats: ``{"$float": "nan"|"inf"|"-inf"}`` (a NaN's sign is not kept; a
      NaN with another payload is refused: store it as a tensor to keep its bits);
    * ``bytes``/``bytearray``: ``{"$bytes": "<base64>"}`` (opaque bytes; never unpickled);
    * lists: JSON arrays; tuples: ``{"$tuple": [...]}`` (so ``(1, (2, 3))`` comes back as
      itself, not as ``[1, [2, 3]]``);
    * ``str``-keyed mappings: JSON objects (as ``dict``); a key starting with ``$`` gets one
      more ``$``, so that a user's key never reads as one of the tags above.

    Raises :class:`NotJSONableError` naming ``key`` for anything else (objects, dtypes,
    strings that are not valid Unicode, values nested deeper than :data:`MAX_DEPTH`).
    """
    return _to_json(value, key, 0)


def _to_json(value: Any, key: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise NotJSONableError(f"value at key {key[:200]!r}... nests deeper than {MAX_DEPTH} levels (or contains itself)")
    if isinstance(value, str):
        _check_text(value, key)
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, int):
        if value.bit_length() > _INT_TEXT_BITS and _digits(value) > MAX_INT_DIGITS:
            raise NotJSONableError(
                f"value at key {key!r}: an integer of more than {MAX_INT_DIGITS} digits, more than Python reads "
                "from JSON by default (sys.get_int_max_str_digits): store it as bytes or a tensor"
            )
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        if not math.isnan(value):
            return {"$float": "inf" if value > 0 else "-inf"}
        bits = struct.unpack("<Q", struct.pack("<d", value))[0]
        if bits & ~(1 << 63) != _QUIET_NAN_BITS:
            raise NotJSONableError(
                f"value at key {key!r}: a NaN with the payload {bits:#018x}, which the format does not keep "
                "(it stores one nan): store it as a tensor to keep its bits"
            )
        return {"$float": "nan"}
    if is_tensor(value):  # (a 0-d one too: as a number it would load as a float, not a tensor)
        raise NotJSONableError(
            f"value at key {key!r} is a tensor inside a value stored as JSON (a tuple, or what one PerRank wraps): "
            "tensors are leaves of the state dict's dicts and lists only (a tuple is one value, as in torch DCP); "
            "in a state dict to save, make the tuple a list, or wrap each tensor in a PerRank of its own"
        )
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        return _to_json(value.item(), key, depth)  # numpy scalars
    if isinstance(value, list):
        return [_to_json(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [_to_json(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise NotJSONableError(f"key {key!r}: mapping key {k!r} is not a string")
            _check_text(k, key)
            out["$" + k if k.startswith("$") else k] = _to_json(v, f"{key}.{k}", depth + 1)
        return out
    raise NotJSONableError(
        f"value at key {key!r} of type {type(value).__name__} is neither a tensor nor JSON-able "
        "(None, bool, int, float, str, bytes, lists and str-keyed dicts of them)"
    )


_EXACT = (type(None), bool, int, float, str, bytes, list, tuple, dict)
"""The types :func:`from_json` gives back: a value made of these alone round-trips type for type."""


def check_exact(value: Any, key: str) -> None:
    """Refuse (:class:`NotJSONableError`, naming ``key``) a value :func:`to_json` takes but
    :func:`from_json` would give back as another type: a subclass (an ``IntEnum``, a
    namedtuple, ``torch.Size``, an ``OrderedDict``), a numpy scalar, a ``bytearray``, at any
    depth. (For callers that promise values back as they were: the DCP drop-in, since DCP's
    own writer pickles them. Call after ``to_json``, which bounds the depth.)"""
    kind = type(value)
    if kind not in _EXACT:
        base = next((t.__name__ for t in _EXACT if isinstance(value, t)), None)
        raise NotJSONableError(
            f"value at key {key!r} is a {kind.__module__}.{kind.__qualname__}"
            + (f", which would come back as a plain {base}" if base else ", which would come back as a plain number")
            + ": ucp_zarr stores no pickles, so it cannot give it back as itself; convert it to a plain value "
            "before saving (int(v), tuple(v), dict(v), float(v), bytes(v))"
        )
    if kind in (list, tuple):
        for i, v in enumerate(value):
            check_exact(v, f"{key}.{i}")
    elif kind is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise NotJSONableError(
                    f"value at key {key!r}: mapping key {k!r} is a {type(k).__module__}.{type(k).__qualname__}, which "
                    "would come back as a plain str: convert it (str(k)) before saving"
                )
            check_exact(v, f"{key}.{k}")


def from_json(value: Any, key: str = "") -> Any:
    """Inverse of :func:`to_json`. Raises :class:`FormatError` naming ``key`` for data that
    :func:`to_json` never produces (an unknown or malformed ``$`` tag, a value nested deeper
    than :data:`MAX_DEPTH`)."""
    return _from_json(value, key, 0)


def _from_json(value: Any, key: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise FormatError(f"value {key[:200]!r}... nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [_from_json(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        tag = next(iter(value), None)
        if isinstance(tag, str) and tag.startswith("$") and not tag.startswith("$$"):
            return _from_tag(value, key, depth)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or (k.startswith("$") and not k.startswith("$$")):
                raise FormatError(f"value {key!r}: member {k!r} is neither a key nor a tag of this format")
            out[k[1:] if k.startswith("$") else k] = _from_json(v, f"{key}.{k}", depth + 1)
        return out
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    raise FormatError(f"value {key!r}: {value!r} is not a value this format stores")


def _from_tag(value: dict[str, Any], key: str, depth: int) -> Any:
    tag, body = next(iter(value.items())) if len(value) == 1 else (None, None)
    if tag == "$float" and body in _NONFINITE:
        return _NONFINITE[body]
    if tag == "$bytes" and isinstance(body, str):
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:
            pass
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_from_json(v, f"{key}.{i}", depth + 1) for i, v in enumerate(body))
    raise FormatError(f"value {key!r}: {str(value)[:200]} is not a valid tagged value of this format")


# --- nesting -------------------------------------------------------------------------------

STRUCTURE_FORMAT = "ucp_zarr.structure/1"


class ListIndex(int):
    """A position in a list, as an element of a :data:`Path` read from a checkpoint (a
    plain ``int`` there is a mapping key)."""


@dataclass(frozen=True)
class Structure:
    """How a saved state dict nested: each flattened key's path (list positions as
    :class:`ListIndex`, mapping keys as themselves), in the state dict's order, and its
    empty mappings, each after the first ``n`` keys of ``paths``."""

    paths: dict[str, Path]
    empty: list[tuple[int, Path]]
    metadata: list[tuple[Path, dict[str, Any]]] = field(default_factory=list)
    """The ``_metadata`` of the mappings that had one (a module's ``state_dict()``: each
    submodule's ``{"version": n}``, which ``load_state_dict`` passes to the modules)."""

    def to_json(self) -> dict[str, Any]:
        """The commit record's ``structure`` member (FORMAT.md section 3)."""
        out: dict[str, Any] = {"format": STRUCTURE_FORMAT, "paths": {k: _path_to_json(p) for k, p in self.paths.items()}}
        if self.empty:
            out["empty"] = [[n, _path_to_json(p)] for n, p in self.empty]
        if self.metadata:
            out["metadata"] = [[_path_to_json(p), to_json(m, f"{key_of(p)}._metadata".lstrip("."))]
                               for p, m in self.metadata]
        return out

    @classmethod
    def from_json(cls, doc: Any, keys: set[str], where: str) -> "Structure":
        """Decode and check a ``structure`` member: every key one of ``keys`` and spelled by
        its path, list positions below the number of entries (so a rebuild allocates no
        more than the record holds). Raises :class:`FormatError`."""
        if not (isinstance(doc, dict) and doc.get("format") == STRUCTURE_FORMAT and isinstance(doc.get("paths"), dict)):
            raise FormatError(f"{where}: structure is not a {STRUCTURE_FORMAT} object with paths")
        empty = doc.get("empty", [])
        if not isinstance(empty, list):
            raise FormatError(f"{where}: structure.empty is not a list")
        paths: dict[str, Path] = {}
        for key, raw in doc["paths"].items():
            if key not in keys:
                raise FormatError(f"{where}: structure names {key!r}, which the checkpoint does not hold")
            path = _path_from_json(raw, f"{where}: structure of {key!r}")
            if key_of(path) != key:
                raise FormatError(f"{where}: the structure path of {key!r} spells another key")
            paths[key] = path
        out = []
        for item in empty:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] <= len(paths)):
                raise FormatError(f"{where}: structure.empty holds {str(item)[:100]}, not [position, path]")
            out.append((item[0], _path_from_json(item[1], f"{where}: structure.empty")))
        metadata = []
        for item in doc.get("metadata", []) if isinstance(doc.get("metadata", []), list) else [None]:
            if not (isinstance(item, list) and len(item) == 2):
                raise FormatError(f"{where}: structure.metadata holds {str(item)[:100]}, not [path, metadata]")
            meta = from_json(item[1], f"{where}: structure.metadata")
            if not isinstance(meta, dict):
                raise FormatError(f"{where}: structure.metadata holds {str(item[1])[:100]}, not a mapping")
            metadata.append((_path_from_json(item[0], f"{where}: structure.metadata", root=True), meta))
        _check_list_slots([*paths.values(), *(p for _, p in out)], where)
        return cls(paths, out, metadata)

    def select(self, keep: Callable[[str], bool], keep_empty: Callable[[str], bool] | None = None) -> "Structure":
        """The structure of the keys ``keep`` accepts, and of the empty mappings (by their
        spelling) that ``keep_empty`` (default ``keep``) accepts."""
        kept, before = {}, [0]
        for key, path in self.paths.items():
            if keep(key):
                kept[key] = path
            before.append(len(kept))
        keep_empty = keep_empty or keep
        return Structure(kept, [(before[n], p) for n, p in self.empty if keep_empty(key_of(p))], self.metadata)

    @classmethod
    def merged(cls, per_rank: list["Structure | None"]) -> "Structure | None":
        """One structure from every saving rank's (None when none recorded one): the first
        rank's, then the keys and empty mappings only later ranks hold, in rank order; a
        mapping empty on one rank that holds keys on another is not empty."""
        given = [s for s in per_rank if s is not None]
        if not given:
            return None
        paths = dict(given[0].paths)
        empty = list(given[0].empty)
        metadata: dict[Path, dict[str, Any]] = {}
        for other in given:
            for key, path in other.paths.items():
                paths.setdefault(key, path)
            known = {p for _, p in empty}
            empty += [(len(paths), p) for _, p in other.empty if p not in known]
            for path, meta in other.metadata:  # (another pipeline stage's modules: their entries added)
                metadata[path] = meta | metadata.get(path, {})
        held = {path[:i] for path in paths.values() for i in range(1, len(path))}
        return cls(paths, [(n, p) for n, p in empty if p not in held], list(metadata.items()))

    def nest(self, values: Mapping[str, Any], where: str) -> dict[Any, Any]:
        """The nested state dict of ``values`` (flattened key -> value) as it was saved, with
        its empty mappings; a key of ``values`` without a path stays flat at the top."""
        root: dict[Any, Any] = {}
        empty: dict[int, list[Path]] = {}
        for n, path in self.empty:
            empty.setdefault(n, []).append(path)
        for i, key in enumerate([*self.paths, None]):
            for path in empty.get(i, []):
                put_path(root, path, {}, where, replace=False)
            if key is not None and key in values:
                put_path(root, self.paths[key], values[key], where)
        for key, value in values.items():
            if key not in self.paths:
                put_path(root, (key,), value, where)
        for path, meta in self.metadata:
            root = _mark_at(root, path, meta)
        return root


def with_metadata(mapping: Mapping[Any, Any], meta: Mapping[str, Any]) -> OrderedDict[Any, Any]:
    """``mapping`` as an ``OrderedDict`` whose ``_metadata`` is ``meta``, as a module's
    ``state_dict()`` is."""
    marked = OrderedDict(mapping)
    marked._metadata = meta  # type: ignore[attr-defined]
    return marked


def _mark_at(root: dict[Any, Any], path: Path, meta: dict[str, Any]) -> dict[Any, Any]:
    """``root`` with the mapping at ``path`` (where there is one) given ``meta`` as its
    ``_metadata`` (:func:`with_metadata`)."""
    parent: Any = None
    node: Any = root
    for p in path:
        inside = isinstance(node, list) and isinstance(p, ListIndex) and p < len(node)
        if not (inside or isinstance(node, dict) and not isinstance(p, ListIndex) and p in node):
            return root
        parent, node = node, node[p]
    if not isinstance(node, dict):
        return root
    marked = with_metadata(node, OrderedDict(meta))
    if parent is None:
        return marked
    parent[path[-1]] = marked
    return root


def module_metadata(state_dict: Mapping[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """The ``_metadata`` of every mapping in ``state_dict`` that has one, by path (its
    entries JSON holds: a hook's other objects are left out, as if not recorded)."""
    out: list[tuple[Path, dict[str, Any]]] = []

    def walk(path: Path, node: Any) -> None:
        if isinstance(node, Mapping):
            meta = getattr(node, "_metadata", None)
            if isinstance(meta, Mapping):
                out.append((path, {k: v for k, v in meta.items() if isinstance(k, str) and _storable(v)}))
            for k, v in node.items():
                if isinstance(v, (Mapping, list)):
                    walk(path + (k,), v)
        elif isinstance(node, list) and not _is_terminal(node, len(path)):
            for i, v in enumerate(node):
                if isinstance(v, (Mapping, list)):
                    walk(path + (ListIndex(i),), v)

    walk((), state_dict)
    return out


def _storable(value: Any) -> bool:
    try:
        to_json(value, "")
    except NotJSONableError:
        return False
    return True


def structure_of(state_dict: Mapping[str, Any], paths: Mapping[str, Path], empty: list[tuple[int, Path]]) -> Structure:
    """The :class:`Structure` of ``state_dict`` from the live paths of its stored keys (as
    :func:`iter_leaves` gave them; a key placed under another name maps to its leaf's
    path) and its empty mappings (as :func:`iter_leaves` gave them; a leaf not stored
    before one only moves it later among its siblings): list positions and mapping keys
    told apart by walking it."""
    out = {key: typed_path(state_dict, path, key) for key, path in paths.items()}
    return Structure(out, [(min(n, len(out)), typed_path(state_dict, p)) for n, p in empty], module_metadata(state_dict))


def typed_path(state_dict: Any, path: Path, key: str | None = None) -> Path:
    """``path`` with list positions as :class:`ListIndex`; with ``key`` (a stored key that
    differs from the path's spelling: a placed tensor's consolidated key), the leading and
    trailing elements that still spell it, and the rest of ``key`` as one mapping key."""
    node, typed = state_dict, []
    for p in path:
        typed.append(ListIndex(p) if isinstance(node, list) else p)
        node = node[p] if isinstance(node, (list, Mapping)) else None
    spelled = [str(p) for p in typed]
    if key is None or ".".join(spelled) == key:
        return tuple(typed)
    head = 0
    while head < len(typed) - 1 and key.startswith(".".join(spelled[: head + 1]) + "."):
        head += 1
    tail = 0
    while tail < len(typed) - head - 1 and key.endswith("." + ".".join(spelled[len(typed) - tail - 1 :])):
        tail += 1
    lead = ".".join(spelled[:head]) + "." if head else ""
    trail = "." + ".".join(spelled[len(typed) - tail :]) if tail else ""
    middle = key[len(lead) : len(key) - len(trail)]
    if not middle:
        return (key,)
    return (*typed[:head], middle, *typed[len(typed) - tail :])


def key_of(path: Path) -> str:
    """The flattened key ``path`` spells."""
    return ".".join(str(p) for p in path)


def _path_to_json(path: Path) -> list[Any]:
    """String keys as strings, list positions as integers, other mapping keys as
    ``{"key": <value>}`` (section 8's JSON values; a key JSON cannot hold, as its text:
    :func:`ucp_zarr.load` into a state dict with that key matches it by its flattened key,
    as DCP does; ``read_state_dict`` gives the text)."""
    out: list[Any] = []
    for p in path:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, ListIndex):
            out.append(int(p))
        else:
            try:
                out.append({"key": to_json(p, "")})
            except NotJSONableError:
                out.append(str(p))
    return out


MAX_EXTRA_LIST_SLOTS = 1 << 16
"""How many list slots a structure may make beyond one per node it names (a saved list has
no holes, so it makes none)."""


def _check_list_slots(paths: list[Path], where: str) -> None:
    """Refuse list positions that would make a rebuild allocate far more than the record
    holds (:class:`FormatError`)."""
    slots: dict[Path, int] = {}
    nodes = set()
    for path in paths:
        for i, p in enumerate(path):
            nodes.add(path[: i + 1])
            if isinstance(p, ListIndex):
                slots[path[:i]] = max(slots.get(path[:i], 0), p + 1)
    if sum(slots.values()) > len(nodes) + MAX_EXTRA_LIST_SLOTS:
        raise FormatError(f"{where}: the list positions of structure would make {sum(slots.values())} list slots")


def _path_from_json(raw: Any, where: str, root: bool = False) -> Path:
    """A path (``root``: the empty path of the root mapping too)."""
    if not (isinstance(raw, list) and (raw or root)):
        raise FormatError(f"{where}: a path is a non-empty list")
    out: list[Any] = []
    for p in raw:
        if isinstance(p, str):
            out.append(p)
        elif type(p) is int and p >= 0:
            out.append(ListIndex(p))
        elif isinstance(p, dict) and set(p) == {"key"}:
            key = from_json(p["key"], where)
            if isinstance(key, str) or not hashable(key):
                raise FormatError(f"{where}: mapping key {str(p)[:100]} is not a key of another type than str")
            out.append(key)
        else:
            raise FormatError(f"{where}: path element {str(p)[:100]} is neither a key nor a list position")
    return tuple(out)


def hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def put_path(root: MutableMapping[Any, Any], path: Path, value: Any, where: str, replace: bool = True) -> None:
    """Set ``path`` in ``root`` (unless ``replace`` is false and it is set), making the
    dicts and lists on the way (list slots not reached yet are None, as DCP's loaders
    leave them); :class:`FormatError` (naming ``where``) where ``root`` nests otherwise."""
    node: Any = root
    for i, here in enumerate(path):
        last = i == len(path) - 1
        if isinstance(here, ListIndex) != isinstance(node, list):
            raise FormatError(f"{where}: {_spell(path)} does not match the nesting of the other keys")
        if isinstance(node, list):
            node.extend([None] * (here + 1 - len(node)))
            held = node[here] is not None
        else:
            held = here in node
        if last and (replace or not held):
            node[here] = value
        elif not last and not held:
            node[here] = [] if isinstance(path[i + 1], ListIndex) else {}
        node = node[here]
        if not last and not isinstance(node, (list, MutableMapping)):
            raise FormatError(f"{where}: {_spell(path)} passes through a value")


# --- array paths ---------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
MAX_NAME = 200
"""The longest node name made (file systems allow 255 bytes, and ``~n`` may be appended)."""


def _escape(name: str) -> str:
    """A safe node name: characters outside ``[A-Za-z0-9_.-]`` percent-encoded (each UTF-8
    byte as ``%XX``), and a leading ``.`` or ``_`` too when the name would otherwise be
    hidden, reserved by Zarr (``__``), or ``zarr.json``. A name longer than
    :data:`MAX_NAME` keeps its first 160 characters and gets ``~`` and 32 hex digits of the
    SHA-256 of the whole escaped name appended."""
    name = _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)
    if name.startswith(("__", ".")) or name in ("", "zarr.json"):
        name = f"%{ord(name[0]):02X}{name[1:]}" if name else "%00"
    if len(name) > MAX_NAME:
        head = re.sub(r"%[0-9A-F]?$", "", name[:160])
        name = f"{head}~{hashlib.sha256(name.encode()).hexdigest()[:32]}"
    return name


def array_path(key: str) -> str:
    """Where the tensor of ``key`` is stored: ``<group>/<array>``, one group per parameter.

    A parameter and its optimizer moments share a group named after the parameter's FQN:

    * ``<opt>.state.<fqn>.<moment>`` -> ``<fqn>/<opt>.<moment>``
      (``optim.state.layers.0.w.exp_avg`` -> ``layers.0.w/optim.exp_avg``)
    * ``<top>.<fqn>`` -> ``<fqn>/<top>`` (``model.layers.0.w`` -> ``layers.0.w/model``)
    * ``<top>`` -> ``<top>/<top>``

    Characters outside ``[A-Za-z0-9_.-]`` are percent-encoded and long names shortened
    (see :func:`_escape`). The root document maps every key to its path, so readers never
    need to invert this rule.
    """
    parts = key.split(".")
    if len(parts) >= 4 and parts[1] == "state":
        group, name = ".".join(parts[2:-1]), f"{parts[0]}.{parts[-1]}"
    elif len(parts) >= 2:
        group, name = ".".join(parts[1:]), parts[0]
    else:
        group, name = key, key
    return f"{_escape(group)}/{_escape(name)}"


def assign_array_paths(keys: list[str], aliases: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """:func:`array_path` for each key (or for its alias in ``aliases``), made unique: a
    later key whose path is taken gets ``~2``, ``~3``, ... appended."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        base = array_path((aliases or {}).get(key) or key)
        path, n = base, 1
        while path in taken:
            n += 1
            path = f"{base}~{n}"
        taken.add(path)
        out[key] = path
    return out
