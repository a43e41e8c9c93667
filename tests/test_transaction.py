"""The save transaction (ucp_zarr.protocol.transaction), unit-tested on a real local store wrapped in
a recording, crash-injecting store, with a liveness judge that declares chosen saves dead.

The claims under test:
* two saves never both own a path; a live owner is never disturbed; a dead one's leftovers
  are reclaimed exactly once, by one newcomer (also when the newcomer dies mid-takeover);
* a commit never replaces a committed root, and only the current owner commits;
* an overwrite crashed at ANY operation leaves the old or the new checkpoint complete and
  findable (never a mix), and the next save rolls it forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _faulty import Crash, FaultyStore, Judge, Log

from ucp_zarr.errors import CheckpointExistsError, IncompleteCheckpointError, NotACheckpointError, OwnershipError
from ucp_zarr.format.documents import dump_document
from ucp_zarr.format.commit_record import CheckpointMeta
from ucp_zarr.protocol.owned import Owned, OwnedArray
from ucp_zarr.io.local import LocalStore
from ucp_zarr.protocol.liveness import HEARTBEAT, MARKER, OWNED, REPLACE_RECORD, TAKEOVER, Fence, read_owner
from ucp_zarr.protocol.transaction import Transaction, committed_store


def _store(tmp_path: Path, name: str = "ck", log: Log | None = None) -> FaultyStore:
    return FaultyStore(LocalStore(str(tmp_path / name)), log)


def _owned(objects) -> Owned:
    """What a save of ``objects`` (``<group>/<array>/c/<i>`` keys) owns: one 1-d array per
    ``<group>/<array>``, of one-element shards, and the group and array documents."""
    arrays: dict[str, int] = {}
    for key in objects:
        path, _, index = key.rpartition("/c/")
        arrays[path] = max(arrays.get(path, 0), int(index) + 1)
    docs = sorted({f"{p.split('/')[0]}/zarr.json" for p in arrays} | {f"{p}/zarr.json" for p in arrays})
    return Owned(tuple(docs), tuple(OwnedArray(p, (n,), (1,)) for p, n in sorted(arrays.items())))


def _txn(store, judge: Judge | None = None, objects=(), **kw) -> Transaction:
    """A transaction of a save that will write ``objects``."""
    return Transaction(store, liveness=judge or Judge(), lease_s=3600, owned=_owned(objects), **kw)


def _save(txn: Transaction, objects: dict[str, bytes], root: bytes) -> None:
    """What a save does: claim (unless done), write its objects, commit."""
    if not txn.claimed:
        txn.owned = _owned(objects)
        txn.begin()
    for key, data in objects.items():
        txn.target.write(key, [data])
    txn.commit(root)


def _root(tag: str, objects=()) -> bytes:
    """A commit record (tagged ``tag``) of a checkpoint of ``objects``: what it owns is what
    the transaction deletes when it is replaced."""
    owned = _owned(objects)
    meta = CheckpointMeta(
        tensors={}, values={"tag": tag}, created="now", library="test", save_id="0" * 32,
        documents={d: "sha256:" + "0" * 64 for d in owned.documents},
        consolidated={
            a.path: {"node_type": "array", "shape": list(a.shape), "chunk_grid": {"configuration": {"chunk_shape": [1]}}}
            for a in owned.arrays
        },
    )
    return dump_document(meta.to_zarr_json())


def _content(store) -> dict[str, bytes]:
    """What a reader sees: the committed checkpoint's objects (protocol files excluded)."""
    ck = committed_store(store)
    return {k: ck.read(k) for k in ck.list() if not k.startswith(".ucp_zarr")}


OLD = {"a/x/c/0": b"old-a", "b/y/c/0": b"old-b", "only-old/z/c/0": b"old-z"}
NEW = {"a/x/c/0": b"new-a", "b/y/c/0": b"new-b", "only-new/w/c/0": b"new-w"}


