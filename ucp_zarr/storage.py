"""Where bytes live: a small store interface over the local filesystem or any fsspec URL.

Keys are ``/``-separated paths relative to the checkpoint root. The local store uses plain
``os`` calls (``writev``/``preadv`` straight from and into tensor memory, ``fsync`` of files
and directories); the fsspec store serves every other URL (``memory://``, ``s3://``, ...).
Both count what they read and write in :class:`IOStats`.
"""

from __future__ import annotations

import os
import posixpath
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import fsspec

Buffer = memoryview
ReadRequest = tuple[int, Sequence[memoryview]]
"""Fill these writable buffers, one after another, from this byte offset of an object."""

_IOV_MAX = 512
PENDING_MARKER = ".ucp_zarr_pending"
"""Marks a checkpoint directory whose save is under way or crashed (see :mod:`.format`)."""


@dataclass
class IOStats:
    """Counters of one store's traffic (thread-safe)."""

    bytes_read: int = 0
    read_calls: int = 0
    bytes_written: int = 0
    written: list[str] = field(default_factory=list)
    """Keys of the objects written, in order."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, nbytes: int, calls: int = 1) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_calls += calls

    def add_write(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.written.append(key)


class Store:
    """The operations the format needs from a storage backend."""

    url: str
    stats: IOStats

    def write(self, key: str, buffers: Iterable[Buffer | bytes]) -> int:
        """Write an object from ``buffers`` in order, durably; return its size.

        Each buffer is consumed (written, or copied) before the next is pulled from
        ``buffers``, so a producer may reuse one buffer's memory for the next."""
        raise NotImplementedError

    def write_atomic(self, key: str, data: bytes) -> None:
        """Make ``data`` visible at ``key`` all at once, durably (the commit record)."""
        raise NotImplementedError

    def read(self, key: str) -> bytes:
        """A whole object; :class:`FileNotFoundError` if absent."""
        raise NotImplementedError

    def read_tail(self, key: str, nbytes: int) -> bytes:
        raise NotImplementedError

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def is_empty(self) -> bool:
        """True when nothing is stored under the root (or the root does not exist)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        """Remove everything under the root."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the directory entries of everything written so far durable."""


