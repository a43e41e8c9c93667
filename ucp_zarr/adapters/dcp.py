"""torch.distributed.checkpoint (DCP) storage plug-ins that read and write the universal format.

``dcp.save(sd, storage_writer=ZarrStorageWriter(path))`` writes exactly what
``ucp_zarr.save`` writes (one Zarr v3 array per tensor in global shape, JSON values, the
commit record last), and ``dcp.load(sd, storage_reader=ZarrStorageReader(path))`` reads a
checkpoint written by either. No pickle is ever written: there is no ``.metadata`` file and
no ``.distcp`` file; DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` is
rebuilt from the checkpoint's JSON index when loading.

They are drop-ins for DCP's ``FileSystemWriter`` / ``FileSystemReader``: code written for
those works unchanged with these in their place (that of ``format_utils.torch_save_to_dcp``
and ``dcp_to_torch_save``, which hard-code DCP's plug-ins, and
``_load_state_dict_from_keys`` included):

* saving again to a ``checkpoint_id`` replaces the checkpoint there (``overwrite=True`` by
  default, as DCP's writer), crash-safely: a reader finds the old or the new checkpoint,
  complete, at every point, never a mix; ``overwrite=False`` refuses instead;
* the checkpoint may share its directory with other files (a ``config.json``, the
  ``torch.save`` file ``torch_save_to_dcp`` converts, ...): a save, an overwrite, a failed
  save and the takeover of a crashed save's leftovers touch only the checkpoint's own
  objects (see :func:`_own_key`), never the other files; beside a checkpoint of DCP's own
  ``FileSystemWriter`` (its ``.metadata``), which ``dcp.load(checkpoint_id=path)`` reads
  instead of this one, a save warns;
* DCP's ``planner_data`` (how ``DefaultSavePlanner`` flattened the nested state dict: flat
  key -> object path) is kept as JSON in the commit record and handed back by
  ``read_metadata``, so DCP's metadata-only loaders rebuild the nested structure;
* ``io.BytesIO`` values (DCP's type for opaque blobs) are stored as bytes and come back as
  a ``BytesIO`` with the same content (at position 0); ``ucp_zarr.load`` gives the bytes.

How the DCP steps map onto ucp_zarr
-----------------------------------
Save (every rank runs ``write_data`` at the same time; DCP has already deduplicated
replicated items, so a replicated tensor is held by one rank of the plan only):

* rank 0 (DCP's coordinator) takes ``planner_data`` from the ``Metadata`` its
  ``DefaultSavePlanner`` made (what ``FileSystemWriter`` pickles), or else from the plans
  ``prepare_global_plan`` saw, merged as ``DefaultSavePlanner`` merges them;
* tensor items (``TENSOR``/``SHARD``) become this rank's :class:`~ucp_zarr.protocol.fragments.Fragment`
  pieces: ``item.index.fqn`` is the key, ``item.tensor_data.size`` the global shape,
  ``item.tensor_data.chunk`` the global box of ``planner.resolve_data(item)``;
* ``BYTE_IO`` items are stored as JSON values (never pickled): the original object is taken
  from the planner's flattened state dict, not from the pickled bytes DCP would write; a
  ``BytesIO`` is stored as its bytes, and the ranks agree on which keys were ``BytesIO``
  (one small all-gather, which also fails every rank at once if one could not collect);
* ``ucp_zarr.protocol.saver.prepare(...).finish()`` then validates the global layout, writes every
  shard exactly once and commits, collectively over the writer's process group, with
  ``{"dcp": {...}}`` (schema/FORMAT.md, section 3) in the root's ``layout``.

So the checkpoint is complete and committed when ``write_data`` returns on every rank;
``finish`` (coordinator only) has nothing left to do.

Load: ``read_metadata`` describes every tensor as a ``TensorStorageMetadata`` whose chunks
are the shards of its array, every JSON value as ``BytesStorageMetadata``, and returns the
stored ``planner_data``, or for a checkpoint written by ``ucp_zarr.save`` the one its recorded
nesting gives (as ``DefaultSavePlanner`` would have made it: DCP's ``_load_state_dict_from_keys``
rebuilds the nested state dict from it). ``read_data`` reads each requested box with :meth:`Checkpoint.read` (only the
chunks overlapping it) into the planner's destination; JSON values are handed to
``planner.load_bytes`` as a ``torch.save`` of the decoded value (bytes made here from JSON,
so nothing read from storage is ever unpickled).

Limits
------
* The writer is collective over ``process_group`` (default: the default group), which must
  be the group ``dcp.save`` uses, with DCP's coordinator its rank 0 (``dcp.save``'s
  default); ``use_collectives=False`` is refused. ``no_dist=True`` while torch.distributed
  is initialised cannot be detected on rank 0 and is not supported.
* For ``dcp.async_save``, give the writer (and ``dcp.async_save``) a dedicated gloo group so
  that the background collectives never interleave with training's, as DCP recommends.
* Non-tensor values must be JSON-able (see :func:`ucp_zarr.format.statedict.to_json`), or a
  ``BytesIO`` leaf; a ``BytesIO`` nested inside a value is refused.
* ``planner_data`` is stored when it is a flatten mapping as ``DefaultSavePlanner`` makes it
  (str key -> path of str and int whose ``.``-join is the key); other planner data is not.
* Other files beside the checkpoint are left alone by this writer; ``ucp_zarr.save(...,
  overwrite=True)`` (and a plain save finishing a crashed overwrite) treat every object under
  the path as the checkpoint's, so use this writer for checkpoints that share a directory.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Future as _PyFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..protocol.reader import CheckpointReader, open_store_reader
from ..protocol.distributed import Comm
from ..format.dtypes import stored_dtype_by_name
from ..protocol.fragments import Fragment
from ..layout import Box
from ..layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from ..protocol.collect import Collected
from ..errors import CheckpointError
from ..protocol.filling import read_workers, say_partly_filled
from ..protocol.saver import SaveOptions, prepare
from ..protocol.saving import save_workers
from ..io.factory import open_store
from ..io.store import Buffer, ReadRequest, Store, WriteGuard, at_once
from ..protocol.transaction import is_checkpoint_object
from .dcp_plans import (
    _MISSING,
    _as_bytes,
    _chunk,
    dcp_layout,
    merged_planner_data,
    planner_data_of,
    _plan_to_state,
    _read_dcp_layout,
    _read_into,
    _saved_value,
    _write_results,
)

__all__ = ["ZarrStorageReader", "ZarrStorageWriter"]

DCP_METADATA = ".metadata"
"""What DCP's ``FileSystemWriter`` writes last, and its ``FileSystemReader`` reads first."""


