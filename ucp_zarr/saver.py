"""Executing a save: normalise, plan, stage, exchange boundary pieces, write, commit.

Every rank runs :func:`prepare` (the blocking stage: metadata exchange, planning, and for
async saves the copy into host memory) and then :meth:`PreparedSave.finish` (exchange,
writes, commit), either inline or on a background thread.
"""

from __future__ import annotations

import datetime
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .version import __version__
from .arrayio import as_storage, write_shard
from .distributed import Comm, describe
from .errors import CheckpointExistsError
from .format import METADATA_FILE, ArrayMeta, CheckpointMeta, TensorEntry, group_zarr_json
from .fragments import Fragment, is_fragment_value, to_fragment
from .layout import Box
from .planner import FragmentInfo, SavePlan, ShardTask, plan_save
from .codec import checksum
from .statedict import iter_leaves, to_json
from .storage import PENDING_MARKER, Store

DIGEST_COPY_BYTES = 16 << 20
"""Off-CPU plain tensors up to this size are copied to the host for their digest."""


@dataclass
class Staged:
    """Host copies of the boxes this rank writes or sends: array key -> [(box, copy)]."""

    boxes: dict[str, list[tuple[Box, torch.Tensor]]] = field(default_factory=dict)


@dataclass(frozen=True)
class SaveResult:
    """What one rank's part of a save did."""

    url: str
    rank: int
    bytes_written: int
    objects: tuple[str, ...]
    """The keys of the objects this rank wrote (no other rank wrote any of them)."""


@dataclass
class PreparedSave:
    store: Store
    comm: Comm
    plan: SavePlan
    fragments: dict[str, Fragment]
    meta: CheckpointMeta
    staged: Staged
    max_workers: int

    def finish(self) -> SaveResult:
        """Exchange boundary pieces, write this rank's documents and shards, commit."""
        comm, store, plan = self.comm, self.store, self.plan
        error: BaseException | None = None
        try:
            received = _exchange(comm, plan, self._data)
            docs = _documents(plan)
            mine = [(k, d) for k, d in docs if plan.doc_writers[k] == comm.rank]
            tasks = [(n, t) for n, t in enumerate(plan.shards) if t.writer == comm.rank]
            with ThreadPoolExecutor(self.max_workers) as pool:
                jobs = [pool.submit(store.write, k, [d]) for k, d in mine]
                jobs += [pool.submit(self._write, n, t, received) for n, t in tasks]
                for job in jobs:
                    job.result()
            store.sync()
        except BaseException as e:  # every rank must learn of it before anyone commits
            error = e
        comm.agree(error, f"saving {store.url}")
        if comm.rank == 0:
            try:
                store.write_atomic(METADATA_FILE, _dumps(self.meta.to_zarr_json()))
                store.delete(PENDING_MARKER)
            except BaseException as e:
                error = e
        comm.agree(error, f"committing {store.url}")
        objects = tuple(k for k in store.stats.written if k != PENDING_MARKER)
        return SaveResult(store.url, comm.rank, store.stats.bytes_written, objects)

    def _data(self, akey: str, box: Box) -> torch.Tensor:
        """This rank's data of ``box`` of array ``akey``, in the storage dtype (a view)."""
        t, held = self._holding(akey, box)
        return t[box.relative_to(held).slices()]

    def _write(self, n: int, task: ShardTask, received: dict[tuple[int, int], torch.Tensor]) -> None:
        path, meta = self.plan.arrays[task.key]
        sbox = meta.grid.shard_box(task.shard)
        if not task.sources:
            src = self._holding(task.key, sbox)
            write_shard(self.store, path, meta, task.shard, src[0], src[1])
            return
        buf = torch.empty(sbox.shape, dtype=meta.dtype.storage_torch_dtype)
        for i, (rank, box) in enumerate(task.sources):
            part = self._data(task.key, box) if rank == self.comm.rank else received[(n, i)]
            buf[box.relative_to(sbox).slices()] = part.reshape(box.shape)
        write_shard(self.store, path, meta, task.shard, buf, sbox)

    def _holding(self, akey: str, box: Box) -> tuple[torch.Tensor, Box]:
        """A tensor of this rank holding ``box`` whole, and the box it holds."""
        for sbox, t in self.staged.boxes.get(akey, ()):
            if sbox.contains(box):
                return t, sbox
        meta = self.plan.arrays[akey][1]
        pbox, t = self.fragments[meta.key].holding(box)
        return as_storage(t, meta), pbox


