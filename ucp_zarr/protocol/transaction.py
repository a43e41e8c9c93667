"""The save as a transaction: claim the path, fence stale writers, commit once, or abort.

A checkpoint path moves through these states (each a set of objects under the path):

* **empty**: nothing there;
* **claimed**: ``.ucp_zarr_pending`` (the *owner marker*) names the save writing it: its
  save id, host, PID namespace, process id and lease. It is created exclusively
  (``O_EXCL``/hard link on local disks, ``If-None-Match: *`` on object stores), so two saves
  never both own a path. Right after claiming, the save records the objects it will write
  (``.ucp_zarr_owned.<save id>``, see :mod:`.owned`), before writing any. On a store that
  waits a round trip per request, the path's names and its staging siblings' are listed at
  once first: a path found empty, with no sibling, is claimed with no other read before;
* **committed**: the root ``zarr.json`` exists. It is created exclusively too, so a commit
  never replaces a committed checkpoint, and only after the owner re-checked the marker.
  A claim that finds the path committed right after it won the marker gives it back.

**What may be deleted.** Nothing is deleted by a pattern over the directory: an abort
deletes the objects its save recorded, a takeover those its dead owner recorded, an
overwrite those the replaced commit record names (:mod:`.owned`). A checkpoint nested in a
subfolder, a foreign Zarr group and any other file survive all of them.

**Liveness.** Leftovers of another save are removed only when that save is provably dead:
in the same PID namespace of the same boot of the same host its process is gone (exited,
reaped or a zombie), and so are the writer processes the marker names (a background save's,
see :mod:`..io.writer_process`: they die with it); anywhere
else (another host, container or PID namespace, where its process cannot be seen) its
lease expired (the owner renews ``.ucp_zarr_heartbeat.<save id>`` every ``lease_s / 4``);
or the caller says so (``overwrite_incomplete=True``). Taking over from a dead owner ``X``
first creates ``.ucp_zarr_takeover.<X>`` exclusively, so two newcomers never both clear and
claim; a takeover whose taker died is itself taken over the same way.

**Fencing.** Every writing rank checks, at most every ``FENCE_INTERVAL_S``, that the marker
still names its save (:class:`Fence`), and the coordinator that its own lease has not
lapsed (:meth:`Heartbeat.lapsed`: no renewal for 3/4 of ``lease_s``, as after a stall); once
either fails the save writes nothing more and raises. On local disks every object is
written under a save-unique temporary name and moved into place only if nothing is there
(or, after a forced re-check, to replace a dead save's stray), so a writer that stalled
past its lease cannot replace a successor's objects. Every shard also carries its save id
(see :mod:`..format.codec`), so a stray object of another save is detected when read.

**Overwrite.** ``overwrite=True`` on a committed path writes the new checkpoint into a
staging sibling ``.<name>.ucp_zarr-<save id>`` and commits it there; then the *replace
record* ``.ucp_zarr_replace`` (created exclusively, naming the staging sibling) is written
into the path, what the old checkpoint owns is recorded (``.ucp_zarr_retired``), the old
root removed, the new objects adopted (hard links / server-side copies, as many at once as
the store keeps requests in flight; all data before any document), the old ones deleted (in
bulk requests where the store has them), the new root created, then the records removed (the
retired record, the lease, the replace record, in that order) while the sibling is. Until
the new root exists, readers follow the record to the complete staging copy; after a crash,
whoever finds the record of a dead owner rolls the replacement forward (a replacement that
fails in a live process marks itself aborted, so the same goes for it). At every point the
old or the new checkpoint is complete and findable, never a mix. Staging
siblings of dead saves that never got that far are removed by the next save at the path
(and by the manager's retention).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Callable, NamedTuple

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    FormatError,
    IncompleteCheckpointError,
    Keyword,
    NotACheckpointError,
    OwnershipError,
)
from ..format.documents import METADATA_FILE, NAME_COMPONENT
from .owned import Owned
from ..io.store import Store, at_once, folders_of, temp_name
from .liveness import (
    DEFAULT_LEASE_S,
    FENCE_INTERVAL_S,
    Fence,
    HEARTBEAT,
    Heartbeat,
    INTERNAL_PREFIX,
    Liveness,
    MARKER,
    OWNED,
    Owner,
    REPLACE_RECORD,
    RETIRED,
    STAGING_INFIX,
    TAKEOVER,
    _SAVE_ID,
    last_heartbeat,
    mark_aborted,
    read_owner,
    try_mark_aborted,
)

log = logging.getLogger(__name__)

def read_owned(store: Store, key: str) -> Owned | None:
    """The objects recorded at ``key`` (:data:`OWNED` + save id, or :data:`RETIRED`); None
    when absent or unreadable (then nothing is deleted on its behalf)."""
    try:
        return Owned.from_bytes(store.read(key), f"{store.url}/{key}")
    except FileNotFoundError:
        return None
    except FormatError as e:
        log.warning("ucp_zarr: ignoring the unreadable record %s/%s (its objects are left in place): %s", store.url, key, e)
        return None


def delete_owned(store: Store, owned: Owned, tag: str | None = None, keep: frozenset[str] = frozenset()) -> None:
    """Delete ``owned`` from ``store`` phase by phase (:meth:`Owned.deletion_phases`), except
    ``keep``, with the temporary names a save ``tag`` stages them under on stores that have
    them, then the folders left empty."""
    staged = tag is not None and store.stages_writes
    folders: set[str] = set()
    deleted = False
    for keys in owned.deletion_phases():
        keys = [k for k in keys if k not in keep]
        store.delete_many([*keys, *(temp_name(k, tag) for k in keys)] if staged else keys)  # type: ignore[arg-type]
        folders |= folders_of(keys)
        deleted = deleted or bool(keys)
    if deleted:  # (nothing deleted empties no folder: no listing for an overwrite of the same layout)
        store.prune(folders)


_NAME = NAME_COMPONENT.pattern  # an escaped group or array name (schema/FORMAT.md, section 1)
_CHECKPOINT_OBJECT = re.compile(
    rf"(?:zarr\.json|{_NAME}/zarr\.json|{_NAME}/{_NAME}/(?:zarr\.json|c(?:/[0-9]+)*))(?:\.tmp-[0-9a-f]{{32}})?"
)
_FINAL_OBJECT = re.compile(rf"{_NAME}/zarr\.json|{_NAME}/{_NAME}/(?:zarr\.json|c(?:/[0-9]+)*)")


def is_checkpoint_object(key: str) -> bool:
    """Whether ``key`` (relative to the checkpoint path) names an object of the format: the
    root ``zarr.json``, a protocol file (``.ucp_zarr_*``), a group or array ``zarr.json``
    (``<group>/zarr.json``, ``<group>/<array>/zarr.json``), a shard (``<group>/<array>/c/i/j``,
    ``c`` for a 0-d array), or a store's temporary name for one of them. Anything else
    (``config.json``, ``tokenizer/vocab.json``, DCP's ``.metadata``) is another file sharing
    the directory. Deletions never go by this test (see :mod:`.owned`): it tells only
    whether a directory holds anything that is not a checkpoint's."""
    return is_internal(key) or _CHECKPOINT_OBJECT.fullmatch(key) is not None


_COMMIT_TEMP = re.compile(rf"{re.escape(METADATA_FILE)}\.tmp-[0-9a-f]{{32}}")
"""A temporary copy of the commit record: a local store's exclusive create writes one, then
links it into place, so a save killed in between leaves it behind."""


def remove_commit_temps(store: Store) -> None:
    """Delete what saves killed while committing left of their commit records (called by the
    path's owner only: no live save is creating the record)."""
    for name in store.child_names():
        if _COMMIT_TEMP.fullmatch(name):
            store.delete(name)


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


def require_exclusive_create(store: Store, allow: bool) -> None:
    """Refuse to save to a store whose exclusive create is check-then-write (two saves could
    both claim the path), unless the caller took that risk (``allow``)."""
    if not store.exclusive_create and not allow:
        raise OwnershipError(
            f"{store.url}: this store cannot create an object exclusively (its 'exclusive' create is "
            "check-then-write), so two saves racing for the path could both claim it and corrupt each "
            "other. Save to a local path or an s3:// URL, or, if no other save can ever target this "
            "path, pass ", Keyword("unsafe_non_exclusive_store", True),
        )


# --- the transaction (run by the coordinating rank) -------------------------------------------

_RUNNING: set[str] = set()
"""The save ids of this process's transactions from the start of their claim to its release
(commit, abort): a claim or replace record naming this process and a save id not here is left
by a save that failed and could not give it back (the process's own liveness, which the
process id cannot tell)."""
_RUNNING_LOCK = threading.Lock()


class _Look(NamedTuple):
    """What a save saw at its path before claiming it (:meth:`Transaction._look`)."""

    names: list[str]
    """The path's names (top level)."""
    staging: list[str]
    """Its staging siblings' names."""


class Transaction:
    """One save's claim on ``store``, from :meth:`begin` to :meth:`commit` or :meth:`abort`.

    Only the coordinating rank runs it; the other ranks learn :attr:`save_id` and
    :attr:`staged` from it and write into :func:`target_store` behind a :class:`Fence`.
    ``owned`` names every object the save will write (recorded before any is written);
    ``writers`` the processes that write them for this one (see :attr:`Owner.writers`).
    """

    def __init__(
        self,
        store: Store,
        *,
        owned: Owned | None = None,
        overwrite: bool = False,
        overwrite_incomplete: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        save_id: str | None = None,
        liveness: Liveness | None = None,
        writers: tuple[int, ...] = (),
    ) -> None:
        self.store = store
        self.owned = owned or Owned()
        self.overwrite = overwrite
        self.overwrite_incomplete = overwrite_incomplete
        self.lease_s = lease_s
        self.save_id = save_id or uuid.uuid4().hex
        self.liveness = liveness or Liveness.here()
        self.me = Owner.this_process(self.save_id, lease_s, writers=writers)
        self.staged: str | None = None
        """The staging sibling's name when overwriting a committed checkpoint."""
        self.target = store
        """Where this save's objects go: ``store``, or the staging sibling."""
        self.claimed = False
        self._may_hold = False
        self.heartbeat: Heartbeat | None = None

    def fence(self) -> Fence:
        """The coordinator's fence: the marker and this save's own lease."""
        return Fence(self.target, self.save_id, min(FENCE_INTERVAL_S, self.lease_s / 4), lease=self.heartbeat)

    # -- begin ---------------------------------------------------------------------------

    def begin(self) -> None:
        """Claim the path (or a staging sibling when overwriting) and record what this save
        will write, or raise :class:`CheckpointExistsError` / :class:`OwnershipError`. A
        failure once the claim may be this save's gives it back (its records and lease too),
        as :meth:`abort` does for a save that wrote nothing: no live lease is left behind."""
        with _RUNNING_LOCK:
            _RUNNING.add(self.save_id)
        try:
            self._claim_path()
            self.claimed = True
            with ThreadPoolExecutor(1) as pool:  # (the lease and the record at once: one round trip, not two)
                recording = pool.submit(self.target.write_atomic, OWNED + self.save_id, self.owned.to_bytes())
                try:
                    self.heartbeat = Heartbeat(self.target, self.save_id, self.lease_s)
                finally:
                    recording.result()
        except BaseException:
            if self._may_hold:
                self.claimed = True  # (abort gives back only a marker that names this save)
                try:
                    self.abort(wrote=False)
                except Exception as e:  # the failure itself is what the caller needs to see
                    log.warning("ucp_zarr: could not give back the claim on %s: %s", self.target.url, e)
            self._end()
            raise

    def _claim_path(self) -> None:
        """:meth:`begin`'s claim: the path's marker, or a new staging sibling's."""
        first = self._look()
        for attempt in range(16):
            # what the first look saw, unless there is a replacement to settle (or on a retry)
            seen = first if attempt == 0 and first is not None and REPLACE_RECORD not in first.names else None
            if seen is None:
                self._settle_replacement()
            if seen is None or seen.staging:
                collect_staging(self.store, self.liveness)
            if METADATA_FILE in seen.names if seen is not None else self.store.exists(METADATA_FILE):
                # the marker of a save that died right after its commit (none where none was listed)
                holder = read_owner(self.store, MARKER) if seen is None or MARKER in seen.names else None
                if holder is not None and not self._alive(self.store, holder):
                    release_committed(self.store, holder.save_id)
                if not self.overwrite:
                    raise CheckpointExistsError(
                        f"a checkpoint is already committed at {self.store.url}; choose a new path "
                        "or pass ", Keyword("overwrite", True),
                    )
                self.staged = staging_name(self.store, self.save_id)
                self.target = self.store.sibling(self.staged)
            # (a new staging sibling, named by this save, or a path found empty: no leftovers)
            if self._claim(self.target, empty=seen is not None and (self.staged is not None or not seen.names)):
                break
            self.staged, self.target = None, self.store  # committed just before we claimed it
        else:
            raise OwnershipError(f"could not claim {self.store.url}: other saves keep committing it")

    def _look(self) -> _Look | None:
        """On a store that waits a round trip per request, the path's names and its staging
        siblings', both listed at once: they stand in for :meth:`begin`'s first reads, one
        after another (a replacement to settle, staging to collect, a commit record,
        leftovers); the exclusive create and the check after it decide, as always. None on
        other stores (their reads cost no round trip)."""
        if not self.store.request_concurrency:
            return None
        prefix = f".{self.store.name}{STAGING_INFIX}"
        asks = [self.store.child_names, lambda: self.store.sibling_names(prefix)]
        return _Look(*at_once(self.store, lambda ask: ask(), asks))

    def _alive(self, store: Store, owner: Owner) -> bool:
        return not self.liveness.is_dead(owner, last_heartbeat(store, owner.save_id))

    def _holds(self, store: Store, owner: Owner) -> bool:
        """Whether ``owner`` of a claim or a replacement still holds it: :meth:`_alive`, but
        one of this very process holds it only while its transaction runs (:data:`_RUNNING`):
        a save that failed and could not give it back, the storage failing too, leaves no
        obstacle to this process's next save, as after a withdrawal."""
        if not self._alive(store, owner):
            return False
        if self._mine(owner):
            with _RUNNING_LOCK:
                return owner.save_id in _RUNNING
        return True

    def _mine(self, owner: Owner) -> bool:
        """Whether ``owner`` is this process."""
        return (owner.pid, owner.host, owner.boot_id) == (self.me.pid, self.me.host, self.me.boot_id)

    def _claim(self, store: Store, empty: bool = False) -> bool:
        """Own ``store``'s marker; False (and the marker given back) when the path turned
        out committed once we held it: a save never writes into a committed path. ``empty``:
        the path was just found empty (the first try looks for no leftovers)."""
        for attempt in range(16):
            if not (empty and attempt == 0) and not store.exists(MARKER) and not store.exists(METADATA_FILE):
                leftovers = [k for k in store.list() if not is_internal(k) and not _COMMIT_TEMP.fullmatch(k)]
                if leftovers:
                    raise CheckpointExistsError(
                        f"{store.url} is not empty and holds no ucp_zarr checkpoint (found "
                        f"{leftovers[0]!r}); refusing to write into it"
                    )
            try:
                self._may_hold = True  # (from here on, a failure may leave a marker naming this save)
                store.create_exclusive(MARKER, self.me.to_bytes())
                if self.staged is not None:
                    return True  # (a staging sibling named by this save: no other save commits there)
                won = True
            except FileExistsError:
                holder = read_owner(store, MARKER)
                if holder is None:
                    continue  # it was just released: try again
                if not self.overwrite_incomplete and self._holds(store, holder):
                    if self._mine(holder):
                        raise OwnershipError(
                            f"{store.url} is being written by {holder.describe()}: a save of this process that has not "
                            "ended (running in another thread, or left waiting by a failed collective); wait for it, "
                            "choose another path, or pass ", Keyword("overwrite_incomplete", True), " if none runs",
                        ) from None
                    raise OwnershipError(
                        f"{store.url} is being written by {holder.describe()}, which is still alive; "
                        "wait for it, choose another path, or pass ", Keyword("overwrite_incomplete", True),
                        " if you know it is dead",
                    ) from None
                won = self._take_over(store, holder)
            if won:
                if not store.exists(METADATA_FILE):
                    if store.stages_writes:  # (only a local store's exclusive create leaves one)
                        remove_commit_temps(store)
                    return True
                self._release(store)
                return False
        raise OwnershipError(f"could not claim {store.url}: other saves keep claiming it")

    def _release(self, store: Store) -> None:
        current = read_owner(store, MARKER)
        if current is not None and current.save_id == self.save_id:
            store.delete(MARKER)

    def _take_over(self, store: Store, victim: Owner) -> bool:
        """Replace the dead ``victim``'s claim by ours, deleting what it recorded as its own;
        False if someone else got there first."""
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
                    ) from None
                chain.append(taker)
        mine = [TAKEOVER + o.save_id for o in chain]
        try:
            current = read_owner(store, MARKER)
            if current is None or current.save_id != victim.save_id:
                store.delete(mine[-1])
                return False
            for dead in chain:
                owned = read_owned(store, OWNED + dead.save_id)
                if owned is not None:
                    delete_owned(store, owned, tag=dead.save_id)
            for dead in chain:
                store.delete(HEARTBEAT + dead.save_id)
                store.delete(OWNED + dead.save_id)
            store.write_atomic(MARKER, self.me.to_bytes())
            for key in reversed(mine):
                store.delete(key)
        except BaseException:  # (our takeover record named a live process: the next save may take over at once)
            try:
                store.delete(mine[-1])
            except Exception:
                pass
            raise
        return True

    # -- replacement (overwrite) -----------------------------------------------------------

    def _settle_replacement(self) -> None:
        """Finish the overwrite of a dead save that crashed while putting its checkpoint in
        place (or refuse while a live one does)."""
        record = read_owner(self.store, REPLACE_RECORD)
        if record is None:
            return
        if self._holds(self.store, record):
            raise OwnershipError(f"{self.store.url} is being replaced by {record.describe()}")
        settle_replacement(self.store, record)

    def _replace(self, root: bytes) -> None:
        record = Owner.this_process(self.save_id, self.lease_s, staged=self.staged)
        assert self.staged is not None
        lease: Heartbeat | None = None
        replaced = threading.Event()
        try:
            for _ in range(16):
                try:
                    created_at = time.monotonic()
                    self.store.create_exclusive(REPLACE_RECORD, record.to_bytes())
                    break
                except FileExistsError:
                    self._settle_replacement()
            else:
                raise OwnershipError(f"could not replace {self.store.url}: other saves keep replacing it")
            lease = Heartbeat(self.store, self.save_id, self.lease_s)  # the record's liveness
            fence = Fence(
                self.store, self.save_id, min(FENCE_INTERVAL_S, self.lease_s / 4), lease=lease, key=REPLACE_RECORD,
                checked=created_at,
            )
            roll_forward(self.store, self.target, fence, root=root, replaced=replaced)
        except BaseException as e:
            if lease is not None:
                lease.stop()
            self._stop_heartbeat()
            self._give_up_replacement()
            if not replaced.is_set() or not isinstance(e, Exception) or isinstance(e, CheckpointError):
                raise
            # the storage failed once the old commit record was gone: the new checkpoint is the
            # one at the path (readers follow the replace record to its staging copy), so the save
            # succeeded (a refusal, a lost claim: raised, as the path cannot take it)
            log.warning("ucp_zarr: the checkpoint at %s is committed (in its staging copy %s), but putting it in "
                        "place failed (%s); the next save or retention there finishes it", self.store.url,
                        self.target.url, e)
            return
        lease.stop()
        self._stop_heartbeat()  # (the staging copy's lease: a renewal after its removal would put it back)
        try:
            finish_replacement(self.store, self.target, self.save_id)
        except BaseException as e:  # the new checkpoint is in place: the save succeeded
            self._give_up_replacement()
            if not isinstance(e, Exception):
                raise
            _left_behind(self.store, e)

    def _give_up_replacement(self) -> None:
        """After a failure while putting the staging copy in place: mark this save aborted,
        at the path while the replace record names it and in the staging copy, so that the
        next save here (this process's too) rolls the replacement forward and removes the
        copy (or, with no record of this save, collects the copy) at once, instead of finding
        a live replacement until this process ends."""
        try:
            record = read_owner(self.store, REPLACE_RECORD)
            if record is not None and record.save_id == self.save_id:
                mark_aborted(self.store, self.save_id)
            if read_owner(self.target, MARKER) is not None:
                mark_aborted(self.target, self.save_id)
        except Exception as e:  # the failure itself is what the caller needs to see
            log.warning("ucp_zarr: could not mark the failed replacement of %s aborted: %s", self.store.url, e)

    # -- commit and abort --------------------------------------------------------------------

    def commit(self, root: bytes) -> None:
        """Re-check ownership, create the root exclusively, release the claim; when
        overwriting, put the staged checkpoint in place. Once the new commit record is in
        place at the path the save has succeeded: a failure to remove its records after that
        is logged, not raised (they are marked aborted, so that the next save at the path
        removes them at once), so that a save that raises never leaves its checkpoint
        committed at the path."""
        self.fence().check(force=True)
        try:
            self.target.create_exclusive(METADATA_FILE, root)
        except FileExistsError:
            raise OwnershipError(f"{self.target.url} was committed by another save meanwhile") from None
        except BaseException as e:
            if not self._landed(root, e):
                raise
        self.claimed = False
        if self.staged is not None:
            try:
                self._replace(root)  # the staging sibling keeps its marker and lease until removed
            finally:
                self._stop_heartbeat()
            self._end()
            return
        self._stop_heartbeat()
        try:
            release_committed(self.target, self.save_id)
        except Exception as e:  # committed: the save succeeded
            try_mark_aborted(self.target, self.save_id, "the records of a committed save")
            _left_behind(self.target, e)
        self._end()

    def _landed(self, root: bytes, error: BaseException) -> bool:
        """After the commit record's create failed with ``error``: whether the record is in
        place all the same (its acknowledgement was lost: a response that never came, an
        fsync after the link that failed), which makes the save committed. Where that cannot
        be read, nothing of the save may be deleted (an abort would leave a commit record
        over missing shards): the claim is dropped, so the abort leaves it all for the next
        save here, and ``error`` stands."""
        if isinstance(error, Exception):
            try:
                return self.target.holds(METADATA_FILE, root)
            except Exception as e:
                log.warning("ucp_zarr: %s: the commit record's create failed (%s) and whether it landed cannot be read "
                            "(%s): nothing of the save is deleted", self.target.url, error, e)
        self.claimed = False
        return False

    def abort(self, *, wrote: bool = True) -> None:
        """Give up the claim: mark this save aborted (so the next save may take over at
        once) and delete what it recorded as its own, keeping the marker, so that the path
        reads as an incomplete checkpoint rather than as nothing. A staging sibling is
        removed whole. A save that wrote nothing yet (``wrote=False``: refused while it
        prepared) gives the path back as it found it."""
        try:
            self._abort(wrote)
        finally:
            self._end()

    def _abort(self, wrote: bool) -> None:
        self._stop_heartbeat()
        if not self.claimed:
            return
        self.claimed = False
        owner = read_owner(self.target, MARKER)
        if owner is None or owner.save_id != self.save_id:
            return  # taken over: the leftovers are the new owner's business
        if self.staged is not None:
            try:
                remove_staging(self.target)
            except BaseException:  # (left for the next save at the path to collect, at once)
                try_mark_aborted(self.target, self.save_id, "a staging copy not removed")
                raise
            return
        if not wrote:
            release_committed(self.target, self.save_id)  # (its records, the marker last)
            self.target.prune(())
            return
        mark_aborted(self.target, self.save_id)
        delete_owned(self.target, self.owned, tag=self.save_id)

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def _end(self) -> None:
        """This transaction no longer runs (committed, aborted, or failed to begin)."""
        with _RUNNING_LOCK:
            _RUNNING.discard(self.save_id)


