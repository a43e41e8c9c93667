"""The Python face: :func:`save` and :func:`load` (``open`` lives in :mod:`.checkpoint`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, MutableMapping

import torch

from .checkpoint import Checkpoint, open_store_checkpoint
from .distributed import Comm
from .errors import KeyMismatchError
from .fragments import Fragment, is_fragment_value, to_fragment
from .layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .saver import SaveResult, collect, prepare
from .statedict import from_json, iter_leaves, set_leaf
from .storage import open_store

DEFAULT_WORKERS = 4

_background = ThreadPoolExecutor(1, thread_name_prefix="ucp_zarr-save")
_pending: Future | None = None
_pending_lock = threading.Lock()
_async_groups: dict[Any, Any] = {}


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    async_save: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_workers: int = DEFAULT_WORKERS,
) -> SaveResult | Future:
    """Save ``state_dict`` at ``path``; every rank of ``process_group`` calls it.

    Tensor values may be DTensors, :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard`
    or plain tensors (whole, identical on every rank; a small plain tensor that differs
    between ranks is stored per rank). Other values must be JSON-able; values that differ
    between ranks are stored per rank. Each rank writes only its own shards, no two ranks
    write the same object, and the commit record is written last, after every rank's data
    is durable. Saving onto a committed checkpoint raises
    :class:`~ucp_zarr.CheckpointExistsError`; the leftovers of a failed save are replaced.

    With ``async_save`` the call returns a :class:`~concurrent.futures.Future` after copying
    the state into host memory; writing and commit happen in the background, errors surface
    on the future. Any save first waits for the previous one.

    Returns (or resolves to) this rank's :class:`~ucp_zarr.saver.SaveResult`.
    """
    wait_for_pending_save()
    comm = Comm(process_group)
    store = open_store(path, storage_options)
    options = dict(chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, max_workers=max_workers)
    if not async_save:
        return prepare(lambda: collect(state_dict), store, comm, copy=False, **options).finish()
    background = Comm(_background_group(process_group)) if comm.active else comm
    prepared = prepare(lambda: collect(state_dict), store, comm, copy=True, **options)
    prepared.comm = background
    global _pending
    with _pending_lock:
        _pending = _background.submit(prepared.finish)
        return _pending


def wait_for_pending_save() -> None:
    """Block until the last asynchronous save has finished (its errors are on its future)."""
    with _pending_lock:
        pending = _pending
    if pending is not None:
        pending.exception()


def _background_group(group: Any) -> Any:
    """A separate gloo group for background saves, so they never interleave with the
    training's collectives (created collectively on first use)."""
    import torch.distributed as dist

    if group not in _async_groups:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _async_groups[group] = dist.new_group(ranks=ranks, backend="gloo")
    return _async_groups[group]


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    max_workers: int = DEFAULT_WORKERS,
) -> MutableMapping[str, Any]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.

    Every rank reads only the chunks that overlap what its own tensors hold (DTensor,
    :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard` or whole tensors), whatever the
    saving layout was. Tensors keep their dtype and device; other values are replaced.
    Per-rank state is restored on the ranks that existed at save time; other ranks keep
    their own values. With ``strict``, keys missing from the checkpoint or unexpected in it
    raise one :class:`~ucp_zarr.KeyMismatchError` listing them all.
    """
    rank = Comm(process_group).rank
    ck = open_store_checkpoint(open_store(path, storage_options))
    leaves = {leaf.key: leaf for leaf in iter_leaves(state_dict)}
    saved_values = set(ck.meta.values) | set(ck.meta.rank_values)
    saved = list(ck.meta.tensors) + [k for k in ck.meta.values] + [k for k in ck.meta.rank_values]
    missing = [k for k in leaves if k not in ck.meta.tensors and k not in saved_values]
    unexpected = [k for k in saved if k not in leaves]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)

    reads: list[tuple[str, Fragment]] = []
    for key, leaf in leaves.items():
        if key in ck.meta.tensors:
            if not is_fragment_value(leaf.value):
                raise TypeError(f"key {key!r}: the checkpoint holds a tensor, the state dict a {type(leaf.value).__name__}")
            frag = to_fragment(key, leaf.value)
            saved_shape = ck.meta.tensors[key].shape
            if frag.shape != saved_shape:
                raise ValueError(f"tensor {key!r}: checkpoint shape {list(saved_shape)}, state dict shape {list(frag.shape)}")
            reads.append((key, frag))
        elif key in saved_values and is_fragment_value(leaf.value):
            raise TypeError(f"key {key!r}: the state dict holds a tensor, the checkpoint a JSON value")

    with ThreadPoolExecutor(max_workers) as pool:
        list(pool.map(lambda item: _read_fragment(ck, item[0], item[1], rank), reads))
    for key, leaf in leaves.items():
        if key in ck.meta.values:
            set_leaf(state_dict, leaf.path, from_json(ck.meta.values[key]))
        elif key in ck.meta.rank_values and rank in ck.meta.rank_values[key]:
            set_leaf(state_dict, leaf.path, from_json(ck.meta.rank_values[key][rank]))
    return state_dict


def _read_fragment(ck: Checkpoint, key: str, frag: Fragment, rank: int) -> None:
    entry = ck.meta.tensors[key]
    if entry.ranks is not None and rank not in entry.ranks:
        return  # per-rank state of a rank that did not exist at save time: keep ours
    for box, view in frag.pieces:
        with torch.no_grad():
            ck.read(key, box, out=view, rank=rank if entry.ranks is not None else None)
