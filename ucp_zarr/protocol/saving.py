"""The save calls: :func:`save`, :func:`async_save` (the host copy now, the writing on a
background thread at a lower priority, over its own process group) and
:func:`wait_for_pending_save`. The face :mod:`ucp_zarr.api` re-exports them; operations and
adapters call them from here."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import traceback
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError, OptionError
from ..io import writer_process
from ..io.factory import open_store
from ..io.pace import Pace
from ..io.store import Store
from ..layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES
from .distributed import Comm
from .liveness import DEFAULT_LEASE_S
from .collect import collect
from .saver import SaveOptions, SaveResult, prepare

DEFAULT_WORKERS = 4
"""Threads of a save's host copies, and of its writes where ``max_workers`` is not given and
the store declares no request concurrency of its own (a local disk)."""

_background = ThreadPoolExecutor(1, thread_name_prefix="ucp_zarr-save")
_pending: Future | None = None
_pending_lock = threading.Lock()


class SaveFuture(Future):
    """The future of a background save (a :class:`concurrent.futures.Future`). An error that
    nobody asked for (``result()``, ``exception()``) before the interpreter exits is written
    to stderr then, as asyncio reports a task's: a failed last save is never lost silently."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.asked = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self._told()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self._told()

    def _told(self) -> None:
        """Its outcome reached the caller (not a wait that timed out first)."""
        if self.done():
            self.asked = True
            _unreported.discard(self)


_unreported: set[SaveFuture] = set()
"""Background saves running, or failed with nobody told yet (see :func:`_report_at_exit`)."""


def run_reported(pool: ThreadPoolExecutor, what: str, fn: Callable[..., Any], *args: Any) -> SaveFuture:
    """``fn(*args)`` on ``pool``, its outcome on a :class:`SaveFuture` that says ``what`` failed
    at exit if nobody asked."""
    fut = SaveFuture(what)
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
            _unreported.discard(fut)
        except BaseException as e:
            fut.set_exception(e)

    _unreported.add(fut)
    try:
        pool.submit(run)
    except BaseException:  # (the pool takes no work: nothing is left for the exit to wait on)
        _unreported.discard(fut)
        raise
    return fut


def _report_at_exit() -> None:
    """Wait for every background save; write to stderr the error of each that failed with
    nobody told."""
    for fut in list(_unreported):
        wait([fut])
        error = Future.exception(fut)  # (the base class's: not asking)
        if not fut.asked and error is not None:
            print(f"ucp_zarr: {fut.what} failed, and nothing asked for its outcome before exit:", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)


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
    max_workers: int | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    model: torch.nn.Module | None = None,
    unsafe_non_exclusive_store: bool = False,
) -> SaveResult | Future:
    """Save ``state_dict`` at ``path``; every rank of ``process_group`` calls it.

    Tensor values may be DTensors, :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard`
    or plain tensors (whole, identical on every rank). Per-rank state (RNG states, data
    positions) must be wrapped in :class:`~ucp_zarr.PerRank`; a plain tensor that differs
    between ranks is an error. Other values must be JSON-able. Each rank writes only its
    own shards, no two ranks write the same object, and the commit record is written last,
    after every rank's data is durable. A failure on any rank fails the save on every rank.

    The save is a transaction on ``path`` (see :mod:`ucp_zarr.protocol.transaction`):

    * a committed checkpoint is never replaced, unless ``overwrite``: then the new one is
      staged beside it and put in place so that a crash at any point leaves the old or the
      new checkpoint complete and findable;
    * the leftovers of another save are removed only when that save is provably dead (its
      process is gone, or its lease of ``lease_s`` seconds expired on another host), or
      with ``overwrite_incomplete``; a live one raises :class:`~ucp_zarr.OwnershipError`;
    * a save deletes only objects it wrote (or, when overwriting, that the replaced
      checkpoint's commit record names): other files and checkpoints in subfolders stay;
    * the store must create objects exclusively (local paths, ``s3://``, ``memory://``):
      elsewhere two saves could both claim the path, so the save is refused unless
      ``unsafe_non_exclusive_store`` says no other save can ever target it.

    ``hmac_key`` signs the checkpoint (HMAC-SHA256 over the commit record, which holds the
    digests of every document and array, and per-chunk SHA-256 in every shard), so that
    ``load``/``open``/``verify`` with the key refuse any change.

    ``async_save=True`` is deprecated (it will be removed in the next release): call
    :func:`async_save`, which returns the future, as DCP's ``async_save`` does.

    Optimizer state keyed by parameter number (a plain ``optimizer.state_dict()``) is
    stored beside its parameter, in the parameter's Zarr group, when the names are
    knowable: the optimizer was built from ``model.named_parameters()`` (its param groups
    carry ``param_names``), or ``model`` is given and the optimizer was built from
    ``model.parameters()``. Keys do not change (``optim.state.0.exp_avg``).

    ``max_workers`` threads make host copies and write objects: by default
    ``DEFAULT_WORKERS`` (4), and as many writers as the store's own request concurrency
    where it declares one (an object store: 16, as each request waits a round trip; the
    shards assembled in memory at once stay at 4).

    Returns this rank's :class:`~ucp_zarr.protocol.saver.SaveResult`.
    """
    if async_save:
        warnings.warn(
            "ucp_zarr.save(..., async_save=True) is deprecated and will be removed in the next release: "
            "call ucp_zarr.async_save(...), which returns the future",
            DeprecationWarning,
            stacklevel=2,
        )
        return _async_save(
            state_dict, path, process_group=process_group, storage_options=storage_options, async_group=async_group,
            overwrite=overwrite, overwrite_incomplete=overwrite_incomplete, hmac_key=hmac_key,
            chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, max_workers=max_workers, lease_s=lease_s, model=model,
            unsafe_non_exclusive_store=unsafe_non_exclusive_store,
        )
    comm = Comm(process_group)
    store, options = _begin(comm, "save", path, storage_options, lambda: None, chunk_bytes, shard_bytes, max_workers,
                            overwrite, overwrite_incomplete, lease_s, hmac_key, unsafe_non_exclusive_store)
    return prepare(lambda: collect(state_dict, model), store, comm, options, copy=False).finish()


