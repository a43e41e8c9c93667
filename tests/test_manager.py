"""The CheckpointManager: retention, crash safety of latest() under SIGKILL, async pipelining
and error surfacing, the interval advisor in the loop, listings, and a loopback S3 server."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable

import pytest
import torch
from _manager_jobs import (
    CHUNK_BYTES,
    SHARD_BYTES,
    crash_state,
    delete_crashing,
    empty_state,
    hold_lease,
    interrupted_save,
    overwrite_dying,
    save_until_killed,
    vanish,
)

import ucp_zarr.protocol.saver
from ucp_zarr.errors import CheckpointError
from ucp_zarr.ops import CheckpointManager, StepGoneError, list_steps, optimal_interval, parse_step, step_name, steps_to_delete
from ucp_zarr.ops.steps import DELETING, READER, ReadLease, scan, step_store
from ucp_zarr.protocol.owned import Owned
from ucp_zarr.io.factory import open_store
from ucp_zarr.io.local import LocalStore
from ucp_zarr.protocol.liveness import Owner
from ucp_zarr.protocol.transaction import Transaction

KILL_TRIALS = int(os.environ.get("UCP_ZARR_MANAGER_KILL_TRIALS", "20"))


def _save(m: CheckpointManager, step: int, **kwargs: Any) -> Any:
    return m.save(step, crash_state(step), chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES, **kwargs)


def _assert_loads(m: CheckpointManager, step: int) -> None:
    """``step`` loads completely and bit-exactly."""
    state = empty_state()
    m.load(step, state)
    want = crash_state(step)
    for key in want["model"]:
        assert torch.equal(state["model"][key], want["model"][key]), (step, key)
    assert torch.equal(state["optim"]["m"], want["optim"]["m"]), step
    assert state["step"] == step and state["optim"]["step"] == step


def _folders(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if parse_step(n) is not None)


def _context() -> Any:
    """Children forked from a server that imported torch once and holds no threads (a child
    forked from this process would inherit its thread pools in a broken state)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ucp_zarr.api", "_manager_jobs"])  # no-op once the server runs
    return ctx