def _left_behind(store: Store, error: Exception) -> None:
    log.warning(
        "ucp_zarr: the checkpoint at %s is committed, but its save could not remove its own records (%s); "
        "the next save at this path removes them", store.url, error,
    )


def roll_forward(store: Store, staged: Store, fence: Fence | None = None, *, root: bytes | None = None,
                 replaced: threading.Event | None = None) -> None:
    """Put the committed checkpoint of ``staged`` (named by the replace record of ``store``)
    in place at ``store``, idempotently (then :func:`finish_replacement`). ``fence`` (the
    replacing save's own) is checked before every change; ``root``: the staged commit record,
    where the caller has it. ``replaced`` is set once the old commit record is gone: from then
    on readers follow the record to ``staged``, the new checkpoint."""
    check = fence.check if fence is not None else (lambda: None)
    if root is None:
        root = staged.read(METADATA_FILE)
    with ThreadPoolExecutor(1) as pool:
        listing = pool.submit(staged.list)  # (a round trip or more on an object store: meanwhile, the steps below)
        try:
            current: bytes | None = store.read(METADATA_FILE)
        except FileNotFoundError:
            current = None
        if current == root:
            listing.cancel()
        else:
            _put_in_place(store, staged, root, current, listing.result, check, replaced)


def _put_in_place(
    store: Store, staged: Store, root: bytes, current: bytes | None, listing: Callable[[], list[str]],
    check: Callable[[], None], replaced: threading.Event | None = None,
) -> None:
    """:func:`roll_forward`'s work where ``store``'s commit record is ``current`` (None when
    gone), not yet ``root``; ``listing()``: the keys of ``staged``."""
    retired = None
    if current is not None:  # what the old checkpoint owns, kept until it is deleted
        check()
        retired = _owned_by_root(store, current)
        store.write_atomic(RETIRED, retired.to_bytes())
        try:
            store.delete(METADATA_FILE)
        except BaseException:  # (gone all the same, a directory's fsync failing after the unlink: replaced)
            if replaced is not None and _gone(store, METADATA_FILE):
                replaced.set()
            raise
    if replaced is not None:
        replaced.set()
    new = [k for k in listing() if _FINAL_OBJECT.fullmatch(k)]
    tag = staged.name.rpartition(STAGING_INFIX)[2]  # the replacing save's id
    if retired is None:
        retired = read_owned(store, RETIRED) or Owned()
    blocking = _in_the_way(retired, new)
    if blocking:  # (a tensor of another number of dims: its old shard c/0/0 is where c/0 goes, or the reverse)
        check()
        store.delete_many(blocking)  # (a resumed roll-forward finds new folders there: no object to delete)
        store.prune(folders_of(blocking))

    def adopt(key: str) -> None:
        check()
        store.adopt(staged, key, tag)

    at_once(store, adopt, [k for k in new if not k.endswith(METADATA_FILE)])  # data first,
    at_once(store, adopt, [k for k in new if k.endswith(METADATA_FILE)])  # then documents
    check()
    delete_owned(store, retired, keep=frozenset(new) | frozenset(blocking))
    store.sync()
    check()
    try:
        store.create_exclusive(METADATA_FILE, root)
    except FileExistsError:
        if store.read(METADATA_FILE) != root:
            raise OwnershipError(f"{store.url} was committed by another save while being replaced") from None