def test_a_live_owner_is_never_disturbed(tmp_path):
    store = _store(tmp_path)
    a = _txn(store)
    a.begin()
    a.target.write("a/x/c/0", [b"a's data"])
    b = _txn(_store(tmp_path))
    # (in one process: the message says it runs in another thread)
    with pytest.raises(OwnershipError, match=f"being written by save {a.save_id}.*a save of this process that has "
                                             "not ended.*overwrite_incomplete=True if none runs"):
        b.begin()
    assert store.read("a/x/c/0") == b"a's data"  # nothing of a's was touched
    a.commit(_root("a"))
    assert _content(store)["zarr.json"] == _root("a")


class _Outage(FaultyStore):
    """Storage that goes down at the first operation ``at`` (an object put in place, written),
    until told otherwise."""

    down: list[bool] = []
    at = "adopt"

    def _op(self, name: str, key: str = "") -> None:
        if name == self.at and self.down == []:
            self.down.append(True)
        if self.down == [True]:
            raise OSError(f"injected: the storage is down ({name} {key})")
        super()._op(name, key)


def test_an_overwrite_whose_storage_fails_once_the_old_record_is_gone_has_succeeded(tmp_path):
    """Storage failing while an overwrite's staging copy is put in place, after the old commit
    record was deleted (readers follow the replace record to the new checkpoint from then on):
    the save raised though its checkpoint was the one at the path, and, marking itself aborted
    failing too, its live-looking replace record refused every later save of this process
    ("being replaced by ... of process <this one>"). The save has succeeded; the next save of
    this process finishes the replacement and goes on."""
    _save(_txn(_store(tmp_path)), OLD, _root("old", OLD))
    outage = _Outage(LocalStore(str(tmp_path / "ck")))
    outage.down = []
    _save(_txn(outage, overwrite=True), NEW, _root("new", NEW))  # (returns: no error)
    assert outage.down == [True]  # (the storage did fail under it)
    outage.down.append(False)  # (back)
    store = _store(tmp_path)
    assert REPLACE_RECORD in store.child_names()
    assert _content(store)["zarr.json"] == _root("new", NEW)
    _save(_txn(store, overwrite=True), OLD, _root("again", OLD))
    assert _content(store) == {**OLD, "zarr.json": _root("again", OLD)}
    assert REPLACE_RECORD not in store.child_names()


def test_a_claim_this_process_could_not_withdraw_is_taken_at_once(tmp_path):
    """A save whose storage failed after its claim, and failed again when the claim was to be
    given back: this process's next save at the path was refused until the process ended (its
    own claim looked alive: "which is still alive"). No thread here renews that claim any more:
    the next save takes it over at once."""
    outage = _Outage(LocalStore(str(tmp_path / "ck")))
    outage.down, outage.at = [], "write"
    txn = _txn(outage)
    txn.begin()
    with pytest.raises(OSError, match="injected"):
        outage.write("a/x/c/0", [b"data"])
    with pytest.raises(OSError, match="injected"):
        txn.abort()
    outage.down.append(False)  # (back)
    store = _store(tmp_path)
    assert read_owner(store, MARKER).save_id == txn.save_id
    _save(_txn(store), NEW, _root("new", NEW))
    assert _content(store) == {**NEW, "zarr.json": _root("new", NEW)}


def test_a_committed_root_is_never_replaced(tmp_path):
    store = _store(tmp_path)
    _save(_txn(store), OLD, _root("old", OLD))
    with pytest.raises(CheckpointExistsError, match="already committed"):
        _txn(store).begin()
    # a stale owner that somehow reaches its commit cannot replace the root either
    stale = _txn(_store(tmp_path, "other"))
    stale.begin()
    stale.target.inner.create_exclusive("zarr.json", _root("someone else"))
    with pytest.raises(OwnershipError, match="committed by another save"):
        stale.commit(_root("stale"))
    assert stale.target.read("zarr.json") == _root("someone else")


