"""torch.distributed.checkpoint (DCP) storage plug-ins that read and write the universal format.

``dcp.save(sd, storage_writer=ZarrStorageWriter(path))`` writes exactly what
``ucp_zarr.save`` writes (one Zarr v3 array per tensor in global shape, JSON values, the
commit record last), and ``dcp.load(sd, storage_reader=ZarrStorageReader(path))`` reads a
checkpoint written by either. No pickle is ever written: there is no ``.metadata`` file and
no ``.distcp`` file; DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` is
rebuilt from the checkpoint's JSON index when loading.

How the DCP steps map onto ucp_zarr
-----------------------------------
Save (every rank runs ``write_data`` at the same time; DCP has already deduplicated
replicated items, so a replicated tensor is held by one rank of the plan only):

* tensor items (``TENSOR``/``SHARD``) become this rank's :class:`~ucp_zarr.fragments.Fragment`
  pieces: ``item.index.fqn`` is the key, ``item.tensor_data.size`` the global shape,
  ``item.tensor_data.chunk`` the global box of ``planner.resolve_data(item)``;
* ``BYTE_IO`` items are stored as JSON values (never pickled): the original object is taken
  from the planner's flattened state dict, not from the pickled bytes DCP would write;
* ``ucp_zarr.saver.prepare(...).finish()`` then validates the global layout, writes every
  shard exactly once and commits, collectively over the writer's process group.

So the checkpoint is complete and committed when ``write_data`` returns on every rank;
``finish`` (coordinator only) has nothing left to do.

Load: ``read_metadata`` describes every tensor as a ``TensorStorageMetadata`` whose chunks
are the shards of its array, and every JSON value as ``BytesStorageMetadata``. ``read_data``
reads each requested box with :meth:`Checkpoint.read` (only the chunks overlapping it) into
the planner's destination; JSON values are handed to ``planner.load_bytes`` as a
``torch.save`` of the decoded value (bytes made here from JSON, so nothing untrusted is ever
unpickled).

Limits
------
* The writer is collective over ``process_group`` (default: the default group), which must
  be the group ``dcp.save`` uses; ``use_collectives=False`` is refused. ``no_dist=True``
  while torch.distributed is initialised cannot be detected on rank 0 and is not supported.
* For ``dcp.async_save``, give the writer (and ``dcp.async_save``) a dedicated gloo group so
  that the background collectives never interleave with training's, as DCP recommends.
* Like DCP's own writer, it replaces a committed checkpoint at the path (``overwrite=True``
  by default; the replacement is crash-safe); it refuses a directory of unrelated files.
* Non-tensor values must be JSON-able (see :func:`ucp_zarr.statedict.to_json`).
* DCP's ``planner_data`` (the nesting of the flattened keys) is not stored; a reader's
  ``Metadata.planner_data`` is None, so DCP's metadata-only loaders rebuild a flat dict.
"""

from __future__ import annotations

import io
import json
import math
import os
import uuid
from concurrent.futures import Future as _PyFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..checkpoint import Checkpoint, open_store_checkpoint
from ..distributed import Comm
from ..dtypes import stored_dtype_by_name
from ..fragments import Fragment
from ..layout import Box
from ..layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from ..saver import Collected, SaveOptions, prepare
from ..statedict import from_json, to_json
from ..storage import open_store

__all__ = ["ZarrStorageReader", "ZarrStorageWriter"]


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


