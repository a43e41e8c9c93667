"""A save deletes only what it owns (issue 18, data loss).

Regressions, each reproduced on the code before the fix:
* an overwrite, an abort, a takeover and retention deleted every object whose name looked
  like the format's (a checkpoint nested in a subfolder lost its root ``zarr.json``);
* a save that claimed a path just after another save committed it aborted, deleting the
  committed checkpoint;
* a save in another PID namespace on the same host was judged dead by ``/proc`` and taken
  over while alive;
* ``file://`` URLs and local paths given with ``storage_options`` went through fsspec's
  check-then-write "exclusive" create; stores without exclusive create were not refused;
* staging siblings of crashed overwrites were never collected;
* array documents were written beside their data, so a Zarr reader saw fill values.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import Judge
from test_concurrent_saves import Backend, Save

import ucp_zarr
from ucp_zarr.errors import CheckpointExistsError, OwnershipError
from ucp_zarr.ops.steps import collect_staging_copies
from ucp_zarr.io.factory import open_store
from ucp_zarr.io.fsspec import FsspecStore
from ucp_zarr.io.local import LocalStore
from ucp_zarr.protocol.liveness import MARKER, Liveness, Owner, host_identity, process_alive, process_start
from ucp_zarr.protocol.transaction import Transaction


def _state(value: float) -> dict:
    return {"w": torch.full((8, 16), value), "b": {"x": torch.full((5,), value)}, "step": int(value)}


def _assert_holds(path, value: float) -> None:
    ck = ucp_zarr.open(path)
    ck.verify()
    assert torch.equal(ck.read("w"), torch.full((8, 16), value)) and ck.metadata["step"] == int(value)


def _nested(run: Path) -> dict[str, float]:
    """Put a manager root, a plain nested checkpoint and a foreign Zarr group inside ``run``."""
    import numpy as np
    import zarr

    with ucp_zarr.CheckpointManager(run / "steps") as manager:
        manager.save(1, _state(1.0))
        manager.save(2, _state(2.0))
    ucp_zarr.save(_state(7.0), run / "sub" / "ck")
    group = zarr.open_group(str(run / "foreign"), mode="w")
    group.create_array("a", data=np.arange(6, dtype="float32"))
    (run / "notes.txt").write_text("mine")
    return {"steps/step_00000001": 1.0, "steps/step_00000002": 2.0, "sub/ck": 7.0}


def _assert_nested_intact(run: Path, nested: dict[str, float]) -> None:
    import numpy as np
    import zarr

    for rel, value in nested.items():
        _assert_holds(run / rel, value)
    assert np.array_equal(zarr.open_array(str(run / "foreign" / "a"))[:], np.arange(6, dtype="float32"))
    assert (run / "notes.txt").read_text() == "mine"
    with ucp_zarr.CheckpointManager(run / "steps") as manager:  # retention keeps every step
        assert manager.steps() == [1, 2]


def test_an_overwrite_keeps_checkpoints_nested_inside_it(tmp_path):
    run = tmp_path / "run"
    ucp_zarr.save(_state(3.0), run)
    nested = _nested(run)
    ucp_zarr.save(_state(4.0), run, overwrite=True)
    ucp_zarr.save({"w": torch.full((8, 16), 5.0), "step": 5}, run, overwrite=True)  # "b" goes away
    _assert_holds(run, 5.0)
    assert "b.x" not in ucp_zarr.open(run) and not (run / "x").exists()
    _assert_nested_intact(run, nested)


def test_a_failed_overwrite_keeps_checkpoints_nested_inside_it(tmp_path, monkeypatch):
    import ucp_zarr.protocol.saver as saver

    run = tmp_path / "run"
    ucp_zarr.save(_state(3.0), run)
    nested = _nested(run)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saver, "write_shard", fail)
    with pytest.raises(OSError, match="disk full"):
        ucp_zarr.save(_state(4.0), run, overwrite=True)
    monkeypatch.undo()
    _assert_holds(run, 3.0)
    _assert_nested_intact(run, nested)
    assert not list(tmp_path.glob(".run.ucp_zarr-*"))  # the aborted staging copy is gone


def test_an_abort_and_a_takeover_keep_what_the_dead_save_did_not_write(tmp_path, monkeypatch):
    """A save that fails (or dies) deletes only its own objects, even when a checkpoint
    appeared in a subfolder of its path meanwhile."""
    import ucp_zarr.protocol.saver as saver

    run = tmp_path / "run"
    original = saver.PreparedSave._write_documents
    nested: dict[str, float] = {}

    def nest_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.target.url != str(run):  # (a nested save)
            return
        monkeypatch.setattr(saver.PreparedSave, "_write_documents", original)
        nested.update(_nested(run))  # written while the save holds the path
        raise OSError("the commit never happens")

    monkeypatch.setattr(saver.PreparedSave, "_write_documents", nest_then_fail)
    with pytest.raises(OSError, match="commit never happens"):
        ucp_zarr.save(_state(3.0), run)
    monkeypatch.undo()
    assert not (run / "w").exists() and not (run / "x").exists() and not (run / "zarr.json").exists()  # its own objects: gone
    _assert_nested_intact(run, nested)
    # the aborted save's marker stays; the next save takes the path over
    assert (run / MARKER).exists()
    ucp_zarr.save(_state(4.0), run, overwrite_incomplete=True)
    _assert_holds(run, 4.0)
    _assert_nested_intact(run, nested)


def test_retention_keeps_a_checkpoint_nested_in_a_deleted_step(tmp_path):
    root = tmp_path / "steps"
    with ucp_zarr.CheckpointManager(root, keep_last=1) as manager:
        manager.save(1, _state(1.0))
        ucp_zarr.save(_state(9.0), root / "step_00000001" / "eval" / "ck")
        (root / "step_00000001" / "eval" / "scores.json").write_text("{}")
        manager.save(2, _state(2.0))
        assert manager.steps() == [2]
    _assert_holds(root / "step_00000001" / "eval" / "ck", 9.0)
    assert (root / "step_00000001" / "eval" / "scores.json").read_text() == "{}"
    assert not (root / "step_00000001" / "zarr.json").exists() and not (root / "step_00000001" / "w").exists()


# --- a save that claims a path just committed by another -----------------------------------------


class _CommitsOnClaim(LocalStore):
    """A store where another save commits right before this save's marker is created: the
    window in which two racing saves met (the loser won the marker of a committed path)."""

    def __init__(self, root: str, other: Transaction, root_doc: bytes) -> None:
        super().__init__(root)
        self.other, self.root_doc = other, root_doc

    def create_exclusive(self, key: str, data: bytes) -> None:
        if key == MARKER and self.other is not None:
            other, self.other = self.other, None
            other.commit(self.root_doc)
        super().create_exclusive(key, data)


def test_a_save_that_claims_a_path_committed_meanwhile_never_touches_it(tmp_path):
    ucp_zarr.save(_state(1.0), tmp_path / "template")
    root_doc = (tmp_path / "template" / "zarr.json").read_bytes()
    for overwrite in (False, True):
        ck = tmp_path / f"ck-{overwrite}"
        winner = Transaction(LocalStore(str(ck)), lease_s=60)
        winner.begin()
        shutil.copytree(tmp_path / "template", ck, dirs_exist_ok=True)  # what the winner writes
        (ck / "zarr.json").unlink()
        loser = Transaction(_CommitsOnClaim(str(ck), winner, root_doc), lease_s=60, overwrite=overwrite)
        if overwrite:
            loser.begin()  # gives the marker back and claims a staging sibling instead
            assert loser.staged is not None
            loser.abort()
        else:
            with pytest.raises(CheckpointExistsError):
                loser.begin()
        _assert_holds(ck, 1.0)
        assert not (ck / MARKER).exists()


def _racer(index: int, paths: list[str], barrier, results) -> None:
    import torch

    import ucp_zarr

    torch.set_num_threads(1)
    for path in paths:
        barrier.wait()
        try:
            ucp_zarr.save({"w": torch.full((64, 64), float(index)), "step": index}, path, chunk_bytes=4096)
            results.put((path, index, "ok"))
        except ucp_zarr.CheckpointError as e:
            results.put((path, index, type(e).__name__))


@pytest.mark.parametrize("races", [pytest.param(16, id="16"), pytest.param(400, id="400", marks=pytest.mark.long)])
def test_racing_saves_never_lose_the_winners_checkpoint(tmp_path, races):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    paths = [str(tmp_path / f"p{i}") for i in range(races)]
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(i, paths, barrier, results)) for i in (1, 2)]
    for p in procs:
        p.start()
    outcome: dict[str, dict[int, str]] = {}
    for _ in range(2 * races):
        path, index, what = results.get(timeout=300)
        outcome.setdefault(path, {})[index] = what
    for p in procs:
        p.join(60)
    for path in paths:
        won = [i for i, what in outcome[path].items() if what == "ok"]
        assert len(won) == 1, (path, outcome[path])
        ck = ucp_zarr.open(path)
        ck.verify()
        assert torch.equal(ck.read("w"), torch.full((64, 64), float(won[0]))), (path, outcome[path])


# --- liveness across PID namespaces -----------------------------------------------------------------


def test_an_owner_in_another_pid_namespace_is_judged_by_its_lease_only():
    host, boot, ns = host_identity()
    gone = Liveness((host, boot, ns), alive=lambda pid, start: False, clock=lambda: 1000.0)
    here = Owner("a" * 32, host, boot, 12345, 1, 900.0, 60.0, pid_ns=ns)
    elsewhere = Owner("b" * 32, host, boot, 12345, 1, 900.0, 60.0, pid_ns="pid:[1]")
    unknown = Owner("c" * 32, host, boot, 12345, 1, 900.0, 60.0, pid_ns="")
    assert gone.is_dead(here, renewed=990.0)  # same namespace: its process is gone
    assert not gone.is_dead(elsewhere, renewed=990.0)  # its process cannot be seen: lease fresh
    assert not gone.is_dead(unknown, renewed=990.0)
    assert gone.is_dead(elsewhere, renewed=930.0) and gone.is_dead(unknown, renewed=None)  # lease expired


def test_an_owner_is_alive_while_its_writer_process_is():
    host, boot, ns = host_identity()
    writer_alive = Liveness((host, boot, ns), alive=lambda pid, start: pid == 222, writers_exit_s=0.2)
    owner = Owner("a" * 32, host, boot, 111, 1, 900.0, 60.0, pid_ns=ns, writers=((222, 5),))
    assert not writer_alive.is_dead(owner, renewed=None)  # its own process is gone, its writer is not (yet)
    exits: list[int] = []
    writer_exits = Liveness((host, boot, ns), alive=lambda pid, start: pid == 222 and len(exits.append(1) or exits) < 5)
    assert writer_exits.is_dead(owner, renewed=None) and len(exits) == 5  # waited for it
    assert Owner.from_bytes(owner.to_bytes(), "test") == owner  # (the marker keeps it)
    assert "writer process 222" in owner.describe()
    assert Liveness((host, boot, ns), alive=lambda pid, start: False).is_dead(owner, renewed=None)


def test_a_zombie_process_is_dead():
    """A process that exited but is not reaped yet (as an orphan under a PID 1 that never
    reaps) writes nothing more: its saves can be taken over."""
    proc = subprocess.Popen(["true"])
    start = process_start(proc.pid)
    deadline = time.monotonic() + 10
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not process_alive(proc.pid, start) and not process_alive(proc.pid, None)
    finally:
        proc.wait()
    assert process_alive(os.getpid(), process_start(os.getpid()))


def _unshare() -> tuple[str, ...]:
    cmd = ("unshare", "--pid", "--fork", "--mount-proc")
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("unshare --pid is not permitted here (needs root or user namespaces)")
    return cmd


def test_a_live_save_in_another_pid_namespace_is_never_taken_over(tmp_path):
    backend = Backend("local", str(tmp_path), None)
    url = backend.url()
    first = Save(tmp_path, backend, url, 1.0, pause=True, wrap=_unshare())
    first.wait_paused()
    try:
        with pytest.raises(OwnershipError, match="still alive"):
            ucp_zarr.save(_state(2.0), url)
    finally:
        first.go()
    assert first.outcome()["ok"]
    ck = ucp_zarr.open(url)
    ck.verify()
    assert ck.metadata["step"] == 1


# --- stores that cannot create exclusively --------------------------------------------------------


def test_local_file_systems_always_use_the_local_store(tmp_path):
    for url in (str(tmp_path / "a"), f"file://{tmp_path}/b"):
        assert isinstance(open_store(url), LocalStore)
    with pytest.raises(ValueError, match="storage_options.*do not apply to the local path"):
        open_store(f"file://{tmp_path}/c", {"auto_mkdir": True})
    with pytest.raises(ValueError, match="storage_options"):
        ucp_zarr.save(_state(1.0), tmp_path / "d", storage_options={"anon": True})


def test_racing_exclusive_creates_have_one_winner(tmp_path):
    for make in (lambda i: LocalStore(str(tmp_path / f"l{i}")), lambda i: open_store(f"memory://race-{os.getpid()}/m{i}")):
        for i in range(50):
            store = make(i)
            won: list[int] = []
            start = threading.Barrier(4)

            def claim(n: int) -> None:
                start.wait()
                try:
                    store.create_exclusive(MARKER, str(n).encode())
                    won.append(n)
                except FileExistsError:
                    pass

            threads = [threading.Thread(target=claim, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(won) == 1 and store.read(MARKER) == str(won[0]).encode()


def test_a_store_without_exclusive_create_is_refused_unless_the_risk_is_taken(tmp_path):
    url = f"simplecache::memory://nonexclusive-{os.getpid()}/ck"
    # (a cache folder of the test's own: one fsspec made would be removed whenever its
    # filesystem is collected, maybe in a later test's forked child that forbids writes)
    options = {"simplecache": {"cache_storage": str(tmp_path / "cache")}}
    store = open_store(url, options)
    assert isinstance(store, FsspecStore) and not store.exclusive_create
    with pytest.raises(OwnershipError, match="unsafe_non_exclusive_store=True"):
        ucp_zarr.save(_state(1.0), url, storage_options=options)
    ucp_zarr.save(_state(1.0), f"memory://nonexclusive-{os.getpid()}/ok")  # memory:// creates exclusively
    ucp_zarr.save(_state(2.0), url, unsafe_non_exclusive_store=True, storage_options=options)


# --- staging siblings of crashed overwrites ---------------------------------------------------------


def _crashed_overwrite(path: Path, judge: Judge) -> str:
    """An overwrite of the committed checkpoint at ``path`` that died while writing its staging copy."""
    txn = Transaction(LocalStore(str(path)), liveness=judge, overwrite=True, lease_s=60)
    txn.begin()
    txn.target.write("w/w/c/0/0", [b"half a checkpoint"])
    txn._stop_heartbeat()
    judge.dead.add(txn.save_id)
    assert txn.staged is not None and (path.parent / txn.staged).is_dir()
    return txn.staged


def test_the_next_save_removes_a_dead_overwrites_staging_copy(tmp_path):
    judge = Judge()
    ck = tmp_path / "ck"
    ucp_zarr.save(_state(1.0), ck)
    staged = _crashed_overwrite(ck, judge)
    live = Transaction(LocalStore(str(ck)), liveness=Judge(), overwrite=True, lease_s=60)
    live.begin()  # a live overwrite's staging copy is never collected
    Transaction(LocalStore(str(ck)), liveness=judge, overwrite=True, lease_s=60).begin()
    assert not (tmp_path / staged).exists() and (tmp_path / live.staged).is_dir()
    live.abort()
    _assert_holds(ck, 1.0)


def test_a_killed_overwrite_leaves_a_staging_copy_that_the_manager_collects(tmp_path):
    root = tmp_path / "root"
    with ucp_zarr.CheckpointManager(root) as manager:
        manager.save(1, _state(1.0))
    backend = Backend("local", str(tmp_path), None)
    step = str(root / "step_00000001")
    killed = Save(tmp_path, backend, step, 2.0, pause=True, overwrite=True)
    killed.wait_paused()
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(30)
    assert list(root.glob(".step_00000001.ucp_zarr-*"))
    assert collect_staging_copies(open_store(root)) and not list(root.glob(".step_00000001.ucp_zarr-*"))
    killed = Save(tmp_path, backend, step, 3.0, pause=True, overwrite=True)
    killed.wait_paused()
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(30)
    with ucp_zarr.CheckpointManager(root) as manager:
        manager.save(2, _state(2.0))  # retention collects the dead overwrite's copy
        assert manager.steps() == [1, 2]
    assert not list(root.glob(".step_*.ucp_zarr-*"))
    _assert_holds(root / "step_00000001", 1.0)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_claim_whose_records_cannot_be_written_is_given_back(tmp_path, monkeypatch, overwrite):
    """A save that claimed its path (or staging sibling) but could not record what it will
    write (the store failed right after the claim) raises and gives the claim back: no lease
    left renewing, no record left, and the next save there works at once. Before, the marker
    of a live save stayed, its lease renewed by a thread for the life of the process, and
    every later save there was refused."""
    from ucp_zarr.protocol.liveness import OWNED

    ck = tmp_path / "ck"
    if overwrite:
        ucp_zarr.save(_state(1.0), ck)
    leases = {t for t in threading.enumerate() if t.name == "ucp_zarr-heartbeat"}
    write_atomic = LocalStore.write_atomic

    def failing(self: LocalStore, key: str, data: bytes) -> None:
        if key.startswith(OWNED):
            raise OSError("injected: the store failed right after the claim")
        write_atomic(self, key, data)

    monkeypatch.setattr(LocalStore, "write_atomic", failing)
    with pytest.raises(Exception, match="injected"):
        ucp_zarr.save(_state(2.0), ck, overwrite=overwrite)
    monkeypatch.setattr(LocalStore, "write_atomic", write_atomic)
    assert {t for t in threading.enumerate() if t.name == "ucp_zarr-heartbeat"} <= leases
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")], list(tmp_path.rglob("*"))
    if overwrite:
        _assert_holds(ck, 1.0)
    ucp_zarr.save(_state(3.0), ck, overwrite=overwrite)
    _assert_holds(ck, 3.0)


@pytest.mark.parametrize("failing", ["record", "adopt"])
def test_an_overwrite_that_fails_while_put_in_place_leaves_the_path_to_the_next_save(tmp_path, monkeypatch, failing):
    """A store failing while an overwrite puts its committed staging copy in place: creating
    the replace record fails the save, and readers find the old checkpoint; a copy back, after
    the old commit record is gone (readers find the new one through the record) does not: the
    save has succeeded (a save that raises never leaves its checkpoint in place: before, it
    raised). The next save at the path (this process's own: a manager or Lightning saving the
    same name again) finishes the replacement or collects the copy, and goes on at once.
    Before, the replace record named a live process: every later save there was refused until
    it ended."""
    from ucp_zarr.protocol.liveness import REPLACE_RECORD

    ck = tmp_path / "ck"
    ucp_zarr.save(_state(1.0), ck)
    name = {"record": "create_exclusive"}.get(failing, failing)
    original = getattr(LocalStore, name)
    calls = [0]

    def fails(self: LocalStore, *args: Any) -> Any:
        calls[0] += 1
        if (failing == "adopt" and calls[0] == 2) or (failing == "record" and args[0] == REPLACE_RECORD):
            raise OSError(f"injected: {failing} failed")
        return original(self, *args)

    monkeypatch.setattr(LocalStore, name, fails)
    if failing == "record":
        with pytest.raises(Exception, match="injected"):
            ucp_zarr.save(_state(2.0), ck, overwrite=True)
    else:
        ucp_zarr.save(_state(2.0), ck, overwrite=True)
    monkeypatch.setattr(LocalStore, name, original)
    _assert_holds(ck, 1.0 if failing == "record" else 2.0)
    ucp_zarr.save(_state(3.0), ck, overwrite=True)
    _assert_holds(ck, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("failing", ["marker", "replace record", "staging copy"])
def test_a_save_whose_records_cannot_be_removed_after_its_commit_succeeds(tmp_path, monkeypatch, caplog, failing):
    """Once a save's commit record is in place at its path the save has succeeded: a store
    failing afterwards, while the save removes its own records (a new path's marker; an
    overwrite's replace record or staging copy), is logged, and the save returns, so that a
    save that raises never leaves its checkpoint committed (the caller would take the path
    for unchanged, or retry). What is left is marked aborted: the next save at the path
    (this process's own) removes it and goes on at once. Before, the save raised with the new
    checkpoint committed, and a new path's marker named a live process."""
    from ucp_zarr.protocol.liveness import REPLACE_RECORD

    ck = tmp_path / "ck"
    overwrite = failing != "marker"
    if overwrite:
        ucp_zarr.save(_state(1.0), ck)
    name, key = {"marker": ("delete", MARKER), "replace record": ("delete", REPLACE_RECORD)}.get(failing, ("remove", None))
    original = getattr(LocalStore, name)

    def fails(self: LocalStore, *args: Any) -> Any:
        if key is None or args[0] == key:
            raise OSError(f"injected: {failing} not removed")
        return original(self, *args)

    monkeypatch.setattr(LocalStore, name, fails)
    with caplog.at_level("WARNING", logger="ucp_zarr"):
        ucp_zarr.save(_state(2.0), ck, overwrite=overwrite)
    monkeypatch.setattr(LocalStore, name, original)
    assert f"injected: {failing} not removed" in caplog.text and "is committed" in caplog.text
    _assert_holds(ck, 2.0)
    ucp_zarr.save(_state(3.0), ck, overwrite=True)
    _assert_holds(ck, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("fail_at", [None, 1, 3])
@pytest.mark.parametrize("shapes", [((64, 64), (64,)), ((64,), (8, 8)), ((), (4,))], ids=["2d-1d", "1d-2d", "0d-1d"])
def test_an_overwrite_may_change_a_tensors_number_of_dims(tmp_path, monkeypatch, shapes, fail_at):
    """An overwrite whose tensor has another number of dims puts shards ``c/0`` where the old
    checkpoint had folders ``c/0/`` (or the reverse): the old shards in the way go first. Also
    when the storage fails while the overwrite puts its copy in place (the ``fail_at``-th copy
    back, after the old commit record is gone: the save has succeeded, and says so in a warning)
    the next save rolls it forward and completes. Before: IsADirectoryError (or "a file is in
    the way") after the old commit record was gone, at every later save: the path stuck."""
    first, second = shapes
    ck = tmp_path / "ck"
    small = {"chunk_bytes": 256, "shard_bytes": 1024}
    ucp_zarr.save({"x": torch.randn(first)}, ck, **small)
    new = torch.randn(second)
    if fail_at is not None:
        adopt, calls = LocalStore.adopt, [0]

        def failing(self: LocalStore, *args: Any) -> None:
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError("injected: a copy back failed")
            adopt(self, *args)

        monkeypatch.setattr(LocalStore, "adopt", failing)
        ucp_zarr.save({"x": new}, ck, overwrite=True, **small)
        monkeypatch.setattr(LocalStore, "adopt", adopt)
        assert torch.equal(ucp_zarr.read_state_dict(ck)["x"], new)  # (through the replace record)
        new = torch.randn(first)
        ucp_zarr.save({"x": new}, ck, overwrite=True, **small)
    else:
        ucp_zarr.save({"x": new}, ck, overwrite=True, **small)
    ucp_zarr.open(ck).verify()
    assert torch.equal(ucp_zarr.read_state_dict(ck)["x"], new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and not [p for p in ck.iterdir() if p.name.startswith(".")]
    import zarr

    assert zarr.open_array(str(ck / "x" / "x"))[...].shape == tuple(new.shape)


def test_an_overwrite_whose_staging_copy_cannot_be_removed_leaves_it_to_the_next_save(tmp_path, monkeypatch):
    """An overwrite failing before its commit removes its staging copy; where that removal
    fails too, the copy is marked aborted, and the next save at the path collects it (before:
    it named a live process and stayed until the process ended)."""
    import ucp_zarr.protocol.saver as saver

    ck = tmp_path / "ck"
    ucp_zarr.save(_state(1.0), ck)
    write_shard, remove = saver.write_shard, LocalStore.remove

    def broken(*args: Any, **kwargs: Any) -> bytes:
        raise OSError("injected: disk full")

    def cannot_remove(self: LocalStore) -> None:
        raise OSError("injected: cannot remove")

    monkeypatch.setattr(saver, "write_shard", broken)
    monkeypatch.setattr(LocalStore, "remove", cannot_remove)
    with pytest.raises(Exception, match="disk full"):
        ucp_zarr.save(_state(2.0), ck, overwrite=True)
    monkeypatch.setattr(saver, "write_shard", write_shard)
    monkeypatch.setattr(LocalStore, "remove", remove)
    assert len(list(tmp_path.glob(".ck.ucp_zarr-*"))) == 1
    _assert_holds(ck, 1.0)
    ucp_zarr.save(_state(3.0), ck, overwrite=True)
    _assert_holds(ck, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_takeover_that_fails_leaves_the_leftovers_to_the_next_save(tmp_path, monkeypatch):
    """A save taking over a dead save's leftovers whose store fails meanwhile raises and
    withdraws its takeover record: the next save (this process's own) takes over at once.
    Before, the record named a live process: every later save there was refused ("is taking
    over the leftovers ... right now") until it ended."""
    from ucp_zarr.protocol.liveness import read_owner

    judge = Judge()
    ck = tmp_path / "ck"
    dead = Transaction(LocalStore(str(ck)), liveness=judge, lease_s=60)
    dead.begin()
    dead._stop_heartbeat()
    judge.dead.add(dead.save_id)
    delete_many = LocalStore.delete_many

    def failing(self: LocalStore, keys: Any) -> None:
        raise OSError("injected: the store failed during the takeover")

    monkeypatch.setattr(LocalStore, "delete_many", failing)  # (deleting the dead save's records)
    with pytest.raises(OSError, match="injected"):
        Transaction(LocalStore(str(ck)), liveness=judge, lease_s=60).begin()
    monkeypatch.setattr(LocalStore, "delete_many", delete_many)
    nxt = Transaction(LocalStore(str(ck)), liveness=judge, lease_s=60)
    nxt.begin()
    assert nxt.claimed and read_owner(LocalStore(str(ck)), MARKER).save_id == nxt.save_id
    assert not list(ck.glob(".ucp_zarr_takeover.*"))
    nxt.abort(wrote=False)


def test_a_deletion_that_fails_is_resumed_by_the_next_at_once(tmp_path, monkeypatch):
    """Retention whose store fails mid-deletion raises; the next deletion of that step (this
    process's own: the next retention) resumes it at once. Before, the failed deletion's
    record named a live process, so every later one skipped the step until it ended."""
    from ucp_zarr.ops.steps import delete_step

    ck = tmp_path / "step_00000001"
    ucp_zarr.save(_state(1.0), ck)
    delete_many = LocalStore.delete_many

    def failing(self: LocalStore, keys: Any) -> None:
        raise OSError("injected: the store failed mid-deletion")

    monkeypatch.setattr(LocalStore, "delete_many", failing)
    with pytest.raises(OSError, match="injected"):
        delete_step(open_store(ck))
    monkeypatch.setattr(LocalStore, "delete_many", delete_many)
    assert delete_step(open_store(ck))
    assert not ck.exists()


def test_a_reader_lease_that_cannot_be_deleted_neither_fails_the_load_nor_blocks_retention(tmp_path, monkeypatch, caplog):
    """A manager's load whose reader lease the store fails to delete afterwards returns the
    filled state dict (the failure is logged), and the lease counts as released: the next
    retention of that step (this process's own) deletes it. Before, the load raised after
    filling the state dict, and the lease named a live reader until the process ended."""
    from ucp_zarr.ops.steps import READER, delete_step

    delete = LocalStore.delete

    def failing(self: LocalStore, key: str) -> None:
        if key.startswith(READER):
            raise OSError("injected: the lease is not deleted")
        delete(self, key)

    with ucp_zarr.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, _state(1.0))
        target = _state(0.0)
        monkeypatch.setattr(LocalStore, "delete", failing)
        with caplog.at_level("WARNING", logger="ucp_zarr"):
            manager.load(1, target)
        monkeypatch.setattr(LocalStore, "delete", delete)
        assert torch.equal(target["w"], torch.full((8, 16), 1.0)) and "the lease is not deleted" in caplog.text
        step = tmp_path / "run" / "step_00000001"
        assert [p.name for p in step.iterdir() if p.name.startswith(READER)]
        assert delete_step(open_store(step))
        assert not step.exists()


# --- what a generic Zarr reader sees during a save --------------------------------------------------


def test_a_zarr_reader_never_reads_fill_values_for_data_not_yet_written(tmp_path, monkeypatch):
    """While a save runs, every array zarr-python finds holds its final bytes."""
    import numpy as np
    import zarr

    import ucp_zarr.io.arrayio as arrayio
    import ucp_zarr.protocol.saver as saver

    original = arrayio.write_shard

    def slow_write_shard(*args, **kwargs):
        time.sleep(0.01)
        return original(*args, **kwargs)

    monkeypatch.setattr(saver, "write_shard", slow_write_shard)
    ck = tmp_path / "ck"
    sd = {f"t{i}": torch.full((16, 16), float(i + 1)) for i in range(40)}
    done = threading.Event()
    seen: list[str] = []
    wrong: list[str] = []

    def poll() -> None:
        while not done.is_set():
            for i in range(40):
                try:
                    data = zarr.open_array(str(ck / f"t{i}" / f"t{i}"), mode="r")[:]
                except Exception:  # not there (yet): fine
                    continue
                seen.append(f"t{i}")
                if not np.array_equal(data, np.full((16, 16), float(i + 1), dtype="float32")):
                    wrong.append(f"t{i}")

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        ucp_zarr.save(sd, ck, max_workers=1)
    finally:
        done.set()
        poller.join()
    assert seen, "the reader never found an array (the test polled too late)"
    assert not wrong, f"a Zarr reader read fill values for {sorted(set(wrong))[:5]}"


def test_a_save_never_writes_through_a_symbolic_link_inside_its_path(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    ck = tmp_path / "ck"
    ucp_zarr.save(_state(1.0), ck)
    shutil.rmtree(ck / "w")
    (ck / "w").symlink_to(outside)
    with pytest.raises(ucp_zarr.NotACheckpointError, match="symbolic link inside the checkpoint"):
        ucp_zarr.save(_state(2.0), ck, overwrite=True)
    assert not any(outside.iterdir())
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # the path itself may be a link
    ucp_zarr.save(_state(3.0), tmp_path / "link" / "ck")
    _assert_holds(tmp_path / "real" / "ck", 3.0)


_DIE_COMMITTING = """
import os, sys, torch, ucp_zarr
link = os.link
def dying_link(src, dst, *a, **k):
    if dst == os.path.join(sys.argv[1], "zarr.json"):  # the commit record, its temporary copy written
        os._exit(9)
    return link(src, dst, *a, **k)
os.link = dying_link
ucp_zarr.save({"w": torch.ones(4, 4)}, sys.argv[1])
"""


def test_a_save_killed_while_committing_leaves_nothing_that_blocks_the_path(tmp_path):
    """A local exclusive create writes the commit record to a temporary file, then links it
    into place; a save killed in between left ``zarr.json.tmp-<hex>``, which the next save
    or the manager's clean-up kept, and a later save at the path was refused (the path 'is
    not empty and holds no ucp_zarr checkpoint')."""
    ck = tmp_path / "ck"
    died = subprocess.run([sys.executable, "-c", _DIE_COMMITTING, str(ck)], capture_output=True)
    assert died.returncode == 9, died.stderr.decode()[-2000:]
    assert any(n.startswith("zarr.json.tmp-") for n in os.listdir(ck))
    ucp_zarr.save(_state(2.0), ck)  # takes the dead save's claim over
    _assert_holds(ck, 2.0)
    assert not [n for n in os.listdir(ck) if ".tmp-" in n]

    alone = tmp_path / "alone"  # what the manager's clean-up of a dead step left: the temporary copy alone
    alone.mkdir()
    shutil.copy(next(p for p in ck.iterdir() if p.name == "zarr.json"), alone / f"zarr.json.tmp-{'a' * 32}")
    ucp_zarr.save(_state(3.0), alone)
    _assert_holds(alone, 3.0)
    assert sorted(os.listdir(alone)) == sorted(n for n in os.listdir(ck))


def test_the_objects_of_a_record_without_consolidated_metadata(tmp_path: Path) -> None:
    """What a commit record owns, where its root holds no consolidated copy of the arrays'
    documents (older checkpoints): every array's grid is read from its own document, no
    group's (a group holds no shard; an overwrite on a distant store read 32 of them one
    after another), and the shards found are those of the consolidated record."""
    import json

    from ucp_zarr.protocol.owned import Owned

    state = {f"layer{i % 3}.w{i}": torch.randn(8, 4) for i in range(6)} | {"opt": {"m": torch.randn(5)}}
    path = tmp_path / "ck"
    ucp_zarr.save(state, str(path))
    raw = (path / "zarr.json").read_bytes()
    full = Owned.from_commit_record(raw, "root")
    bare = json.loads(raw)
    del bare["consolidated_metadata"]
    store, asked = LocalStore(str(path)), []
    owned = Owned.from_commit_record(json.dumps(bare).encode(), "root", lambda key: asked.append(key) or store.read(key))
    arrays = {a.path for a in full.arrays}
    assert owned == full and len(arrays) == 7
    assert sorted(k.removesuffix("/zarr.json") for k in asked) == sorted(arrays)
    assert set(full.documents) > set(asked)  # (the groups' documents are owned, and not read)


def test_a_live_claim_of_another_thread_is_never_taken_over(tmp_path, monkeypatch):
    """Two saves of one path in two threads of one process, the first claim's lease slow to
    start (its first renewal a slow request): the second save is refused and the first
    commits. (A claim of this process counts as held while its transaction runs: judged by
    the threads renewing leases, the second save took a live claim over.)"""
    from ucp_zarr.protocol.liveness import HEARTBEAT

    write, slowed = LocalStore.write_atomic, []

    def slow(self: LocalStore, key: str, data: bytes) -> None:
        if key.startswith(HEARTBEAT) and not slowed:
            slowed.append(key)
            time.sleep(1.0)
        write(self, key, data)

    monkeypatch.setattr(LocalStore, "write_atomic", slow)
    ck, said = tmp_path / "ck", {}

    def save(name: str, value: float, delay: float) -> None:
        time.sleep(delay)
        try:
            ucp_zarr.save(_state(value), ck)
            said[name] = "ok"
        except ucp_zarr.CheckpointError as e:
            said[name] = str(e)

    threads = [threading.Thread(target=save, args=a) for a in (("first", 1.0, 0.0), ("second", 2.0, 0.4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert said["first"] == "ok" and "a save of this process that has not ended" in said["second"], said
    _assert_holds(ck, 1.0)


def test_an_overwrite_whose_old_record_is_gone_but_its_delete_failed_has_succeeded(tmp_path, monkeypatch):
    """The old commit record unlinked, then the directory's fsync failing (EIO): the save raised,
    though readers found the new checkpoint through the replace record. It has succeeded."""
    import errno

    ck = tmp_path / "ck"
    ucp_zarr.save(_state(1.0), ck)
    delete, failed = LocalStore.delete, []

    def failing(self: LocalStore, key: str) -> None:
        delete(self, key)
        if key == "zarr.json" and not failed:
            failed.append(key)
            raise OSError(errno.EIO, "injected: the directory's fsync failed")

    monkeypatch.setattr(LocalStore, "delete", failing)
    ucp_zarr.save(_state(2.0), ck, overwrite=True)
    assert failed
    monkeypatch.setattr(LocalStore, "delete", delete)
    _assert_holds(ck, 2.0)
    ucp_zarr.save(_state(3.0), ck, overwrite=True)
    _assert_holds(ck, 3.0)
