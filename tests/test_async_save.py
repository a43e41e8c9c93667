"""An asynchronous save in one process: its host copy (made by all workers above
``PARALLEL_FILL_BYTES`` when torch copies on one thread) is the state at the call, whatever training does next; its
background thread runs at a lower priority than training."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ucp_zarr
import ucp_zarr.protocol.saving as api
from ucp_zarr.protocol.staging import PARALLEL_FILL_BYTES


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(4001, 1024, generator=g),  # above the threshold alone: cut among workers
        "t": torch.randn(77, 33, generator=g).t(),  # not contiguous
        "bf": torch.randn(1000, 999, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "ints": torch.arange(10**5, dtype=torch.int64),
        "step": 7,
    }


def _copy_is_the_state_at_the_call(path: str, threads: int) -> None:
    torch.set_num_threads(threads)  # 1: the copy is cut among the workers; more: one parallel copy_ each
    sd = _state()
    assert sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor)) > PARALLEL_FILL_BYTES
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    fut = ucp_zarr.async_save(sd, path, max_workers=3)
    for v in sd.values():  # training goes on at once
        if isinstance(v, torch.Tensor) and v.numel():
            v.fill_(-1)
    fut.result()
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    ucp_zarr.load(out, path)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            bits = (lambda t: t.view(torch.int16)) if v.dtype == torch.bfloat16 else (lambda t: t)
            assert torch.equal(bits(out[k]), bits(v)), k
        else:
            assert out[k] == v


@pytest.mark.parametrize("threads", [1, 2])
def test_async_copy_is_the_state_at_the_call(tmp_path, threads) -> None:
    # in a child: tensors this large start torch's OpenMP pool, and a process forked later by
    # another test (test_bad_input's sandboxed children) would hang in it
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_async_save as t; " \
           f"t._copy_is_the_state_at_the_call({str(tmp_path / 'ck')!r}, {threads})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_background_save_yields_the_cpu(tmp_path, monkeypatch) -> None:
    """The background save's threads (the one that writes included, with ``writer="thread"``;
    for the writer process see test_writer_process) run ``BACKGROUND_NICE`` below the
    priority of the thread that called ``save``, whatever that is (the whole job may run
    under ``nice``): the caller's own is unchanged."""
    from ucp_zarr.io.local import LocalStore

    writers: list[int] = []
    real = LocalStore.write

    def write(self, key, *args, **kwargs):
        writers.append(_thread_nice())
        return real(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "write", write)

    def save_from_a_thread_at(nice: int, path) -> int:
        """Save from a fresh thread at ``nice`` (made nicer only: always permitted); its nice after."""
        seen: list[int | BaseException] = []

        def run() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                ucp_zarr.async_save({"w": torch.ones(4)}, path, writer="thread").result()
                seen.append(_thread_nice())
            except BaseException as e:  # (raised below, in the test's thread)
                seen.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if isinstance(seen[0], BaseException):
            raise seen[0]
        return seen[0]

    base = _thread_nice()
    for i, nice in enumerate(sorted({base, min(base + 3, 19), 19})):  # nicer each time: no privilege needed
        writers.clear()
        assert save_from_a_thread_at(nice, tmp_path / f"ck{i}") == nice  # the caller's is unchanged
        assert writers and set(writers) == {min(nice + api.BACKGROUND_NICE, api.MAX_NICE)}, (nice, writers)
    assert _thread_nice() == base


def test_background_save_writes_on_one_thread(tmp_path, monkeypatch) -> None:
    """Every writer thread competes with training for the GIL: a background save written by
    this process (``writer="thread"``) writes its objects from ``BACKGROUND_WRITERS`` (1)
    thread, however many ``max_workers`` copy."""
    from ucp_zarr.io.local import LocalStore

    threads: set[int] = set()
    real = LocalStore.write

    def write(self, key, *args, **kwargs):
        threads.add(threading.get_ident())
        return real(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "write", write)
    sd = {f"w{i}": torch.full((64, 64), float(i)) for i in range(12)}
    ucp_zarr.async_save(sd, tmp_path / "ck", max_workers=4, writer="thread").result()
    assert len(threads) == api.BACKGROUND_WRITERS == 1 and threading.get_ident() not in threads
    out = {k: torch.zeros(64, 64) for k in sd}
    ucp_zarr.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_async_save_is_dcps_spelling_and_the_old_flag_still_works_with_a_warning(tmp_path):
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    fut = ucp_zarr.async_save(sd, tmp_path / "new")
    assert isinstance(fut.result(), ucp_zarr.SaveResult)
    with pytest.deprecated_call(match=r"ucp_zarr\.async_save"):
        old = ucp_zarr.save(sd, tmp_path / "old", async_save=True)
    old.result()
    for name in ("new", "old"):
        assert torch.equal(ucp_zarr.open(tmp_path / name)["w"][...], sd["w"])


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_an_async_overwrite_right_before_exit_lands(tmp_path, writer) -> None:
    """A script whose last line is an async save over an existing checkpoint (Lightning's
    ``trainer.save_checkpoint`` at the end of a re-run): the save lands before the
    interpreter exits (before: Python's shutdown refused the overwrite's new thread-pool
    work, the error went to a future nobody read, and the old checkpoint stayed, its
    replacement stranded in a staging folder)."""
    code = textwrap.dedent(f"""
        import torch, ucp_zarr
        ucp_zarr.save({{"w": torch.zeros(64, 64), "step": 1}}, {str(tmp_path / "ck")!r})
        ucp_zarr.async_save({{"w": torch.ones(64, 64), "step": 2}}, {str(tmp_path / "ck")!r}, overwrite=True,
                            writer={writer!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    got = ucp_zarr.read_state_dict(tmp_path / "ck")
    assert got["step"] == 2 and torch.equal(got["w"], torch.ones(64, 64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("how", ["async_save", "manager", "asked"])
def test_a_background_save_failing_with_nobody_told_is_reported_at_exit(tmp_path, how) -> None:
    """A script whose last line starts a background save that then fails (the disk full): the
    error is written to stderr at exit (before: the process ended as if it had saved, with
    nothing said), unless the script asked for the outcome."""
    code = textwrap.dedent(f"""
        import torch, ucp_zarr
        from ucp_zarr.io import local
        write = local.LocalStore.write
        def full(self, key, *args, **kwargs):
            if key.startswith("w/"):
                raise OSError(28, "No space left on device (injected)")
            return write(self, key, *args, **kwargs)
        local.LocalStore.write = full
        state = {{"w": torch.ones(64, 64), "step": 2}}
        if {how!r} == "manager":
            ucp_zarr.CheckpointManager({str(tmp_path / "root")!r}).save(2, state, async_save=True, writer="thread")
        else:
            fut = ucp_zarr.async_save(state, {str(tmp_path / "ck")!r}, writer="thread")
            if {how!r} == "asked":
                try:
                    fut.result()
                except OSError:
                    print("asked")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    told = "failed, and nothing asked for its outcome before exit" in done.stderr and "No space left" in done.stderr
    assert told == (how != "asked"), done.stderr[-2000:]
    assert done.stdout.strip() == ("asked" if how == "asked" else "")


def test_a_wait_that_timed_out_does_not_count_as_asking(tmp_path) -> None:
    """``result(timeout=0)`` on a running save raised TimeoutError but marked the save as
    asked: its later failure was not reported at exit."""
    gate = threading.Event()

    def slow() -> None:
        gate.wait(30)
        raise OSError(28, "No space left on device (injected)")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        fut = api.run_reported(pool, "a test save", slow)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0)
        assert not fut.asked and fut in api._unreported
        gate.set()
        with pytest.raises(OSError):
            fut.result(timeout=30)
    assert fut.asked and fut not in api._unreported