class LocalStore(Store):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.stats = IOStats()
        self._dirs: set[str] = set()
        self._dirs_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _makedirs(self, d: str) -> None:
        with self._dirs_lock:
            if d in self._dirs:
                return
        os.makedirs(d, exist_ok=True)
        with self._dirs_lock:
            while d.startswith(self.root) and d not in self._dirs:
                self._dirs.add(d)
                d = os.path.dirname(d)
            self._dirs.add(os.path.dirname(self.root))

    def write(self, key: str, buffers: Iterable[Buffer | bytes]) -> int:
        total = self._write_file(self._path(key), buffers)
        self.stats.add_write(key, total)
        return total

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        self._write_file(tmp, [data])
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))
        self.stats.add_write(key, len(data))

    def _write_file(self, path: str, buffers: Iterable[Buffer | bytes]) -> int:
        """Create ``path`` from ``buffers`` with ``writev``, then ``fsync`` it."""
        self._makedirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 0
        try:
            # each buffer is written before the next is pulled: producers may reuse memory
            for b in buffers:
                total += _writev_all(fd, [b])
            os.fsync(fd)
        finally:
            os.close(fd)
        return total

    def read(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            data = f.read()
        self.stats.add_read(len(data))
        return data

    def read_tail(self, key: str, nbytes: int) -> bytes:
        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise OSError(f"{self._path(key)} has {size} bytes, fewer than its {nbytes}-byte index")
            data = os.pread(fd, nbytes, size - nbytes)
        finally:
            os.close(fd)
        self.stats.add_read(len(data))
        return data

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        path = self._path(key)
        fd = os.open(path, os.O_RDONLY)
        total = calls = 0
        try:
            for offset, bufs in requests:
                for start in range(0, len(bufs), _IOV_MAX):
                    part = bufs[start : start + _IOV_MAX]
                    want = sum(b.nbytes for b in part)
                    got = _preadv_all(fd, part, offset)
                    if got != want:
                        raise OSError(f"{path}: short read of {got} bytes at {offset}, wanted {want}")
                    offset += got
                    total += got
                    calls += 1
        finally:
            os.close(fd)
        self.stats.add_read(total, calls)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def is_empty(self) -> bool:
        return not os.path.isdir(self.root) or not os.listdir(self.root)

    def delete(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass
        _fsync_dir(os.path.dirname(self._path(key)))

    def clear(self) -> None:
        import shutil

        if os.path.isdir(self.root):
            # the pending marker goes last, so a crash mid-way leaves a claimable directory
            for name in sorted(os.listdir(self.root), key=lambda n: n == PENDING_MARKER):
                p = os.path.join(self.root, name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
            _fsync_dir(self.root)

    def sync(self) -> None:
        with self._dirs_lock:
            dirs = sorted(self._dirs, key=len, reverse=True)
        for d in dirs:
            if os.path.isdir(d):
                _fsync_dir(d)


def _flat(bufs: Sequence[Buffer | bytes]) -> list[memoryview]:
    views = [memoryview(b) for b in bufs]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if v.nbytes]


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (after a partial vectored read or write)."""
    while views and n >= views[0].nbytes:
        n -= views.pop(0).nbytes
    if n:
        views[0] = views[0][n:]


def _writev_all(fd: int, bufs: list[Buffer | bytes]) -> int:
    views, total = _flat(bufs), 0
    while views:
        n = os.writev(fd, views)
        total += n
        _advance(views, n)
    return total


def _preadv_all(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    views, total = _flat(bufs), 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        _advance(views, n)
    return total


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecStore(Store):
    """Any fsspec filesystem. Objects are written whole or multipart by fsspec; a PUT is
    atomic on object stores, so the commit record needs no rename."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.url = url
        self.stats = IOStats()

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, key)

    def write(self, key: str, buffers: Iterable[Buffer | bytes]) -> int:
        total = 0
        with self.fs.open(self._path(key), "wb") as f:
            for b in buffers:
                total += f.write(memoryview(b).cast("B"))
        self.stats.add_write(key, total)
        return total

    def write_atomic(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)
        self.stats.add_write(key, len(data))

    def read(self, key: str) -> bytes:
        data = self.fs.cat_file(self._path(key))
        self.stats.add_read(len(data))
        return data

    def read_tail(self, key: str, nbytes: int) -> bytes:
        data = self.fs.cat_file(self._path(key), start=-nbytes)
        if len(data) != nbytes:
            raise OSError(f"{self._path(key)} is shorter than its {nbytes}-byte index")
        self.stats.add_read(len(data))
        return data

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        path = self._path(key)
        sizes = [sum(b.nbytes for b in bufs) for _, bufs in requests]
        datas = self.fs.cat_ranges(
            [path] * len(requests), [o for o, _ in requests], [o + n for (o, _), n in zip(requests, sizes)]
        )
        for (offset, bufs), want, data in zip(requests, sizes, datas):
            if isinstance(data, Exception):
                raise data
            if len(data) != want:
                raise OSError(f"{path}: short read of {len(data)} bytes at {offset}, wanted {want}")
            pos = 0
            for b in bufs:
                flat = b.cast("B") if b.format != "B" or b.ndim != 1 else b
                flat[:] = data[pos : pos + flat.nbytes]
                pos += flat.nbytes
        self.stats.add_read(sum(sizes), len(requests))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def is_empty(self) -> bool:
        try:
            return not self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return True

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def clear(self) -> None:
        if self.fs.exists(self.root):
            for p in sorted(self.fs.ls(self.root, detail=False), key=lambda p: p.endswith(PENDING_MARKER)):
                self.fs.rm(p, recursive=True)


def open_store(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """A store for a local path, a ``file://`` URL or any other fsspec URL."""
    path = os.fspath(path)
    if "://" not in path:
        return LocalStore(path)
    if path.startswith("file://") and not storage_options:
        return LocalStore(path[len("file://") :])
    return FsspecStore(path, storage_options)
