"""Orchestrating a save: every rank runs the same phases, each ending in an agreement.

1. **collect** this rank's fragments and values -> agree (error, fragment infos, values);
2. **plan** (pure, the same on every rank) and **claim** the path (the coordinator's
   :class:`~.transaction.Transaction`) -> agree (save id, staging sibling);
3. **stage** host copies (:mod:`.staging`) and build the **boundary exchange**
   (:mod:`.exchange`) -> agree (error, bytes each rank will send to each peer, checked by
   every rank against the plan). An asynchronous save returns here;
4. **exchange** boundary pieces point-to-point, with the sizes agreed;
5. **write** shards, each rank behind a :class:`~.liveness.Fence`, and make them durable
   -> agree (error); then the array and group documents -> gather (error, shard seals) on
   the coordinator. An array's ``zarr.json`` appears only once every shard of it is
   durable, so a Zarr reader looking at a save in progress finds no array, or its final
   bytes, never fill values standing in for data not yet written;
6. the coordinator **commits** (or aborts) -> broadcast the outcome.

A failure on any rank fails the save on every rank at the next agreement, with one error
naming the failing ranks (after the claim, the coordinator aborts the transaction first);
no rank is left waiting in a collective.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..io.arrayio import Seal, write_shard
from ..io.pace import Pace
from ..io.writer_process import DocumentJob, ShardJob, WriterProcess
from .distributed import Comm, describe, raise_failures
from ..errors import LayoutError, OptionError
from .exchange import Exchange, build_exchange, check_sizes
from ..format.documents import METADATA_FILE, dump_consolidated, dump_document, group_zarr_json
from ..format.commit_record import ArrayRef, CheckpointMeta, TensorEntry
from .collect import Collected, fragment_infos, merge_values
from .hooks import LayoutHooks
from ..format.integrity import RECORD_DIGEST, array_digest, document_digest, record_digest, sign
from ..layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .planner import FragmentInfo, SavePlan, ShardTask, plan_save, shared_infos
from .replicas import Digests, check_replicas, combine_replicas, replica_digests, set_combined
from .staging import Staging
from .ties import agree_ties
from ..format.statedict import Structure
from .owned import owned_by
from ..io.store import Store, wait_all
from .liveness import DEFAULT_LEASE_S, FENCE_INTERVAL_S, Fence
from .transaction import Transaction, is_internal, require_exclusive_create, target_store
from ..version import __version__

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SaveOptions:
    """The knobs of one save (see :func:`ucp_zarr.save`)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shard_bytes: int = DEFAULT_SHARD_BYTES
    max_workers: int = 4
    """Threads making host copies; as many shards are assembled in memory at once at most."""
    write_workers: int | None = None
    """Threads writing objects (default ``max_workers``): more where each write waits a
    network round trip (:attr:`~ucp_zarr.io.store.Store.request_concurrency`)."""
    overwrite: bool = False
    overwrite_incomplete: bool = False
    lease_s: float = DEFAULT_LEASE_S
    hmac_key: bytes | None = None
    unsafe_non_exclusive_store: bool = False
    """Save to a store whose exclusive create is check-then-write (see
    :func:`~.transaction.require_exclusive_create`)."""
    write_bytes_per_s: float | None = None
    """At most this many bytes per second written by this rank (:class:`~..io.pace.Pace`);
    None: as fast as the storage takes them."""


def begin_transaction(store: Store, plan: SavePlan, options: SaveOptions, writers: tuple[int, ...] = ()) -> Transaction:
    """Claim ``store`` for a save of ``plan`` (the coordinator's part of phase 2), written
    by this process and ``writers``."""
    require_exclusive_create(store, options.unsafe_non_exclusive_store)
    txn = Transaction(
        store,
        owned=owned_by(plan),
        overwrite=options.overwrite,
        overwrite_incomplete=options.overwrite_incomplete,
        lease_s=options.lease_s,
        writers=writers,
    )
    txn.begin()
    return txn


