"""Crash consistency, measured: ranks of a real 4-process save are SIGKILLed at random
points, and the checkpoints on disk must stay trustworthy.

Each trial saves generation ``n`` with 4 processes, either onto a new path beside the
previous checkpoint or onto the previous checkpoint itself with ``overwrite=True``, and
kills one random rank: at a random mutating storage operation of that rank (which covers
every write, the claim, the commit and the overwrite's replacement), or after a random
delay. The surviving ranks are then killed too, as a launcher tears a job down. After
every trial:

* the previous committed checkpoint loads bit-exactly (or, when it was being overwritten,
  the path holds either it or the new one, complete and bit-exact: never a mix);
* the interrupted checkpoint is never opened or loaded as complete: ``open`` raises
  IncompleteCheckpointError / NotACheckpointError, or it is complete and verifies;
* a new save onto the same path afterwards works (the dead owner is recognised as dead).

``UCP_ZARR_KILL_TRIALS`` sets the number of trials (CI: 16); ``-m long`` runs 200.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _crash_job import WORLD, full_state, worker

import ucp_zarr

TRIALS = int(os.environ.get("UCP_ZARR_KILL_TRIALS", "16"))
LONG_TRIALS = 200


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ucp_zarr", "_crash_job"])
    return ctx


def _run_job(ctx: Any, spec: dict[str, Any], timeout: float = 60) -> list[int | None]:
    """Run the 4 ranks; once one dies or all finish, kill the rest. Returns exit codes."""
    port = _port()
    procs = [ctx.Process(target=worker, args=(r, port, spec)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.01)
    for p in procs:
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)  # the launcher tears the job down
            except ProcessLookupError:  # it exited meanwhile
                pass
        p.join()
    return [p.exitcode for p in procs]


def _check_complete(path: Path, generations: set[int]) -> int:
    """The checkpoint at ``path`` is complete, verifies, and is exactly one of ``generations``."""
    ck = ucp_zarr.open(path)
    ck.verify()
    gen = ck.metadata["step"]
    assert gen in generations, (gen, generations)
    want = full_state(gen)
    out = {"w": torch.zeros_like(want["w"]), "f": torch.zeros_like(want["f"]), "rng": torch.zeros(2, dtype=torch.int64), "step": -1}
    ucp_zarr.load(out, path)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["f"], want["f"]) and out["step"] == gen
    assert out["rng"].tolist() == [gen, 0]
    return gen


def _state_of(path: Path) -> str:
    try:
        ucp_zarr.open(path)
    except (ucp_zarr.IncompleteCheckpointError, ucp_zarr.NotACheckpointError):
        return "incomplete"
    return "complete"


def _trials(tmp_path: Path, n: int) -> dict[str, int]:
    rng = random.Random(20261202)
    ctx = _context()
    tally = {"trials": 0, "killed": 0, "by_ops": 0, "by_timer": 0, "overwrite": 0,
             "left_old": 0, "left_new": 0, "left_incomplete": 0, "redone": 0}
    base = tmp_path / "prev"
    ucp_zarr.save({"w": full_state(0)["w"], "f": full_state(0)["f"], "rng": ucp_zarr.PerRank(torch.tensor([0, 0])), "step": 0}, base)

    # calibrate: how many mutating storage operations does each rank perform?
    done = tmp_path / "done-cal"
    done.mkdir()
    cal = {"victim": -1, "kill_ops": None, "kill_delay": 0, "generation": 1, "path": str(tmp_path / "cal"),
           "overwrite": False, "done": str(done)}
    assert _run_job(ctx, cal) == [0] * WORLD
    ops = [json.loads((done / f"{r}.json").read_text())["ops"] for r in range(WORLD)]
    assert min(ops) > 3, ops
    _check_complete(tmp_path / "cal", {1})

    for t in range(n):
        gen = t + 2
        trial = tmp_path / f"t{t}"
        trial.mkdir()
        prev = trial / "ck"
        shutil.copytree(base, prev)
        overwrite = rng.random() < 0.5
        target = prev if overwrite else trial / "new"
        victim = rng.randrange(WORLD)
        by_ops = rng.random() < 0.7
        spec = {"victim": victim, "kill_ops": rng.randrange(ops[victim] + 6) if by_ops else None,
                "kill_delay": rng.uniform(0.0, 0.6), "generation": gen, "path": str(target),
                "overwrite": overwrite, "done": str(trial)}
        codes = _run_job(ctx, spec)
        tally["trials"] += 1
        tally["overwrite"] += overwrite
        tally["by_ops" if by_ops else "by_timer"] += 1
        tally["killed"] += codes[victim] == -signal.SIGKILL
        what = f"trial {t}: {spec}, exit codes {codes}"

        if overwrite:  # the old or the new checkpoint, complete: never a mix
            got = _check_complete(prev, {0, gen})
            tally["left_new" if got == gen else "left_old"] += 1
        else:
            assert _check_complete(prev, {0}) == 0, what
            if _state_of(target) == "complete":
                assert _check_complete(target, {gen}) == gen, what
                tally["left_new"] += 1
            else:
                tally["left_incomplete"] += 1
        # a new save onto the interrupted path works at once (its owner is dead)
        again = {"w": full_state(gen + 1000)["w"], "f": full_state(gen + 1000)["f"], "rng": ucp_zarr.PerRank(torch.tensor([gen + 1000, 0])), "step": gen + 1000}
        ucp_zarr.save(again, target, overwrite=True)
        assert _check_complete(target, {gen + 1000}) == gen + 1000, what
        tally["redone"] += 1
        shutil.rmtree(trial)
    return tally


def test_random_kills_never_lose_or_half_commit_a_checkpoint(tmp_path):
    tally = _trials(tmp_path, TRIALS)
    print("kill trials:", tally)
    assert tally["trials"] == TRIALS and tally["redone"] == TRIALS
    assert tally["killed"] >= TRIALS // 2, tally  # most trials really killed a rank mid-save
    assert tally["left_incomplete"] > 0 and tally["left_old"] > 0, tally  # both sides of the commit were hit


@pytest.mark.long
def test_random_kills_long_run(tmp_path):
    tally = _trials(tmp_path, LONG_TRIALS)
    print("kill trials:", tally)
    assert tally["redone"] == LONG_TRIALS


def test_durability_order_every_file_and_directory_is_fsynced_before_the_commit(tmp_path, monkeypatch):
    """The commit record becomes visible (hard link of its fsynced temporary file) only after
    every object and every directory entry of the checkpoint is durable (fsynced, or covered
    by a syncfs of the file system after it was written), and its own directory entry is
    fsynced after."""
    from ucp_zarr.io import local as storage

    events: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_link, real_close = os.open, os.fsync, os.link, os.close
    real_syncfs = storage._syncfs

    def rec_syncfs(fd: int) -> None:
        real_syncfs(fd)
        events.append(("syncfs", fds.get(fd, f"fd{fd}")))

    def rec_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        fds[fd] = os.path.abspath(os.fspath(path))
        if flags & os.O_CREAT:
            events.append(("create", fds[fd]))
        return fd

    def rec_fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", fds.get(fd, f"fd{fd}")))

    def rec_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_link(src, dst, *args, **kwargs)
        events.append(("link", os.path.abspath(os.fspath(dst))))

    def rec_close(fd: int) -> None:
        path = fds.pop(fd, None)  # before the fd can be reused by another thread's open
        real_close(fd)
        if path is not None:
            events.append(("close", path))

    real_rename = storage._rename_noreplace

    def rec_rename(src: str, dst: str) -> bool:  # a guarded write moving its object into place
        done = real_rename(src, dst)
        events.append(("rename", os.path.abspath(dst)))
        moved[os.path.abspath(dst)] = os.path.abspath(src)
        return done

    moved: dict[str, str] = {}
    monkeypatch.setattr(storage, "_rename_noreplace", rec_rename)
    monkeypatch.setattr(os, "open", rec_open)
    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "link", rec_link)
    monkeypatch.setattr(os, "close", rec_close)
    monkeypatch.setattr(storage, "_syncfs", rec_syncfs)
    path = tmp_path / "ck"
    ucp_zarr.save({"w": torch.randn(64, 1024), "b": torch.randn(10), "step": 1}, path, chunk_bytes=4096, shard_bytes=16384)
    monkeypatch.undo()

    root = str(path / "zarr.json")
    commit = events.index(("link", root))
    before, after = events[:commit], events[commit + 1 :]
    files = [p for p in path.rglob("*") if p.is_file() and p != path / "zarr.json"]
    assert len(files) > 10
    synced_before = {p for kind, p in before if kind == "fsync"}
    for f in files:
        written = moved.get(str(f), str(f))  # the temporary file a guarded write filled
        closed = max(i for i, e in enumerate(before) if e == ("close", written))
        synced = written in synced_before or any(kind == "syncfs" for kind, _ in before[closed:])
        assert synced, f"{f} was not fsynced before the commit"
        # and its directory entry: the directory was fsynced (or the file system synced) after the file was created
        created = before.index(("rename", str(f)) if str(f) in moved else ("create", str(f)))
        entry = any(e == ("fsync", str(f.parent)) or e[0] == "syncfs" for e in before[created:])
        assert entry, f"directory of {f} not fsynced before the commit"
    tmp = [p for kind, p in before if kind == "fsync" and p.startswith(root + ".tmp-")]
    assert tmp, "the commit record's temporary file was not fsynced before it was linked"
    assert ("fsync", str(path)) in after, "the commit record's directory entry was not fsynced"