def _exchange(
    comm: Comm, plan: SavePlan, data: Callable[[str, Box], torch.Tensor]
) -> dict[tuple[int, int], torch.Tensor]:
    """Send the boundary pieces this rank holds to their shards' writers; receive ours.

    The pieces for one peer travel as one byte buffer, each at a 64-byte aligned offset so
    that it can be viewed in its dtype. Returns ``{(task number, source number): piece}``."""
    sends: dict[int, list[torch.Tensor]] = {}
    expect: dict[int, list[tuple[tuple[int, int], Box, ArrayMeta]]] = {}
    for n, task in enumerate(plan.shards):
        meta = plan.arrays[task.key][1]
        for i, (src, box) in enumerate(task.sources):
            if src == task.writer:
                continue
            if src == comm.rank:
                raw = data(task.key, box).contiguous().reshape(-1).view(torch.uint8)
                pad = _aligned(raw.numel()) - raw.numel()
                sends.setdefault(task.writer, []).extend([raw, torch.zeros(pad, dtype=torch.uint8)])
            elif task.writer == comm.rank:
                expect.setdefault(src, []).append(((n, i), box, meta))
    sizes = {src: sum(_aligned(b.numel * m.dtype.itemsize) for _, b, m in items) for src, items in expect.items()}
    got = comm.exchange({dst: torch.cat(parts) for dst, parts in sends.items()}, sizes)
    out: dict[tuple[int, int], torch.Tensor] = {}
    for src, items in expect.items():
        pos = 0
        for ident, box, meta in items:
            nbytes = box.numel * meta.dtype.itemsize
            out[ident] = got[src][pos : pos + nbytes].view(meta.dtype.storage_torch_dtype).reshape(box.shape)
            pos += _aligned(nbytes)
    return out


def _documents(plan: SavePlan) -> list[tuple[str, bytes]]:
    docs = [(f"{g}/{METADATA_FILE}", _dumps(group_zarr_json())) for g in plan.groups]
    docs += [(f"{p}/{METADATA_FILE}", _dumps(m.to_zarr_json())) for p, m in plan.arrays.values()]
    return docs


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=1, allow_nan=False).encode()


def collect(state_dict: Mapping[str, Any]) -> tuple[dict[str, Fragment], dict[str, Any]]:
    """A state dict's tensors as fragments and its other leaves as JSON, by flattened key."""
    fragments: dict[str, Fragment] = {}
    values: dict[str, Any] = {}
    for leaf in iter_leaves(state_dict):
        if is_fragment_value(leaf.value):
            fragments[leaf.key] = to_fragment(leaf.key, leaf.value)
        else:
            values[leaf.key] = to_json(leaf.value, leaf.key)
    return fragments, values


def _infos(fragments: dict[str, Fragment]) -> list[FragmentInfo]:
    return [
        FragmentInfo(
            f.key,
            f.shape,
            str(f.dtype).removeprefix("torch."),
            tuple(b for b, _ in f.pieces),
            f.flat,
            f.plain,
            _digest(f) if f.plain else None,
        )
        for f in fragments.values()
    ]


def _digest(f: Fragment) -> int | None:
    """A fingerprint of a plain tensor's bytes, compared across ranks to tell replicas from
    per-rank state: crc32c on the host; for a large off-CPU tensor, a sum of its bytes and
    of its bytes weighted by position, computed on the device."""
    if not f.pieces:
        return None
    t = f.pieces[0][1].detach().contiguous().reshape(-1)
    if t.dtype.is_complex:
        t = torch.view_as_real(t).reshape(-1)
    raw = t.view(torch.uint8)
    if t.device.type == "cpu" or f.nbytes <= DIGEST_COPY_BYTES:
        return checksum(memoryview(raw.cpu().numpy()))
    v = raw.to(torch.int64)
    pos = torch.arange(1, v.numel() + 1, device=v.device) % 65521
    return hash((int(v.sum()), int((v * pos).sum())))


def _begin(store: Store) -> None:
    """Claim ``store`` for a new checkpoint: refuse a committed one, clear a failed one."""
    if store.exists(METADATA_FILE):
        raise CheckpointExistsError(f"a checkpoint is already committed at {store.url}; choose a new path")
    if store.exists(PENDING_MARKER):
        store.clear()
    elif not store.is_empty():
        raise CheckpointExistsError(f"{store.url} is not empty and holds no ucp_zarr checkpoint; refusing to write into it")
    store.write(PENDING_MARKER, [b"{}"])