@dataclass(frozen=True)
class SaveResult:
    """What one rank's part of a save did."""

    url: str
    rank: int
    bytes_written: int
    objects: tuple[str, ...]
    """The keys of the objects this rank wrote (no other rank wrote any of them)."""
    save_id: str = ""

    def __repr__(self) -> str:  # one line, whatever the number of objects
        return (f"SaveResult(url={self.url!r}, rank={self.rank}, bytes_written={self.bytes_written}, "
                f"objects=<{len(self.objects)} keys>, save_id={self.save_id!r})")


class PreparedSave:
    """A save after its blocking stage (phases 1-3); :meth:`finish` runs phases 4-6."""

    def __init__(
        self,
        store: Store,
        comm: Comm,
        options: SaveOptions,
        plan: SavePlan,
        txn: Transaction | None,
        save_id: str,
        staged: str | None,
        staging: Staging,
        exchange: Exchange,
        values: tuple[dict[str, Any], dict[str, dict[int, Any]]],
        order: list[str],
        layout: dict[str, Any] | None = None,
        structure: Structure | None = None,
        ties: dict[str, str] | None = None,
        whole: SavePlan | None = None,
        writer: tuple[WriterProcess, int] | None = None,
    ) -> None:
        self.store = store
        self.comm = comm
        self.options = options
        self.plan = plan
        self.txn = txn
        self.save_id = save_id
        self.target = target_store(store, staged)
        self.staging = staging
        self.exchange = exchange
        self.values = values
        self.order = order
        self.layout = layout or {}
        self.structure = structure
        self.ties = ties or {}
        self.whole = plan if whole is None else whole
        """The whole plan, on the coordinator (``plan`` is this rank's part; a process
        saving alone may pass its whole plan as ``plan``)."""
        self._docs: list[tuple[str, bytes]] | None = None
        self.writer = writer
        """The process (and its pid, which the claim names) that writes the shards staged
        in shared memory and the documents (a background save to a local store, see
        :mod:`..io.writer_process`); else this process's threads do."""
        self.pace = Pace(options.write_bytes_per_s)
        """Paces this process's own writes (the writer process paces its own)."""
        self.seal = Seal(save_id, options.hmac_key is not None, options.hmac_key)
        """What seals this save's shards."""

    def finish(self, comm: Comm | None = None) -> SaveResult:
        """Exchange boundary pieces, write this rank's documents and shards, commit (over
        ``comm``, by default the one the save was prepared on)."""
        comm = comm or self.comm
        error: BaseException | None = None
        seals: dict[int, bytes] = {}
        fence = Fence(
            self.target, self.save_id, min(FENCE_INTERVAL_S, self.options.lease_s / 4),
            lease=None if self.txn is None else self.txn.heartbeat,
        )
        try:
            received = self.exchange.run(comm)
            seals = self._write_data(comm.rank, received, fence)
        except BaseException as e:  # every rank must learn of it before anyone commits
            error = e
        try:
            if not any(comm.all_gather(describe(error))):  # every rank's data is durable: now the documents
                try:
                    self._write_documents(comm.rank, fence)
                except BaseException as e:
                    error = e
            gathered = comm.gather((describe(error), seals))
        except BaseException:  # a collective failed (a rank died): the coordinator gives the claim back
            if comm.rank == 0 and self.txn is not None:
                self._abort()
            raise
        outcome: dict[int, tuple[str, str]] = {}
        if comm.rank == 0:
            assert gathered is not None and self.txn is not None
            outcome = {r: e for r, (e, _) in enumerate(gathered) if e is not None}
            if outcome:
                self._abort()
            else:
                try:
                    self.txn.commit(self._root(gathered))
                except BaseException as e:
                    error = e
                    outcome = {0: describe(e)}  # type: ignore[dict-item]
                    self._abort()
        outcome = comm.broadcast(outcome)
        raise_failures(comm, outcome, error, f"saving {self.store.url}")
        objects = tuple(k for k in self.target.stats.written if not is_internal(k))
        return SaveResult(self.store.url, comm.rank, self.target.stats.bytes_written, objects, self.save_id)

    def _abort(self) -> None:
        _abort(self.txn, self.store, wrote=True)

    def _documents(self) -> list[tuple[str, bytes]]:
        """Every group and array ``zarr.json`` of the whole plan (:attr:`whole`: on a rank
        other than the coordinator, its part): key and bytes as written (made once per save:
        the documents written, the commit record's digests of them and its consolidated
        copy). Kept as bytes, not parsed: thousands of dicts and lists alive for the whole
        of a background write count towards Python's trigger of a full garbage collection
        of the training process (~100 ms, see benchmarks/results/profiles.md)."""
        if self._docs is None:
            self._docs = [(k, dump_document(d)) for k, d in documents_of(self.whole)]
        return self._docs

    def _write_documents(self, rank: int, fence: Fence) -> None:
        """Write this rank's group and array documents behind the fence, durably."""
        docs = [(k, b) for k, b in self._documents() if self.plan.doc_writers.get(k) == rank]
        if self.writer is not None and docs:
            process, pid = self.writer
            process.write(self.target, [DocumentJob(k, d) for k, d in docs], fence, self.seal, None,
                          self.options.max_workers, pid, self.options.write_bytes_per_s)
            return

        def write(key: str, data: bytes) -> int:
            self.pace.take(len(data))
            return self.target.write(key, [data], fence)

        with ThreadPoolExecutor(self.options.write_workers or self.options.max_workers) as pool:
            wait_all([pool.submit(write, k, d) for k, d in docs])
        self.target.sync()

    def _write_data(self, rank: int, received: dict[tuple[int, int], torch.Tensor], fence: Fence) -> dict[int, bytes]:
        """Write this rank's shards behind the fence, durably; return the seal of each shard
        written, by task number."""
        seal = self.seal
        plan = self.plan
        tasks = [(n, t) for n, t in plan.numbered() if t.writer == rank]
        memory = self.staging.memory
        remote = {n: job for n, job in ((n, self._shard_job(t)) for n, t in tasks) if job is not None}
        sizes = {n: _shard_nbytes(plan, t) for n, t in tasks}
        # the rate is this rank's: the writer process and this one's threads share it by their bytes
        rate = remote_rate = self.options.write_bytes_per_s
        pace = self.pace
        assembling = threading.BoundedSemaphore(self.options.max_workers)  # (whatever the writers)
        share = sum(sizes[n] for n in remote) / max(1, sum(sizes.values()))
        if rate is not None and 0 < share < 1:
            pace, remote_rate = Pace(rate * (1 - share)), rate * share

        def write_task(n: int, task: ShardTask) -> bytes:
            fence.check()
            path, meta = plan.arrays[task.key]
            sbox = meta.grid.shard_box(task.shard)
            paced = None if pace.bytes_per_s is None else pace.take
            if not task.sources:
                src, held = self.staging.holding(task.key, sbox)
                try:
                    return write_shard(self.target, path, meta, task.shard, src, held, seal, fence, paced)
                finally:  # (a pooled copy not given back on a failure would block the other writers forever)
                    self.staging.release(task.key, sbox)
            with assembling:
                buf = torch.empty(sbox.shape, dtype=meta.dtype.storage_torch_dtype)
                for i, (src_rank, box) in enumerate(task.sources):
                    part = self.staging.data(task.key, box) if src_rank == rank else received[(n, i)]
                    buf[box.relative_to(sbox).slices()] = part.reshape(box.shape)
                    if src_rank == rank:
                        self.staging.release(task.key, box)
                return write_shard(self.target, path, meta, task.shard, buf, sbox, seal, fence, paced)

        seals: dict[int, bytes] = {}
        try:
            with ThreadPoolExecutor(self.options.write_workers or self.options.max_workers) as pool:
                jobs = {n: pool.submit(write_task, n, t) for n, t in tasks if n not in remote}
                if remote:
                    assert self.writer is not None and memory is not None
                    process, pid = self.writer
                    written = process.write(self.target, list(remote.values()), fence, seal, memory,
                                            self.options.max_workers, pid, remote_rate)
                    seals.update((n, s) for n, s in zip(remote, written) if s is not None)
                wait_all(list(jobs.values()))
                seals.update((n, job.result()) for n, job in jobs.items())
        finally:
            if memory is not None:
                memory.close()
        self.target.sync()
        return seals

    def _shard_job(self, task: ShardTask) -> ShardJob | None:
        """``task`` for the writer process: a shard wholly staged in the shared memory."""
        memory = self.staging.memory
        if self.writer is None or memory is None or task.sources:
            return None
        path, meta = self.plan.arrays[task.key]
        # (an async save stages every box it writes: holding leases no pooled copy here)
        src, held = self.staging.holding(task.key, meta.grid.shard_box(task.shard))
        at = memory.offset(src.data_ptr(), src.numel() * src.element_size())
        if at is None or not src.is_contiguous():
            return None
        size = src.element_size()
        return ShardJob(path, meta, tuple(task.shard), at, tuple(src.shape), tuple(st * size for st in src.stride()), held)

    def _root(self, gathered: list[Any]) -> bytes:
        """The commit record, from the whole plan and every rank's shard seals."""
        plan = self.whole
        seals: dict[int, bytes] = {}
        for _, s in gathered:
            seals.update(s)
        by_array: dict[str, list[bytes]] = {}
        for n, task in enumerate(plan.shards):
            by_array.setdefault(task.key, []).append(seals[n])
        refs = {akey: ArrayRef(path, array_digest(by_array.get(akey, []))) for akey, (path, _) in plan.arrays.items()}
        entries: dict[str, TensorEntry] = {}
        for akey, (path, meta) in plan.arrays.items():
            if meta.rank is None:
                rule = plan.meanings.get(akey)
                entries[akey] = TensorEntry(
                    path, meta.shape, meta.dtype.name, refs[akey].digest, rule=None if rule is None else json.loads(rule)
                )
        for key, ranks in plan.per_rank.items():
            copies = {r: refs[a] for r, a in ranks.items()}
            first = copies[min(copies)]
            meta = plan.arrays[ranks[min(ranks)]][1]
            entries[key] = TensorEntry(first.path, meta.shape, meta.dtype.name, first.digest, copies)
        position = {k: i for i, k in enumerate(self.order)}
        made = self._documents()
        global_values, rank_values = self.values
        stored = set(entries) | set(global_values) | set(rank_values) | set(self.ties)
        meta = CheckpointMeta(
            tensors=dict(sorted(entries.items(), key=lambda kv: position.get(kv[0], 0))),
            values=global_values,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            library=f"ucp_zarr {__version__}",
            save_id=self.save_id,
            world_size=self.comm.world,
            layout=self.layout,
            rank_values=rank_values,
            structure=None if self.structure is None else self.structure.select(stored.__contains__, lambda _: True),
            documents={k: document_digest(b) for k, b in made},
            ties=self.ties,
        )
        attrs = meta.attributes()
        attrs[RECORD_DIGEST] = record_digest(attrs)
        if self.options.hmac_key is not None:
            attrs["signature"] = sign(attrs, self.options.hmac_key)
        return dump_consolidated(meta.to_zarr_json(attrs), made, {f"{g}/{METADATA_FILE}" for g in plan.groups})