def _gone(store: Store, key: str) -> bool:
    """Whether ``key`` is known to be absent (False where that cannot be read)."""
    try:
        return not store.exists(key)
    except Exception:
        return False


def _in_the_way(retired: Owned, new: list[str]) -> list[str]:
    """The retired objects that stand where a folder of ``new`` goes (an old shard ``c/0``
    of a tensor whose new shards are ``c/0/0``), or inside where an object of ``new`` goes
    (the reverse): a file system cannot hold both, so they go before the new ones are put
    in place (the old commit record is gone by then: nobody reads them)."""
    keys, folders = set(new), folders_of(new)
    return [r for r in retired.data_keys() if r not in keys and (r in folders or not keys.isdisjoint(folders_of([r])))]


def release_committed(store: Store, save_id: str) -> None:
    """Release save ``save_id``'s claim on ``store`` (after it committed, or before it wrote
    anything): remove its records, the marker last (a crash in between leaves the marker of
    a dead save, which the next save there releases or takes over)."""
    store.delete_many([OWNED + save_id, HEARTBEAT + save_id])
    store.delete(MARKER)


def settle_replacement(store: Store, record: Owner) -> None:
    """Finish the overwrite of ``store`` whose replace record ``record`` names a dead save:
    put its committed staging copy in place; a record naming none is garbage, removed."""
    staged = staged_store(store, record)
    if staged is not None:
        roll_forward(store, staged)
        finish_replacement(store, staged, record.save_id)
    else:
        store.delete(HEARTBEAT + record.save_id)
        store.delete(REPLACE_RECORD)


