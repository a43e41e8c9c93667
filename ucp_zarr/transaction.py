"""The save as a transaction: claim the path, fence stale writers, commit once, or abort.

A checkpoint path moves through these states (each a set of objects under the path):

* **empty**: nothing there;
* **claimed**: ``.ucp_zarr_pending`` (the *owner marker*) names the save writing it: its
  save id, host, process id and lease. It is created exclusively (``O_EXCL``/hard link on
  local disks, ``If-None-Match: *`` on object stores), so two saves never both own a path;
* **committed**: the root ``zarr.json`` exists. It is created exclusively too, so a commit
  never replaces a committed checkpoint, and only after the owner re-checked the marker.

Leftovers of another save are removed only when that save is provably dead: on the same
host (same host name and boot id) its process is gone; elsewhere its lease expired (the
owner renews ``.ucp_zarr_heartbeat.<save id>`` every ``lease_s / 4``); or the caller says
so (``overwrite_incomplete=True``). Taking over from a dead owner ``X`` first creates
``.ucp_zarr_takeover.<X>`` exclusively, so two newcomers never both clear and claim; a
takeover whose taker died is itself taken over the same way.

Every writing rank checks, at most every ``FENCE_INTERVAL_S``, that the marker still names
its save (:class:`Fence`), so a stale writer that lost its claim stops within seconds; and
every shard carries its save id (see :mod:`.codec`), so a stray object of another save is
detected when read.

**Overwrite.** ``overwrite=True`` on a committed path writes the new checkpoint into a
staging sibling ``.<name>.ucp_zarr-<save id>`` and commits it there; then the *replace
record* ``.ucp_zarr_replace`` (created exclusively, naming the staging sibling) is written
into the path, the old root is removed, the new objects are adopted (hard links / server-
side copies), the old ones deleted, the new root created, the record and the sibling
removed. Until the new root exists, readers follow the record to the complete staging copy;
after a crash, whoever finds the record of a dead owner rolls the replacement forward. At
every point the old or the new checkpoint is complete and findable, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .errors import CheckpointExistsError, FormatError, IncompleteCheckpointError, NotACheckpointError, OwnershipError
from .format import _COMPONENT, METADATA_FILE
from .storage import Store
from .version import __version__

MARKER = ".ucp_zarr_pending"
HEARTBEAT = ".ucp_zarr_heartbeat."
TAKEOVER = ".ucp_zarr_takeover."
REPLACE_RECORD = ".ucp_zarr_replace"
INTERNAL_PREFIX = ".ucp_zarr_"
"""Top-level objects of the protocol (marker, heartbeats, takeovers, replace record)."""
STAGING_INFIX = ".ucp_zarr-"
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
UNREADABLE_SAVE_ID = "0" * 32
"""The save id given to an owner record that cannot be read (a dead owner's)."""

DEFAULT_LEASE_S = 120.0
"""How long a save on another host counts as alive after its last heartbeat."""
FENCE_INTERVAL_S = 2.0
"""How often (at most) a writing rank re-reads the owner marker."""


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

    @classmethod
    def this_process(cls, save_id: str, lease_s: float, staged: str | None = None) -> "Owner":
        host, boot = host_identity()
        pid = os.getpid()
        return cls(save_id, host, boot, pid, process_start(pid), time.time(), lease_s, staged=staged)

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
                None if d.get("staged") is None else str(d["staged"]),
            )
            if not _SAVE_ID.fullmatch(owner.save_id):  # (save ids name protocol files)
                raise ValueError(f"save_id {owner.save_id[:40]!r} is not 32 hex digits")
            return owner
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            # garbage (or, on a file system without hard links, a record whose creator died
            # between creating and writing it): nobody can prove it alive
            return cls(UNREADABLE_SAVE_ID, f"(unreadable record {where})", "", -1, None, 0.0, 0.0)

    def describe(self) -> str:
        return (
            f"save {self.save_id} of process {self.pid} on host {self.host!r}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}"
        )