def prepare(
    collected: Callable[[], tuple[dict[str, Fragment], dict[str, Any]]],
    store: Store,
    comm: Comm,
    *,
    chunk_bytes: int,
    shard_bytes: int,
    max_workers: int,
    copy: bool,
) -> PreparedSave:
    """The blocking stage of a save of what ``collected()`` returns (see :func:`collect`).

    With ``copy`` (async saves) every box this rank will write or send is copied into host
    memory; otherwise only non-CPU tensors are."""
    fragments: dict[str, Fragment] = {}
    values: dict[str, Any] = {}
    infos: list[FragmentInfo] = []
    error: BaseException | None = None
    try:
        fragments, values = collected()
        infos = _infos(fragments)
    except BaseException as e:
        error = e
    gathered = comm.all_gather((describe(error), infos, values))  # no tensor bytes: boxes, dtypes, JSON
    comm.raise_failures([g[0] for g in gathered], error, "preparing the save")
    plan = plan_save([g[1] for g in gathered], chunk_bytes=chunk_bytes, shard_bytes=shard_bytes)
    global_values, rank_values = _merge_values([g[2] for g in gathered])

    error = None
    if comm.rank == 0:
        try:
            _begin(store)
        except BaseException as e:
            error = e
    comm.agree(error, f"starting a checkpoint at {store.url}")

    staged = _stage(plan, fragments, comm.rank, copy)
    entries: dict[str, TensorEntry] = {}
    for akey, (path, meta) in plan.arrays.items():
        if meta.rank is None:
            entries[akey] = TensorEntry(path, meta.shape, meta.dtype.name)
    for key, ranks in plan.per_rank.items():
        paths = {r: plan.arrays[a][0] for r, a in ranks.items()}
        meta = plan.arrays[ranks[min(ranks)]][1]
        entries[key] = TensorEntry(paths[min(paths)], meta.shape, meta.dtype.name, paths)
    order = {k: i for i, k in enumerate(k for g in gathered for k in [f.key for f in g[1]])}
    entries = dict(sorted(entries.items(), key=lambda kv: order.get(kv[0], 0)))
    meta = CheckpointMeta(
        tensors=entries,
        values=global_values,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        library=f"ucp_zarr {__version__}",
        world_size=comm.world,
        rank_values=rank_values,
    )
    return PreparedSave(store, comm, plan, fragments, meta, staged, max_workers)


def _merge_values(per_rank: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """Values equal on every rank holding them are global; the others are per-rank."""
    seen: dict[str, dict[int, Any]] = {}
    for r, vals in enumerate(per_rank):
        for k, v in vals.items():
            seen.setdefault(k, {})[r] = v
    global_values: dict[str, Any] = {}
    rank_values: dict[str, dict[int, Any]] = {}
    for k, by_rank in seen.items():
        first = next(iter(by_rank.values()))
        if all(_same(v, first) for v in by_rank.values()):
            global_values[k] = first
        else:
            rank_values[k] = by_rank
    return global_values, rank_values


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _stage(plan: SavePlan, fragments: dict[str, Fragment], rank: int, copy: bool) -> Staged:
    """Copy what this rank writes or sends into host memory (all of it with ``copy``, else
    only what lives off the CPU), in one buffer."""
    wanted: list[tuple[str, Box]] = []
    for task in plan.shards:
        if task.writer == rank and not task.sources:
            wanted.append((task.key, plan.arrays[task.key][1].grid.shard_box(task.shard)))
        for src, box in task.sources:
            if src == rank:
                wanted.append((task.key, box))
    staged = Staged()
    todo = []
    for akey, box in wanted:
        frag = fragments[plan.arrays[akey][1].key]
        if copy or frag.device.type != "cpu":
            todo.append((akey, box, frag))
    if not todo:
        return staged
    pin = torch.cuda.is_available() and any(f.device.type == "cuda" for _, _, f in todo)
    sizes = [_aligned(box.numel * frag.dtype.itemsize) for _, box, frag in todo]
    buf = _STAGING.get(sum(sizes), pin)
    pos = 0
    for (akey, box, frag), size in zip(todo, sizes):
        meta = plan.arrays[akey][1]
        dst = buf[pos : pos + box.numel * frag.dtype.itemsize].view(meta.dtype.storage_torch_dtype).view(box.shape)
        pbox, t = frag.holding(box)
        dst.copy_(as_storage(t, meta)[box.relative_to(pbox).slices()], non_blocking=pin)
        staged.boxes.setdefault(akey, []).append((box, dst))
        pos += size
    if pin:
        torch.cuda.synchronize()
    return staged


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


class _StagingBuffer:
    """One host buffer per process, reused by every save that fits in it (a save waits
    for the previous one before staging, so reuse is safe)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or buf.is_pinned() != pin:
            self._buf = buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return buf


_STAGING = _StagingBuffer()