def test_dead_owner_is_taken_over_and_its_leftovers_removed(tmp_path):
    judge = Judge()
    store = _store(tmp_path)
    dead = _txn(store, judge, objects=["a/x/c/0"])
    dead.begin()
    dead.target.write("a/x/c/0", [b"half"])
    dead._stop_heartbeat()  # the process died
    judge.dead.add(dead.save_id)
    with pytest.raises(IncompleteCheckpointError):
        committed_store(store)
    new = _txn(_store(tmp_path), judge)
    new.begin()
    assert read_owner(store, MARKER).save_id == new.save_id
    assert store.list() == sorted([MARKER, HEARTBEAT + new.save_id, OWNED + new.save_id])  # leftovers gone
    _save(new, NEW, _root("new", NEW))
    assert _content(store) == {**NEW, "zarr.json": _root("new", NEW)}


def test_takeover_whose_taker_died_is_taken_over_in_turn(tmp_path):
    judge = Judge()
    store = _store(tmp_path)
    victim = _txn(store, judge)
    victim.begin()
    victim._stop_heartbeat()
    judge.dead.add(victim.save_id)
    # a newcomer claims the takeover of the victim, and dies right after
    taker = _txn(_store(tmp_path), judge)
    taker._stop_heartbeat()
    taker.target.create_exclusive(TAKEOVER + victim.save_id, taker.me.to_bytes())
    # while the taker is alive, nobody else may take over
    other = _txn(_store(tmp_path), judge)
    with pytest.raises(OwnershipError, match="taking over"):
        other.begin()
    judge.dead.add(taker.save_id)
    other.begin()
    assert read_owner(store, MARKER).save_id == other.save_id
    assert not any(k.startswith(TAKEOVER) for k in store.list())


def test_overwrite_incomplete_takes_over_a_live_owner_which_then_cannot_commit(tmp_path):
    store = _store(tmp_path)
    stale = _txn(store, objects=["a/x/c/0"])
    stale.begin()
    stale.target.write("a/x/c/0", [b"stale"])
    fence = Fence(stale.target, stale.save_id, interval_s=0)
    fence.check()
    forced = _txn(_store(tmp_path), overwrite_incomplete=True)
    forced.begin()
    with pytest.raises(OwnershipError, match=f"save {stale.save_id} lost its claim"):
        fence.check()  # the stale writer stops at its next object
    _save(forced, NEW, _root("forced"))
    with pytest.raises(OwnershipError, match="lost its claim"):
        stale.commit(_root("stale"))  # the re-check before committing
    stale._stop_heartbeat()
    assert _content(store) == {**NEW, "zarr.json": _root("forced")}


def test_abort_marks_the_save_dead_and_keeps_the_path_incomplete(tmp_path):
    store = _store(tmp_path)
    txn = _txn(store, objects=["a/x/c/0"])
    txn.begin()
    txn.target.write("a/x/c/0", [b"x"])
    txn.abort()
    with pytest.raises(IncompleteCheckpointError):
        committed_store(store)
    assert [k for k in store.list() if not k.startswith(".ucp_zarr")] == []
    # the same (live) process may save there again at once: an aborted save is dead
    again = _txn(_store(tmp_path))
    _save(again, OLD, _root("again"))
    assert _content(store)["zarr.json"] == _root("again")


def test_empty_and_foreign_directories(tmp_path):
    with pytest.raises(NotACheckpointError):
        committed_store(_store(tmp_path, "nothing"))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        _txn(_store(tmp_path, "foreign")).begin()
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def _overwrite_ops(tmp_path: Path) -> int:
    """How many mutating operations an overwrite of a committed checkpoint takes."""
    log = Log()
    store = _store(tmp_path / "count", log=log)
    _save(_txn(store), OLD, _root("old", OLD))
    start = log.mutations
    txn = _txn(_store(tmp_path / "count", log=log), overwrite=True)
    txn.begin()
    _save(txn, NEW, _root("new", NEW))
    assert _content(store) == {**NEW, "zarr.json": _root("new", NEW)}
    return log.mutations - start


