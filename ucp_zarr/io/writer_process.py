"""The writer process of background saves (:func:`ucp_zarr.async_save`).

A background *thread* that writes a save holds the GIL for its Python between system calls
(per object and per chunk), and the training loop's thread waits every time it wants the
GIL back. Measured on 2 cores (``benchmarks/results/profiles.md``), the same save made a
training step 1.07x slower (1.03-1.19 over repeats) from a thread of the training process,
and 1.01x (0.99-1.06) from another process. So a background save to a local file system
hands its writes to a child process:

* the host copy is staged in shared memory (:class:`SharedMemory`, a ``memfd``) that the
  child maps, so nothing is copied or pickled but the job descriptions;
* the child writes the shards and documents given to it (:meth:`WriterProcess.write`) with
  a few threads of its own, syncs them, and answers once, with every object's size and
  each shard's seal (each message would cost the training process a turn of the GIL);
* before it puts an object in place the child asks the save's guard, which stays in the
  training process (:class:`~ucp_zarr.protocol.liveness.Fence`: claim and lease), so the
  checks are those of an in-process write; its answer says until when it would pass
  without reading anything, and until then the child does not ask again.

The training process keeps the plan, the exchange, the collectives and the commit. The child
is ``python -m ucp_zarr.io.writer_process`` (it never re-imports the caller's ``__main__`` as
``multiprocessing``'s spawn would), imports no torch, and exits when its socket closes. Only
this module's own parent and child exchange pickles, over a socket pair no one else holds.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Sequence

import numpy as np

from ..errors import CheckpointError
from ..format.codec import chunk_key
from ..format.documents import ArrayMeta
from ..layout import Box
from .arrayio import Seal, write_shard_array
from .local import LocalStore
from .pace import Pace
from .store import WriteGuard


def available(store: Any) -> bool:
    """Whether saves to ``store`` can be written by a child process (a local store on a
    system with ``memfd_create``)."""
    return type(store) is LocalStore and hasattr(os, "memfd_create")


class SharedMemory:
    """Host memory of ``nbytes`` that a child process can map (an anonymous ``memfd``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("ucp_zarr-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            self.map = mmap.mmap(self.fd, max(nbytes, 1))
        except BaseException:
            os.close(self.fd)
            raise
        self.close = weakref.finalize(self, os.close, self.fd)
        """Close the descriptor (once the child has it; the mapping lives on while used)."""
        self.address = np.frombuffer(self.map, dtype=np.uint8).ctypes.data

    def offset(self, address: int, nbytes: int) -> int | None:
        """The offset of the ``nbytes`` at ``address`` in this memory, None if not all in it."""
        at = address - self.address
        return at if 0 <= at and at + nbytes <= self.nbytes else None


@dataclass(frozen=True)
class ShardJob:
    """Write shard ``shard`` of the array at ``path`` from the source at ``offset`` of the
    shared memory (``shape`` and byte ``strides`` of ``meta``'s storage dtype), which holds
    ``src_box`` of the array."""

    path: str
    meta: ArrayMeta
    shard: tuple[int, ...]
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    src_box: Box


@dataclass(frozen=True)
class DocumentJob:
    """Write ``data`` at ``key``."""

    key: str
    data: bytes


class WriterProcess:
    """A child process that writes for this one (see the module's doc): started by
    :meth:`start`, again after it died, ``nice_offset`` below the priority of the thread that
    starts it (a higher nice value: the kernel caps it at 19); one save's writes at a time.

    The child never outlives this process: the kernel kills it when the thread that started
    it ends (``PR_SET_PDEATHSIG``; a thread of this object's own that lives until
    :meth:`close`), and it exits when its socket closes. A save's owner marker names it
    (:attr:`~ucp_zarr.protocol.liveness.Owner.writers`), so no later save on this host takes
    the path over while it still runs."""

    def __init__(self, nice_offset: int = 0) -> None:
        self.nice_offset = nice_offset
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._release = threading.Event()
        """Set to let the current child's parent thread end."""
        self._pid = os.getpid()
        """The process whose child ``_proc`` is (a forked copy starts its own)."""
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a process forked from this one's: the child, its socket and the lock (held by a
        save of the parent's that no thread here finishes) are the parent's; start afresh."""
        self._proc, self._conn, self._pid = None, None, os.getpid()
        self._release, self._lock = threading.Event(), threading.Lock()

    def start(self) -> int:
        """Start the child unless it runs; its pid (for a save's :meth:`write`)."""
        with self._lock:
            return self._started()[1]

    def write(
        self,
        store: LocalStore,
        jobs: Sequence[ShardJob | DocumentJob],
        guard: WriteGuard,
        seal: Seal,
        memory: SharedMemory | None,
        workers: int,
        pid: int,
        bytes_per_s: float | None = None,
    ) -> list[bytes | None]:
        """Write ``jobs`` into ``store`` behind ``guard``, durably (:meth:`LocalStore.sync`),
        by the child ``pid`` (the :meth:`start` that the save's claim recorded), at most
        ``bytes_per_s`` (:class:`~.pace.Pace`); return each job's seal (None for a
        document). Raises the first failure (the rest are not started); the objects written
        so far are counted in ``store.stats``."""
        with self._lock:
            conn, running = self._started()
            if running != pid:
                raise CheckpointError(
                    f"the writer process ({pid}) of the background save to {store.url} ended before it wrote: "
                    "nothing of this save is committed"
                )
            try:
                seals, failure = self._run(conn, pid, store, list(jobs), guard, seal, memory, workers, bytes_per_s)
            except _Stopped as e:  # (killed: a stopped process exits on SIGKILL alone)
                assert self._proc is not None
                self._proc.kill()
                code = self._stop()
                raise CheckpointError(
                    f"the writer process ({pid}) of the background save to {store.url} {e} (exit code {code}): "
                    "nothing of this save is committed"
                ) from None
            except (EOFError, OSError) as e:  # (the socket: the child is gone)
                code = self._stop()
                raise CheckpointError(
                    f"the writer process ({pid}) of the background save to {store.url} failed ({e!r}; exit code {code}): "
                    "nothing of this save is committed"
                ) from e
        if failure is not None:
            raise failure
        return seals

    def _started(self) -> tuple[Connection, int]:
        if self._pid != os.getpid():  # forked: the child and its socket are the parent's
            self._proc, self._conn, self._pid, self._release = None, None, os.getpid(), threading.Event()
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn, self._proc.pid
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        started: list[subprocess.Popen | BaseException] = []
        ready, release = threading.Event(), threading.Event()
        nice = thread_nice()

        def parent() -> None:  # (the child's parent thread: it dies when this ends)
            try:
                if nice is not None:  # (a process starts at its creating thread's nice value)
                    set_thread_nice(nice + self.nice_offset)
                started.append(subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                ))
            except BaseException as e:
                started.append(e)
            ready.set()
            release.wait()

        threading.Thread(target=parent, name="ucp_zarr-writer-parent", daemon=True).start()
        ready.wait()
        theirs.close()
        if isinstance(started[0], BaseException):
            release.set()
            ours.close()
            raise started[0]
        self._proc, self._release = started[0], release
        self._conn = Connection(ours.detach())
        return self._conn, self._proc.pid

    def _stop(self) -> int | None:
        """Close the socket (the child exits) and reap the child; its exit code."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            self._proc = None
        self._release.set()
        return code

    def close(self) -> None:
        with self._lock:
            self._stop()

    @staticmethod
    def _run(
        conn: Connection, pid: int, store: LocalStore, jobs: list[ShardJob | DocumentJob], guard: WriteGuard,
        seal: Seal, memory: SharedMemory | None, workers: int, bytes_per_s: float | None,
    ) -> tuple[list[bytes | None], BaseException | None]:
        """One save's exchange with the child: the jobs out, the guard's answers back, until
        it has finished; the seals and the first failure."""
        conn.send(("save", store.root, store.batch_sync, guard.tag, seal, workers, bytes_per_s, memory is not None, jobs))
        if memory is not None:
            send_handle(conn, memory.fd, pid)
        seals: list[bytes | None] = [None] * len(jobs)
        failure: BaseException | None = None
        lease = getattr(getattr(guard, "lease", None), "lease_s", None) or STOPPED_LIMIT_S
        while True:
            _wait_while_running(conn, pid, lease)
            msg = conn.recv()
            if msg[0] == "check":  # the child asks the guard before it puts an object in place
                try:
                    guard.check(force=msg[2])
                    valid_until = getattr(guard, "valid_until", None)
                    conn.send(("checked", msg[1], True, -math.inf if valid_until is None else valid_until()))
                except BaseException as e:
                    failure = failure or e
                    conn.send(("checked", msg[1], False, -math.inf))
            elif msg[0] == "failed":
                failure = failure or _error(msg[1], store)
            elif msg[0] == "finished":  # (what it wrote, in one message: every message costs this process the GIL)
                for n, key, nbytes, sealed in msg[1]:
                    store.stats.add_write(key, nbytes)
                    seals[n] = sealed
                return seals, failure


STOPPED_LIMIT_S = 120.0
"""How long a writer process may stay stopped (``SIGSTOP``) before its save fails, where the
save's guard names no lease of its own."""


class _Stopped(Exception):
    """The writer process stayed stopped longer than its save's lease."""


def _wait_while_running(conn: Connection, pid: int, limit_s: float) -> None:
    """Return once ``conn`` has a message; raise :class:`_Stopped` once process ``pid`` has
    been seen stopped for ``limit_s`` in a row (the parent renews the save's lease meanwhile,
    so no other save takes the path over: the save would wait without end). A job suspended
    whole (Ctrl-Z) stops this process too and does not count."""
    stopped_since = None
    while not conn.poll(1.0):
        if not _is_stopped(pid):
            stopped_since = None
            continue
        now = time.monotonic()
        stopped_since = now if stopped_since is None else stopped_since
        if now - stopped_since > limit_s:
            raise _Stopped(f"was stopped (SIGSTOP) for more than {limit_s:.0f} s, the save's lease")


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux: its state in ``/proc``; False
    elsewhere, and for a task a cgroup freezer holds, which shows as sleeping)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _error(payload: tuple[BaseException | None, str, str], store: LocalStore) -> BaseException:
    """The child's exception (its own, or, where it did not pickle, a CheckpointError naming it)."""
    error, name, message = payload
    return error if error is not None else CheckpointError(f"writing the save to {store.url}: {name}: {message}")


# --- the child ---------------------------------------------------------------------------


class _Refused(Exception):
    """The parent's guard refused (the parent holds the real error)."""


class _RemoteGuard:
    """The parent's guard, asked over the socket; not asked again (unless forced) until the
    time its last answer said it would pass without reading anything (``valid_until``: its
    next owner check, or its lease's deadline), as the guard itself would not read until
    then. Both processes read the same clock (``CLOCK_MONOTONIC``, one per host)."""

    def __init__(self, conn: Connection, send: threading.Lock, tag: str) -> None:
        self.tag = tag
        self._conn = conn
        self._send = send
        self._replies: dict[int, tuple[threading.Event, list[tuple[bool, float]]]] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._valid_until = -math.inf

    def check(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._valid_until:
            return
        with self._lock:
            n = self._next = self._next + 1
            event, answer = self._replies[n] = (threading.Event(), [])
        with self._send:
            self._conn.send(("check", n, force))
        event.wait()
        ok, until = answer[0]
        if not ok:
            self._valid_until = -math.inf
            raise _Refused("the save's guard refused")
        self._valid_until = until

    def answered(self, n: int, ok: bool, until: float) -> None:
        with self._lock:
            event, answer = self._replies.pop(n)
        answer.append((ok, until))
        event.set()


def _serve(conn: Connection) -> None:
    """Serve saves until the socket closes: the main thread reads (jobs, the guard's answers);
    one thread per save writes."""
    send = threading.Lock()
    guard: _RemoteGuard | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent closed the socket, or died: write nothing more
            os._exit(0)
        if msg[0] == "save":
            _, root, batch_sync, tag, seal, workers, bytes_per_s, shared, jobs = msg
            view = None
            if shared:
                fd = recv_handle(conn)
                try:
                    view = mmap.mmap(fd, 0)
                finally:
                    os.close(fd)
            guard = _RemoteGuard(conn, send, tag)
            store = LocalStore(root, batch_sync, direct_writes=False)  # (beside training: through the page cache)
            args = (conn, send, store, jobs, guard, seal, view, workers, Pace(bytes_per_s))
            threading.Thread(target=_save, args=args, daemon=True).start()
        elif msg[0] == "checked" and guard is not None:
            guard.answered(*msg[1:])


def _save(
    conn: Connection, send: threading.Lock, store: LocalStore, jobs: list[ShardJob | DocumentJob], guard: _RemoteGuard,
    seal: Seal, view: mmap.mmap | None, workers: int, pace: Pace,
) -> None:
    memory = None if view is None else np.frombuffer(view, dtype=np.uint8)
    wrote: list[tuple[int, str, int, bytes | None]] = []

    def run(n: int, job: ShardJob | DocumentJob) -> None:
        if isinstance(job, DocumentJob):
            pace.take(len(job.data))
            nbytes, sealed = store.write(job.key, [job.data], guard), None
            key = job.key
        else:
            assert memory is not None
            dtype = job.meta.dtype.numpy_dtype
            src = np.ndarray(job.shape, dtype, buffer=memory, offset=job.offset, strides=job.strides)
            paced = None if pace.bytes_per_s is None else pace.take
            sealed, nbytes = write_shard_array(store, job.path, job.meta, job.shard, src, job.src_box, seal, guard, paced)
            key = f"{job.path}/{chunk_key(job.shard)}"
        wrote.append((n, key, nbytes, sealed))  # (list.append: atomic)

    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = [pool.submit(run, n, job) for n, job in enumerate(jobs)]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                f.cancel()
        errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if not errors:
            try:
                store.sync()
            except BaseException as e:
                errors.append(e)
        real = [e for e in errors if not isinstance(e, _Refused)]
        if real:
            with send:
                conn.send(("failed", _payload(real[0])))
    except BaseException as e:  # (the parent must hear of anything)
        with send:
            conn.send(("failed", _payload(e)))
    finally:
        memory = None
        with send:
            conn.send(("finished", wrote))
        if view is not None:
            try:
                view.close()
            except BufferError:  # a view outlived the save: the mapping goes with it
                pass


def _payload(error: BaseException) -> tuple[BaseException | None, str, str]:
    try:
        pickle.loads(pickle.dumps(error))
        return error, type(error).__name__, str(error)
    except Exception:
        return None, type(error).__name__, str(error)


def thread_nice() -> int | None:
    """The calling thread's nice value (None where threads have none)."""
    if not (hasattr(os, "getpriority") and hasattr(threading, "get_native_id")):
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return None


def set_thread_nice(nice: int) -> None:
    """Set the calling thread's nice value (Linux: per thread, inherited by the threads it
    starts) where permitted (raising the priority back needs ``CAP_SYS_NICE``: else kept)."""
    own = thread_nice()
    try:
        if own is not None and own != nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent thread ends (Linux), and exit now
    if the parent ``parent`` is already gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the socket's end is the signal
        pass
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> None:
    _die_with(int(argv[1]))
    _serve(Connection(int(argv[0])))


if __name__ == "__main__":  # (run as the module itself: the jobs unpickle as its classes, not __main__'s)
    from ucp_zarr.io.writer_process import main as _main

    _main(sys.argv[1:])
