"""The Python face: :func:`save` and :func:`load` (``open`` lives in :mod:`.checkpoint`)."""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, MutableMapping

import torch

from .checkpoint import Checkpoint, open_store_checkpoint
from .distributed import Comm
from .dtypes import is_lossless_cast, stored_dtype_by_name
from .errors import (
    CheckpointError,
    DtypeMismatchError,
    KeyMismatchError,
    LayoutError,
    PerRankStateError,
    ShapeMismatchError,
)
from .fragments import Fragment, PerRank, Placed, is_fragment_value, to_fragment
from .layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .rules import same_meaning
from .saver import SaveOptions, SaveResult, collect, prepare
from .statedict import from_json, iter_leaves, set_leaf
from .storage import open_store
from .transaction import DEFAULT_LEASE_S

DEFAULT_WORKERS = 4

_background = ThreadPoolExecutor(1, thread_name_prefix="ucp_zarr-save")
_pending: Future | None = None
_pending_lock = threading.Lock()
_async_groups: dict[tuple[int, ...], tuple[Any, Any]] = {}
"""Background groups by the global ranks of the group they serve: (default group, group)."""


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    async_save: bool = False,
    async_group: Any = None,
    overwrite: bool = False,
    overwrite_incomplete: bool = False,
    hmac_key: bytes | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_workers: int = DEFAULT_WORKERS,
    lease_s: float = DEFAULT_LEASE_S,
    model: torch.nn.Module | None = None,
) -> SaveResult | Future:
    """Save ``state_dict`` at ``path``; every rank of ``process_group`` calls it.

    Tensor values may be DTensors, :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard`
    or plain tensors (whole, identical on every rank). Per-rank state (RNG states, data
    positions) must be wrapped in :class:`~ucp_zarr.PerRank`; a plain tensor that differs
    between ranks is an error. Other values must be JSON-able. Each rank writes only its
    own shards, no two ranks write the same object, and the commit record is written last,
    after every rank's data is durable. A failure on any rank fails the save on every rank.

    The save is a transaction on ``path`` (see :mod:`ucp_zarr.transaction`):

    * a committed checkpoint is never replaced, unless ``overwrite``: then the new one is
      staged beside it and put in place so that a crash at any point leaves the old or the
      new checkpoint complete and findable;
    * the leftovers of another save are removed only when that save is provably dead (its
      process is gone, or its lease of ``lease_s`` seconds expired on another host), or
      with ``overwrite_incomplete``; a live one raises :class:`~ucp_zarr.OwnershipError`.

    ``hmac_key`` signs the checkpoint (HMAC-SHA256 over the commit record, which holds the
    digests of every document and array, and per-chunk SHA-256 in every shard), so that
    ``load``/``open``/``verify`` with the key refuse any change.

    With ``async_save`` the call returns a :class:`~concurrent.futures.Future` after copying
    the state into host memory; writing and commit happen in the background, over
    ``async_group`` (a group of the same ranks reserved for checkpointing, as DCP asks) or
    else a gloo group created once, by the ranks of ``process_group`` only. Errors surface
    on the future. Any save first waits for the previous one.

    Optimizer state keyed by parameter number (a plain ``optimizer.state_dict()``) is
    stored beside its parameter, in the parameter's Zarr group, when the names are
    knowable: the optimizer was built from ``model.named_parameters()`` (its param groups
    carry ``param_names``), or ``model`` is given and the optimizer was built from
    ``model.parameters()``. Keys do not change (``optim.state.0.exp_avg``).

    Returns (or resolves to) this rank's :class:`~ucp_zarr.saver.SaveResult`.
    """
    wait_for_pending_save()
    comm = Comm(process_group)
    options = SaveOptions(
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        max_workers=max_workers,
        overwrite=overwrite,
        overwrite_incomplete=overwrite_incomplete,
        lease_s=lease_s,
        hmac_key=hmac_key,
    )
    store = open_store(path, storage_options)
    if not async_save:
        return prepare(lambda: collect(state_dict, model), store, comm, options, copy=False).finish()
    background = comm
    if comm.active:
        background = Comm(async_group if async_group is not None else _background_group(process_group))
        if background.world != comm.world:
            raise CheckpointError(f"async_group has {background.world} ranks, process_group {comm.world}: give the same ranks")
    options = dataclasses.replace(options, write_workers=min(max_workers, BACKGROUND_WRITERS))
    prepared = prepare(lambda: collect(state_dict, model), store, comm, options, copy=True)
    global _pending
    with _pending_lock:
        _pending = _background.submit(_in_background, prepared.finish, background, _nice())
        return _pending