def _in_child(fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` in a child that exits without any clean-up (as a killed process);
    exit code 7 when ``fn`` raised the injected Crash, 0 when it returned."""
    p = _context().Process(target=vanish, args=(fn, *args))
    p.start()
    p.join(60)
    assert p.exitcode in (0, 7), p.exitcode
    return p.exitcode


# --- naming and policy -------------------------------------------------------------------------


def test_step_names(tmp_path):
    assert step_name(100) == "step_00000100" and parse_step("step_00000100") == 100
    assert step_name(123456789) == "step_123456789" and parse_step("step_123456789") == 123456789
    for foreign in ("step_100", "step_000000100", "step_0000010a", "step_00000100.bak", ".step_00000001.ucp_zarr-ab", "x"):
        assert parse_step(foreign) is None, foreign
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError, match="non-negative integer"):
            step_name(bad)
    m = CheckpointManager(tmp_path)
    _save(m, 7)
    (tmp_path / "step_7").mkdir()  # foreign names are ignored
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "step_00000009.bak").mkdir()
    assert m.steps() == [7] and m.latest() == 7
    assert [i.step for i in list_steps(tmp_path)] == [7]


def test_retention_policy():
    assert steps_to_delete(range(1, 11), keep_last=3) == [1, 2, 3, 4, 5, 6, 7]
    assert steps_to_delete(range(1, 11), keep_last=3, keep_every=4) == [1, 2, 3, 5, 6, 7]
    assert steps_to_delete(range(1, 11), keep_last=None, keep_every=4) == []  # keep all
    assert steps_to_delete(range(1, 11), keep_last=2, protected={1, 5}) == [2, 3, 4, 6, 7, 8]
    assert steps_to_delete([5, 3, 9], keep_last=1) == [3, 5]  # never the newest
    assert steps_to_delete([], keep_last=1) == []
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_last must be None or a positive integer"):
            steps_to_delete([1], keep_last=bad)
        with pytest.raises(ValueError, match="keep_every"):
            CheckpointManager("unused", keep_every=bad)


# --- retention on disk ---------------------------------------------------------------------------


def test_keep_last_and_keep_every(tmp_path):
    seen = []
    m = CheckpointManager(tmp_path, keep_last=3, keep_every=4, on_saved=seen.append)
    for step in range(1, 11):
        _save(m, step, async_save=step % 2 == 0)
    m.wait()
    assert m.steps() == [4, 8, 9, 10] and m.latest() == 10
    assert _folders(tmp_path) == [step_name(s) for s in (4, 8, 9, 10)]  # deleted folders are gone
    for step in m.steps():
        _assert_loads(m, step)
    history = m.history()
    assert [h.step for h in history] == list(range(1, 11)) and seen == history
    assert sorted(s for h in history for s in h.deleted) == [1, 2, 3, 5, 6, 7]
    assert all(h.bytes > 64 * 128 * 4 and h.objects >= 4 and 0 < h.blocking_s <= h.total_s for h in history)
    assert [h.async_save for h in history] == [s % 2 == 0 for s in range(1, 11)]
    m.close()
    with pytest.raises(CheckpointError, match="closed"):
        _save(m, 11)


def test_never_the_newest_nor_the_step_just_saved(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    _save(m, 5)
    _save(m, 3)  # an older step after a roll-back: kept (just saved), and so is the newest
    assert m.steps() == [3, 5] and m.latest() == 5
    _save(m, 6)
    assert m.steps() == [6]


def test_never_a_step_being_read(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1)
    _save(m, 1)
    with ReadLease(step_store(LocalStore(str(tmp_path)), 1)):  # a live reader (this process)
        _save(m, 2)
        _save(m, 3)
        assert m.steps() == [1, 3]
        assert [(i.step, i.readers) for i in list_steps(tmp_path)] == [(1, 1), (3, 0)]
    _save(m, 4)
    assert m.steps() == [4]
    # a reader that died holding its lease protects nothing
    _in_child(hold_lease, str(tmp_path / step_name(4)))
    assert any(n.startswith(READER) for n in os.listdir(tmp_path / step_name(4)))
    _save(m, 5)
    assert m.steps() == [5] and _folders(tmp_path) == [step_name(5)]
    # a reader backs off from a step a live deleter works on, and from a deleted one
    store = step_store(LocalStore(str(tmp_path)), 5)
    store.create_exclusive(DELETING, Owner.this_process(uuid.uuid4().hex, 60.0).to_bytes())
    with pytest.raises(StepGoneError, match="being deleted"):
        m.load(5, empty_state())
    assert not any(n.startswith(READER) for n in os.listdir(tmp_path / step_name(5)))  # lease released
    store.delete(DELETING)
    _assert_loads(m, 5)
    with pytest.raises(StepGoneError, match="no committed checkpoint"):
        m.load(4, empty_state())


def test_interrupted_saves_of_dead_owners_are_cleaned_live_ones_kept(tmp_path):
    root = str(tmp_path)
    m = CheckpointManager(root, keep_last=2)
    _save(m, 1)
    _in_child(interrupted_save, root, 2)
    live = Transaction(step_store(LocalStore(root), 3), owned=Owned(("g/a/zarr.json",)))
    live.begin()
    live.target.write("g/a/zarr.json", [b"{}"])
    assert [(i.step, i.state, i.committed) for i in list_steps(root)] == [
        (1, "committed", True), (2, "interrupted", False), (3, "writing", False)
    ]
    assert list_steps(root)[1].owner["pid"] != os.getpid() and list_steps(root)[2].owner["pid"] == os.getpid()
    assert m.steps() == [1] and m.latest() == 1
    _save(m, 4)
    assert _folders(root) == [step_name(s) for s in (1, 3, 4)]  # the dead one's leftovers are gone
    live.abort()  # (an aborted save is dead)
    _save(m, 5)
    assert _folders(root) == [step_name(s) for s in (4, 5)]
    # a dead save's leftovers in the step being saved are taken over
    _in_child(interrupted_save, root, 6)
    assert list_steps(root)[-1].state == "interrupted"
    _save(m, 6)
    _assert_loads(m, 6)


def test_a_step_whose_overwrite_died_is_still_retired(tmp_path):
    """A step whose overwrite was killed while its staging copy was put in place: retention
    skipped it for good (its replace record stays until a save of that very step, which a run
    that moved on never makes), so keep_last=1 kept it and its full staging copy forever,
    saying nothing. Retention finishes the dead overwrite, as the next save there would, and
    then deletes the step."""
    root = str(tmp_path)
    m = CheckpointManager(root)
    _save(m, 1)
    _save(m, 2)
    _in_child(overwrite_dying, root, 2, 2)
    assert any(n.startswith(f".{step_name(2)}.") for n in os.listdir(root))  # (its staging copy)
    m = CheckpointManager(root, keep_last=1)
    for step in (3, 4):
        metrics = _save(m, step)
        assert metrics.retention_error is None, metrics.retention_error
    assert sorted(os.listdir(root)) == [step_name(4)] and metrics.deleted == (3,)
    _assert_loads(m, 4)


def test_a_file_named_like_a_step_stops_no_retention(tmp_path):
    """A file named like a step in the root (``step_00000001``: not the manager's) failed every
    retention at it: the interrupted save of step 3 was never cleaned, and ``deleted`` said
    () though steps had been deleted. The file is left alone, the rest done and reported."""
    root = str(tmp_path)
    (tmp_path / step_name(1)).write_text("someone's notes")
    (tmp_path / step_name(2)).mkdir()  # (an empty step folder: a save of another process may have just made it)
    _in_child(interrupted_save, root, 3)
    m = CheckpointManager(root, keep_last=1)
    deleted = [(_save(m, s).deleted, m.history()[-1].retention_error) for s in (4, 5)]
    assert deleted == [((), None), ((4,), None)]
    assert sorted(os.listdir(root)) == [step_name(1), step_name(2), step_name(5)]
    assert (tmp_path / step_name(1)).read_text() == "someone's notes"


def test_a_step_retention_cannot_delete_stops_no_other(tmp_path, monkeypatch):
    """One step's deletion failing (here step 1's) stopped the retention there and lost the
    list of the steps it had deleted: each is tried, and the metrics say both."""
    import ucp_zarr.ops.manager as manager

    keep_all = CheckpointManager(str(tmp_path))
    _save(keep_all, 1)
    _save(keep_all, 2)
    m = CheckpointManager(str(tmp_path), keep_last=1)
    delete = manager.delete_step

    def failing(store: Any, **kwargs: Any) -> bool:
        if store.url.endswith(step_name(1)):
            raise OSError("injected: permission denied")
        return delete(store, **kwargs)

    monkeypatch.setattr(manager, "delete_step", failing)
    metrics = _save(m, 3)
    assert metrics.deleted == (2,) and "deleting step 1: OSError: injected: permission denied" in metrics.retention_error
    assert _folders(str(tmp_path)) == [step_name(1), step_name(3)]


def test_deletion_crash_points(tmp_path):
    """A deleter killed at each of its mutating storage operations in turn: the step is
    either still committed and complete, or not committed; the next retention finishes."""
    k = 0
    while True:
        root = str(tmp_path / f"k{k}")
        m = CheckpointManager(root, keep_last=1)
        _save(m, 1)
        m2 = CheckpointManager(root)  # no retention: keeps step 1
        _save(m2, 2)
        code = _in_child(delete_crashing, os.path.join(root, step_name(1)), k)
        if 1 in m.steps():
            _assert_loads(m, 1)
        assert m.latest() == 2
        _save(m, 3)
        assert _folders(root) == [step_name(3)], k
        if code == 0:  # the deletion ran to its end: every crash point was visited
            break
        k += 1
    assert k >= 3  # the record, the commit record, the rest


def test_latest_under_sigkill_at_random_points(tmp_path):
    """A training loop saving through the manager (keep_last=2, every other save async) is
    SIGKILLed at a random moment, again and again, each time resuming with load_latest:
    every committed step must load completely and bit-exactly, whatever the kill interrupted
    (a save, a retention deletion, a load under its reader lease). One trial in four kills
    during the start (the load); the others after it, within 0.4 s, except one in four up to
    2 s after it: the first background save of a process starts its writer process, which
    on a loaded 2-core machine takes longer than 0.4 s, and the steps must still advance."""
    root = str(tmp_path / "ckpt")
    seed = int(os.environ.get("UCP_ZARR_SEED", "11"))
    print(f"seed {seed}, {KILL_TRIALS} trials")
    rng = random.Random(seed)
    ctx = _context()
    states: dict[str, int] = {}
    latest = []
    for trial in range(KILL_TRIALS):
        ready = ctx.Event()
        p = ctx.Process(target=save_until_killed, args=(root, 2, ready))
        p.start()
        if trial % 4 == 0:
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            assert ready.wait(60)
            time.sleep(rng.uniform(0.0, 0.4) if trial % 4 != 3 else rng.uniform(0.4, 2.0))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, (trial, p.exitcode)
        for folder in scan(LocalStore(root)):
            states[folder.state] = states.get(folder.state, 0) + 1
        m = CheckpointManager(root)
        latest.append(m.latest())
        for step in m.steps():
            _assert_loads(m, step)
        m.close()
    print(f"latest after each kill: {latest}; step folders seen after kills by state: {states}")
    committed = [s for s in latest if s is not None]
    assert committed and committed[-1] > 2 and committed == sorted(committed), latest
    m = CheckpointManager(root, keep_last=2)
    _save(m, committed[-1] + 1)
    # (an empty step folder may be left: a deletion killed before its last rmdir; retention leaves empty folders,
    # which a save of another process may have just made)
    left = [(i.step, i.state) for i in list_steps(root) if not i.committed and os.listdir(i.path)]
    assert not left and len(m.steps()) == 2, (left, m.steps())


# --- async saves --------------------------------------------------------------------------------


def test_async_saves_pipeline(tmp_path, monkeypatch):
    go = threading.Event()
    finish = ucp_zarr.protocol.saver.PreparedSave.finish

    def gated(self: Any, comm: Any = None) -> Any:
        assert go.wait(30)
        return finish(self, comm)

    monkeypatch.setattr(ucp_zarr.protocol.saver.PreparedSave, "finish", gated)
    m = CheckpointManager(tmp_path, keep_last=1)
    state = crash_state(1)
    fut = m.save(1, state, async_save=True)
    assert not fut.done() and m.steps() == [] and m.latest() is None  # training goes on meanwhile
    for t in state["model"].values():
        t.add_(1)  # the save holds its own copy
    go.set()
    _save(m, 2, async_save=True)
    assert fut.done() and fut.result().step == 1  # the next save waited for the previous one
    assert m.wait().step == 2 and m.wait() is None
    assert m.steps() == [2]
    _assert_loads(m, 2)
    assert [h.step for h in m.history()] == [1, 2] and m.history()[1].deleted == (1,)


@pytest.mark.parametrize("surface", ["save", "wait", "latest", "close"])
def test_async_error_surfaces_on_the_next_call(tmp_path, monkeypatch, surface):
    m = CheckpointManager(tmp_path, keep_last=3)
    _save(m, 1)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ucp_zarr.protocol.saver.PreparedSave, "_write_data", fail)
    fut = _save(m, 2, async_save=True)
    fut.exception(timeout=30)  # failed in the background ...
    monkeypatch.undo()
    with pytest.raises(OSError, match="injected"):  # ... and surfaces on the next call
        if surface == "save":
            _save(m, 3)
        else:
            getattr(m, surface)()
    if surface == "close":
        return
    assert m.latest() == 1  # raised once; the failed step is not committed
    _save(m, 4)
    assert m.steps() == [1, 4] and _folders(tmp_path) == [step_name(1), step_name(4)]  # its leftovers removed


def test_an_async_error_is_raised_on_every_rank_by_the_same_collective_call(tmp_path):
    """On 2 gloo ranks, a failed background save's error is raised by ``load`` and by
    ``load_latest`` on every rank, whichever rank saw the failure first, and the job goes on
    (both ranks save the next step). Before, a rank whose save had already failed raised
    before the load's collective while the other waited in it (until the process group's
    timeout), and after ``load_latest`` only rank 0 had taken the error: rank 1 raised it
    again from its next save, leaving rank 0 in the save's collectives."""
    from _dist import run
    from _manager_jobs import async_error_on_collective_calls

    run(2, async_error_on_collective_calls, str(tmp_path / "root"), str(tmp_path / "out"), timeout_s=30)
    got = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert got[0][:3] == got[1][:3] == ["load: SaveError", "load_latest: SaveError", "latest 3"]
    # rank 0 took the next failure from latest() alone: the next save raised on both ranks (rank 0 was
    # left in the save's collectives until the timeout), and the job went on
    assert got[0][3:] == ["latest: SaveError", "save 5: SaveError", "latest 6"], got[0]
    assert got[1][3:] == ["save 5: SaveError", "latest 6"], got[1]


def test_a_manager_made_before_the_process_group_is_one_of_every_rank(tmp_path):
    """Made before ``init_process_group``, a manager took each rank for a job of one: each
    decided alone when to save (steps 169 and 141 here), the first to decide alone in the
    save's collectives."""
    import torch.multiprocessing as mp
    from _dist import free_port
    from _manager_jobs import manager_made_before_init

    mp.start_processes(manager_made_before_init, args=(2, free_port(), str(tmp_path / "root"), str(tmp_path / "out")),
                       nprocs=2, start_method="spawn", join=True)
    got = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert got[0] == got[1] and got[0]["steps"] == [got[0]["first"]]


# --- the interval advisor in the loop -------------------------------------------------------------


def test_should_save_fixed_and_adaptive(tmp_path):
    m = CheckpointManager(tmp_path / "a", every_n_steps=5)
    assert [s for s in range(1, 21) if m.should_save(s)] == [5, 10, 15, 20]

    m = CheckpointManager(tmp_path / "b", mtbf_s=3600.0, save_cost_s=20.0)
    interval = optimal_interval(20.0, 3600.0)
    assert m.interval_s() == pytest.approx(interval)
    first = next(s for s in range(1, 1000) if m.should_save(s, step_time_s=10.0))
    assert first == math.ceil(interval / 10)  # the first call counts one step
    _save(m, first)  # measured: far cheaper than the 20 s estimate
    assert m.save_cost_s == pytest.approx(20.0 + 0.3 * (m.history()[0].blocking_s - 20.0))
    shorter = m.interval_s()
    assert shorter == pytest.approx(optimal_interval(m.save_cost_s, 3600.0)) and shorter < interval
    second = next(s for s in range(first, 10_000) if m.should_save(s, step_time_s=10.0))
    assert second == first + math.ceil(shorter / 10)
    assert not m.should_save(first, step_time_s=10.0)  # never at or before the last save

    # without an estimate the first call saves (to measure the cost); step times are measured
    m = CheckpointManager(tmp_path / "c", failures_per_node_day=1.0, nodes=8)
    assert m.mtbf_s == pytest.approx(10800.0)
    assert m.should_save(1) and m.interval_s() is None
    _save(m, 1)
    for s in range(2, 5):
        time.sleep(0.05)
        assert not m.should_save(s)
    assert 0.04 <= m.step_time_s <= 0.5
    m.load(1, empty_state())
    assert not m.should_save(1)


def test_manager_arguments(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        CheckpointManager(tmp_path, every_n_steps=5, mtbf_s=100.0)
    with pytest.raises(ValueError, match="every_n_steps must be None or a positive integer"):
        CheckpointManager(tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match="nodes is missing"):
        CheckpointManager(tmp_path, failures_per_node_day=2.0)
    with pytest.raises(ValueError, match="method must be one of"):
        CheckpointManager(tmp_path, mtbf_s=100.0, method="guess")
    with pytest.raises(CheckpointError, match="needs every_n_steps or a failure rate"):
        CheckpointManager(tmp_path).should_save(1)
    m = CheckpointManager(tmp_path)
    assert m.latest() is None and m.steps() == [] and m.load_latest(empty_state()) is None
    _save(m, 1)
    with pytest.raises(CheckpointError, match="already committed"):
        _save(m, 1)


# --- listing -----------------------------------------------------------------------------------


def test_list_steps_without_torch(tmp_path):
    root = str(tmp_path)
    m = CheckpointManager(root)
    _save(m, 1)
    _save(m, 2)
    _in_child(interrupted_save, root, 3)
    code = (
        "import json, sys; from ucp_zarr.ops import list_steps; "
        f"infos = list_steps({root!r}); assert 'torch' not in sys.modules, 'torch imported'; "
        "print(json.dumps([i.to_json() for i in infos]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    infos = json.loads(out.stdout)
    assert [(i["step"], i["state"], i["committed"]) for i in infos] == [(1, "committed", True), (2, "committed", True), (3, "interrupted", False)]
    want = crash_state(1)
    nbytes = sum(t.numel() * t.element_size() for t in (*want["model"].values(), want["optim"]["m"]))
    assert infos[0]["nbytes"] == nbytes and infos[0]["tensors"] == 3 and infos[0]["world_size"] == 1
    assert infos[0]["layout"] == [] and infos[0]["created"] and infos[0]["path"].endswith(step_name(1))
    assert infos[2]["nbytes"] is None and infos[2]["owner"]["host"]


# --- loopback S3 ---------------------------------------------------------------------------------


def test_on_loopback_s3(seaweed):
    url = f"s3://objstore/{uuid.uuid4().hex[:8]}/run"
    options = seaweed.storage_options()
    m = CheckpointManager(url, storage_options=options, keep_last=1)
    assert m.latest() is None and m.load_latest(empty_state()) is None
    _save(m, 1)
    _save(m, 2, async_save=True)
    m.wait()
    assert m.steps() == [2] and m.latest() == 2
    store = open_store(url, options)
    assert sorted({k.split("/")[0] for k in store.list()}) == [step_name(2)]  # step 1 is gone
    with ReadLease(step_store(store, 2)):  # a reader holds step 2, which keep_last=1 would delete
        _save(m, 3, async_save=True)
        m.wait()
    assert m.steps() == [2, 3]
    m.close()
    assert [(i.step, i.state) for i in list_steps(url, storage_options=options)] == [(2, "committed"), (3, "committed")]
    resumed = CheckpointManager(url, storage_options=options, keep_last=1)
    state = empty_state()
    assert resumed.load_latest(state) == 3
    for key, want in crash_state(3)["model"].items():
        assert torch.equal(state["model"][key], want)
    assert state["step"] == 3 and state["optim"]["step"] == 3
    _assert_loads(resumed, 2)
    _save(resumed, 4)
    assert resumed.steps() == [4]
    assert all(k.startswith(step_name(4) + "/") for k in store.list())  # no lease, claim or record left behind


def test_a_wait_interrupted_by_a_signal_keeps_the_failed_saves_error(tmp_path, monkeypatch) -> None:
    """A preemption handler raising from a signal while wait() waits (or save() waits for the
    save before) dropped the save in flight: its failure was never raised by any later call,
    close() included ('its error ... never vanishes')."""
    from ucp_zarr.io.local import LocalStore

    real = LocalStore.write

    def failing(self, key, buffers, guard=None):
        if "step_00000001" in self.url and "/c/" in key:
            time.sleep(1.0)
            raise OSError(5, "Input/output error (injected)")
        return real(self, key, buffers, guard)

    class Preempted(Exception):
        pass

    def preempt(signum, frame):
        raise Preempted()

    monkeypatch.setattr(LocalStore, "write", failing)
    m = CheckpointManager(tmp_path / "run", keep_last=2)
    m.save(1, {"w": torch.ones(64)}, async_save=True, writer="thread")
    old = signal.signal(signal.SIGALRM, preempt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Preempted):
            m.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(Exception, match="injected"):
        m.close()


def test_a_save_older_than_the_newest_step_warns(tmp_path) -> None:
    """After a rollback to step 20 of a root holding 30, the new run's steps are older than
    30: latest() and load_latest() name 30 and retention keeps it over them (documented);
    the save now says so, instead of a crash resuming the abandoned run without a word."""
    m = CheckpointManager(tmp_path / "run", keep_last=2)
    for step in (10, 20, 30):
        m.save(step, {"w": torch.full((2,), float(step))})
    with pytest.warns(UserWarning, match=r"saved step 22 under .* newer steps \[30\]: .* latest\(\)"):
        m.save(22, {"w": torch.ones(2)})
    assert m.latest() == 30
    m.close()
