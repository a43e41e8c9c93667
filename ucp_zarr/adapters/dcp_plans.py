"""DCP's plans and metadata in ucp_zarr's terms: a save plan as fragments and values, the stored DCP
layout record (planner data, blobs), stored values and boxes as DCP reads them."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..protocol.reader import CheckpointReader
from ..errors import FormatError
from ..format.commit_record import CheckpointMeta
from ..protocol.fragments import Fragment
from ..layout import Box
from ..format.statedict import ListIndex, check_exact, from_json, to_json
from ..protocol.read_state import dcp_structure


DCP_LAYOUT_FORMAT = "ucp_zarr.dcp/1"
"""``layout.dcp.format`` of the commit record (schema/FORMAT.md, section 3)."""


def merged_planner_data(per_plan: list[Any]) -> dict[str, tuple[str | int, ...]] | None:
    """Every plan's ``planner_data`` merged as ``DefaultSavePlanner`` merges it (the first
    plan naming a key wins), when each is a flatten mapping (flat key -> object path whose
    ``.``-join is the key); otherwise None (other planners' data is not stored)."""
    merged: dict[str, tuple[str | int, ...]] = {}
    for data in per_plan:
        if not isinstance(data, Mapping):
            return None
        for key, path in data.items():
            if not (isinstance(key, str) and isinstance(path, (tuple, list)) and _is_object_path(key, path)):
                return None
            merged.setdefault(key, tuple(path))
    return merged


def _is_object_path(key: str, path: Sequence[Any]) -> bool:
    return (
        len(path) > 0
        and all(isinstance(p, str) or (type(p) is int and p >= 0) for p in path)
        and ".".join(map(str, path)) == key
    )


def dcp_layout(planner_data: dict[str, tuple[str | int, ...]] | None, blobs: list[str]) -> dict[str, Any]:
    """The ``layout.dcp`` member of the commit record, or {} when there is nothing to keep."""
    out: dict[str, Any] = {}
    if planner_data:
        out["planner_data"] = {k: list(p) for k, p in planner_data.items()}
    if blobs:
        out["bytes_io"] = blobs
    return {"format": DCP_LAYOUT_FORMAT, **out} if out else {}


def _write_results(plan: SavePlan, values: dict[str, Any]) -> list[WriteResult]:
    results = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            size = len(json.dumps(values[item.index.fqn]))
        else:
            td = item.tensor_data
            assert td is not None
            size = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
        results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
    return results


def _plan_to_state(plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Fragment], dict[str, Any], list[str]]:
    """This rank's fragments (tensor items), JSON values (``BYTE_IO`` items) and the keys of
    the values that were ``BytesIO`` (stored as their bytes) of ``plan``."""
    fragments: dict[str, Fragment] = {}
    values: dict[str, Any] = {}
    blobs: list[str] = []
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            value = _original_value(planner, item)
            if isinstance(value, io.BytesIO):
                value = value.getvalue()  # (leaves the caller's position alone)
                blobs.append(fqn)
            values[fqn] = to_json(value, fqn)
            check_exact(value, fqn)  # (DCP's own writer pickles it: it comes back as it was, or is refused)
            continue
        td = item.tensor_data
        if td is None:
            raise ValueError(f"DCP write item {fqn!r} of type {item.type.name} has no tensor data")
        shape = tuple(int(n) for n in td.size)
        dtype = td.properties.dtype
        box = Box(tuple(int(o) for o in td.chunk.offsets), tuple(int(n) for n in td.chunk.sizes))
        tensor = planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {fqn!r}: the planner resolved a {type(tensor).__name__}, expected a tensor")
        tensor = tensor.detach()
        if tuple(tensor.shape) != box.shape:
            raise ValueError(
                f"tensor {fqn!r}: the planner resolved shape {list(tensor.shape)} for the chunk "
                f"{list(box.shape)} at {list(box.offset)}"
            )
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        frag = fragments.get(fqn)
        if frag is None:
            frag = fragments[fqn] = Fragment(fqn, shape, dtype, [], device=tensor.device)
        elif (frag.shape, frag.dtype) != (shape, dtype):
            raise ValueError(
                f"tensor {fqn!r}: write items disagree on the global shape or dtype "
                f"({list(frag.shape)} {frag.dtype} vs {list(shape)} {dtype})"
            )
        if box.numel:
            frag.pieces.append((box, tensor))
    return fragments, values, blobs


_MISSING = object()
_RESOLVING = ("resolve_data", "transform_object", "lookup_object")
"""The methods by which DCP's default planner turns a state-dict object into the bytes it saves."""


