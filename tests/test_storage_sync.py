"""Batched durability of the local store: small objects are made durable by one ``syncfs``
of their file system at ``Store.sync()`` instead of one fsync each, never later than the
commit record is created, and a failed ``syncfs`` fails the save.

The system calls are recorded by monkeypatching ``os.open``/``os.fsync``/``os.link``/
``os.close`` and ``ucp_zarr.io.local._syncfs``; the batching file systems are set to the
type of ``tmp_path``'s, so the tests run wherever the temporary directory lives.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp_zarr
from ucp_zarr.io import local as storage
from ucp_zarr.io.local import LocalStore, file_system_type, syncfs_reports_errors

needs_syncfs = pytest.mark.skipif(not syncfs_reports_errors(), reason="syncfs(2) reporting writeback errors (Linux >= 5.8)")


def _state(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    sd: dict[str, Any] = {f"layers.{i}.weight": torch.randn(32, 64, generator=g) for i in range(n)}
    sd["step"] = 3
    return sd


class Recorder:
    """The durability-relevant calls in order: ("create"|"fsync"|"close"|"link"|"syncfs", path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        self.moved: dict[str, str] = {}
        """Final path -> the temporary file a guarded write moved there."""
        fds: dict[int, str] = {}
        real_open, real_fsync, real_link, real_close = os.open, os.fsync, os.link, os.close
        real_syncfs = storage._syncfs

        def rec_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            fds[fd] = os.path.abspath(os.fspath(path))
            if flags & os.O_CREAT:
                self.events.append(("create", fds[fd]))
            return fd

        def rec_fsync(fd: int) -> None:
            real_fsync(fd)
            self.events.append(("fsync", fds.get(fd, f"fd{fd}")))

        def rec_syncfs(fd: int) -> None:
            real_syncfs(fd)
            self.events.append(("syncfs", fds.get(fd, f"fd{fd}")))

        def rec_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real_link(src, dst, *args, **kwargs)
            self.events.append(("link", os.path.abspath(os.fspath(dst))))

        def rec_close(fd: int) -> None:
            path = fds.pop(fd, None)  # before the fd can be reused by another thread's open
            real_close(fd)
            if path is not None:
                self.events.append(("close", path))

        real_rename = storage._rename_noreplace

        def rec_rename(src: str, dst: str) -> bool:  # a guarded write moving its object into place
            done = real_rename(src, dst)
            self.events.append(("rename", os.path.abspath(dst)))
            self.moved[os.path.abspath(dst)] = os.path.abspath(src)
            return done

        monkeypatch.setattr(os, "open", rec_open)
        monkeypatch.setattr(os, "fsync", rec_fsync)
        monkeypatch.setattr(os, "link", rec_link)
        monkeypatch.setattr(os, "close", rec_close)
        monkeypatch.setattr(storage, "_syncfs", rec_syncfs)
        monkeypatch.setattr(storage, "_rename_noreplace", rec_rename)

    def count(self, kind: str, under: Path | None = None) -> int:
        """Calls of ``kind``, only on paths below ``under`` when given (the patched calls also
        see other threads of the process, such as a heartbeat an earlier test left running)."""
        root = None if under is None else os.path.join(os.path.abspath(under), "")
        return sum(1 for k, p in self.events if k == kind and (root is None or p.startswith(root)))


def _batching_here(monkeypatch: pytest.MonkeyPatch, where: Path) -> None:
    """Make ``where``'s file system one that batches (whatever the test machine mounts)."""
    kind = file_system_type(os.stat(where).st_dev)
    if kind is None:
        pytest.skip(f"the file system of {where} is not in /proc/self/mountinfo")
    monkeypatch.setattr(storage, "BATCH_FILE_SYSTEMS", frozenset({kind}))


def _assert_durable_before_commit(
    events: list[tuple[str, str]], path: Path, moved: dict[str, str]
) -> list[tuple[str, str]]:
    """Every object of the checkpoint at ``path`` and its directory entry were durable before
    the commit record was linked: the file was fsynced, or a syncfs ran after its last close;
    its directory was fsynced, or a syncfs ran, after the file was created. Returns the
    events before the commit."""
    root = str(path / "zarr.json")
    commit = events.index(("link", root))
    before = events[:commit]
    files = [p for p in path.rglob("*") if p.is_file() and p != path / "zarr.json"]
    assert files
    for f in files:
        written = moved.get(str(f), str(f))  # the temporary file a guarded write filled, then moved
        created = before.index(("rename", str(f)) if str(f) in moved else ("create", str(f)))
        closed = max(i for i, e in enumerate(before) if e == ("close", written))
        synced_data = ("fsync", written) in before or any(k == "syncfs" for k, _ in before[closed:])
        assert synced_data, f"{f} was not durable when the commit record was created"
        synced_entry = any(e == ("fsync", str(f.parent)) or e[0] == "syncfs" for e in before[created:])
        assert synced_entry, f"the directory entry of {f} was not durable when the commit record was created"
    tmp = [p for k, p in before if k == "fsync" and p.startswith(root + ".tmp-")]
    assert tmp, "the commit record's temporary file was not fsynced before it was linked"
    assert ("fsync", str(path)) in events[commit + 1 :], "the commit record's directory entry was not fsynced"
    return before


@needs_syncfs
def test_small_objects_are_durable_by_syncfs_before_the_commit(tmp_path, monkeypatch):
    _batching_here(monkeypatch, tmp_path)
    rec = Recorder(monkeypatch)
    path = tmp_path / "ck"
    ucp_zarr.save(_state(24), path)
    monkeypatch.undo()

    before = _assert_durable_before_commit(rec.events, path, rec.moved)
    syncs = [i for i, (k, _) in enumerate(before) if k == "syncfs"]
    assert len(syncs) == 2, "two syncfs per save: the data, then the documents"
    documents = [i for i, (k, p) in enumerate(before) if k in ("create", "rename") and p.endswith("zarr.json")]
    assert syncs[0] < min(documents), "an array's zarr.json appeared before the data was durable"
    objects = [p for p in path.rglob("*") if p.is_file()]
    assert len(objects) > 48
    # the protocol's own objects (claim, heartbeat, commit record) are still fsynced one by
    # one; the 48+ data objects and their directories are not
    assert rec.count("fsync", under=tmp_path) <= 12, rec.events
    src = _state(24)
    loaded = ucp_zarr.load({k: torch.zeros(32, 64) for k in src if k != "step"} | {"step": 0}, path)
    assert all(torch.equal(loaded[k], src[k]) for k in src if k != "step") and loaded["step"] == 3


@needs_syncfs
def test_the_syncfs_descriptor_is_opened_before_any_deferred_byte_is_written(tmp_path, monkeypatch):
    """syncfs reports writeback errors that happened since its descriptor was opened: the
    descriptor must exist before the first deferred write, else an error could go unseen."""
    _batching_here(monkeypatch, tmp_path)
    store = LocalStore(str(tmp_path / "ck"))
    opened: list[str] = []
    writes: list[str] = []
    real_open, real_writev = os.open, os.writev

    def rec_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if not flags & os.O_CREAT:
            opened.append(os.fspath(path))
        return fd

    def rec_writev(fd: int, bufs: Any) -> int:
        writes.append(f"after {len(opened)} opens")
        return real_writev(fd, bufs)

    monkeypatch.setattr(os, "open", rec_open)
    monkeypatch.setattr(os, "writev", rec_writev)
    store.write("g/a/c/0", [b"x" * 1000])
    monkeypatch.undo()
    assert opened and writes and writes[0] == "after 1 opens"
    assert os.path.samefile(opened[0], tmp_path / "ck" / "g" / "a" / "c")
    store.sync()


@needs_syncfs
def test_deferred_objects_start_their_writeback_at_once(tmp_path, monkeypatch):
    """A deferred object's writeback starts as it is closed (``sync_file_range``, a hint), so
    the final syncfs mostly waits for work already under way (64-256 MiB saves: 7-20% faster);
    a large object is fsynced instead, and durability still comes from the syncfs."""
    _batching_here(monkeypatch, tmp_path)
    store = LocalStore(str(tmp_path / "ck"))
    hinted: list[int] = []
    monkeypatch.setattr(storage, "_SYNC_FILE_RANGE", lambda fd, off, n, flags: hinted.append(os.fstat(fd).st_size) or 0)
    store.write("g/a/c/0", [b"x" * 1000])
    store.write("g/b/c/0", [b"y" * (storage.DEFER_MAX_BYTES + 1)])
    assert hinted == [1000]
    store.sync()


@needs_syncfs
def test_a_failed_syncfs_fails_the_save_and_nothing_is_committed(tmp_path, monkeypatch):
    _batching_here(monkeypatch, tmp_path)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "syncfs: Input/output error")

    monkeypatch.setattr(storage, "_syncfs", broken)
    path = tmp_path / "ck"
    with pytest.raises(Exception, match="Input/output error"):
        ucp_zarr.save(_state(4), path)
    assert not (path / "zarr.json").exists()
    monkeypatch.undo()
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(path)