def _valid_id(checkpoint_id: Any) -> bool:
    return isinstance(checkpoint_id, (str, os.PathLike)) and bool(os.fspath(checkpoint_id))


class _CheckpointPath:
    """What DCP's storage writer and reader share: the checkpoint id is the path."""

    path: str | os.PathLike[str]

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._fresh()

    def _fresh(self) -> None:
        """Forget the previous save or load."""
        raise NotImplementedError


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# --- a checkpoint beside other files ----------------------------------------------------------

class _BesideOtherFiles(Store):
    """The checkpoint at a path that may hold other files: the save transaction sees only
    the checkpoint's own objects (:func:`_own_key`), so claiming the path, aborting, taking
    over a dead save's leftovers and putting an overwrite in place (which delete what
    :meth:`list` shows) never touch the other files. Staging siblings are plain stores."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.stats = inner.stats
        self.exclusive_create = inner.exclusive_create
        self.durable = inner.durable
        self.stages_writes = inner.stages_writes
        self.local_path = inner.local_path
        self.request_concurrency = inner.request_concurrency

    def holding(self, nbytes: int) -> AbstractContextManager[Any]:
        return self.inner.holding(nbytes)

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        return self.inner.write(key, buffers, guard)

    def write_atomic(self, key: str, data: bytes) -> None:
        self.inner.write_atomic(key, data)

    def create_exclusive(self, key: str, data: bytes) -> None:
        self.inner.create_exclusive(key, data)

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def read_tail(self, key: str, nbytes: int) -> bytes:
        return self.inner.read_tail(key, nbytes)

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        self.inner.readv(key, requests)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self) -> list[str]:
        return [k for k in self.inner.list() if is_checkpoint_object(k)]

    def child_names(self) -> list[str]:
        return self.inner.child_names()

    def sibling_names(self, prefix: str) -> list[str]:
        return self.inner.sibling_names(prefix)

    def prune(self, folders: Iterable[str]) -> None:
        self.inner.prune(folders)

    def delete(self, key: str) -> None:
        if not is_checkpoint_object(key):  # (the transaction deletes only what a save recorded)
            raise ValueError(f"refusing to delete {self.url}/{key}: it is not part of the checkpoint")
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            if not is_checkpoint_object(key):
                raise ValueError(f"refusing to delete {self.url}/{key}: it is not part of the checkpoint")
        self.inner.delete_many(keys)

    def remove(self) -> None:
        """Delete the checkpoint's objects; the directory and the other files stay."""
        self.inner.delete_many(self.list())

    def sibling(self, name: str) -> Store:
        return self.inner.sibling(name)

    def child(self, name: str) -> Store:
        return self.inner.child(name)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        self.inner.adopt(src, key, tag)

    def sync(self) -> None:
        self.inner.sync()