def _abort(txn: Transaction | None, store: Store, *, wrote: bool) -> None:
    """Abort the failed save ``txn`` (if this rank holds it) at ``store``; a failure to clean
    up is logged: the save's own error is what the caller needs to see."""
    if txn is None:
        return
    try:
        txn.abort(wrote=wrote)
    except Exception as e:
        log.warning("ucp_zarr: could not clean up the failed save at %s: %s", store.url, e)


def _shard_nbytes(plan: SavePlan, task: ShardTask) -> int:
    meta = plan.arrays[task.key][1]
    return meta.grid.shard_box(task.shard).numel * meta.dtype.itemsize


def document_dicts(plan: SavePlan) -> list[tuple[str, dict[str, Any]]]:
    """Every group and array ``zarr.json`` of the checkpoint."""
    return list(documents_of(plan))


def documents_of(plan: SavePlan) -> Iterator[tuple[str, dict[str, Any]]]:
    """:func:`document_dicts` one at a time (a save dumps each as it is made)."""
    for g in plan.groups:
        yield f"{g}/{METADATA_FILE}", group_zarr_json()
    for p, m in plan.arrays.values():
        yield f"{p}/{METADATA_FILE}", m.to_zarr_json()



def _agreed_rules(per_rank: list[tuple[dict[str, Any] | None, frozenset[str]]], hooks: LayoutHooks) -> dict[str, Any] | None:
    """The layout document (rules) every rank placed its state dict by (the same on every
    rank that used any), its placements checked together by the layout's ``hooks``."""
    given = [(r, rules) for r, (rules, _) in enumerate(per_rank) if rules is not None]
    if not given:
        return None
    first = given[0][1]
    for r, rules in given[1:]:
        if rules != first:
            raise LayoutError(f"ranks {given[0][0]} and {r} placed their state dicts by different rules")
    hooks.check_placements(first, [used for _, used in per_rank])
    return first