def test_overwrite_crashed_at_every_operation_leaves_old_or_new(tmp_path):
    """The crash-safety claim of overwrite=True, exhaustively: crash at operation k for every
    k; a reader always finds the old or the new checkpoint, complete; the next save (after
    the crashed one is recognised as dead) rolls the replacement forward or starts over."""
    total = _overwrite_ops(tmp_path)
    assert total > 10
    seen = {"old": 0, "new": 0}
    for k in range(total):
        base = tmp_path / f"k{k}"
        log = Log()
        judge = Judge()
        store = _store(base, log=log)
        _save(_txn(store, judge), OLD, _root("old", OLD))
        log.crash_at = log.mutations + k
        txn = _txn(_store(base, log=log), judge, overwrite=True)
        with pytest.raises(Crash):
            txn.begin()
            _save(txn, NEW, _root("new", NEW))
        txn._stop_heartbeat()
        judge.dead.add(txn.save_id)
        seen_now = _content(store)
        assert seen_now in ({**OLD, "zarr.json": _root("old", OLD)}, {**NEW, "zarr.json": _root("new", NEW)}), (k, log.ops[-3:])
        seen["old" if seen_now["zarr.json"] == _root("old", OLD) else "new"] += 1
        # the next save onto the path: finishes a replacement whose staged copy is complete
        nxt = _txn(_store(base), judge, overwrite=True)
        nxt.begin()
        assert not (base / "ck").joinpath(REPLACE_RECORD).exists()
        third = {"a/x/c/0": b"third"}
        _save(nxt, third, _root("third", third))
        assert _content(store) == {**third, "zarr.json": _root("third", third)}
        siblings = sorted(p.name for p in base.iterdir())
        assert siblings[-1] == "ck" and all(s.startswith(".ck.ucp_zarr-") for s in siblings[:-1]), siblings
    assert seen["old"] > 0 and seen["new"] > 0  # crashes hit both sides of the switch


def test_an_overwrite_keeps_the_other_files_of_the_directory(tmp_path) -> None:
    """Replacing a committed checkpoint deletes only the old checkpoint's objects: a config,
    a tokenizer folder or a file named like a shard elsewhere stay (they were deleted)."""
    import torch

    import ucp_zarr

    ck = tmp_path / "ck"
    ucp_zarr.save({"w": torch.ones(3), "b": {"x": torch.ones(2)}}, ck)
    others = {"config.json": "{}", "tokenizer/vocab.txt": "a b", "notes/c/0": "not a shard", "w/README": "mine"}
    for name, text in others.items():
        (ck / name).parent.mkdir(parents=True, exist_ok=True)
        (ck / name).write_text(text)
    ucp_zarr.save({"w": torch.zeros(3)}, ck, overwrite=True)
    assert {n: (ck / n).read_text() for n in others} == others
    assert torch.equal(ucp_zarr.open(ck).read("w"), torch.zeros(3)) and "b.x" not in ucp_zarr.open(ck)
    assert not (ck / "b").exists() or not any((ck / "b").rglob("*.json"))


def test_a_commit_whose_acknowledgement_is_lost_stays_whole(tmp_path, monkeypatch):
    """The commit record's create lands, then fails (a response lost after the server stored
    it, an EIO from the fsync after the link). The save aborted and deleted its shards under
    the record in place: latest() named a step whose data was gone. Now the save reads the
    record back: in place, it is committed; unreadable, nothing of it is deleted."""
    import torch

    import ucp_zarr

    real = LocalStore.create_exclusive

    def landed_then_failed(self, key, data):
        real(self, key, data)
        if key == "zarr.json":
            raise OSError(5, "Input/output error (injected after the create landed)")

    monkeypatch.setattr(LocalStore, "create_exclusive", landed_then_failed)
    ucp_zarr.save({"w": torch.arange(4.0)}, tmp_path / "ck")  # committed: its record is in place
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][:], torch.arange(4.0))

    def unreadable(self, key, data):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(LocalStore, "holds", unreadable)
    with pytest.raises(Exception, match="injected after the create landed"):
        ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck2")
    monkeypatch.undo()
    assert torch.equal(ucp_zarr.open(tmp_path / "ck2")["w"][:], torch.ones(3))  # (whole: nothing was deleted)