class ZarrStorageWriter(_CheckpointPath, StorageWriter):
    """A DCP ``StorageWriter`` that writes the ucp_zarr universal format at ``path``
    (a local path or fsspec URL), a drop-in for DCP's ``FileSystemWriter``.

    ``chunk_bytes``, ``shard_bytes``, ``max_workers``, ``overwrite_incomplete``,
    ``unsafe_non_exclusive_store`` and ``hmac_key`` are those of ``ucp_zarr.save``. ``overwrite`` defaults to True, as DCP's
    own writer overwrites: a committed checkpoint at ``path`` is replaced, crash-safely
    (the old or the new one is complete and findable at every point); with
    ``overwrite=False`` a save onto a committed checkpoint raises
    :class:`~ucp_zarr.CheckpointExistsError`. Other files in the directory are left alone.
    ``process_group`` must be the group ``dcp.save`` runs on (default: the default group,
    or a single process when torch.distributed is not initialised).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        overwrite: bool = True,
        overwrite_incomplete: bool = False,
        hmac_key: bytes | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_workers: int | None = None,
        unsafe_non_exclusive_store: bool = False,
    ) -> None:
        super().__init__()
        self.path = path
        self.storage_options = storage_options
        self.process_group = process_group
        self.max_workers = max_workers
        """Threads, as ``ucp_zarr.save`` takes them (:func:`~ucp_zarr.protocol.saving.save_workers`,
        once the store is open)."""
        self.options = SaveOptions(
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            overwrite_incomplete=overwrite_incomplete,
            hmac_key=hmac_key,
            unsafe_non_exclusive_store=unsafe_non_exclusive_store,
        )
        self._fresh()

    def _fresh(self) -> None:
        self.save_id = uuid.uuid4().hex
        self.result: Any = None
        """This rank's :class:`~ucp_zarr.protocol.saver.SaveResult` of the last save."""
        self._planner_data: dict[str, tuple[str | int, ...]] | None = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("ZarrStorageWriter saves collectively; dcp.save(use_collectives=False) is not supported")
        self._planner_data = None  # (DCP resets a writer only when given a checkpoint_id)
        comm = Comm(self.process_group)
        rank = kwargs.get("rank")
        if rank is not None and comm.active and rank != comm.rank:
            raise ValueError(
                f"dcp.save runs this process as rank {rank}, ZarrStorageWriter's process group as rank "
                f"{comm.rank}: pass the same process_group to both (no_dist=True is not supported "
                "while torch.distributed is initialised)"
            )
        if comm.active and bool(is_coordinator) != (comm.rank == 0):
            raise ValueError(
                f"dcp.save's coordinator must be rank 0 of ZarrStorageWriter's process group "
                f"(this process is rank {comm.rank}, coordinator: {bool(is_coordinator)})"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Keep the merged ``planner_data`` (coordinator only), as ``DefaultSavePlanner``
        merges it into DCP's ``Metadata``, for the commit record (used when the planner does
        not hold that ``Metadata`` itself)."""
        comm = Comm(self.process_group)
        if comm.active and len(plans) != comm.world:  # (its collectives would wait for ranks that do not save)
            raise ValueError(
                f"dcp.save runs over {len(plans)} ranks, ZarrStorageWriter's process group has {comm.world}: pass "
                "dcp.save's process_group to ZarrStorageWriter(process_group=...) too"
            )
        self._planner_data = merged_planner_data([p.planner_data for p in plans])
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's part of the checkpoint and commit it, collectively."""
        comm = Comm(self.process_group)
        store: Any = None
        fragments: dict[str, Fragment] = {}
        values: dict[str, Any] = {}
        blobs: list[str] = []
        results: list[WriteResult] = []
        planner_data = self._planner_data
        error: BaseException | None = None
        try:
            store = _BesideOtherFiles(open_store(self.path, self.storage_options))
            if store.inner.exists(DCP_METADATA):  # (left alone, as every other file: but said)
                warnings.warn(
                    f"{store.url} also holds a checkpoint of DCP's own FileSystemWriter ({DCP_METADATA}), left as "
                    "it is: dcp.load(checkpoint_id=...) of this path reads that one, not this save; load this one "
                    "with storage_reader=ZarrStorageReader(...), or remove the .metadata and .distcp files",
                    stacklevel=2,
                )
            fragments, values, blobs = _plan_to_state(plan, planner)
            results = _write_results(plan, values)
            metadata = getattr(planner, "metadata", None)
            if comm.rank == 0 and isinstance(metadata, Metadata):
                # the coordinator's DefaultSavePlanner holds DCP's Metadata of this save: its
                # planner_data is what FileSystemWriter would pickle (with plan caching, the
                # plans prepare_global_plan saw may be empty deltas)
                planner_data = merged_planner_data([metadata.planner_data])
        except BaseException as e:  # every rank learns of it in the agreement below
            error = e
        # which keys hold a BytesIO (each value was written by one rank, after DCP's dedup)
        gathered = comm.agree(error, "preparing the save", blobs)
        # what the commit record keeps for DCP; only rank 0 (DCP's coordinator) writes it
        layout = dcp_layout(planner_data, sorted({k for ks in gathered for k in ks}))
        options = dataclasses.replace(self.options, **save_workers(store, self.max_workers))  # (as ucp_zarr.save)
        prepared = prepare(lambda: Collected(fragments, values), store, comm, options, copy=False)
        if layout:
            prepared.layout = {**prepared.layout, "dcp": layout}
        self.result = prepared.finish()
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to do: ``write_data`` already committed the checkpoint on all ranks (the
        commit record is written only after every rank's data is durable), and DCP's
        ``Metadata`` is not stored because the reader rebuilds it from the JSON index (its
        ``planner_data`` was stored by ``write_data``).
        Like DCP's own writer, it stamps ``metadata.storage_meta`` (returned by ``dcp.save``)."""
        metadata.storage_meta = self.storage_meta()


class ZarrStorageReader(_CheckpointPath, StorageReader):
    """A DCP ``StorageReader`` for a checkpoint in the ucp_zarr universal format at
    ``path``, written by ``ucp_zarr.save`` or by :class:`ZarrStorageWriter`; a drop-in for
    DCP's ``FileSystemReader``.

    Each rank reads only the chunks overlapping what its state dict holds, using up to
    ``max_workers`` threads (default: as ``ucp_zarr.load``, the store's request concurrency
    on an object store, else 4). Per-rank state saved by ``ucp_zarr.save`` is read from the copy
    of this rank (its rank in the group ``dcp.load`` runs on) when the checkpoint has one;
    otherwise the state dict keeps its own value, as ``ucp_zarr.load`` does.
    ``unsafe_non_exclusive_store`` is taken so that the writer's options build the reader
    too; a load creates nothing, so it needs no exclusive create and the flag changes nothing.

    A tensor is read into a destination of another dtype when the conversion is exact
    (``bfloat16`` into ``float32``); a lossy one (``float32`` into ``bfloat16``, which DCP's
    ``FileSystemReader`` does silently) raises :class:`~ucp_zarr.DtypeMismatchError` unless
    ``allow_lossy_cast``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        max_workers: int | None = None,
        allow_lossy_cast: bool = False,
        unsafe_non_exclusive_store: bool = False,
    ) -> None:
        super().__init__()
        self.path = path
        self.storage_options = storage_options
        self.max_workers = max_workers
        self.allow_lossy_cast = allow_lossy_cast
        self._fresh()

    def _fresh(self) -> None:
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self._ck: CheckpointReader | None = None
        self._blobs: frozenset[str] = frozenset()

    def _checkpoint(self) -> CheckpointReader:
        if self._ck is None:
            self._ck = open_store_reader(open_store(self.path, self.storage_options), shared=Comm().world > 1)
        return self._ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's view of the checkpoint, from its JSON index and its arrays' zarr.json, with
        the ``planner_data`` stored by :class:`ZarrStorageWriter`, or made from the nesting a
        ``ucp_zarr.save`` recorded.

        Every load starts here, so the checkpoint is (re)opened here: a reader may be reused."""
        self._ck = None
        ck = self._checkpoint()
        planner_data, self._blobs = _read_dcp_layout(ck.meta, ck.store.url)
        tensors = ck.meta.tensors

        def describe(key: str) -> TensorStorageMetadata:
            entry = tensors[key]
            shape = tuple(entry.shape)
            chunks = []
            if entry.ranks is None:  # per-rank copies may differ in grid: one whole chunk
                grid = ck.array_meta(key).grid
                chunks = [_chunk(grid.shard_box(idx)) for idx in grid.all_shards()]
            if not chunks:
                chunks = [_chunk(Box.whole(shape))]
            dtype = stored_dtype_by_name(entry.dtype).torch_dtype
            return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)

        described = dict(zip(tensors, at_once(ck.store, describe, tensors)))
        md: dict[str, Any] = dict(described)
        for alias, canonical in ck.meta.ties.items():  # (tied tensors: each alias reads its canonical tensor)
            md[alias] = described[canonical]
        for key in list(ck.meta.values) + list(ck.meta.rank_values):
            md.setdefault(key, BytesStorageMetadata())
        if planner_data is None and ck.meta.structure is not None:  # (a ucp_zarr.save: its recorded nesting)
            planner_data = planner_data_of(ck.meta, list(md), f"{ck.store.url}/zarr.json")
        if planner_data:  # the saved state dict's order, as DCP's metadata keeps it
            position = {k: i for i, k in enumerate(planner_data)}
            md = dict(sorted(md.items(), key=lambda kv: position.get(kv[0], len(position))))
        return Metadata(
            state_dict_metadata=md,
            planner_data=planner_data,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items: tensor boxes straight from the overlapping chunks, JSON
        values through ``planner.load_bytes``. Planner calls stay on this thread; only the
        reads run on worker threads (at most twice as many in flight)."""
        ck = self._checkpoint()
        rank = self.rank if self.rank is not None else 0
        workers = read_workers(ck.store, self.max_workers)
        window = 2 * workers
        pending: list[tuple[ReadItem, torch.Tensor, _PyFuture]] = []
        started = False

        def settle(n: int) -> None:
            while len(pending) > n:
                item, target, fut = pending.pop(0)
                fut.result()
                planner.commit_tensor(item, target)

        with ThreadPoolExecutor(workers) as pool:
            try:
                for item in plan.items:
                    fqn = item.storage_index.fqn
                    if item.type == LoadItemType.BYTE_IO:
                        value = _saved_value(ck, fqn, rank)
                        if value is not _MISSING:
                            planner.load_bytes(item, _as_bytes(value, fqn in self._blobs))
                        continue
                    entry = ck.meta.tensors.get(ck.meta.canonical(fqn))
                    if entry is None:
                        raise KeyError(f"no tensor {fqn!r} in checkpoint {ck.store.url}")
                    copy_of: int | None = None
                    if entry.ranks is not None:
                        if rank not in entry.ranks:
                            continue  # per-rank state of a rank absent at save time: keep ours
                        copy_of = rank
                    base = item.storage_index.offset or torch.Size([0] * len(item.lengths))
                    box = Box(
                        tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets)),
                        tuple(int(n) for n in item.lengths),
                    )
                    target = planner.resolve_tensor(item).detach()
                    if tuple(target.shape) != box.shape:
                        raise AssertionError(
                            f"tensor {fqn!r}: destination shape {list(target.shape)} != read box {list(box.shape)}"
                        )
                    pending.append((item, target, pool.submit(_read_into, ck, fqn, box, target, copy_of,
                                                              self.allow_lossy_cast)))
                    started = True
                    settle(window)
                settle(0)
            except CheckpointError as e:  # (a corrupt chunk is found where it is read: into its target)
                if started:
                    say_partly_filled(e)
                raise
            finally:
                for _, _, fut in pending:
                    fut.cancel()
        return _done(None)