BACKGROUND_WRITERS = 1
"""Threads a background save writes with (its host copy is made by ``max_workers``): every
writer thread competes with training for the GIL, and a lower nice value does not stop a
writer holding the GIL from delaying a training step."""
BACKGROUND_NICE = 10
"""How much higher the nice value (the lower the scheduling priority) of a background save's
threads is than that of the thread that called :func:`save` (capped at ``MAX_NICE``): on a busy
host the writer yields the CPU to training steps (its I/O does not wait), however nice the job
itself already runs."""
MAX_NICE = 19


def _nice() -> int | None:
    """The calling thread's nice value (None where threads have none)."""
    if not (hasattr(os, "getpriority") and hasattr(threading, "get_native_id")):
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return None


def _in_background(finish: Any, comm: Comm, caller_nice: int | None) -> SaveResult:
    """Run ``finish`` on the background thread at ``BACKGROUND_NICE`` below the caller's
    priority (Linux: per thread, and inherited by the worker threads it starts)."""
    own = _nice()
    if own is not None and caller_nice is not None:
        want = min(caller_nice + BACKGROUND_NICE, MAX_NICE)
        try:
            if own != want:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), want)
        except OSError:  # not permitted here (raising the priority back needs CAP_SYS_NICE): keep it
            pass
    return finish(comm)


def wait_for_pending_save() -> None:
    """Block until the last asynchronous save has finished (its errors are on its future)."""
    with _pending_lock:
        pending = _pending
    if pending is not None:
        pending.exception()