def host_identity() -> tuple[str, str]:
    """This machine: its host name and kernel boot id (two containers on one kernel share
    the boot id but not, usually, the host name; the pair names one process namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later
    process that reuses its id; None where /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs on this host."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        now_start = process_start(pid)
        return now_start is not None and (start is None or now_start == start)
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

    host: tuple[str, str]
    alive: Callable[[int, int | None], bool] = process_alive
    clock: Callable[[], float] = time.time

    @classmethod
    def here(cls) -> "Liveness":
        return cls(host_identity())

    def is_dead(self, owner: Owner, renewed: float | None) -> bool:
        """Provably dead: same host and its process is gone, or its lease has expired
        (measured from its last heartbeat, else its start)."""
        if owner.pid < 0 or renewed == -math.inf:
            return True
        if (owner.host, owner.boot_id) == self.host:
            return not self.alive(owner.pid, owner.pid_start)
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


_NAME = _COMPONENT.pattern  # an escaped group or array name (schema/FORMAT.md, section 1)
_CHECKPOINT_OBJECT = re.compile(
    rf"(?:zarr\.json|{_NAME}/zarr\.json|{_NAME}/{_NAME}/(?:zarr\.json|c(?:/[0-9]+)*))(?:\.tmp-[0-9a-f]{{32}})?"
)


def is_checkpoint_object(key: str) -> bool:
    """Whether ``key`` (relative to the checkpoint path) names an object of the format: the
    root ``zarr.json``, a protocol file (``.ucp_zarr_*``), a group or array ``zarr.json``
    (``<group>/zarr.json``, ``<group>/<array>/zarr.json``), a shard (``<group>/<array>/c/i/j``,
    ``c`` for a 0-d array), or a store's temporary name for one of them. Anything else
    (``config.json``, ``tokenizer/vocab.json``, DCP's ``.metadata``) is another file sharing
    the directory, which no step of the protocol deletes."""
    return is_internal(key) or _CHECKPOINT_OBJECT.fullmatch(key) is not None


def is_internal(key: str) -> bool:
    return "/" not in key and key.startswith(INTERNAL_PREFIX)


def staging_name(store: Store, save_id: str) -> str:
    return f".{store.name}{STAGING_INFIX}{save_id}"


def staged_store(store: Store, record: Owner) -> Store | None:
    """The committed staging copy a replace record names, or None. Only the staging sibling
    of the record's own save counts (``.<name>.ucp_zarr-<save id>``): a record naming any
    other directory is garbage, never followed."""
    if not (_SAVE_ID.fullmatch(record.save_id) and record.staged == staging_name(store, record.save_id)):
        return None
    staged = store.sibling(record.staged)
    return staged if staged.exists(METADATA_FILE) else None


def committed_store(store: Store) -> Store:
    """The store holding the committed checkpoint at ``store``: the store itself, or, while
    an overwrite is being put in place, its complete staging copy. Raises
    :class:`IncompleteCheckpointError` or :class:`NotACheckpointError`."""
    if store.exists(METADATA_FILE):
        return store
    record = read_owner(store, REPLACE_RECORD)
    if record is not None:
        staged = staged_store(store, record)
        if staged is not None:
            return staged
    if record is not None or store.exists(MARKER):
        raise IncompleteCheckpointError(
            f"{store.url} holds an incomplete checkpoint: its commit record {METADATA_FILE} "
            "was never written (the save failed or is still running)"
        )
    if not store.is_empty():
        raise IncompleteCheckpointError(
            f"{store.url} holds files but no commit record {METADATA_FILE}: an incomplete "
            "checkpoint, or not a ucp_zarr checkpoint"
        )
    raise NotACheckpointError(f"no checkpoint at {store.url}")


# --- the fence ------------------------------------------------------------------------------


class Fence:
    """Checks, at most every ``interval_s``, that the owner marker of ``store`` still names
    save ``save_id``; every writing rank calls :meth:`check` before each object it writes."""

    def __init__(self, store: Store, save_id: str, interval_s: float = FENCE_INTERVAL_S) -> None:
        self.store = store
        self.save_id = save_id
        self.interval_s = interval_s
        self._checked = -float("inf")
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def check(self, force: bool = False) -> None:
        """Raise :class:`OwnershipError` if the claim is lost (or the error of a failed check:
        once failed, every later check fails at once)."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if not force and time.monotonic() - self._checked < self.interval_s:
                return
            try:
                owner = read_owner(self.store, MARKER)
                if owner is None or owner.save_id != self.save_id:
                    now = "no save" if owner is None else owner.describe()
                    raise OwnershipError(
                        f"save {self.save_id} lost its claim on {self.store.url}: the owner marker now names {now}"
                    )
            except BaseException as e:
                self._failed = e
                raise
            self._checked = time.monotonic()


# --- the transaction (run by the coordinating rank) -------------------------------------------


class Transaction:
    """One save's claim on ``store``, from :meth:`begin` to :meth:`commit` or :meth:`abort`.

    Only the coordinating rank runs it; the other ranks learn :attr:`save_id` and
    :attr:`staged` from it and write into :func:`target_store` behind a :class:`Fence`.
    """

    def __init__(
        self,
        store: Store,
        *,
        overwrite: bool = False,
        overwrite_incomplete: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        save_id: str | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.store = store
        self.overwrite = overwrite
        self.overwrite_incomplete = overwrite_incomplete
        self.lease_s = lease_s
        self.save_id = save_id or uuid.uuid4().hex
        self.liveness = liveness or Liveness.here()
        self.me = Owner.this_process(self.save_id, lease_s)
        self.staged: str | None = None
        """The staging sibling's name when overwriting a committed checkpoint."""
        self.target = store
        """Where this save's objects go: ``store``, or the staging sibling."""
        self.claimed = False
        self._heartbeat: _Heartbeat | None = None

    # -- begin ---------------------------------------------------------------------------

    def begin(self) -> None:
        """Claim the path (or a staging sibling when overwriting), or raise
        :class:`CheckpointExistsError` / :class:`OwnershipError`."""
        self._settle_replacement()
        if self.store.exists(METADATA_FILE):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint is already committed at {self.store.url}; choose a new path "
                    "or pass overwrite=True"
                )
            self.staged = staging_name(self.store, self.save_id)
            self.target = self.store.sibling(self.staged)
        self._claim(self.target)
        self.claimed = True
        self._heartbeat = _Heartbeat(self.target, self.save_id, self.lease_s)

    def _alive(self, store: Store, owner: Owner) -> bool:
        return not self.liveness.is_dead(owner, last_heartbeat(store, owner.save_id))

    def _claim(self, store: Store) -> None:
        for _ in range(16):
            if not store.exists(MARKER) and not store.exists(METADATA_FILE):
                leftovers = [k for k in store.list() if not is_internal(k)]
                if leftovers:
                    raise CheckpointExistsError(
                        f"{store.url} is not empty and holds no ucp_zarr checkpoint (found "
                        f"{leftovers[0]!r}); refusing to write into it"
                    )
            try:
                store.create_exclusive(MARKER, self.me.to_bytes())
                return
            except FileExistsError:
                pass
            holder = read_owner(store, MARKER)
            if holder is None:
                continue  # it was just released: try again
            if not self.overwrite_incomplete and self._alive(store, holder):
                raise OwnershipError(
                    f"{store.url} is being written by {holder.describe()}, which is still alive; "
                    "wait for it, choose another path, or pass overwrite_incomplete=True if you "
                    "know it is dead"
                )
            if self._take_over(store, holder):
                return
        raise OwnershipError(f"could not claim {store.url}: other saves keep claiming it")

    def _take_over(self, store: Store, victim: Owner) -> bool:
        """Replace the dead ``victim``'s claim by ours; False if someone else got there first."""
        chain = [victim]
        while True:
            key = TAKEOVER + chain[-1].save_id
            try:
                store.create_exclusive(key, self.me.to_bytes())
                break
            except FileExistsError:
                taker = read_owner(store, key)
                if taker is None:
                    continue
                if self._alive(store, taker):
                    raise OwnershipError(
                        f"{store.url}: {taker.describe()} is taking over the leftovers of "
                        f"{victim.describe()} right now"
                    )
                chain.append(taker)
        mine = [TAKEOVER + o.save_id for o in chain]
        current = read_owner(store, MARKER)
        if current is None or current.save_id != victim.save_id:
            store.delete(mine[-1])
            return False
        for key in store.list():
            if key != MARKER and key not in mine and is_checkpoint_object(key) and not self._live_takeover(store, key):
                store.delete(key)
        store.write_atomic(MARKER, self.me.to_bytes())
        for key in reversed(mine):
            store.delete(key)
        return True

    def _live_takeover(self, store: Store, key: str) -> bool:
        if not key.startswith(TAKEOVER):
            return False
        taker = read_owner(store, key)
        return taker is not None and self._alive(store, taker)

    # -- replacement (overwrite) -----------------------------------------------------------

    def _settle_replacement(self) -> None:
        """Finish the overwrite of a dead save that crashed while putting its checkpoint in
        place (or refuse while a live one does)."""
        record = read_owner(self.store, REPLACE_RECORD)
        if record is None:
            return
        if self._alive(self.store, record):
            raise OwnershipError(f"{self.store.url} is being replaced by {record.describe()}")
        staged = staged_store(self.store, record)
        if staged is not None:
            roll_forward(self.store, staged)
        else:  # it names no committed staging copy of its own save: garbage
            self.store.delete(REPLACE_RECORD)

    def _replace(self) -> None:
        record = Owner.this_process(self.save_id, self.lease_s, staged=self.staged)
        assert self.staged is not None
        for _ in range(16):
            try:
                self.store.create_exclusive(REPLACE_RECORD, record.to_bytes())
                break
            except FileExistsError:
                self._settle_replacement()
        else:
            raise OwnershipError(f"could not replace {self.store.url}: other saves keep replacing it")
        roll_forward(self.store, self.target)

    # -- commit and abort --------------------------------------------------------------------

    def commit(self, root: bytes) -> None:
        """Re-check ownership, create the root exclusively, release the claim; when
        overwriting, put the staged checkpoint in place."""
        Fence(self.target, self.save_id).check(force=True)
        try:
            self.target.create_exclusive(METADATA_FILE, root)
        except FileExistsError:
            raise OwnershipError(f"{self.target.url} was committed by another save meanwhile") from None
        self._stop_heartbeat()
        self.target.delete(MARKER)
        self.target.delete(HEARTBEAT + self.save_id)
        self.claimed = False
        if self.staged is not None:
            self._replace()

    def abort(self) -> None:
        """Give up the claim: mark this save aborted (so the next save may take over at
        once) and delete its data, keeping the marker, so that the path reads as an
        incomplete checkpoint rather than as nothing. A staging sibling is removed whole."""
        self._stop_heartbeat()
        if not self.claimed:
            return
        self.claimed = False
        owner = read_owner(self.target, MARKER)
        if owner is None or owner.save_id != self.save_id:
            return  # taken over: the leftovers are the new owner's business
        if self.staged is not None:
            self.target.remove()
            return
        self.target.write_atomic(HEARTBEAT + self.save_id, json.dumps({"aborted": True}).encode())
        for key in self.target.list():
            if not is_internal(key) and is_checkpoint_object(key):
                self.target.delete(key)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None


def roll_forward(store: Store, staged: Store) -> None:
    """Put the committed checkpoint of ``staged`` in place at ``store`` (whose replace record
    names it), idempotently, then remove the record and ``staged``."""
    root = staged.read(METADATA_FILE)
    store.delete(METADATA_FILE)
    new = [k for k in staged.list() if not is_internal(k) and k != METADATA_FILE]
    for key in new:
        store.adopt(staged, key)
    keep = set(new)
    for key in store.list():  # the old checkpoint's objects; other files in the directory stay
        if key not in keep and not is_internal(key) and is_checkpoint_object(key):
            store.delete(key)
    store.sync()
    try:
        store.create_exclusive(METADATA_FILE, root)
    except FileExistsError:
        if store.read(METADATA_FILE) != root:
            raise OwnershipError(f"{store.url} was committed by another save while being replaced") from None
    for key in store.list():
        if is_internal(key) and key != REPLACE_RECORD:
            store.delete(key)
    store.delete(REPLACE_RECORD)
    staged.remove()


def target_store(store: Store, staged: str | None) -> Store:
    """Where a save writes, given the coordinator's :attr:`Transaction.staged`."""
    return store if staged is None else store.sibling(staged)


class _Heartbeat:
    """Renews ``.ucp_zarr_heartbeat.<save id>`` every ``lease_s / 4`` until stopped."""

    def __init__(self, store: Store, save_id: str, lease_s: float) -> None:
        self.store = store
        self.key = HEARTBEAT + save_id
        self.period = max(lease_s / 4, 0.05)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ucp_zarr-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.write_atomic(self.key, json.dumps({"renewed": time.time()}).encode())

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat()
            except Exception:  # a storage hiccup: the next beat tries again
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def describe_claim(store: Store) -> dict[str, Any] | None:
    """The owner marker of an incomplete checkpoint, as plain data (for ``ucp-zarr info``)."""
    owner = read_owner(store, MARKER)
    return None if owner is None else asdict(owner)
