"""A root of step checkpoints on storage: naming, listing, reader leases, crash-safe deletion.

**Naming.** Step ``s`` lives in the folder ``step_%08d`` under the root (``step_00000100``;
steps past 10**8 take more digits). Only canonical names count: ``step_100``,
``step_000000100`` and anything else in the root are foreign and ignored. Each step folder
holds an ordinary ucp_zarr checkpoint, so the save's transaction rules hold there
(:mod:`ucp_zarr.protocol.transaction`): it is **committed** once its root ``zarr.json`` exists (or a
replace record names a committed staging copy), and nothing else says so.

**Reader leases.** A process reading a step first creates ``.ucp_zarr_reader.<id>``
exclusively in its folder (an :class:`~ucp_zarr.protocol.liveness.Owner` record: host, boot id,
process, lease, renewed by ``.ucp_zarr_heartbeat.<id>``), then checks that no live deleter is
at work, reads, and removes its lease. Leases of dead readers (same rules as dead saves) are
ignored and removed with the step.

**Deletion** (:func:`delete_step`) first creates ``.ucp_zarr_deleting`` (an Owner record),
then looks for live reader leases (any: it backs off), then deletes the root ``zarr.json``
(from here on the step is not committed), then the folder. Readers
write their lease before looking for the record, deleters their record before looking for
leases, so one of the two always sees the other. A crash at any point leaves either a
complete committed step or an uncommitted folder that the next retention removes: the
deletion of a dead deleter is resumed, an interrupted save of a dead owner is taken over by
a :class:`~ucp_zarr.protocol.transaction.Transaction` and dropped. :func:`latest` can therefore never
name a partial checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, FormatError, IncompleteCheckpointError, NotACheckpointError
from ..format.documents import METADATA_FILE, parse_document
from ..format.commit_record import CheckpointMeta
from ..io.factory import open_store
from ..io.store import Store, at_once
from ..protocol.owned import Owned
from ..protocol.liveness import (
    DEFAULT_LEASE_S,
    HEARTBEAT,
    INTERNAL_PREFIX,
    MARKER,
    REPLACE_RECORD,
    RETIRED,
    STAGING_INFIX,
    Heartbeat,
    Liveness,
    Owner,
    last_heartbeat,
    read_owner,
    try_mark_aborted,
)
from ..protocol.transaction import (
    Transaction, collect_staging, committed_store, delete_owned, read_owned, settle_replacement,
)

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
STEP_DIGITS = 8
READER = ".ucp_zarr_reader."
DELETING = ".ucp_zarr_deleting"
_STEP_NAME = re.compile(r"step_([0-9]{8,})")


def step_name(step: int) -> str:
    """The folder name of ``step`` (``step_00000100``)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step is a non-negative integer, got {step!r}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or None for any name :func:`step_name` does not make."""
    m = _STEP_NAME.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


# --- the root and its step folders ------------------------------------------------------------


def step_store(root: Store, step: int) -> Store:
    """The store of ``step``'s folder under ``root`` (same kind, client and options)."""
    return root.child(step_name(step))


def step_numbers(root: Store) -> list[int]:
    """The steps that have a folder under ``root`` (committed or not), ascending."""
    return sorted(s for s in (parse_step(n) for n in root.child_names()) if s is not None)


def is_committed(store: Store) -> bool:
    """Whether the step folder ``store`` holds a committed checkpoint."""
    try:
        committed_store(store)
        return True
    except (NotACheckpointError, IncompleteCheckpointError):
        return False


def read_meta(store: Store) -> CheckpointMeta:
    """The commit record of the committed checkpoint in ``store`` (FormatError if it does not parse)."""
    held = committed_store(store)
    where = f"{held.url}/{METADATA_FILE}"
    return CheckpointMeta.from_zarr_json(parse_document(held.read(METADATA_FILE), where), where)


# --- what a step folder holds --------------------------------------------------------------------


@dataclass(frozen=True)
class StepInfo:
    """One step folder under a root, as :func:`list_steps` finds it.

    ``state``: ``"committed"``; ``"writing"`` (a live save owns it); ``"interrupted"`` (the
    save that owned it is dead); ``"deleting"`` (its commit record is gone, a deletion is
    under way or was interrupted); ``"leftover"`` (neither: the remains of a deletion);
    ``"unreadable"`` (a commit record that does not parse)."""

    step: int
    path: str
    committed: bool
    state: str
    nbytes: int | None = None
    """The bytes of every stored tensor (per-rank copies counted each), from the commit record."""
    tensors: int | None = None
    world_size: int | None = None
    created: str | None = None
    layout: tuple[str, ...] = ()
    """The top keys of the commit record's ``layout`` (``rules``, ``dcp``, ``source``);
    empty for a plain save."""
    library: str | None = None
    owner: dict[str, Any] | None = None
    """The owner marker of an uncommitted step (who wrote it, from where)."""
    readers: int = 0
    """Live reader leases."""
    error: str | None = None
    """Why an ``"unreadable"`` commit record could not be read."""

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class _Folder:
    """One step folder's top-level objects and the judgments made from them."""

    step: int
    store: Store
    names: frozenset[str]
    committed: bool
    owner: Owner | None = None
    owner_alive: bool = False
    deleter_alive: bool = False
    live_readers: list[str] = field(default_factory=list)
    dead_readers: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        if self.committed:
            return "committed"
        if self.owner is not None:
            return "writing" if self.owner_alive else "interrupted"
        if DELETING in self.names:
            return "deleting"
        return "leftover"