def finish_replacement(store: Store, staged: Store, save_id: str) -> None:
    """After :func:`roll_forward`: remove the record of what the old checkpoint owned, the
    replacing save ``save_id``'s lease, then its replace record (so no lease outlives its
    record), and meanwhile ``staged`` (the new root exists: nobody follows the record to it
    any more; a record left naming a copy without its root is garbage,
    :meth:`Transaction._settle_replacement`)."""
    with ThreadPoolExecutor(1) as pool:
        removing = pool.submit(remove_staging, staged)
        store.delete(RETIRED)
        store.delete(HEARTBEAT + save_id)
        store.delete(REPLACE_RECORD)
        removing.result()


def _owned_by_root(store: Store, root: bytes) -> Owned:
    """The objects of the committed checkpoint whose commit record is ``root``; nothing
    (and a warning) if the record is unreadable: then no old object is deleted."""
    where = f"{store.url}/{METADATA_FILE}"
    try:
        return Owned.from_commit_record(root, where, store.read)
    except FormatError as e:
        log.warning("ucp_zarr: the replaced commit record %s is unreadable (%s); its objects are left in place", where, e)
        return Owned()


def remove_staging(staged: Store) -> None:
    """Remove a staging sibling whole, its root first (from then on nobody reads it)."""
    staged.delete(METADATA_FILE)
    staged.remove()