def _original_value(planner: SavePlanner, item: WriteItem) -> Any:
    """The object a ``BYTE_IO`` item saves, which ``dcp.load`` gives back: the state dict's
    own, where the planner resolves objects as DCP's default planner does (pickling them
    unchanged); else the ``torch.save`` stream the planner resolved, read back in this very
    process (never bytes from storage), allowing plain data only. A planner that transforms
    or redacts values is obeyed, as DCP's own writer obeys it."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    sd, lookup = getattr(planner, "state_dict", None), getattr(planner, "lookup_object", None)
    original = (sd[item.index.fqn] if isinstance(sd, dict) and item.index.fqn in sd
                else lookup(item.index) if lookup is not None else _MISSING)
    if original is not _MISSING and all(getattr(type(planner), m, None) is getattr(DefaultSavePlanner, m)
                                        for m in _RESOLVING):
        return original
    buf = planner.resolve_data(item)  # (Megatron's planner resolves its own torch.save streams as they are)
    if not isinstance(buf, io.BytesIO):
        raise TypeError(f"value {item.index.fqn!r}: the planner resolved a {type(buf).__name__}, expected the BytesIO "
                        "of a torch.save")
    try:
        with torch.serialization.safe_globals([io.BytesIO]):  # (a BytesIO value, pickled as DCP's default does)
            return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise TypeError(f"value {item.index.fqn!r}: the bytes the planner made of it are not plain data (a weights-only "
                        f"load refused them: {str(e).splitlines()[0]}); ucp_zarr stores values as JSON") from None


def _saved_value(ck: CheckpointReader, fqn: str, rank: int) -> Any:
    if fqn in ck.meta.values:
        return ck.meta.values[fqn]
    per_rank = ck.meta.rank_values.get(fqn)
    if per_rank is None:
        raise KeyError(f"no value {fqn!r} in checkpoint {ck.store.url}")
    return per_rank.get(rank, _MISSING)


def _as_bytes(value: Any, blob: bool) -> io.BytesIO:
    """What ``planner.load_bytes`` expects: a ``torch.save`` of the decoded JSON value (of a
    ``BytesIO`` holding the stored bytes when the saved value was one)."""
    obj = from_json(value)
    if blob:
        obj = io.BytesIO(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


MAX_EXTRA_LIST_SLOTS = 1 << 16
"""How many list slots ``planner_data`` may make DCP allocate beyond one per key (lists of
a state dict are descended only when they hold tensors or mappings, so each slot but those
of empty mappings holds at least one key)."""


def planner_data_of(meta: CheckpointMeta, keys: list[str], where: str) -> dict[str, tuple[str | int, ...]]:
    """``planner_data`` as ``DefaultSavePlanner`` records it for the state dict the checkpoint
    was saved from (its structure, or the DCP nesting it kept): list positions as integers,
    mapping keys as strings (DCP's own flattening spells an integer key ``"0"``); a key whose
    nesting is not recorded stays flat."""
    structure = meta.structure or dcp_structure(meta, where)
    paths = {} if structure is None else structure.paths
    wanted = set(keys)
    ordered = [k for k in paths if k in wanted] + [k for k in keys if k not in paths]  # (as saved)
    return {k: tuple(int(p) if isinstance(p, ListIndex) else str(p) for p in paths[k]) if k in paths else (k,)
            for k in ordered}


def _read_dcp_layout(meta: CheckpointMeta, url: str) -> tuple[dict[str, tuple[str | int, ...]] | None, frozenset[str]]:
    """``planner_data`` and the keys of ``BytesIO`` values from the root's ``layout.dcp``;
    :class:`FormatError` for anything :class:`ZarrStorageWriter` does not write (checked
    here because DCP's loaders build containers from these paths)."""
    raw = meta.layout.get("dcp")
    if raw is None:
        return None, frozenset()
    where = f"{url}/zarr.json: layout.dcp"
    if not isinstance(raw, dict) or raw.get("format") != DCP_LAYOUT_FORMAT:
        fmt = raw.get("format") if isinstance(raw, dict) else None
        raise FormatError(f"{where} has format {str(fmt)[:100]!r}; this library reads {DCP_LAYOUT_FORMAT!r}")
    planner_data: dict[str, tuple[str | int, ...]] | None = None
    if "planner_data" in raw:
        stored = raw["planner_data"]
        if not isinstance(stored, dict):
            raise FormatError(f"{where}.planner_data is not an object")
        planner_data = {}
        slots: dict[tuple[str | int, ...], int] = {}
        for key, path in stored.items():
            if not (isinstance(path, list) and _is_object_path(key, path)):
                raise FormatError(
                    f"{where}.planner_data[{key[:200]!r}] is {str(path)[:200]}, not a path of names and "
                    "non-negative indices that joins to the key"
                )
            for i, p in enumerate(path):
                if type(p) is int:
                    slots[tuple(path[:i])] = max(slots.get(tuple(path[:i]), 0), p + 1)
            planner_data[key] = tuple(path)
        if sum(slots.values()) > len(stored) + MAX_EXTRA_LIST_SLOTS:
            raise FormatError(f"{where}.planner_data: its list indices would make {sum(slots.values())} list slots")
    blobs = raw.get("bytes_io", [])
    if not isinstance(blobs, list):
        raise FormatError(f"{where}.bytes_io is not a list")
    for key in blobs:
        if not isinstance(key, str):
            raise FormatError(f"{where}.bytes_io holds {str(key)[:200]}, not a key")
        stored_values = [meta.values[key]] if key in meta.values else list(meta.rank_values.get(key, {}).values())
        if not stored_values or not all(isinstance(from_json(v, key), bytes) for v in stored_values):
            raise FormatError(f"{where}.bytes_io names {str(key)[:200]!r}, which is not a bytes value")
    return planner_data, frozenset(blobs)


def _read_into(ck: CheckpointReader, fqn: str, box: Box, target: torch.Tensor, rank: int | None, lossy: bool) -> None:
    with torch.no_grad():
        ck.read(fqn, box, out=target, rank=rank, allow_lossy_cast=lossy)


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape))