def test_a_process_group_destroyed_under_a_background_save_is_named(tmp_path) -> None:
    """A script ending ``async_save(...); dist.destroy_process_group()`` (torch's usual last
    line): the save cannot commit, and its report at exit named only torch's "Group ... is not
    registered". It now says the group was destroyed while the save was in flight, and the fix."""
    code = textwrap.dedent(f"""
        import time, torch, torch.distributed as dist, ucp_zarr
        from ucp_zarr.io import local
        write = local.LocalStore.write
        def slow(self, *args, **kwargs):
            time.sleep(1.0)  # (the save is still writing when the group goes)
            return write(self, *args, **kwargs)
        local.LocalStore.write = slow
        dist.init_process_group("gloo")
        ucp_zarr.async_save({{"w": torch.ones(4, 8)}}, {str(tmp_path / "ck")!r}, writer="thread")
        dist.destroy_process_group()
    """)
    (tmp_path / "job.py").write_text(code)
    # (one rank: with two, a rank whose background collective began before its peer left waits
    # for the peer's address until the group's timeout, at exit: the reason to wait first)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(tmp_path / "job.py")], capture_output=True, text=True, timeout=300)
    assert "the process group was destroyed (destroy_process_group) while this asynchronous save was in flight, so " \
           "it was not committed: wait for the save" in done.stderr, done.stderr[-3000:]
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(tmp_path / "ck")


def _background_timeout(rank: int, world: int) -> None:
    import datetime

    made = api._background_group(None)
    assert made._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=37)


def test_the_background_group_keeps_the_jobs_timeout() -> None:
    """The background saves' group was made with torch's default timeout (30 minutes), whatever
    the job gave its own: a background save waiting on a peer that left (its group destroyed
    under it) waited that long, at exit too. It takes the job's."""
    from _dist import run

    run(2, _background_timeout, timeout_s=37)


def _child_saves(path: str) -> None:
    ucp_zarr.save({"y": torch.ones(3)}, path)
    ucp_zarr.async_save({"y": torch.ones(3)}, path + "-async").result()  # (the writer process's lock was the parent's)


def test_a_process_forked_during_a_background_save_exits_and_saves_its_own(tmp_path):
    """A process forked while a background save runs (a DataLoader worker) inherited that save's
    future: its exit waited for it for ever (DataLoader killed its workers after 5 s each), and
    a save of its own waited likewise (an asynchronous one on the writer process's lock, which
    the parent's save held). The parent's save is not the child's: it exits at once, and its
    own saves commit, as with dcp.async_save. (Paced: the write takes ~2 s.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    fut = ucp_zarr.async_save({"x": torch.randn(512, 1024)}, tmp_path / "parent", write_bytes_per_s=1e6)
    idle = ctx.Process(target=int)
    saving = ctx.Process(target=_child_saves, args=(str(tmp_path / "child"),))
    idle.start()
    saving.start()
    exercised = not fut.done()  # (the parent's save still running when both were forked)
    for p in (idle, saving):
        p.join(timeout=20)
    hung = [p for p in (idle, saving) if p.is_alive()]
    for p in hung:
        p.kill()
    fut.result()
    assert exercised, "the parent's save ended before the children were forked: the case was not exercised"
    assert not hung and idle.exitcode == saving.exitcode == 0, (idle.exitcode, saving.exitcode)
    for name in ("child", "child-async"):
        assert torch.equal(ucp_zarr.read_state_dict(tmp_path / name)["y"], torch.ones(3))