def async_save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    async_group: Any = None,
    overwrite: bool = False,
    overwrite_incomplete: bool = False,
    hmac_key: bytes | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_workers: int | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    model: torch.nn.Module | None = None,
    unsafe_non_exclusive_store: bool = False,
    writer: str = "process",
    write_bytes_per_s: float | None = None,
) -> Future:
    """:func:`save` in the background: returns a :class:`~concurrent.futures.Future` of this
    rank's :class:`~ucp_zarr.protocol.saver.SaveResult` once the state is copied into host
    memory (training may change it from then on); writing and commit happen in the
    background, over ``async_group`` (a group of the same ranks reserved for checkpointing,
    as DCP asks) or else a gloo group created once, by the ranks of ``process_group`` only.
    Errors surface on the future. Any save first waits for the previous one.

    ``writer`` says where the objects are written: ``"process"`` (the default) by a child
    process (:mod:`~ucp_zarr.io.writer_process`, started once) from a host copy in shared
    memory, where the store is a local file system on Linux and the state needs no pinned
    copy (else as ``"thread"``), so that the writing never holds the GIL the training loop
    needs; ``"thread"`` by a thread of this process.

    ``write_bytes_per_s`` paces this rank's writes (None: as fast as storage takes them). A
    write at full speed costs the training steps of its first second or so 10-15% on a
    small host (writeback and memory bandwidth, which no priority buys back); paced, each
    step loses a few percent and the steps lose less in all (measured on 2 cores, 310 MiB:
    the step during the write 1.08x the step before unpaced, 1.04x at 300 MB/s, the write
    0.8 s -> 1.5 s; ``benchmarks/results/table.md``). Choose a rate that finishes well
    within the save interval. The other arguments are :func:`save`'s."""

    def check() -> None:
        if writer not in ("process", "thread"):
            raise ValueError(f"writer must be 'process' or 'thread', not {writer!r}")
        Pace(write_bytes_per_s)  # (refuses a rate that is not a positive number, before anything is done)

    comm = Comm(process_group)
    store, options = _begin(comm, "async_save", path, storage_options, check, chunk_bytes, shard_bytes, max_workers,
                            overwrite, overwrite_incomplete, lease_s, hmac_key, unsafe_non_exclusive_store)
    store.write_in_background()
    background = comm
    if comm.active:
        background = Comm(async_group if async_group is not None else _background_group(process_group))
        if background.world != comm.world:
            raise CheckpointError(f"async_group has {background.world} ranks, process_group {comm.world}: give the same ranks")
    options = dataclasses.replace(options, write_workers=min(options.max_workers, BACKGROUND_WRITERS),
                                  write_bytes_per_s=write_bytes_per_s)
    child = _writer if writer == "process" and writer_process.available(store) else None
    prepared = prepare(lambda: collect(state_dict, model), store, comm, options, copy=True, writer=child)
    global _pending
    with _pending_lock:
        _pending = run_reported(_background, f"the asynchronous save to {store.url}", _in_background, prepared.finish,
                                background, writer_process.thread_nice())
        return _pending


_async_save = async_save  # (for save, whose keyword of that name hides the function)


def save_workers(store: Store, max_workers: int | None) -> dict[str, int | None]:
    """A save's ``max_workers`` and ``write_workers`` (:class:`SaveOptions`) for the
    ``max_workers`` its caller gave: unset, ``DEFAULT_WORKERS``, with as many writers as
    ``store`` keeps requests in flight where it says (:attr:`Store.request_concurrency`)."""
    return {"max_workers": max_workers or DEFAULT_WORKERS, "write_workers": max_workers or store.request_concurrency}


def _begin(comm: Comm, operation: str, path: str | os.PathLike[str], storage_options: dict[str, Any] | None,
           check: Callable[[], None], *option_args: Any) -> tuple[Store, SaveOptions]:
    """The store and options of a save (``option_args``: :func:`_options`'s after the store),
    once the previous asynchronous save is done and ``check`` passed, and the save's first
    collective (:meth:`Comm.start`): a failure of any of these on one rank fails every rank."""
    error: Exception | None = None
    try:
        check()
        wait_for_pending_save()
        store = open_store(path, storage_options)
        options = _options(store, *option_args)
    except Exception as e:
        error = e
    comm.start(operation, f"saving {os.fspath(path)!r}", error)
    return store, options


