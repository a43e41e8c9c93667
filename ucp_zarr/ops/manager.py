"""The checkpoint manager: the save / keep / find / resume loop of a training job as one object.

Every rank of the job creates one :class:`CheckpointManager` on the same root and calls the
same methods in the same order (they are collective where ``ucp_zarr.save``/``load`` are).
Steps live in folders under the root (see :mod:`ucp_zarr.ops.steps`); retention runs on
rank 0 of the group after each commit. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, MutableMapping

from ..errors import CheckpointError, FormatError, IncompleteCheckpointError, NotACheckpointError
from ..io.factory import open_store
from ..io.store import Store, at_once
from ..protocol.liveness import DEFAULT_LEASE_S, Liveness
from .interval import METHODS, _positive, optimal_interval, resolve_mtbf
from .retention import check_policy, steps_to_delete
from .steps import (
    ReadLease,
    StepGoneError,
    clean_folder,
    collect_staging_copies,
    delete_step,
    inspect_step,
    is_committed,
    read_meta,
    step_name,
    step_numbers,
    step_store,
)

if TYPE_CHECKING:
    from ..protocol.distributed import Comm

log = logging.getLogger(__name__)

LOAD_ATTEMPTS = 4
"""How often :meth:`CheckpointManager.load_latest` moves on to the next newest step when
the one it picked is deleted under it (by another job's retention)."""


@dataclass(frozen=True)
class SaveMetrics:
    """What one save through the manager cost, as seen by this rank."""

    step: int
    path: str
    async_save: bool
    blocking_s: float
    """How long training was stalled (the whole save when synchronous)."""
    total_s: float
    """From the call to the commit (async: in the background)."""
    bytes: int
    """Bytes this rank wrote."""
    objects: int
    """Objects this rank wrote."""
    retention_s: float = 0.0
    deleted: tuple[int, ...] = ()
    """Steps retention deleted after this commit (rank 0)."""
    retention_error: str | None = None
    """Why retention failed, if it did (the checkpoint itself is committed)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RetentionFailed(Exception):
    """Retention that failed for some steps (the message names each failure), after it
    deleted the steps ``deleted``."""

    def __init__(self, deleted: tuple[int, ...], message: str) -> None:
        super().__init__(message)
        self.deleted = deleted


class CheckpointManager:
    """Save steps under ``root``, keep some, find the newest complete one, resume from it.

    ``root``: a local path or fsspec URL (``storage_options`` for the latter). ``keep_last``:
    keep the newest N committed steps (None: keep all); ``keep_every``: also keep every step
    that is a multiple of K. Retention never deletes the newest committed step, nor one being
    read (reader leases) or written, and removes interrupted saves of dead owners.

    When to save (:meth:`should_save`): every ``every_n_steps``, or adaptively from a failure
    rate (``mtbf_s``, or ``failures_per_node_day`` with ``nodes``), the measured save cost
    (the blocking stage, an exponential moving average with weight ``smoothing``; ``save_cost_s``
    is the estimate until the first save) and the measured step time, at the interval
    :func:`~ucp_zarr.ops.optimal_interval` gives (``method``).

    ``on_saved(metrics)`` is called after each commit (in the background for async saves);
    each save is also logged at INFO. ``process_group``: the group of the job's ranks
    (default: torch.distributed's default group).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        every_n_steps: int | None = None,
        mtbf_s: float | None = None,
        failures_per_node_day: float | None = None,
        nodes: int | None = None,
        restart_cost_s: float = 0.0,
        save_cost_s: float | None = None,
        method: str = "daly",
        smoothing: float = 0.3,
        on_saved: Callable[[SaveMetrics], None] | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        check_policy(keep_last, keep_every)
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be None or a positive integer, got {every_n_steps!r}")
        rate_given = mtbf_s is not None or failures_per_node_day is not None or nodes is not None
        if every_n_steps is not None and rate_given:
            raise ValueError("give every_n_steps (a fixed schedule) or a failure rate (the computed interval), not both")
        self.mtbf_s = resolve_mtbf(mtbf_s, failures_per_node_day=failures_per_node_day, nodes=nodes) if rate_given else None
        self.restart_cost_s = _positive("restart_cost_s", restart_cost_s, zero=True)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.root = os.fspath(root)
        self.storage_options = storage_options
        self.process_group = process_group
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.every_n_steps = every_n_steps
        self.method = method
        self.smoothing = float(smoothing)
        self.on_saved = on_saved
        self.lease_s = _positive("lease_s", lease_s)
        self._store = open_store(self.root, storage_options)
        self._group_comm: Comm | None = None
        self._stores: dict[int, Store] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ucp_zarr-manager")
        self._inflight: Future | None = None
        self._history: list[SaveMetrics] = []
        self._lock = threading.Lock()
        self._closed = False
        # what the interval advisor measures (rank 0's measurements decide)
        self._save_cost_s = None if save_cost_s is None else _positive("save_cost_s", save_cost_s)
        self._step_time_s: float | None = None
        self._progress_s = 0.0
        """Seconds of training since the last save (or load)."""
        self._last_saved: int | None = None
        self._prev: tuple[int, float] | None = None
        """(step, monotonic time) of the last should_save call, save or load."""
        self._stalled_s = 0.0
        """Blocking save time since ``_prev``, not part of any step's time."""

    @property
    def _comm(self) -> "Comm":
        """The ranks of ``process_group``, taken once the group is up: a manager made before
        ``init_process_group`` is one of every rank then (taken at construction, each rank was
        a job of one and decided alone); kept from then on (a retention after
        ``destroy_process_group`` still runs on rank 0 alone)."""
        from ..protocol.distributed import Comm  # (imports torch)

        comm = self._group_comm
        if comm is None:
            comm = Comm(self.process_group)
            if comm.active:
                self._group_comm = comm
        return comm

    # --- finding steps ---------------------------------------------------------------------

    def path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved."""
        return self._step(step).url

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        self._raise_failed()
        return self._committed(step_numbers(self._store))

    def _committed(self, numbers: list[int]) -> list[int]:
        """Those of ``numbers`` whose folder holds a committed checkpoint (asked at once where
        the store waits a round trip per request: a request per step)."""
        steps = [self._step(s) for s in numbers]
        return [s for s, yes in zip(numbers, at_once(self._store, is_committed, steps)) if yes]

    def latest(self) -> int | None:
        """The newest committed step whose commit record parses, or None."""
        self._raise_failed()
        for s in reversed(step_numbers(self._store)):
            store = self._step(s)
            if not is_committed(store):
                continue
            try:
                read_meta(store)
                return s
            except (FormatError, FileNotFoundError, NotACheckpointError, IncompleteCheckpointError) as e:
                log.warning("ucp_zarr: skipping step %d: %s", s, e)
        return None

    # --- saving ---------------------------------------------------------------------------

    def save(self, step: int, state_dict: MutableMapping[str, Any], *, async_save: bool = False,
             protect: Iterable[int] = (), protect_within_limit: Iterable[int] = (),
             **save_kwargs: Any) -> SaveMetrics | Future:
        """Save ``state_dict`` as ``step`` (every rank calls it); ``save_kwargs`` go to
        :func:`ucp_zarr.save`. Waits for the previous async save first and raises its error.
        The retention after it keeps the steps of ``protect`` too, beside the ``keep_last``
        newest, and those of ``protect_within_limit`` counted among them (as the Hugging Face
        Trainer's ``save_total_limit`` counts its best checkpoint).

        Returns the :class:`SaveMetrics`, or with ``async_save`` (:func:`ucp_zarr.async_save`) a future of them, resolved
        after the commit and retention (its error also surfaces on the next call)."""
        from ..protocol.saving import async_save as save_in_background, run_reported, save as save_checkpoint

        self._check_open()
        step_name(step)  # (validates)
        self._wait_agreed(f"the async save before step {step}")
        if self._comm.rank == 0:
            self._clear_leftovers(step)
        url = self.path(step)
        t0 = time.perf_counter()
        out = (save_in_background if async_save else save_checkpoint)(
            state_dict, url, process_group=self.process_group, storage_options=self.storage_options, **save_kwargs
        )
        blocking = time.perf_counter() - t0
        self._saved(step, blocking)
        kept = (frozenset(protect) | {step}, frozenset(protect_within_limit))
        if async_save:
            self._inflight = run_reported(self._executor, f"the asynchronous save of step {step} to {url}", self._complete,
                                          step, url, out, t0, blocking, True, kept)
            return self._inflight
        return self._complete(step, url, out, t0, blocking, False, kept)

    def _clear_leftovers(self, step: int) -> None:
        """Remove an uncommitted folder of ``step`` nobody alive works on, so the save can
        claim it (errors are left to the save, which reports them on every rank)."""
        try:
            if step not in step_numbers(self._store):
                return
            folder = inspect_step(self._step(step), step, self._liveness())
            if not folder.committed and folder.names:
                clean_folder(folder, lease_s=self.lease_s)
        except Exception as e:
            log.warning("ucp_zarr: could not clear the leftovers at %s: %s", self.path(step), e)

    def _complete(self, step: int, url: str, out: Any, t0: float, blocking: float, is_async: bool,
                  kept: tuple[frozenset[int], frozenset[int]]) -> SaveMetrics:
        result = out.result() if is_async else out
        total = time.perf_counter() - t0
        deleted: tuple[int, ...] = ()
        retention_s, error = 0.0, None
        if self._comm.rank == 0:
            t1 = time.perf_counter()
            try:
                deleted = self._retain(step, kept)
            except RetentionFailed as e:  # the checkpoint is committed; keep training
                deleted, error = e.deleted, str(e)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                log.warning("ucp_zarr: retention under %s failed after saving step %d: %s", self.root, step, error)
            retention_s = time.perf_counter() - t1
        metrics = SaveMetrics(
            step, url, is_async, blocking, total, result.bytes_written, len(result.objects), retention_s, deleted, error
        )
        with self._lock:
            self._history.append(metrics)
        log.info(
            "ucp_zarr: saved step %d to %s: blocking %.3f s, total %.3f s, %d bytes in %d objects (this rank)%s",
            step, url, blocking, total, metrics.bytes, metrics.objects, f"; deleted steps {list(deleted)}" if deleted else "",
        )
        if self.on_saved is not None:
            self.on_saved(metrics)
        return metrics

    def _retain(self, step: int, kept: tuple[frozenset[int], frozenset[int]]) -> tuple[int, ...]:
        """Apply the retention policy (never to the steps ``kept``: the one just saved and those
        the save protects, and those it protects within the limit; :func:`delete_step` backs
        off from steps being read) and remove
        uncommitted folders nobody alive works on. Warns when ``step``, just saved, is not the
        newest: a run rolled back to an older step resumes from the newer ones."""
        numbers = step_numbers(self._store)
        committed = self._committed(numbers)
        newer = [s for s in committed if s > step]
        if newer:
            warnings.warn(f"ucp_zarr: saved step {step} under {self.root}, which holds newer steps {newer[:3]}"
                          f"{' ...' * (len(newer) > 3)}: steps are ordered by number, so latest() and load_latest() "
                          "name those (a crash resumes the run that was rolled back), and retention keeps them over "
                          "this run's steps; remove them to go on from this run", stacklevel=2)
        deleted: list[int] = []
        failed: list[str] = []

        def each(what: str, fn: Callable[[], Any]) -> None:  # (one step's failure stops no other's)
            try:
                fn()
            except Exception as e:
                failed.append(f"{what}: {type(e).__name__}: {e}")

        def delete(s: int) -> None:
            if self._delete(s):
                deleted.append(s)

        def clean(s: int) -> None:
            folder = inspect_step(self._step(s), s, liveness)
            # (no entries: an empty folder, which a save may have just made, or a file named like a step, which
            # is not the manager's: both left alone)
            if folder.names and not folder.committed and clean_folder(folder, lease_s=self.lease_s):
                log.info("ucp_zarr: removed the %s step folder %s", folder.state, folder.store.url)

        for s in steps_to_delete(committed, keep_last=self.keep_last, keep_every=self.keep_every, protected=kept[0],
                                 within_limit=kept[1]):
            each(f"deleting step {s}", lambda: delete(s))
        liveness = self._liveness()
        for s in sorted(set(numbers) - set(committed)):
            each(f"cleaning step {s}", lambda: clean(s))
        each("collecting staging copies", lambda: collect_staging_copies(self._store, liveness))
        if failed:
            raise RetentionFailed(tuple(deleted), "; ".join(failed))
        return tuple(deleted)

    def delete(self, step: int) -> bool:
        """Delete the committed ``step`` now, crash-safely (one process calls it, as retention
        runs on rank 0 alone); False where it backs off (a live reader or writer holds it).
        The async save in flight is waited for first."""
        self._check_open()
        self.wait()
        return self._delete(step)

    def _delete(self, step: int) -> bool:
        done = delete_step(self._step(step), lease_s=self.lease_s)
        if done:
            self._stores.pop(step, None)
        return done

    def wait(self, *, every_rank: bool = False) -> SaveMetrics | None:
        """Wait for the async save in flight (and its retention); raise its error. Returns
        its metrics, or None when none was in flight. With ``every_rank`` (every rank of the
        group calls it), an error raised on any rank is raised on every rank."""
        if every_rank:
            return self._wait_agreed("waiting for the asynchronous save")
        fut = self._inflight
        if fut is None:
            return None
        try:
            metrics = fut.result()
        except BaseException as e:  # (a wait interrupted by a signal's exception keeps the save, and its error)
            if fut.done() and not fut.cancelled() and fut.exception() is e:
                self._inflight = None
            raise
        self._inflight = None
        return metrics

    def _wait_agreed(self, what: str) -> SaveMetrics | None:
        """:meth:`wait`, raising on every rank if it raises on any: an async save's error is
        raised on every rank, but one rank may have had it already (from :meth:`latest` or
        :meth:`wait` called there alone) and would go on into the collectives the others left."""
        comm = self._comm
        if comm.world == 1:
            return self.wait()
        error, metrics = None, None
        try:
            metrics = self.wait()
        except Exception as e:
            error = e
        comm.agree(error, what, own=True)
        return metrics

    def _raise_failed(self) -> None:
        """Raise the error of a finished async save (once), without waiting for a running one."""
        fut = self._inflight
        if fut is not None and fut.done():
            self._inflight = None
            fut.result()

    def history(self) -> list[SaveMetrics]:
        """The metrics of every save this manager completed, oldest first."""
        with self._lock:
            return list(self._history)

    # --- loading ----------------------------------------------------------------------------

    def load(self, step: int, state_dict: MutableMapping[str, Any], **load_kwargs: Any) -> MutableMapping[str, Any]:
        """Fill ``state_dict`` from ``step`` (every rank calls it), holding a reader lease so
        that no retention deletes the step meanwhile; ``load_kwargs`` go to :func:`ucp_zarr.load`.
        Raises :class:`~ucp_zarr.ops.steps.StepGoneError` on every rank when the step is not
        committed or is being deleted; a load that fails on one rank raises on every rank (its
        own error there, one naming it on the others)."""
        from ..protocol.loader import load as load_checkpoint
        from ..protocol.distributed import describe, raise_failures

        self._check_open()
        self._wait_agreed(f"the async save before loading step {step}")  # (before any collective)
        name = step_name(step)
        lease = ReadLease(self._step(step), self.lease_s, self._liveness())
        error: BaseException | None = None
        try:
            lease.__enter__()
        except BaseException as e:
            error = e
        gathered = self._comm.all_gather(describe(error))
        failures = {r: e for r, e in enumerate(gathered) if e is not None}
        if failures:
            if error is None:
                _release(lease)
            if all(e[0] == StepGoneError.__name__ for e in failures.values()):
                raise StepGoneError(f"cannot load {name} under {self.root}: {failures[min(failures)][1]}") from error
            raise_failures(self._comm, failures, error, f"loading {name}")
        error = None
        try:
            load_checkpoint(state_dict, self.path(step), process_group=self.process_group, storage_options=self.storage_options, **load_kwargs)
        except BaseException as e:  # (a load of whole tensors is each rank's own: agreed here, so that no
            error = e               # rank goes on into training while another failed: a new rank's per-rank state)
        finally:
            _release(lease)
        self._comm.agree(error, f"loading {name}", own=True)
        self._last_saved, self._progress_s = step, 0.0
        self._prev, self._stalled_s = (step, time.monotonic()), 0.0
        return state_dict

    def agreed_latest(self) -> int | None:
        """:meth:`latest` as rank 0 finds it, on every rank (every rank calls it): a pending
        async save's error, or rank 0's failure to read the steps, is raised on every rank."""
        from ..protocol.distributed import describe, raise_failures

        self._wait_agreed("the async save before finding the latest step")  # (not through rank 0's latest() alone)
        step, error = None, None
        if self._comm.rank == 0:
            try:
                step = self.latest()
            except BaseException as e:
                error = e
        failure, step = self._comm.broadcast((describe(error), step))
        if failure is not None:
            raise_failures(self._comm, {0: failure}, error, f"finding the latest step under {self.root}")
        return step

    def load_latest(self, state_dict: MutableMapping[str, Any], **load_kwargs: Any) -> int | None:
        """Fill ``state_dict`` from the newest committed step (rank 0's choice, on every
        rank) and return that step; None (``state_dict`` untouched) when there is none."""
        self._check_open()
        for _ in range(LOAD_ATTEMPTS):
            step = self.agreed_latest()
            if step is None:
                return None
            try:
                self.load(step, state_dict, **load_kwargs)
                return step
            except StepGoneError as e:
                log.warning("ucp_zarr: step %d went away while loading it (%s); trying the newest again", step, e)
        raise StepGoneError(f"the newest step under {self.root} was deleted {LOAD_ATTEMPTS} times while loading it")

    # --- when to save -----------------------------------------------------------------------

    @property
    def save_cost_s(self) -> float | None:
        """The measured save cost (moving average of blocking stages), or the given estimate."""
        return self._save_cost_s

    @property
    def step_time_s(self) -> float | None:
        """The measured (or last given) time of one training step."""
        return self._step_time_s

    def interval_s(self) -> float | None:
        """The interval (seconds of training between saves) the adaptive mode now aims at;
        None before the save cost is known or without a failure rate."""
        if self.mtbf_s is None or self._save_cost_s is None:
            return None
        return optimal_interval(self._save_cost_s, self.mtbf_s, restart_cost_s=self.restart_cost_s, method=self.method)

    def should_save(self, step: int, *, step_time_s: float | None = None) -> bool:
        """Whether to save at ``step``; call it once per training step, on every rank.

        With ``every_n_steps``: at multiples of it. Adaptively: once the training time since
        the last save or load (each step counted at ``step_time_s`` if given, else at its
        measured wall-clock time, blocking saves excluded; the first call counts one step of
        ``step_time_s``, nothing when measured) reaches :meth:`interval_s`; the first save
        comes at the first call, unless ``save_cost_s`` was given (it measures the cost).
        Never for a step at or before the last one saved or loaded. In the adaptive mode
        rank 0 decides and broadcasts (a collective)."""
        step_name(step)
        if step_time_s is not None:
            step_time_s = _positive("step_time_s", step_time_s)
        now = time.monotonic()
        if self._prev is not None and step > self._prev[0]:
            n = step - self._prev[0]
            if step_time_s is None:
                measured = max(now - self._prev[1] - self._stalled_s, 0.0) / n
                step_time = measured if self._step_time_s is None else self._step_time_s + self.smoothing * (measured - self._step_time_s)
            else:
                step_time = step_time_s
            self._step_time_s = step_time
            self._progress_s += n * step_time
        elif self._prev is None and step_time_s is not None:  # the first call counts one step
            self._step_time_s = step_time_s
            self._progress_s += step_time_s
        self._prev, self._stalled_s = (step, now), 0.0
        if self._last_saved is not None and step <= self._last_saved:
            return False
        if self.every_n_steps is not None:
            return step % self.every_n_steps == 0
        if self.mtbf_s is None:
            raise CheckpointError("should_save needs every_n_steps or a failure rate (mtbf_s, or failures_per_node_day and nodes)")
        decision = False
        if self._comm.rank == 0:
            interval = self.interval_s()
            decision = interval is None or self._progress_s >= interval
        return bool(self._comm.broadcast(decision)) if self._comm.world > 1 else decision

    def _saved(self, step: int, blocking_s: float) -> None:
        """Advisor bookkeeping after a save's blocking stage."""
        cost = blocking_s if self._save_cost_s is None else self._save_cost_s + self.smoothing * (blocking_s - self._save_cost_s)
        self._save_cost_s = max(cost, 1e-6)  # (optimal_interval needs a positive cost)
        self._last_saved, self._progress_s = step, 0.0
        self._stalled_s += blocking_s

    # --- plumbing ---------------------------------------------------------------------------

    def _step(self, step: int) -> Store:
        """The store of ``step``'s folder, made once (an fsspec filesystem may be costly to set up)."""
        store = self._stores.get(step)
        if store is None:
            store = self._stores[step] = step_store(self._store, step)
        return store

    def _liveness(self) -> Liveness:
        return Liveness.here()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager of {self.root} is closed")

    def close(self) -> None:
        """Wait for the async save in flight (raising its error) and release the manager's thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"


def _release(lease: ReadLease) -> None:
    """Give back a reader lease once the load it guarded is over (done or failed): a failure
    to delete it is logged, not raised (the lease is marked released, see
    :meth:`ReadLease.release`), so that it neither fails a load that filled the state dict
    nor hides the error of one that did not."""
    try:
        lease.release()
    except Exception as e:
        log.warning("ucp_zarr: could not delete the reader lease %s/%s: %s", lease.store.url, lease.key, e)