def _digest_of_path(store: Store) -> tuple[bytes, bytes]:
    """16 bytes that tell one rank's path from another's (sent by every rank to the
    coordinator): the path as given (absolute) and as this host's file system resolves it."""
    given = store.url
    resolved = os.path.realpath(store.local_path) if store.local_path is not None else given
    return tuple(hashlib.blake2b(w.encode(), digest_size=8).digest() for w in (given, resolved))  # type: ignore[return-value]


def _check_one_path(digests: list[tuple[bytes, bytes]], url: str) -> None:
    """Refuse a save whose ranks passed different paths (the coordinator's is ``url``): each
    would claim and write its own, and none could commit every rank's part. One path: the
    same absolute path on every rank (whatever each host mounts there), or paths that every
    rank's file system resolves to the same (a symbolic link in one rank's spelling)."""
    if any(all(d[i] == digests[0][i] for d in digests) for i in (0, 1)):
        return
    others = [r for r, d in enumerate(digests) if d[0] != digests[0][0]]  # (some: the given paths differ)
    raise OptionError(f"saving {url}: ranks {others[:8]}{' ...' if len(others) > 8 else ''} passed another path than "
                      f"rank 0 ({url}); a save is a collective: pass the same path on every rank")


def prepare(
    collected: Callable[[], Collected],
    store: Store,
    comm: Comm,
    options: SaveOptions,
    *,
    copy: bool,
    writer: WriterProcess | None = None,
) -> PreparedSave:
    """The blocking stage of a save of what ``collected()`` returns (phases 1-3).

    With ``copy`` (async saves) every box this rank will write or send is copied into host
    memory; otherwise only non-CPU tensors are. With ``writer``, the copies are made in
    shared memory, and that process writes them (see :mod:`..io.writer_process`)."""
    # 1. collect
    error: BaseException | None = None
    col = Collected({}, {})
    infos: list[FragmentInfo] = []
    differing: dict[str, torch.Tensor] = {}  # (copies the layout's hooks combine)
    try:
        col = collected()
        infos = fragment_infos(col.fragments, col.aliases)
        differing = {k: f.pieces[0][1].detach().cpu() for k, f in col.fragments.items() if f.average and f.pieces}
    except BaseException as e:
        error = e
    # 2. plan on one coordinator (rank 0): it receives every rank's fragment list (through
    # group leaders, which merge equal ones), plans, and sends each group its part, which
    # its leader cuts into its ranks' parts (a layout error is raised by all)
    coordinator: dict[str, Any] = {}

    def plan_all(payloads: list[Any], groups: list[range]) -> list[Any]:
        _check_one_path([g[9] for g in payloads], store.url)
        hooks = next((g[8] for g in payloads if g[8] is not None), None) or LayoutHooks()  # (the layout's, once)
        rules = _agreed_rules([(g[3], g[4]) for g in payloads], hooks)
        combined = combine_replicas([g[5] for g in payloads], hooks)
        ties = agree_ties([(g[7], g[0]) for g in payloads])  # (an alias is stored as its canonical tensor)
        plan = plan_save([[i for i in g[0] if i.key not in ties] for g in payloads], chunk_bytes=options.chunk_bytes,
                         shard_bytes=options.shard_bytes)
        coordinator.update(
            plan=plan,
            values=merge_values([(g[1], g[2]) for g in payloads]),
            order=[f.key for g in payloads for f in g[0]],
            layout={} if rules is None else {"rules": rules},
            structure=Structure.merged([g[6] for g in payloads]),
            ties=ties,
        )
        return [(part, {k: combined[k] for r in g for k in payloads[r][5]}) for part, g in zip(plan.parts(groups), groups)]

    def split(answer: Any, group: range, payloads: list[Any]) -> list[Any]:
        part, combined = answer
        return [(p, {k: combined[k] for k in g[5]}) for p, g in zip(part.parts([(r,) for r in group]), payloads)]

    plan, combined = comm.coordinate(
        error,
        "preparing the save",
        (infos, col.values, col.per_rank_values, col.rules, col.used, differing, col.structure, col.ties, col.hooks,
         _digest_of_path(store)),
        plan_all,
        split,
        lambda payloads: [(i, *p[1:]) for i, p in zip(shared_infos([p[0] for p in payloads]), payloads)],
    )
    whole = coordinator.get("plan")  # (rank 0: the commit record and the replica check need all of it)
    set_combined(col.fragments, combined)
    values, order, layout = coordinator.get("values", ({}, {})), coordinator.get("order", []), coordinator.get("layout", {})
    txn: Transaction | None = None
    error = None
    writer_pid = None
    if writer is not None:  # (before the claim, which names it)
        try:
            writer_pid = writer.start()
        except BaseException as e:
            error = e
    if comm.rank == 0 and error is None:
        try:
            txn = begin_transaction(store, whole, options, () if writer_pid is None else (writer_pid,))
        except BaseException as e:
            error = e

    def give_back() -> None:  # (on rank 0, once any rank failed: before any rank raises)
        _abort(txn, store, wrote=False)  # nothing was written yet: the path is left as it was

    try:  # the claim, to every rank (rank 0 holds it: a failure elsewhere gives it back first)
        save_id, staged = comm.coordinate(
            error, f"starting a checkpoint at {store.url}", None,
            lambda _, groups: [(txn.save_id, txn.staged)] * len(groups),  # type: ignore[union-attr]
            lambda claim, group, _: [claim] * len(group), on_failure=give_back,
        )
    except BaseException:
        give_back()  # (a failure of the exchange itself)
        raise

    # 3. show replicas equal, stage and build the exchange
    error = None
    staging: Staging | None = None
    exchange = Exchange()
    digests: Digests = []
    try:
        digests = replica_digests(plan, col.fragments)
        staging = Staging(plan, col.fragments, comm.rank, copy, workers=options.max_workers, shared=writer is not None)
        exchange = build_exchange(plan, comm.rank, staging)
        check_sizes(plan, comm.rank, exchange)
    except BaseException as e:
        error = e

    def compare(payloads: list[Digests], groups: list[range]) -> list[None]:
        check_replicas(whole, payloads)
        return [None] * len(groups)

    try:
        comm.coordinate(
            error, "staging the save", digests, compare, lambda _, group, __: [None] * len(group), on_failure=give_back
        )
    except BaseException:
        give_back()  # (a failure of the exchange itself; giving back twice does nothing)
        raise
    assert staging is not None
    return PreparedSave(
        store, comm, options, plan, txn, save_id, staged, staging, exchange, values, order, layout,
        structure=coordinator.get("structure"), ties=coordinator.get("ties"), whole=whole,
        writer=None if writer is None else (writer, writer_pid),
    )
