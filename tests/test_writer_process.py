"""Background saves to a local file system are written by a child process
(:mod:`ucp_zarr.io.writer_process`): its writes are the save's (bit-exact, counted, behind the
save's guard), its errors are the caller's, its death fails the save with nothing committed,
and it never holds the training process's GIL (nor its file descriptors)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from _states import assert_bits_equal

import ucp_zarr
import ucp_zarr.io.writer_process as wp
import ucp_zarr.protocol.saving as api
from ucp_zarr.errors import CheckpointError, IncompleteCheckpointError, NotACheckpointError, OwnershipError
from ucp_zarr.io.local import LocalStore
from ucp_zarr.protocol.liveness import MARKER, Fence, Owner, process_alive

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create: background saves write from a thread")


@pytest.fixture
def child(monkeypatch):
    """A fresh writer process for the test (closed after it)."""
    writer = wp.WriterProcess(nice_offset=api.BACKGROUND_NICE)
    monkeypatch.setattr(api, "_writer", writer)
    yield writer
    writer.close()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(640, 384, generator=g),  # chunks that are column blocks: staged in runs
        "t": torch.randn(77, 33, generator=g).t(),  # not contiguous
        "bf": torch.randn(100, 99, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "ints": torch.arange(10**4, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "step": 7,
    }


def _loads_back(path, want: dict) -> None:
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    ucp_zarr.load(out, path)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert_bits_equal(out[k], v, k)
        else:
            assert out[k] == v


def test_a_background_save_is_written_by_the_child(tmp_path, child, monkeypatch) -> None:
    here: list[str] = []
    real = LocalStore.write
    monkeypatch.setattr(LocalStore, "write", lambda self, key, *a, **k: (here.append(key), real(self, key, *a, **k))[1])
    sd = _state()
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    fut = ucp_zarr.async_save(sd, tmp_path / "ck")
    for v in sd.values():  # training goes on at once
        if isinstance(v, torch.Tensor) and v.numel():
            v.fill_(1)
    result = fut.result()
    _loads_back(tmp_path / "ck", want)
    shards = [k for k in result.objects if "/c/" in k or k.startswith("c/")]
    docs = [k for k in result.objects if k.endswith("zarr.json") and k != "zarr.json"]
    assert shards and docs
    assert not set(here) & set(shards + docs)  # none written by this process...
    assert child._proc is not None and child._proc.poll() is None  # ...but by its child, alive for the next save
    stored = sum(os.path.getsize(tmp_path / "ck" / k) for k in shards + docs)
    assert result.bytes_written >= stored  # and counted as this save's


def test_the_child_runs_below_the_callers_priority(tmp_path, child) -> None:
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ucp_zarr.async_save({"w": torch.ones(4)}, tmp_path / "ck").result()
    assert child._proc is not None
    for task in os.listdir(f"/proc/{child._proc.pid}/task"):  # every thread of it
        assert os.getpriority(os.PRIO_PROCESS, int(task)) == min(caller + api.BACKGROUND_NICE, api.MAX_NICE)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_the_child_dying_or_stopping_fails_the_save_and_a_later_save_starts_another(tmp_path, child, monkeypatch,
                                                                                   how) -> None:
    """The child dies, or stops (SIGSTOP), with the jobs sent. A stopped
    child's save waited without end (this process renewed its lease, so nothing took the path
    over; every later save waited too): once the child has been stopped for the lease, the save
    fails and the child is killed. The next save starts another child and lands."""
    ucp_zarr.async_save({"w": torch.ones(4)}, tmp_path / "first").result()
    first = child._proc.pid
    real = wp.send_handle

    def send_and_signal(conn, fd, pid):  # before the child wrote anything
        real(conn, fd, pid)
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

    monkeypatch.setattr(wp, "send_handle", send_and_signal)
    said = "failed" if how == "killed" else r"was stopped \(SIGSTOP\) for more than 2 s"
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"writer process \({first}\) .*{said}.*nothing of this save is committed"):
        ucp_zarr.async_save(_state(), tmp_path / "ck", lease_s=2.0).result(timeout=60)
    assert time.monotonic() - start < 30
    with pytest.raises(IncompleteCheckpointError):  # never committed
        ucp_zarr.open(tmp_path / "ck")
    monkeypatch.setattr(wp, "send_handle", real)
    sd = _state()
    ucp_zarr.async_save(sd, tmp_path / "ck").result()  # (the failed save's claim was given up)
    assert child._proc.pid != first
    _loads_back(tmp_path / "ck", sd)


_TRAINER = """
import sys, time, torch, ucp_zarr
sd = {f"w{i}": torch.full((256, 256), float(i)) for i in range(300)}  # many objects: the child writes a while
ucp_zarr.async_save(sd, sys.argv[1])
print("staged", flush=True)
time.sleep(600)
"""


def test_the_child_dies_with_the_training_process_and_the_claim_waits_for_it(tmp_path) -> None:
    """The training process is SIGKILLed (stopped first, so its child waits on the guard
    mid-save): the claim names the child as a writer of the save, the child dies with its
    parent, and then (not before) a new save takes the path over and commits."""
    path = tmp_path / "ck"
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "staged"
        owner = Owner.from_bytes((path / MARKER).read_bytes(), "marker")
        assert owner.pid == trainer.pid and len(owner.writers) == 1, owner
        writer = owner.writers[0][0]
        assert process_alive(*owner.writers[0])
        os.kill(trainer.pid, signal.SIGSTOP)
        time.sleep(0.2)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while process_alive(*owner.writers[0]):
        assert time.monotonic() < deadline, f"the writer process {writer} outlived its parent"
        time.sleep(0.01)
    sd = {"w": torch.arange(12.0)}
    ucp_zarr.save(sd, path)  # takes the dead save's claim over
    _loads_back(path, sd)


def test_the_childs_objects_pass_the_saves_guard(tmp_path, child, monkeypatch) -> None:
    """The child asks the save's fence (here) before it puts each object in place: once the
    fence refuses, the save fails with the fence's error and that object is not in place."""
    calls: list[bool] = []
    real = Fence.check

    def check(self, force: bool = False) -> None:
        calls.append(force)
        if len(calls) == 5:
            raise OwnershipError("claim lost (test)")
        real(self, force)

    monkeypatch.setattr(Fence, "check", check)
    monkeypatch.setattr(Fence, "valid_until", lambda self: -math.inf)  # the child asks before every object
    sd = {f"w{i}": torch.full((8, 8), float(i)) for i in range(8)}
    with pytest.raises(OwnershipError, match="claim lost"):
        ucp_zarr.async_save(sd, tmp_path / "ck").result()
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ck") for f in fs]
    assert not [f for f in left if "/c/" in f or f.endswith("/c")], left  # no shard in place (aborted), no temp left


