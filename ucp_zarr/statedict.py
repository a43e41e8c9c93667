"""State dicts: flattening to DCP-spelled keys, JSON values, and where each tensor is stored.

Flattening follows ``torch.distributed.checkpoint``: mappings are walked with ``str`` keys
joined by ``.``; a list is walked (``.0``, ``.1``, ...) only when it holds tensors, mappings
or such lists; tuples and other lists are leaves. A tensor leaf is stored as a Zarr array;
any other leaf must be JSON-able and is stored in the root document.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from .errors import NotJSONableError

Path = tuple[Any, ...]
"""The original keys and list indices from the state dict's root to a leaf."""


@dataclass(frozen=True)
class Leaf:
    key: str
    path: Path
    value: Any


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def iter_leaves(state_dict: Mapping[str, Any]) -> Iterator[Leaf]:
    """The leaves of a nested state dict with their DCP-style flattened keys."""

    def walk(path: Path, value: Any) -> Iterator[Leaf]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from walk(path + (k,), v)
        elif isinstance(value, list) and not _is_terminal(value):
            for i, v in enumerate(value):
                yield from walk(path + (i,), v)
        else:
            yield Leaf(".".join(str(p) for p in path), path, value)

    seen: set[str] = set()
    for k, v in state_dict.items():
        for leaf in walk((k,), v):
            if leaf.key in seen:
                raise ValueError(f"two entries of the state dict flatten to the key {leaf.key!r}")
            seen.add(leaf.key)
            yield leaf


def _is_terminal(value: list) -> bool:
    for v in value:
        if isinstance(v, Mapping) or is_tensor(v):
            return False
        if isinstance(v, list) and not _is_terminal(v):
            return False
    return True


def set_leaf(state_dict: Any, path: Path, value: Any) -> None:
    """Replace the leaf at ``path``."""
    parent = state_dict
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value


# --- JSON values ---------------------------------------------------------------------------

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_json(value: Any, key: str) -> Any:
    """``value`` as JSON-able data, so that :func:`from_json` gives back an equal value of
    the same types at every depth:

    * ``None``, ``bool``, ``int``, ``str``, finite ``float``: themselves (numpy scalars too);
    * non-finite floats: ``{"$float": "nan"|"inf"|"-inf"}``;
    * ``bytes``/``bytearray``: ``{"$bytes": "<base64>"}`` (opaque bytes; never unpickled);
    * lists: JSON arrays; tuples: ``{"$tuple": [...]}`` (so ``(1, (2, 3))`` comes back as
      itself, not as ``[1, [2, 3]]``);
    * ``str``-keyed mappings: JSON objects (as ``dict``); a key starting with ``$`` gets one
      more ``$``, so that a user's key never reads as one of the tags above.

    Raises :class:`NotJSONableError` naming ``key`` for anything else (objects, dtypes).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        return to_json(value.item(), key)  # numpy scalars
    if isinstance(value, list):
        return [to_json(v, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [to_json(v, f"{key}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise NotJSONableError(f"key {key!r}: mapping key {k!r} is not a string")
            out["$" + k if k.startswith("$") else k] = to_json(v, f"{key}.{k}")
        return out
    raise NotJSONableError(
        f"value at key {key!r} of type {type(value).__name__} is neither a tensor nor JSON-able "
        "(None, bool, int, float, str, bytes, lists and str-keyed dicts of them)"
    )


def from_json(value: Any) -> Any:
    """Inverse of :func:`to_json`."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$float"}:
            return _NONFINITE[value["$float"]]
        if set(value) == {"$bytes"}:
            return base64.b64decode(value["$bytes"])
        if set(value) == {"$tuple"}:
            return tuple(from_json(v) for v in value["$tuple"])
        return {k[1:] if k.startswith("$$") else k: from_json(v) for k, v in value.items()}
    return value


# --- array paths ---------------------------------------------------------------------------

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _escape(name: str) -> str:
    """A safe node name: characters outside ``[A-Za-z0-9_.-]`` percent-encoded (each UTF-8
    byte as ``%XX``), and a leading ``.`` or ``_`` too when the name would otherwise be
    hidden, reserved by Zarr (``__``), or ``zarr.json``."""
    name = _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)
    if name.startswith(("__", ".")) or name in ("", "zarr.json"):
        name = f"%{ord(name[0]):02X}{name[1:]}" if name else "%00"
    return name


def array_path(key: str) -> str:
    """Where the tensor of ``key`` is stored: ``<group>/<array>``, one group per parameter.

    A parameter and its optimizer moments share a group named after the parameter's FQN:

    * ``<opt>.state.<fqn>.<moment>`` -> ``<fqn>/<opt>.<moment>``
      (``optim.state.layers.0.w.exp_avg`` -> ``layers.0.w/optim.exp_avg``)
    * ``<top>.<fqn>`` -> ``<fqn>/<top>`` (``model.layers.0.w`` -> ``layers.0.w/model``)
    * ``<top>`` -> ``<top>/<top>``

    Characters outside ``[A-Za-z0-9_.-]`` are percent-encoded. The root document maps every
    key to its path, so readers never need to invert this rule.
    """
    parts = key.split(".")
    if len(parts) >= 4 and parts[1] == "state":
        group, name = ".".join(parts[2:-1]), f"{parts[0]}.{parts[-1]}"
    elif len(parts) >= 2:
        group, name = ".".join(parts[1:]), parts[0]
    else:
        group, name = key, key
    return f"{_escape(group)}/{_escape(name)}"


def assign_array_paths(keys: list[str]) -> dict[str, str]:
    """:func:`array_path` for each key, made unique: a later key whose path is taken gets
    ``~2``, ``~3``, ... appended (``~`` never appears in an escaped name)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        base = array_path(key)
        path, n = base, 1
        while path in taken:
            n += 1
            path = f"{base}~{n}"
        taken.add(path)
        out[key] = path
    return out