def _background_group(group: Any) -> Any:
    """A gloo group of the ranks of ``group`` for background saves, so that their
    collectives never interleave with training's. Created on first use by the members of
    ``group`` alone (``use_local_synchronization``: other ranks need not call anything),
    and again after the default group was re-created."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else default))
    held = _async_groups.get(ranks)
    if held is None or held[0] is not default:
        held = (default, dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True))
        _async_groups[ranks] = held
    return held[1]


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_new_ranks: bool = False,
    allow_lossy_cast: bool = False,
    allow_other_rules: bool = False,
    hmac_key: bytes | None = None,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    max_workers: int = DEFAULT_WORKERS,
) -> MutableMapping[str, Any]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.

    Every rank reads only the chunks that overlap what its own tensors hold (DTensor,
    :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard` or whole tensors), whatever the
    saving layout was. Tensors keep their dtype and device (a lossy conversion, such as
    ``float32`` into ``bfloat16``, needs ``allow_lossy_cast``); other values are replaced.
    Per-rank state (:class:`~ucp_zarr.PerRank`) is restored from the copy of the saving
    rank of the same number.

    With ``strict``: keys missing from the checkpoint or unexpected in it raise one
    :class:`~ucp_zarr.KeyMismatchError` listing them all, and a rank that did not exist at
    save time raises :class:`~ucp_zarr.PerRankStateError` for per-rank state it cannot
    restore, unless ``allow_new_ranks`` (then it keeps its current values, as it always
    does without ``strict``). Everything is checked before anything is read.
    ``hmac_key`` refuses a checkpoint that is unsigned or was changed after signing.

    A state dict placed by rules (:func:`ucp_zarr.place`) is filled in place from the
    consolidated tensors, whatever layout saved them; padding rows get zeros. Loading with
    rules that give a tensor another consolidated form (other fused sub-parameter sizes,
    another vocabulary size) raises :class:`~ucp_zarr.LayoutError` unless
    ``allow_other_rules``. With ``strict``, a placed load on several ranks checks the keys
    against the union of every rank's (a collective: every rank of ``process_group`` calls
    ``load``).
    """
    comm = Comm(process_group)
    rank = comm.rank
    ck = open_store_checkpoint(open_store(path, storage_options), hmac_key)
    leaves = {leaf.key: leaf for leaf in iter_leaves(state_dict)}
    # a tensor placed by rules is read from its consolidated key
    stored_key = {k: leaf.value.key if isinstance(leaf.value, Placed) else k for k, leaf in leaves.items()}
    meta = ck.meta
    saved_values = set(meta.values) | set(meta.rank_values)
    saved = list(meta.tensors) + list(meta.values) + list(meta.rank_values)
    missing = [k for k, s in stored_key.items() if s not in meta.tensors and s not in saved_values]
    held = set(stored_key.values())
    if strict and comm.active and any(isinstance(leaf.value, Placed) for leaf in leaves.values()):
        # placed state dicts hold different keys on different ranks (pipeline stages, experts)
        held = set().union(*comm.all_gather(held))
    unexpected = [k for k in saved if k not in held]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)

    reads: list[tuple[str, Fragment, bool]] = []
    unrestorable: list[str] = []
    for leaf_key, leaf in leaves.items():
        key = stored_key[leaf_key]
        value = leaf.value.value if isinstance(leaf.value, PerRank) else leaf.value
        if key in meta.tensors:
            entry = meta.tensors[key]
            if not is_fragment_value(value):
                raise DtypeMismatchError(f"key {key!r}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
            frag = to_fragment(key, value)
            if not allow_other_rules and not same_meaning(entry.rule, frag.meaning):
                raise LayoutError(
                    f"tensor {key!r} was saved as {entry.rule} and the rules loading it ({frag.rule!r}) make it "
                    f"{frag.meaning}: another consolidated form (pass allow_other_rules=True to load it anyway)"
                )
            if frag.shape != entry.shape:
                raise ShapeMismatchError(
                    f"tensor {key!r}: checkpoint shape {list(entry.shape)}, state dict shape {list(frag.shape)}"
                )
            saved_dtype = stored_dtype_by_name(entry.dtype).torch_dtype
            if not allow_lossy_cast and not is_lossless_cast(saved_dtype, frag.dtype):
                raise DtypeMismatchError(
                    f"tensor {key!r}: the checkpoint holds {saved_dtype}, the state dict {frag.dtype}; "
                    "converting loses information (pass allow_lossy_cast=True to convert anyway)"
                )
            per_rank = entry.ranks is not None
            if per_rank and rank not in entry.ranks:
                unrestorable.append(key)
                continue
            reads.append((key, frag, per_rank))
        elif key in saved_values:
            if is_fragment_value(value):
                raise DtypeMismatchError(f"key {key!r}: the state dict holds a tensor, the checkpoint a JSON value")
            if key in meta.rank_values and rank not in meta.rank_values[key]:
                unrestorable.append(key)
    if strict and unrestorable and not allow_new_ranks:
        raise PerRankStateError(
            f"rank {rank} has no saved copy of the per-rank state {unrestorable} (the checkpoint was saved by "
            f"{meta.world_size} rank(s)), so it cannot be restored; pass allow_new_ranks=True to keep the current values"
        )

    with ThreadPoolExecutor(max_workers) as pool:
        list(pool.map(lambda r: _read_fragment(ck, *r, rank, allow_lossy_cast), reads))
    for key, leaf in leaves.items():
        if key in meta.values:
            value = from_json(meta.values[key], key)
        elif key in meta.rank_values and rank in meta.rank_values[key]:
            value = from_json(meta.rank_values[key][rank], key)
        else:
            continue
        set_leaf(state_dict, leaf.path, PerRank(value) if isinstance(leaf.value, PerRank) else value)
    return state_dict


def _read_fragment(ck: Checkpoint, key: str, frag: Fragment, per_rank: bool, rank: int, lossy: bool) -> None:
    with torch.no_grad():
        for box, view in frag.pieces:
            ck.read(key, box, out=view, rank=rank if per_rank else None, allow_lossy_cast=lossy)
        for pad in frag.pad:  # padding (of a padded vocabulary) has no saved counterpart
            pad.zero_()