def test_the_child_asks_again_only_when_the_fences_answer_may_have_changed(tmp_path, child, monkeypatch) -> None:
    """Between the fence's reads of the store (and within its lease) the child does not ask
    again for every object, but it always asks when forced (the commit's last objects)."""
    calls: list[bool] = []
    real = Fence.check

    def check(self, force: bool = False) -> None:
        calls.append(force)
        real(self, force)

    monkeypatch.setattr(Fence, "check", check)
    sd = {f"w{i}": torch.full((8, 8), float(i)) for i in range(32)}
    ucp_zarr.async_save(sd, tmp_path / "ck").result()
    asked_once = len(calls)
    _loads_back(tmp_path / "ck", sd)
    calls.clear()
    monkeypatch.setattr(Fence, "valid_until", lambda self: -math.inf)
    ucp_zarr.async_save(sd, tmp_path / "ck2").result()
    assert len(calls) >= asked_once + 64, (asked_once, len(calls))  # every shard and array document asks
    assert calls.count(True) >= 1


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_write_error_is_the_callers_whichever_writes(tmp_path, child, monkeypatch, writer) -> None:
    from ucp_zarr.protocol.saver import PreparedSave

    real = PreparedSave._write_data

    def obstructed(self, *args, **kwargs):  # a file appears where the array's folder goes
        (tmp_path / "ck" / "w").write_text("in the way")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PreparedSave, "_write_data", obstructed)
    with pytest.raises(NotACheckpointError, match="a file is in the way"):
        ucp_zarr.async_save({"a": {"w": torch.ones(4, 4)}}, tmp_path / "ck", writer=writer).result()


def test_no_descriptor_is_left_open(tmp_path, child) -> None:
    """Five background saves leave no descriptor open. The count is the whole process's, so
    a file another thread holds for a moment (a save's threads winding down after its result
    is set) is waited for, up to 5 s: a leaked descriptor stays."""
    ucp_zarr.async_save({"w": torch.ones(4)}, tmp_path / "warm").result()
    before = set(os.listdir("/proc/self/fd"))
    for i in range(5):
        ucp_zarr.async_save({"w": torch.ones(1000)}, tmp_path / f"ck{i}").result()
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/fd")) > len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    opened = {}
    for fd in set(os.listdir("/proc/self/fd")) - before:
        try:
            opened[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed meanwhile)
            pass
    assert len(os.listdir("/proc/self/fd")) <= len(before), opened


def test_writer_must_be_process_or_thread(tmp_path) -> None:
    with pytest.raises(ValueError, match="'process' or 'thread'"):
        ucp_zarr.async_save({"w": torch.ones(4)}, tmp_path / "ck", writer="fork")