def collect_staging(store: Store, liveness: Liveness) -> list[str]:
    """Remove the staging siblings of ``store`` (``.<name>.ucp_zarr-<save id>``) that no
    live save works on and no replace record names: those whose owner is dead, and those
    without an owner marker that hold anything but a marker being created (a committed copy
    never put in place, or the remains of a removal). Returns the names removed."""
    prefix = f".{store.name}{STAGING_INFIX}"
    names = [n for n in store.sibling_names(prefix) if _SAVE_ID.fullmatch(n[len(prefix):])]
    if not names:
        return []
    record = read_owner(store, REPLACE_RECORD)
    removed = []
    for name in names:
        if record is not None and record.staged == name:
            continue  # the replacement's business (rolled forward, or live)
        sibling = store.sibling(name)
        owner = read_owner(sibling, MARKER)
        if owner is None:
            if all(k.startswith(MARKER) for k in sibling.list()):
                continue  # empty, or a claim being made right now
        elif not liveness.is_dead(owner, last_heartbeat(sibling, owner.save_id)):
            continue
        remove_staging(sibling)
        removed.append(name)
        log.info("ucp_zarr: removed the staging copy %s of a dead save", sibling.url)
    return removed


def target_store(store: Store, staged: str | None) -> Store:
    """Where a save writes, given the coordinator's :attr:`Transaction.staged`."""
    return store if staged is None else store.sibling(staged)


def describe_claim(store: Store) -> dict[str, Any] | None:
    """The owner marker of an incomplete checkpoint, as plain data (for ``ucp-zarr info``)."""
    owner = read_owner(store, MARKER)
    return None if owner is None else asdict(owner)
