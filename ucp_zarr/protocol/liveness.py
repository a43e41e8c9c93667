"""The protocol's object names, owners and liveness: who holds a claim (host, process and its start
time), whether it is alive (a heartbeat within the lease, or the process on this host), the
heartbeat that renews the lease and the fence that stops a stale writer."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from ..errors import FormatError, OwnershipError
from ..io.store import Store
from ..version import __version__

log = logging.getLogger(__name__)


MARKER = ".ucp_zarr_pending"
HEARTBEAT = ".ucp_zarr_heartbeat."
TAKEOVER = ".ucp_zarr_takeover."
OWNED = ".ucp_zarr_owned."
"""+ save id: the objects that save writes (:class:`~ucp_zarr.protocol.owned.Owned`)."""
REPLACE_RECORD = ".ucp_zarr_replace"
RETIRED = ".ucp_zarr_retired"
"""During an overwrite or a deletion: the objects of the checkpoint being removed."""
INTERNAL_PREFIX = ".ucp_zarr_"
"""Top-level objects of the protocol (marker, heartbeats, takeovers, replace record)."""
STAGING_INFIX = ".ucp_zarr-"
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
UNREADABLE_SAVE_ID = "0" * 32
"""The save id given to an owner record that cannot be read (a dead owner's)."""

DEFAULT_LEASE_S = 120.0
"""How long a save on another host counts as alive after its last heartbeat."""
WRITERS_EXIT_S = 30.0
"""How long a save whose process is gone may wait for its writer processes to exit (they are
killed with it; see :attr:`Liveness.writers_exit_s`)."""
FENCE_INTERVAL_S = 2.0
"""How often (at most) a writing rank re-reads the owner marker."""
SELF_FENCE = 0.75
"""The part of its lease after which a save that could not renew stops writing."""


# --- owners and liveness ---------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """Who runs a save: what the owner marker (and takeover and replace records) hold."""

    save_id: str
    host: str
    boot_id: str
    pid: int
    pid_start: int | None
    started: float
    lease_s: float
    library: str = f"ucp_zarr {__version__}"
    staged: str | None = None
    """For a replace record: the staging sibling holding the new checkpoint."""
    pid_ns: str = ""
    """The PID namespace ``pid`` is a process of (``pid:[4026531836]``); empty where
    unknown (then only the lease tells whether the owner is alive)."""
    writers: tuple[tuple[int, int | None], ...] = ()
    """Other processes of the same namespace that write the save's objects for ``pid`` (its
    background writer process, :mod:`..io.writer_process`): pid and start, as ``pid``'s. The
    owner counts as alive while any of them is."""

    @classmethod
    def this_process(
        cls, save_id: str, lease_s: float, staged: str | None = None, writers: tuple[int, ...] = ()
    ) -> "Owner":
        """This process as the owner; ``writers``: the pids of its processes writing for it."""
        host, boot, pid_ns = host_identity()
        pid = os.getpid()
        return cls(
            save_id, host, boot, pid, process_start(pid), time.time(), lease_s, staged=staged, pid_ns=pid_ns,
            writers=tuple((w, process_start(w)) for w in writers),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "Owner":
        try:
            d = json.loads(raw)
            owner = cls(
                str(d["save_id"]), str(d["host"]), str(d["boot_id"]), int(d["pid"]),
                None if d.get("pid_start") is None else int(d["pid_start"]),
                float(d["started"]), float(d["lease_s"]), str(d.get("library", "")),
                None if d.get("staged") is None else str(d["staged"]), str(d.get("pid_ns", "")),
                tuple((int(w), None if start is None else int(start)) for w, start in d.get("writers", [])),
            )
            if not _SAVE_ID.fullmatch(owner.save_id):  # (save ids name protocol files)
                raise ValueError(f"save_id {owner.save_id[:40]!r} is not 32 hex digits")
            return owner
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            # garbage (or, on a file system without hard links, a record whose creator died
            # between creating and writing it): nobody can prove it alive
            return cls(UNREADABLE_SAVE_ID, f"(unreadable record {where})", "", -1, None, 0.0, 0.0)

    def describe(self) -> str:
        writers = f" (and its writer process {', '.join(str(w) for w, _ in self.writers)})" if self.writers else ""
        return (
            f"save {self.save_id} of process {self.pid}{writers} on host {self.host!r}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}"
        )


def host_identity() -> tuple[str, str, str]:
    """Where this process's process ids mean something: the host name, the kernel's boot
    id and the PID namespace (two containers on one kernel share the boot id, and may
    share the host name, but not the PID namespace, unless they see each other's processes)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return socket.gethostname(), boot, pid_ns


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first); None
    where there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later
    process that reuses its id; None where /proc is unavailable."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs on this host (a zombie,
    exited but not yet reaped, does not: it can write nothing more)."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        fields = _stat(pid)
        return fields is not None and fields[0] not in (b"Z", b"X") and (start is None or int(fields[19]) == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass(frozen=True)
class Liveness:
    """How this process judges another save's owner (injectable for tests)."""

    host: tuple[str, ...]
    """This process's :func:`host_identity`."""
    alive: Callable[[int, int | None], bool] = process_alive
    clock: Callable[[], float] = time.time
    writers_exit_s: float = WRITERS_EXIT_S
    """How long to wait for the writer processes of an owner whose own process is gone."""

    @classmethod
    def here(cls) -> "Liveness":
        return cls(host_identity())

    def is_dead(self, owner: Owner, renewed: float | None) -> bool:
        """Provably dead: it aborted; or in this PID namespace (same host, boot and
        namespace, all known) its process and its writer processes are gone (those die with
        it, but one in the middle of a system call, such as an ``fsync``, only once that
        returns: waited for up to ``writers_exit_s``); or, anywhere else, its lease has
        expired (measured from its last heartbeat, else its start). A process this one
        cannot see is never judged by ``/proc``."""
        if owner.pid < 0 or renewed == -math.inf:
            return True
        if owner.pid_ns and (owner.host, owner.boot_id, owner.pid_ns) == tuple(self.host):
            if self.alive(owner.pid, owner.pid_start):
                return False
            until = time.monotonic() + self.writers_exit_s
            while any(self.alive(pid, start) for pid, start in owner.writers):
                if time.monotonic() >= until:
                    return False
                time.sleep(0.01)
            return True
        last = max(owner.started, renewed or 0.0)
        return self.clock() > last + owner.lease_s


# --- reading the protocol's objects ------------------------------------------------------------


def read_owner(store: Store, key: str) -> Owner | None:
    """The owner named by ``key`` (marker, takeover or replace record), or None if absent."""
    try:
        raw = store.read(key)
    except FileNotFoundError:
        return None
    return Owner.from_bytes(raw, f"{store.url}/{key}")


def last_heartbeat(store: Store, save_id: str) -> float | None:
    """When save ``save_id`` last renewed its lease: None when it never did, ``-inf`` once
    it aborted (an aborted save is dead, whatever its process does next)."""
    try:
        beat = json.loads(store.read(HEARTBEAT + save_id))
        return -math.inf if beat.get("aborted") else float(beat["renewed"])
    except (FileNotFoundError, FormatError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def mark_aborted(store: Store, save_id: str) -> None:
    """Mark ``save_id`` aborted in ``store``: it counts as dead from now on (:func:`last_heartbeat`),
    so that its leftovers may be taken over at once, even while its process lives."""
    store.write_atomic(HEARTBEAT + save_id, json.dumps({"aborted": True}).encode())


def try_mark_aborted(store: Store, save_id: str, what: str) -> None:
    """:func:`mark_aborted` after a failure of ``what`` (for the message): where the store
    fails that too, it is logged, not raised (the first failure is what the caller sees)."""
    try:
        mark_aborted(store, save_id)
    except Exception as e:
        log.warning("ucp_zarr: could not mark %s at %s aborted: %s", what, store.url, e)


# --- the lease and the fence ----------------------------------------------------------------------


class Heartbeat:
    """Renews ``.ucp_zarr_heartbeat.<id>`` every ``lease_s / 4`` until stopped, and knows
    when the lease may have lapsed: no renewal succeeded for :data:`SELF_FENCE` of the lease
    (the process stalled, or storage failed; the rest of the lease is the margin for clock
    skew between hosts). Once lapsed it never renews again: whoever judged the save dead may
    have taken over, so the save must stop writing (:meth:`lapsed`)."""

    def __init__(self, store: Store, save_id: str, lease_s: float) -> None:
        self.store = store
        self.key = HEARTBEAT + save_id
        self.lease_s = lease_s
        self.period = max(lease_s / 4, 0.05)
        self._renewed = time.monotonic()
        self._lapsed = False
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ucp_zarr-heartbeat", daemon=True)
        self._thread.start()

    def lapsed(self) -> bool:
        if not self._lapsed and time.monotonic() - self._renewed > self.lease_s * SELF_FENCE:
            self._lapsed = True
        return self._lapsed

    def deadline(self) -> float:
        """The ``time.monotonic()`` after which the lease counts as lapsed unless renewed
        before (-inf once lapsed)."""
        return -math.inf if self.lapsed() else self._renewed + self.lease_s * SELF_FENCE

    def _beat(self) -> None:
        started = time.monotonic()  # before the write: others date the lease from its content
        if self.lapsed():
            return
        self.store.write_atomic(self.key, json.dumps({"renewed": time.time()}).encode())
        self._renewed = started

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat()
            except Exception:  # a storage hiccup: the next beat tries again
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Fence:
    """A save's right to write (a :class:`~ucp_zarr.io.store.WriteGuard`): checks, at most
    every ``interval_s``, that the record ``key`` of ``store`` (the owner marker, or the
    replace record) still names save ``save_id``, and, on every call, that the save's own
    ``lease`` (when this rank holds it) has not lapsed. Every writing rank calls
    :meth:`check` before each object it writes. ``checked``: the ``time.monotonic()`` at
    which the record is known to have named the save, if any: a replace record just created
    (nobody takes over a live replacement). Never the owner marker's claim: a save taken over
    by force (``overwrite_incomplete``) while it stalled between its claim and its first
    object must find out at that object."""

    def __init__(
        self,
        store: Store,
        save_id: str,
        interval_s: float = FENCE_INTERVAL_S,
        *,
        lease: Heartbeat | None = None,
        key: str = MARKER,
        checked: float = -math.inf,
    ) -> None:
        self.store = store
        self.save_id = save_id
        self.tag = save_id
        self.interval_s = interval_s
        self.lease = lease
        self.key = key
        self._checked = checked
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def check(self, force: bool = False) -> None:
        """Raise :class:`OwnershipError` if the claim is lost or the lease may have lapsed
        (or the error of a failed check: once failed, every later check fails at once)."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            try:
                if self.lease is not None and self.lease.lapsed():
                    raise OwnershipError(
                        f"save {self.save_id} on {self.store.url}: its lease may have lapsed (no renewal for "
                        f"{self.lease.lease_s * SELF_FENCE:g} s: the process stalled or storage failed), so another save "
                        "may have taken the path over; it writes nothing more"
                    )
                if not force and time.monotonic() - self._checked < self.interval_s:
                    return
                owner = read_owner(self.store, self.key)
                if owner is None or owner.save_id != self.save_id:
                    now = "no save" if owner is None else owner.describe()
                    raise OwnershipError(
                        f"save {self.save_id} lost its claim on {self.store.url}: {self.key} now names {now}"
                    )
            except BaseException as e:
                self._failed = e
                raise
            self._checked = time.monotonic()

    def valid_until(self) -> float:
        """The ``time.monotonic()`` until which :meth:`check` (not forced) passes without
        reading the store, as far as is known now: the next owner check, or the lease's
        :meth:`~Heartbeat.deadline` if that comes first (-inf after a failure). Another process
        writing for this save may skip asking until then (see :mod:`~ucp_zarr.io.writer_process`)."""
        with self._lock:
            if self._failed is not None:
                return -math.inf
            until = self._checked + self.interval_s
        return until if self.lease is None else min(until, self.lease.deadline())