def _alive(store: Store, owner: Owner, liveness: Liveness) -> bool:
    return not liveness.is_dead(owner, last_heartbeat(store, owner.save_id))


def inspect_step(store: Store, step: int, liveness: Liveness) -> _Folder:
    """What the step folder ``store`` holds: one listing, and the owner records it names."""
    names = frozenset(store.child_names())
    committed = METADATA_FILE in names or (REPLACE_RECORD in names and is_committed(store))
    folder = _Folder(step, store, names, committed)
    if not committed and MARKER in names:
        folder.owner = read_owner(store, MARKER)
        folder.owner_alive = folder.owner is not None and _alive(store, folder.owner, liveness)
    if DELETING in names:
        deleter = read_owner(store, DELETING)
        folder.deleter_alive = deleter is not None and _alive(store, deleter, liveness)
    for name in sorted(n for n in names if n.startswith(READER)):
        reader = read_owner(store, name)
        alive = reader is not None and _alive(store, reader, liveness)
        (folder.live_readers if alive else folder.dead_readers).append(name)
    return folder


def scan(root: Store, liveness: Liveness | None = None) -> list[_Folder]:
    """Every step folder under ``root``, ascending (asked at once where the store waits a
    round trip per request)."""
    liveness = liveness or Liveness.here()
    return at_once(root, lambda s: inspect_step(step_store(root, s), s, liveness), step_numbers(root))


