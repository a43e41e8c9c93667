"""The Python face: :func:`save` and :func:`load` (``open`` lives in :mod:`.checkpoint`)."""

from __future__ import annotations

import datetime
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, MutableMapping

import torch

from . import __version__
from .arrayio import as_storage, write_shard
from .checkpoint import open_store_checkpoint
from .errors import CheckpointExistsError, KeyMismatchError
from .format import METADATA_FILE, PENDING_FILE, CheckpointMeta, TensorEntry, group_zarr_json
from .layout import Box
from .layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .planner import SavePlan, TensorSpec, plan_save
from .statedict import from_json, is_tensor, iter_leaves, set_leaf, to_json
from .storage import Store, open_store

DEFAULT_WORKERS = 4


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_workers: int = DEFAULT_WORKERS,
) -> None:
    """Save ``state_dict`` (nested dicts/lists of tensors and JSON-able values) at ``path``.

    The checkpoint becomes visible only when all its data is durable: the root ``zarr.json``
    (the commit record) is written last. Saving onto a committed checkpoint raises
    :class:`~ucp_zarr.errors.CheckpointExistsError`; the leftovers of a failed save at the
    same path are replaced.
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for leaf in iter_leaves(state_dict):
        if is_tensor(leaf.value):
            tensors[leaf.key] = leaf.value
        else:
            values[leaf.key] = to_json(leaf.value, leaf.key)
    plan = plan_save(
        [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()],
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
    )
    store = open_store(path, storage_options)
    _begin(store)
    host = {k: as_storage(t.detach().cpu(), plan.arrays[k][1]) for k, t in tensors.items()}
    with ThreadPoolExecutor(max_workers) as pool:
        _wait(pool.map(lambda doc: store.write(doc[0], [doc[1]]), _documents(plan)))
        _wait(
            pool.map(
                lambda task: write_shard(
                    store, task.path, plan.arrays[task.key][1], task.shard, host[task.key], Box.whole(host[task.key].shape)
                ),
                plan.shards,
            )
        )
    store.sync()
    meta = CheckpointMeta(
        tensors={k: TensorEntry(p, m.shape, m.dtype.name) for k, (p, m) in plan.arrays.items()},
        values=values,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        library=f"ucp_zarr {__version__}",
    )
    store.write_atomic(METADATA_FILE, _dumps(meta.to_zarr_json()))
    store.delete(PENDING_FILE)


def _begin(store: Store) -> None:
    """Claim ``store`` for a new checkpoint: refuse a committed one, clear a failed one."""
    if store.exists(METADATA_FILE):
        raise CheckpointExistsError(f"a checkpoint is already committed at {store.url}; choose a new path")
    if store.exists(PENDING_FILE):
        store.clear()
    elif not store.is_empty():
        raise CheckpointExistsError(
            f"{store.url} is not empty and holds no ucp_zarr checkpoint; refusing to write into it"
        )
    store.write(PENDING_FILE, [b"{}"])


def _documents(plan: SavePlan) -> list[tuple[str, bytes]]:
    docs = [(f"{g}/{METADATA_FILE}", _dumps(group_zarr_json())) for g in plan.groups]
    docs += [(f"{p}/{METADATA_FILE}", _dumps(m.to_zarr_json())) for p, m in plan.arrays.values()]
    return docs


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=1, allow_nan=False).encode()


def _wait(results: Any) -> None:
    for _ in results:
        pass


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    max_workers: int = DEFAULT_WORKERS,
) -> MutableMapping[str, Any]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.

    Tensors are copied into the existing tensors (keeping their dtype and device); other
    values are replaced. With ``strict``, keys missing from the checkpoint or unexpected in
    it raise one :class:`~ucp_zarr.errors.KeyMismatchError` listing them all.
    """
    ck = open_store_checkpoint(open_store(path, storage_options))
    leaves = {leaf.key: leaf for leaf in iter_leaves(state_dict)}
    saved = set(ck.meta.tensors) | set(ck.meta.values)
    missing = [k for k in leaves if k not in saved]
    unexpected = [k for k in list(ck.meta.tensors) + list(ck.meta.values) if k not in leaves]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)

    reads = []
    for key, leaf in leaves.items():
        if key in ck.meta.tensors:
            if not is_tensor(leaf.value):
                raise TypeError(f"key {key!r}: the checkpoint holds a tensor, the state dict a {type(leaf.value).__name__}")
            saved_shape = ck.meta.tensors[key].shape
            if tuple(leaf.value.shape) != saved_shape:
                raise ValueError(f"tensor {key!r}: checkpoint shape {list(saved_shape)}, state dict shape {list(leaf.value.shape)}")
            reads.append(leaf)
        elif key in ck.meta.values and is_tensor(leaf.value):
            raise TypeError(f"key {key!r}: the state dict holds a tensor, the checkpoint a JSON value")

    with ThreadPoolExecutor(max_workers) as pool:
        _wait(pool.map(lambda leaf: ck.read(leaf.key, out=leaf.value.detach()), reads))
    for key, leaf in leaves.items():
        if key in ck.meta.values:
            set_leaf(state_dict, leaf.path, from_json(ck.meta.values[key]))
    return state_dict
