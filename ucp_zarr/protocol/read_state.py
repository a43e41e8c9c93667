"""Reading a whole checkpoint as a new state dict (read_state_dict): nested as saved, tensors
materialised on a device, DCP-written values in their own structure."""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch

from .distributed import Comm
from .reader import allocating, open_store_reader
from ..format.dtypes import stored_dtype_by_name
from ..errors import KeyMismatchError
from ..format.commit_record import CheckpointMeta
from ..format.statedict import STRUCTURE_FORMAT, Structure, from_json, key_of
from ..io.factory import open_store
from .filling import read_workers, run_all


# --- the whole state dict ----------------------------------------------------------------------


def read_state_dict(
    path: str | os.PathLike[str],
    *,
    keys: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    storage_options: dict[str, Any] | None = None,
    hmac_key: bytes | None = None,
) -> dict[Any, Any]:
    """The state dict saved at ``path``, as ``torch.load`` would give it back: nested
    mappings and lists, integer (and other non-string) keys, tuples and every other value
    as saved, tensors materialised on ``device`` in their saved dtype. Types are the base
    ones (JSON records no classes): every mapping a ``dict`` (an ``OrderedDict``, or the
    ``Counter`` of ``MultiStepLR``'s milestones, too, as DCP's loaders rebuild mappings),
    every tuple a ``tuple`` (a namedtuple or ``torch.Size`` too), an ``int``/``str`` enum
    member its value (a :func:`load` into a state dict keeps the target's types; the DCP
    drop-in refuses such values at save); a module's ``state_dict()`` comes back as an
    ``OrderedDict`` with its ``_metadata`` (the versions ``load_state_dict`` hands to the
    submodules), as ``torch.load`` gives it; a mapping key JSON cannot hold (a
    ``frozenset``, an object) comes back as its ``str()`` (:func:`load` into a state dict
    with that key matches it, as DCP does). What a trainer's
    loader needs, as DCP's ``dcp_to_torch_save`` gives it; no unpickling, nothing to
    fill in advance (:func:`load` fills a state dict of any layout in place instead).

    ``keys`` selects flattened keys (``ck.keys()``'s spelling) or prefixes of them at a
    dot (``"model"``, ``"optim.state"``); one that selects nothing raises
    :class:`~ucp_zarr.KeyMismatchError`. Per-rank state (:class:`~ucp_zarr.PerRank`) comes
    back as the lowest saving rank's copy, unwrapped (``ucp_zarr.open(path).read(key,
    rank=r)`` reads another). ``BytesIO`` values saved through DCP come back as
    ``BytesIO``. A checkpoint that does not record its nesting (saved by an older
    ucp_zarr, converted from a flat format such as safetensors, or through DCP without
    ``planner_data``) comes back flat: ``{flattened key: value}``; one converted from a
    ``torch.save`` file or a DCP folder nests as ``torch.load`` / ``dcp_to_torch_save`` do.
    """
    ck = open_store_reader(open_store(path, storage_options), hmac_key, shared=Comm().world > 1)
    meta = ck.meta
    stored = [*meta.tensors, *meta.values, *meta.rank_values, *meta.ties]
    where = f"{ck.store.url}/zarr.json"
    structure, blobs = meta.structure, dcp_blobs(meta)
    if structure is None:
        structure = dcp_structure(meta, where)
    empty = [] if structure is None else [key_of(p) for _, p in structure.empty]
    wanted = _selected(stored, keys, empty)
    device = torch.device(device)
    needed = wanted | {meta.ties[a] for a in wanted & set(meta.ties)}
    tensors, reads = {}, []
    for key in (k for k in meta.tensors if k in needed):  # each read prepared here, run in the pool
        entry = meta.tensors[key]
        dtype = stored_dtype_by_name(entry.dtype)
        with allocating(key, tuple(entry.shape), dtype.itemsize):
            out = torch.empty(tuple(entry.shape), dtype=dtype.torch_dtype, device=device)
        tensors[key], read = ck.prepare_read(key, out=out)
        reads.append(read)
    with ThreadPoolExecutor(read_workers(ck.store)) as pool:
        run_all(pool, reads)
    values: dict[str, Any] = {}
    for key in stored:
        if key not in wanted:
            continue
        if meta.canonical(key) in tensors:  # (tied tensors: one tensor under each of their keys)
            values[key] = tensors[meta.canonical(key)]
        else:
            raw = meta.values[key] if key in meta.values else meta.rank_values[key][min(meta.rank_values[key])]
            value = from_json(raw, key)
            values[key] = io.BytesIO(value) if key in blobs and isinstance(value, bytes) else value
    if structure is None:
        return values
    return structure.select(wanted.__contains__, lambda k: _selects(k, keys)).nest(values, f"{where}: structure")


def _selected(stored: list[str], keys: Iterable[str] | None, empty: list[str]) -> set[str]:
    """The ``stored`` keys that ``keys`` select; :class:`KeyMismatchError` for one that
    selects nothing stored and no ``empty`` mapping (a fresh optimizer's ``state``)."""
    if keys is None:
        return set(stored)
    asked = [keys] if isinstance(keys, str) else list(keys)
    out = {k for k in stored if _selects(k, asked)}
    unmatched = [a for a in asked if not any(_selects(k, [a]) for k in [*stored, *empty])]
    if unmatched:
        raise KeyMismatchError(unmatched, [])
    return out


def _selects(key: str, asked: Iterable[str] | None) -> bool:
    """Whether ``key`` is one of ``asked`` or lies below one (all keys: ``asked`` None)."""
    if asked is None:
        return True
    asked = [asked] if isinstance(asked, str) else asked
    return any(key == a or key.startswith(a + ".") for a in asked)


def dcp_structure(meta: CheckpointMeta, where: str) -> Structure | None:
    """The nesting a save through torch DCP recorded (``layout.dcp.planner_data``: names
    and list positions, as this format's structure spells them), if any."""
    dcp = meta.layout.get("dcp")
    planner = dcp.get("planner_data") if isinstance(dcp, dict) else None
    if not isinstance(planner, dict):
        return None
    keys = {*meta.tensors, *meta.values, *meta.rank_values}
    doc = {"format": STRUCTURE_FORMAT, "paths": {k: p for k, p in planner.items() if k in keys}}
    return Structure.from_json(doc, keys, f"{where}: layout.dcp.planner_data")


def dcp_blobs(meta: CheckpointMeta) -> set[str]:
    """Keys of values a save through torch DCP was given as ``io.BytesIO``."""
    dcp = meta.layout.get("dcp")
    blobs = dcp.get("bytes_io") if isinstance(dcp, dict) else None
    return {k for k in blobs if isinstance(k, str)} if isinstance(blobs, list) else set()