def _options(
    store: Store, chunk_bytes: int, shard_bytes: int, max_workers: int | None, overwrite: bool,
    overwrite_incomplete: bool, lease_s: float, hmac_key: bytes | None, unsafe_non_exclusive_store: bool,
) -> SaveOptions:
    """The save's options (threads: :func:`save_workers`)."""
    return SaveOptions(
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        **save_workers(store, max_workers),
        overwrite=overwrite,
        overwrite_incomplete=overwrite_incomplete,
        lease_s=lease_s,
        hmac_key=hmac_key,
        unsafe_non_exclusive_store=unsafe_non_exclusive_store,
    )


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

_writer = writer_process.WriterProcess(nice_offset=BACKGROUND_NICE)
"""Writes background saves to local stores (started by the first, see :mod:`..io.writer_process`)."""
atexit.register(_writer.close)  # (after the last background save: its thread is joined first)


def _in_background(finish: Any, comm: Comm, caller_nice: int | None) -> SaveResult:
    """Run ``finish`` on the background thread at ``BACKGROUND_NICE`` below the caller's
    priority (Linux: per thread, and inherited by the worker threads it starts)."""
    if caller_nice is not None:
        writer_process.set_thread_nice(min(caller_nice + BACKGROUND_NICE, MAX_NICE))
    try:
        return finish(comm)
    except Exception as e:
        import torch.distributed as dist

        if comm.active and not dist.is_initialized():  # (torch's own error names only a group)
            raise CheckpointError(
                "the process group was destroyed (destroy_process_group) while this asynchronous save was in flight, "
                "so it was not committed: wait for the save (its future's result(), or the CheckpointManager's "
                f"wait() or close()) before destroy_process_group ({type(e).__name__}: {e})"
            ) from e
        raise


def wait_for_pending_save() -> None:
    """Block until the last asynchronous save has finished (its errors are on its future)."""
    with _pending_lock:
        pending = _pending
    if pending is not None:
        wait([pending])  # (not asking for its outcome: that stays the caller's, see SaveFuture)


def _forget_the_parents_saves() -> None:
    """In a process forked while a background save ran (a DataLoader worker): that save is the
    parent's, and no thread here finishes it; waiting for it (at exit, or before a save of the
    child's own) would wait for ever."""
    global _background, _pending, _pending_lock
    _unreported.clear()
    _background = ThreadPoolExecutor(1, thread_name_prefix="ucp_zarr-save")
    _pending, _pending_lock = None, threading.Lock()
    _writer.after_fork()


os.register_at_fork(after_in_child=_forget_the_parents_saves)

# At interpreter exit the pending background save runs to its end before concurrent.futures
# refuses new work (an overwrite's staged swap submits some: the save was lost, its staging
# folder left beside the old checkpoint). threading's exit hooks run in reverse order of
# registration, and concurrent.futures registered its own when imported above.
# Every save still running (a manager's retention after it too) ends then, and a failure nobody
# was told of is written to stderr.
threading._register_atexit(_report_at_exit)  # type: ignore[attr-defined]


def _timeout_of(group: Any) -> Any:
    """The timeout the job gave ``group`` (a ``timedelta``), for its background group: else torch's
    default (30 minutes), which a save waiting on a peer that left would wait out, at exit too.
    None where torch does not say (it reads its backend's options)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # (no such backend in this group, or another torch)
            continue
    return None


def _background_group(group: Any) -> Any:
    """A gloo group of the ranks of ``group`` for background saves, so that their
    collectives never interleave with training's; created on first use, and again after
    the default group was re-created.

    Every rank of the job saving: ``new_group`` as a collective of them all. A subgroup
    saving: by its members alone (``use_local_synchronization``: the other ranks call
    nothing). torch names such a group by its ranks and the number of groups the creating
    process belongs to (``distributed_c10d._hash_ranks_to_str``), so members that belong to
    different numbers of groups (a Megatron embedding group ``[0, 3]`` beside others) would
    wait for each other under different names until the timeout: that is checked first and
    refused, naming the fix."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else default))
    held = _async_groups.get(ranks)
    if held is None or held[0] is not default:
        timeout = _timeout_of(group if group is not None else default)
        if len(ranks) == dist.get_world_size():
            made = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
        else:
            counts: list[Any] = [None] * len(ranks)
            dist.all_gather_object(counts, len(dist.distributed_c10d._world.pg_names), group=group)
            if len(set(counts)) > 1:
                raise OptionError(
                    f"async_save on the group of ranks {list(ranks)}: its ranks belong to different numbers of process "
                    f"groups ({dict(zip(ranks, counts))}), so torch would give its background group a different name "
                    "on each (a hang); pass async_group=dist.new_group(<those ranks>, backend='gloo'), created on "
                    "every rank of the job, once"
                )
            made = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
        held = (default, made)
        _async_groups[ranks] = held
    return held[1]