def list_steps(root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> list[StepInfo]:
    """Every step folder under ``root`` (a path or fsspec URL), ascending by step, with its
    state and, for committed steps, what its commit record says. Reads JSON only (no torch);
    the commit records are read at once where the store waits a round trip per request."""
    store = open_store(root, storage_options)
    return at_once(store, _step_info, scan(store))


def _step_info(f: _Folder) -> StepInfo:
    """What :func:`list_steps` tells of the step folder ``f``."""
    info = StepInfo(
        f.step, f.store.url, f.committed, f.state,
        owner=None if f.owner is None else f.owner.__dict__.copy(), readers=len(f.live_readers),
    )
    if not f.committed:
        return info
    try:
        meta = read_meta(f.store)
    except (FormatError, FileNotFoundError, NotACheckpointError, IncompleteCheckpointError) as e:
        return StepInfo(f.step, f.store.url, False, "unreadable", error=str(e)[:300])
    return StepInfo(
        f.step, f.store.url, True, "committed", meta.nbytes(), len(meta.tensors), meta.world_size,
        meta.created, tuple(sorted(meta.layout)), meta.library, readers=len(f.live_readers),
    )


# --- reading under a lease -------------------------------------------------------------------


class StepGoneError(IncompleteCheckpointError):
    """The step was deleted, or is being deleted, and cannot be read."""


class ReadLease:
    """``with ReadLease(store):`` holds a reader lease on the step folder ``store`` while
    reading it; entering raises :class:`StepGoneError` when the step is not committed or a
    live deleter is at work on it."""

    def __init__(self, store: Store, lease_s: float = DEFAULT_LEASE_S, liveness: Liveness | None = None) -> None:
        self.store = store
        self.lease_s = lease_s
        self.liveness = liveness or Liveness.here()
        self.id = uuid.uuid4().hex
        self.key = READER + self.id
        self._heartbeat: Heartbeat | None = None

    def __enter__(self) -> "ReadLease":
        if not is_committed(self.store):  # (never create a lease in a folder that is gone)
            raise StepGoneError(f"no committed checkpoint at {self.store.url}")
        self.store.create_exclusive(self.key, Owner.this_process(self.id, self.lease_s).to_bytes())
        try:
            self._heartbeat = Heartbeat(self.store, self.id, self.lease_s)
            deleter = read_owner(self.store, DELETING)
            if deleter is not None and _alive(self.store, deleter, self.liveness):
                raise StepGoneError(f"{self.store.url} is being deleted by {deleter.describe()}")
            if not is_committed(self.store):
                raise StepGoneError(f"{self.store.url} was deleted")
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        """Give the lease back. Where the store fails to delete it, it is marked aborted
        first (then it counts as released: a retention deletes the step at once, instead of
        finding a live reader until this process ends), and the failure is raised."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        try:
            self.store.delete(self.key)
        except Exception:
            try_mark_aborted(self.store, self.id, "a reader lease not deleted")
            raise
        self.store.delete(HEARTBEAT + self.id)


# --- deletion and clean-up ---------------------------------------------------------------------


def delete_step(store: Store, *, lease_s: float = DEFAULT_LEASE_S, liveness: Liveness | None = None) -> bool:
    """Delete the step folder ``store`` crash-safely (see the module docstring); False
    (nothing deleted) while a live reader, deleter or replacement holds it."""
    liveness = liveness or Liveness.here()
    if store.remove_link():  # (a step folder linked into the run: the link goes, what it names stays)
        return True
    if REPLACE_RECORD in store.child_names():  # an overwrite: a live one's business; a dead one's is finished first
        record = read_owner(store, REPLACE_RECORD)
        if record is None:
            if store.exists(REPLACE_RECORD):  # (unreadable: not ours to judge)
                return False
        elif _alive(store, record, liveness):
            return False
        else:
            settle_replacement(store, record)
    me = Owner.this_process(uuid.uuid4().hex, lease_s)
    try:
        store.create_exclusive(DELETING, me.to_bytes())
    except FileExistsError:
        other = read_owner(store, DELETING)
        if other is not None and _alive(store, other, liveness):
            return False
        store.write_atomic(DELETING, me.to_bytes())  # resume a dead deleter's work
    try:
        for name in store.child_names():
            if name.startswith(READER):
                reader = read_owner(store, name)
                if reader is not None and _alive(store, reader, liveness):
                    _withdraw(store, me)
                    return False
        remove_checkpoint(store)
        for name in store.child_names():  # the protocol's records (dead readers' leases among them)
            if name.startswith(INTERNAL_PREFIX) and name not in (DELETING, REPLACE_RECORD):
                store.delete(name)
        store.delete(DELETING)
        store.prune(())
    except BaseException:  # (marked aborted: the next deletion, this process's too, resumes it at once)
        try_mark_aborted(store, me.save_id, "a failed deletion")
        raise
    return True


def remove_checkpoint(store: Store) -> None:
    """Delete the committed checkpoint of ``store``: what its commit record names is
    recorded (``.ucp_zarr_retired``), the commit record deleted first (from here on the
    checkpoint is not committed), then the recorded objects. Other files and folders (a
    checkpoint nested in a subfolder among them) stay. Resumes a crashed removal."""
    try:
        root = store.read(METADATA_FILE)
    except FileNotFoundError:
        pass
    else:
        where = f"{store.url}/{METADATA_FILE}"
        try:
            owned = Owned.from_commit_record(root, where, store.read)
        except FormatError as e:
            log.warning("ucp_zarr: the commit record %s is unreadable (%s); its objects are left in place", where, e)
            owned = Owned()
        store.write_atomic(RETIRED, owned.to_bytes())
        store.delete(METADATA_FILE)
    delete_owned(store, read_owned(store, RETIRED) or Owned())
    store.delete(RETIRED)


def _withdraw(store: Store, me: Owner) -> None:
    """Remove our deletion record (unless another deleter has replaced it)."""
    current = read_owner(store, DELETING)
    if current is not None and current.save_id == me.save_id:
        store.delete(DELETING)


def drop_interrupted(store: Store, *, lease_s: float = DEFAULT_LEASE_S) -> bool:
    """Remove the step folder ``store`` of an interrupted save whose owner is dead: take it
    over as a save would (:class:`~ucp_zarr.protocol.transaction.Transaction`, which removes a dead
    owner's leftovers and refuses a live one), give it up, remove the folder. False when a
    live save holds it or it was committed meanwhile."""
    txn = Transaction(store, lease_s=lease_s)
    try:
        txn.begin()
    except CheckpointError as e:  # a live owner (OwnershipError), or committed meanwhile
        log.debug("ucp_zarr: leaving %s: %s", store.url, e)
        return False
    txn.abort()  # (deletes nothing of its own: it recorded no objects)
    for name in store.child_names():
        if name.startswith(INTERNAL_PREFIX):
            store.delete(name)
    store.prune(())
    return True


_STAGING_COPY = re.compile(rf"\.(step_[0-9]{{8,}}){re.escape(STAGING_INFIX)}[0-9a-f]{{32}}")


def collect_staging_copies(root: Store, liveness: Liveness | None = None) -> list[str]:
    """Remove the staging copies (``.step_XXXXXXXX.ucp_zarr-<save id>``) that crashed
    overwrites of steps under ``root`` left, where no live save works on them and no
    replace record names them (see :func:`~ucp_zarr.protocol.transaction.collect_staging`)."""
    liveness = liveness or Liveness.here()
    steps = {parse_step(m.group(1)) for n in root.child_names() if (m := _STAGING_COPY.fullmatch(n))}
    return [name for s in sorted(x for x in steps if x is not None) for name in collect_staging(step_store(root, s), liveness)]


def clean_folder(folder: _Folder, *, lease_s: float = DEFAULT_LEASE_S) -> bool:
    """Remove an uncommitted step folder that nobody alive is working on; True if removed."""
    state = folder.state
    if state == "interrupted":  # (the transaction refuses a live owner and a committed path)
        return drop_interrupted(folder.store, lease_s=lease_s)
    if state in ("deleting", "leftover") and not folder.deleter_alive and not is_committed(folder.store):
        return delete_step(folder.store, lease_s=lease_s)
    return False