class ZarrStorageWriter(_CheckpointPath, StorageWriter):
    """A DCP ``StorageWriter`` that writes the ucp_zarr universal format at ``path``
    (a local path or fsspec URL).

    ``chunk_bytes``, ``shard_bytes``, ``max_workers``, ``overwrite_incomplete`` and
    ``hmac_key`` are those of ``ucp_zarr.save``. ``overwrite`` defaults to True, as DCP's
    own writer overwrites: a committed checkpoint at ``path`` is replaced, crash-safely
    (the old or the new one is complete and findable at every point).
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
        max_workers: int = 4,
    ) -> None:
        super().__init__()
        self.path = path
        self.storage_options = storage_options
        self.process_group = process_group
        self.options = SaveOptions(
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            max_workers=max_workers,
            overwrite=overwrite,
            overwrite_incomplete=overwrite_incomplete,
            hmac_key=hmac_key,
        )
        self._fresh()

    def _fresh(self) -> None:
        self.save_id = uuid.uuid4().hex
        self.result: Any = None
        """This rank's :class:`~ucp_zarr.saver.SaveResult` of the last save."""

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("ZarrStorageWriter saves collectively; dcp.save(use_collectives=False) is not supported")
        comm = Comm(self.process_group)
        rank = kwargs.get("rank")
        if rank is not None and comm.active and rank != comm.rank:
            raise ValueError(
                f"dcp.save runs this process as rank {rank}, ZarrStorageWriter's process group as rank "
                f"{comm.rank}: pass the same process_group to both (no_dist=True is not supported "
                "while torch.distributed is initialised)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's part of the checkpoint and commit it, collectively."""
        results: list[WriteResult] = []
        store: Any = None
        store_error: BaseException | None = None
        try:
            store = open_store(self.path, self.storage_options)
        except Exception as e:  # raised from collected(), so that every rank learns of it
            store_error = e

        def collected() -> Collected:
            if store_error is not None:
                raise store_error
            fragments, values = _plan_to_state(plan, planner)
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    size = len(json.dumps(values[item.index.fqn]))
                else:
                    td = item.tensor_data
                    assert td is not None
                    size = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
            return Collected(fragments, values)

        self.result = prepare(collected, store, Comm(self.process_group), self.options, copy=False).finish()
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to do: ``write_data`` already committed the checkpoint on all ranks (the
        commit record is written only after every rank's data is durable), and DCP's
        ``Metadata`` is not stored because the reader rebuilds it from the JSON index.
        Like DCP's own writer, it stamps ``metadata.storage_meta`` (returned by ``dcp.save``)."""
        metadata.storage_meta = self.storage_meta()


def _plan_to_state(plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Fragment], dict[str, Any]]:
    """This rank's fragments (tensor items) and JSON values (``BYTE_IO`` items) of ``plan``."""
    fragments: dict[str, Fragment] = {}
    values: dict[str, Any] = {}
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            values[fqn] = to_json(_original_value(planner, item), fqn)
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
    return fragments, values


def _original_value(planner: SavePlanner, item: WriteItem) -> Any:
    """The object behind a ``BYTE_IO`` item, before DCP would pickle it."""
    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict) and item.index.fqn in sd:
        return sd[item.index.fqn]
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        return lookup(item.index)
    # a planner without the default planner's extensions: read back the bytes it made in
    # this very process (never bytes from storage), allowing plain data only
    buf = planner.resolve_data(item)
    assert isinstance(buf, io.BytesIO)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class ZarrStorageReader(_CheckpointPath, StorageReader):
    """A DCP ``StorageReader`` for a checkpoint in the ucp_zarr universal format at
    ``path``, written by ``ucp_zarr.save`` or by :class:`ZarrStorageWriter`.

    Each rank reads only the chunks overlapping what its state dict holds, using up to
    ``max_workers`` threads. Per-rank state saved by ``ucp_zarr.save`` is read from the copy
    of this rank (its rank in the group ``dcp.load`` runs on) when the checkpoint has one;
    otherwise the state dict keeps its own value, as ``ucp_zarr.load`` does.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        max_workers: int = 4,
    ) -> None:
        super().__init__()
        self.path = path
        self.storage_options = storage_options
        self.max_workers = max_workers
        self._fresh()

    def _fresh(self) -> None:
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self._ck: Checkpoint | None = None

    def _checkpoint(self) -> Checkpoint:
        if self._ck is None:
            self._ck = open_store_checkpoint(open_store(self.path, self.storage_options))
        return self._ck

    def read_metadata(self) -> Metadata:
        """DCP's view of the checkpoint, from its JSON index and its arrays' zarr.json.

        Every load starts here, so the checkpoint is (re)opened here: a reader may be reused."""
        self._ck = None
        ck = self._checkpoint()
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

        with ThreadPoolExecutor(max(1, self.max_workers)) as pool:
            described = dict(zip(tensors, pool.map(describe, tensors)))
        md: dict[str, Any] = dict(described)
        for key in list(ck.meta.values) + list(ck.meta.rank_values):
            md.setdefault(key, BytesStorageMetadata())
        return Metadata(
            state_dict_metadata=md,
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
        reads run on worker threads (at most ``2 * max_workers`` in flight)."""
        ck = self._checkpoint()
        rank = self.rank if self.rank is not None else 0
        window = max(1, 2 * self.max_workers)
        pending: list[tuple[ReadItem, torch.Tensor, _PyFuture]] = []

        def settle(n: int) -> None:
            while len(pending) > n:
                item, target, fut = pending.pop(0)
                fut.result()
                planner.commit_tensor(item, target)

        with ThreadPoolExecutor(max(1, self.max_workers)) as pool:
            try:
                for item in plan.items:
                    fqn = item.storage_index.fqn
                    if item.type == LoadItemType.BYTE_IO:
                        value = _saved_value(ck, fqn, rank)
                        if value is not _MISSING:
                            planner.load_bytes(item, _as_bytes(value))
                        continue
                    entry = ck.meta.tensors.get(fqn)
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
                    pending.append((item, target, pool.submit(_read_into, ck, fqn, box, target, copy_of)))
                    settle(window)
                settle(0)
            finally:
                for _, _, fut in pending:
                    fut.cancel()
        return _done(None)


_MISSING = object()


def _saved_value(ck: Checkpoint, fqn: str, rank: int) -> Any:
    if fqn in ck.meta.values:
        return ck.meta.values[fqn]
    per_rank = ck.meta.rank_values.get(fqn)
    if per_rank is None:
        raise KeyError(f"no value {fqn!r} in checkpoint {ck.store.url}")
    return per_rank.get(rank, _MISSING)


def _as_bytes(value: Any) -> io.BytesIO:
    """What ``planner.load_bytes`` expects: a ``torch.save`` of the decoded JSON value."""
    buf = io.BytesIO()
    torch.save(from_json(value), buf)
    buf.seek(0)
    return buf


def _read_into(ck: Checkpoint, fqn: str, box: Box, target: torch.Tensor, rank: int | None) -> None:
    with torch.no_grad():
        ck.read(fqn, box, out=target, rank=rank)


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape))