def test_without_batching_every_object_and_directory_is_fsynced(tmp_path, monkeypatch):
    """On a file system that does not batch (network, FUSE, unknown), each object is fsynced
    by its writer and each directory at sync(); no syncfs."""
    monkeypatch.setattr(storage, "BATCH_FILE_SYSTEMS", frozenset())
    rec = Recorder(monkeypatch)
    path = tmp_path / "ck"
    ucp_zarr.save(_state(6), path)
    monkeypatch.undo()
    before = _assert_durable_before_commit(rec.events, path, rec.moved)
    assert rec.count("syncfs") == 0
    for f in path.rglob("*"):
        if f.is_file() and f != path / "zarr.json":
            written = rec.moved.get(str(f), str(f))  # (filled under a temporary name, then moved)
            assert ("fsync", written) in before, f"{f} was not fsynced"
        elif f.is_dir():
            assert ("fsync", str(f)) in before, f"directory {f} was not fsynced"


@needs_syncfs
def test_large_objects_are_fsynced_by_their_writer_even_when_batching(tmp_path, monkeypatch):
    """Above DEFER_MAX_BYTES an object is fsynced as it is written (its writeback overlaps
    the other writers'), and sync() still covers its directory entry."""
    _batching_here(monkeypatch, tmp_path)
    monkeypatch.setattr(storage, "DEFER_MAX_BYTES", 4096)
    store = LocalStore(str(tmp_path / "ck"))
    rec = Recorder(monkeypatch)
    store.write("g/big", [b"b" * 8192])
    store.write("g/small", [b"s" * 100])
    store.sync()
    monkeypatch.undo()
    big, small = str(tmp_path / "ck" / "g" / "big"), str(tmp_path / "ck" / "g" / "small")
    assert ("fsync", big) in rec.events and ("fsync", small) not in rec.events
    closed_small = rec.events.index(("close", small))
    assert [k for k, _ in rec.events[closed_small:]].count("syncfs") == 1


def test_batch_sync_true_without_syncfs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_SYNCFS", None)
    with pytest.raises(ValueError, match="syncfs"):
        LocalStore(str(tmp_path / "ck"), batch_sync=True)
    assert not syncfs_reports_errors()
    assert not LocalStore(str(tmp_path / "ck"))._batch.allowed  # the default falls back to fsync
