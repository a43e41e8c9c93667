"""Where bytes live: a small store interface over the local filesystem or any fsspec URL.

Keys are ``/``-separated paths relative to the checkpoint root. The local store uses plain
``os`` calls (``writev``/``preadv`` straight from and into tensor memory; ``fsync`` of files
and directories, or one ``syncfs`` of the file system for a batch of small objects); the
fsspec store serves every other URL (``memory://``, ``s3://``, ...). Both count what they
read and write in :class:`IOStats`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import posixpath
import re
import shutil
import stat
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from ..errors import FormatError, Keyword, NotACheckpointError, OptionError

log = logging.getLogger(__name__)
T = TypeVar("T")
Buffer = memoryview
ReadRequest = tuple[int, Sequence[memoryview]]
"""Fill these writable buffers, one after another, from this byte offset of an object."""

_IOV_MAX = 512

BATCH_FILE_SYSTEMS = frozenset({"ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs"})
"""Local file systems whose ``syncfs`` makes every file's data and every directory entry
durable (a journal or transaction commit). Network and FUSE file systems are not listed:
there ``syncfs`` may stop at the client's cache, so their objects are fsynced one by one."""
DEFER_MAX_BYTES = 8 << 20
"""Objects up to this size written with :meth:`Store.write` are made durable by one ``syncfs``
at :meth:`Store.sync` (where that is safe); larger ones are fsynced by their writing thread,
so that their writeback overlaps the other threads' writes."""


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


class WriteGuard(Protocol):
    """A save's right to write into a store (:class:`~ucp_zarr.protocol.transaction.Fence`)."""

    tag: str
    """The save's id: names its temporary objects (:func:`temp_name`)."""

    def check(self, force: bool = False) -> None:
        """Raise unless the save still owns the path (``force``: ask the store now)."""


def temp_name(key: str, tag: str) -> str:
    """Where a guarded write of ``key`` by save ``tag`` is staged before it is moved into place."""
    return f"{key}.tmp-{tag}"


class Store:
    """The operations the format needs from a storage backend.

    Every method names objects by key relative to the store's root. Writes of data objects
    are idempotent (same key, same bytes), so they may be retried; the transaction's
    exclusive creations are not, and say so.

    A store declares what it can guarantee; the transaction asks instead of switching on
    its class:"""

    url: str
    stats: IOStats
    exclusive_create: bool = False
    """:meth:`create_exclusive` never lets two creators of one key both succeed (an atomic
    create: a hard link, a conditional PUT); False where it is check-then-write."""
    durable: bool = False
    """An object survives a crash of the machine once :meth:`sync` returned."""
    stages_writes: bool = False
    """A guarded :meth:`write` stages the object under :func:`temp_name` first."""

    @property
    def name(self) -> str:
        """The last component of the root (the checkpoint's directory name)."""
        return posixpath.basename(self.url.rstrip("/"))

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        """Write an object from ``buffers`` in order, durably; return its size.

        Each buffer is consumed (written, or copied) before the next is pulled from
        ``buffers``, so a producer may reuse one buffer's memory for the next. A store may
        iterate ``buffers`` again to retry a failed write, unless it is an iterator.

        With ``guard``, nothing becomes visible at ``key`` unless ``guard.check()`` passes
        after the bytes are written: a local store writes ``temp_name(key, guard.tag)``
        and moves it into place only if no object is there, or if ``guard.check(force=True)``
        passes (a stray of a dead save); an object store checks before its PUT."""
        raise NotImplementedError

    def write_atomic(self, key: str, data: bytes) -> None:
        """Make ``data`` visible at ``key`` all at once, durably, replacing what is there."""
        raise NotImplementedError

    def create_exclusive(self, key: str, data: bytes) -> None:
        """Make ``data`` visible at ``key`` all at once, durably, only if ``key`` does not
        exist; else raise :class:`FileExistsError` (never replaces an object)."""
        raise NotImplementedError

    def read(self, key: str) -> bytes:
        """A whole object; :class:`FileNotFoundError` if absent."""
        raise NotImplementedError

    def holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds exactly ``data`` (after a create found the key taken: a
        retried create whose first attempt landed made it, and it is the creator's)."""
        try:
            return self.read(key) == data
        except FileNotFoundError:
            return False

    def read_tail(self, key: str, nbytes: int) -> bytes:
        raise NotImplementedError

    def read_small(self, key: str, limit: int) -> bytes | None:
        """The whole object in one request if it has at most ``limit`` bytes, else None; None
        also where a request costs little (a local file: reading the index, then the data
        straight into the destination, measured as fast) or a store cannot tell cheaply.
        :class:`FileNotFoundError` if absent."""
        return None

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        raise NotImplementedError

    def readv_whole(self, key: str, requests: Sequence[ReadRequest], size: int) -> bool:
        """:meth:`readv`, in one request, if the object has exactly ``size`` bytes (True);
        False, reading nothing, if it has another size or the store cannot tell without a
        request of its own (then the caller reads the object's index first)."""
        return False

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self) -> list[str]:
        """The keys of every object under the root (recursively), sorted."""
        raise NotImplementedError

    def child_names(self) -> list[str]:
        """The names of the root's immediate children (objects and folders), sorted."""
        return sorted({k.split("/", 1)[0] for k in self.list()})

    def sibling_names(self, prefix: str) -> list[str]:
        """The names beside the root (in its parent) that start with ``prefix``."""
        raise NotImplementedError

    def prune(self, folders: Iterable[str]) -> None:
        """Remove each of ``folders`` (keys of folders) that holds nothing, deepest first,
        then the root if it holds nothing; folders with anything in them stay."""

    def is_empty(self) -> bool:
        """True when nothing is stored under the root (or the root does not exist)."""
        return not self.list()

    def delete(self, key: str) -> None:
        """Remove an object (no error when it is absent)."""
        raise NotImplementedError

    def remove(self) -> None:
        """Remove every object under the root, and the root itself where that means anything."""
        raise NotImplementedError

    def sibling(self, name: str) -> "Store":
        """A store of the same kind at ``name`` beside this one (same parent)."""
        raise NotImplementedError

    def adopt(self, src: "Store", key: str, tag: str) -> None:
        """Make ``key`` of this store hold what ``key`` of ``src`` (a sibling) holds,
        replacing any object there: a hard link on local disks (staged under
        ``temp_name(key, tag)``, ``tag`` being the adopting save's id), a server-side copy
        on object stores. ``src`` keeps its object."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the directory entries of everything written so far durable."""


class LocalStore(Store):
    """A directory on a local (or mounted) file system.

    Every object is durable before :meth:`sync` returns. Large objects, the protocol's
    atomic and exclusive objects and deletions are fsynced (with their directory) as they
    are written. Small objects written with :meth:`write` are not fsynced one by one where
    ``batch_sync`` allows it: :meth:`sync` then makes them, and every directory entry, durable
    with one ``syncfs`` of their file system. ``batch_sync=None`` (the default) allows it
    where that is as safe as per-file fsync: on Linux 5.8 or later (whose ``syncfs`` reports
    writeback errors) and a file system of :data:`BATCH_FILE_SYSTEMS`; ``False`` fsyncs
    every object."""

    exclusive_create = True
    durable = True
    stages_writes = True

    def __init__(self, root: str, batch_sync: bool | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.stats = IOStats()
        self._dirs: dict[str, int] = {}
        """Every directory this store made or found, with the device (``st_dev``) it is on."""
        self._dirs_lock = threading.Lock()
        if batch_sync and _SYNCFS is None:
            raise ValueError(f"{self.root}: batch_sync=True needs syncfs(2), which this system lacks")
        self.batch_sync = batch_sync
        self._batch = _SyncBatch(syncfs_reports_errors() if batch_sync is None else batch_sync)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _makedirs(self, d: str) -> int:
        """Create directory ``d`` (inside the root) and its parents, never through a symbolic
        link inside the checkpoint (the root itself may be one); return its device."""
        with self._dirs_lock:
            dev = self._dirs.get(d)
        if dev is not None:
            return dev
        new: dict[str, int] = {}
        if self.root not in self._dirs:
            new[self.root] = self._mkdir(self.root, os.makedirs) or os.stat(self.root).st_dev
            parent = os.path.dirname(self.root)
            new[parent] = os.stat(parent).st_dev
        cur, dev = self.root, new.get(self.root, self._dirs.get(self.root))
        for part in os.path.relpath(d, self.root).split(os.sep) if d != self.root else ():
            cur = os.path.join(cur, part)
            known = self._dirs.get(cur)
            if known is None:  # a directory made here is on its parent's device
                known = self._mkdir(cur, os.mkdir) or dev
                new[cur] = known
            dev = known
        with self._dirs_lock:
            self._dirs.update(new)
        assert dev is not None
        return dev

    def _mkdir(self, path: str, mkdir: Callable[[str], None]) -> int | None:
        """Make directory ``path``: None; or the device of the directory already there."""
        try:
            mkdir(path)
            return None
        except (FileExistsError, NotADirectoryError):
            try:
                mode = os.lstat(path).st_mode
                st = os.stat(path)
            except OSError:  # a parent is a file
                mode, st = stat.S_IFREG, None
            if stat.S_ISLNK(mode) and path != self.root:
                raise NotACheckpointError(
                    f"{path} is a symbolic link inside the checkpoint at {self.root}: refusing to write through it"
                ) from None
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise NotACheckpointError(
                    f"cannot create the directory {path}: a file is in the way (a checkpoint path must be a directory)"
                ) from None
            return st.st_dev

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        path = self._path(key)
        if guard is None:
            total = self._write_file(path, buffers, defer=True)
        else:
            tmp = temp_name(path, guard.tag)
            try:
                total = self._write_file(tmp, buffers, defer=True)
                guard.check()
                if not _rename_noreplace(tmp, path):
                    guard.check(force=True)  # an object is there: replace it only while we own the path
                    os.replace(tmp, path)
            except BaseException:
                _unlink_quiet(tmp)
                raise
        self.stats.add_write(key, total)
        return total

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = _tmp_name(path)
        self._write_file(tmp, [data])
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))
        self.stats.add_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        """Written to a temporary file, fsynced, then hard-linked to ``key``: ``link``
        fails if ``key`` exists, and readers see the whole object or nothing. Where the
        file system has no hard links, ``O_EXCL`` creation (exclusive, but a reader may
        see the object before its bytes)."""
        path = self._path(key)
        tmp = _tmp_name(path)
        self._write_file(tmp, [data])
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _writev_all(fd, [data])
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(path))
        self.stats.add_write(key, len(data))

    def _write_file(self, path: str, buffers: Iterable[Buffer | bytes], defer: bool = False) -> int:
        """Create ``path`` from ``buffers`` with ``writev``, then ``fsync`` it; with ``defer``,
        a small file on a batching file system is left to :meth:`sync` instead."""
        directory = os.path.dirname(path)
        dev = self._makedirs(directory)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        total = 0
        try:
            # joined before the first byte is written: its syncfs reports every later writeback error
            batched = defer and self._batch.join(dev, directory)
            # each buffer is written before the next is pulled (producers may reuse memory),
            # except ``bytes``, which cannot change: they join the next buffer's writev
            held: list[Buffer | bytes] = []
            for b in buffers:
                held.append(b)
                if not isinstance(b, bytes) or len(held) >= 64:
                    total += _writev_all(fd, held)
                    held = []
            if held:
                total += _writev_all(fd, held)
            if not batched or total > DEFER_MAX_BYTES:
                os.fsync(fd)
            else:  # start its writeback now, so that the final syncfs mostly waits for what is done
                _start_writeback(fd)
        finally:
            os.close(fd)
        return total

    def read(self, key: str) -> bytes:
        fd = _open_regular(self._path(key))
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        self.stats.add_read(len(data))
        return data

    def read_tail(self, key: str, nbytes: int) -> bytes:
        fd, size = _open_regular_sized(self._path(key))
        try:
            if size < nbytes:
                raise OSError(f"{self._path(key)} has {size} bytes, fewer than its {nbytes}-byte index")
            data = os.pread(fd, nbytes, size - nbytes)
        finally:
            os.close(fd)
        self.stats.add_read(len(data))
        return data

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        path = self._path(key)
        fd = _open_regular(path)
        try:
            self._readv_fd(fd, path, requests)
        finally:
            os.close(fd)

    def readv_whole(self, key: str, requests: Sequence[ReadRequest], size: int) -> bool:
        path = self._path(key)
        fd, actual = _open_regular_sized(path)
        try:
            if actual != size:
                return False
            self._readv_fd(fd, path, requests)
        finally:
            os.close(fd)
        return True

    def _readv_fd(self, fd: int, path: str, requests: Sequence[ReadRequest]) -> None:
        total = calls = 0
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
        self.stats.add_read(total, calls)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list(self) -> list[str]:
        keys = []
        for d, _, files in os.walk(self.root):
            rel = os.path.relpath(d, self.root)
            keys += [f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}" for f in files]
        return sorted(keys)

    def child_names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sibling_names(self, prefix: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(os.path.dirname(self.root)) if n.startswith(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(self._path(key)))

    def prune(self, folders: Iterable[str]) -> None:
        for d in [*sorted(set(folders), key=lambda f: (-f.count("/"), f)), ""]:
            path = self._path(d) if d else self.root
            try:
                os.rmdir(path)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                    raise
                continue
            with self._dirs_lock:
                self._dirs.pop(path, None)
            _fsync_dir(os.path.dirname(path))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=False) if os.path.isdir(self.root) else None
        parent = os.path.dirname(self.root)
        if os.path.isdir(parent):
            _fsync_dir(parent)

    def sibling(self, name: str) -> "LocalStore":
        return LocalStore(os.path.join(os.path.dirname(self.root), name), self.batch_sync)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        if not isinstance(src, LocalStore):
            raise TypeError(f"cannot adopt objects of {src.url} into the local store {self.url}")
        path, source = self._path(key), src._path(key)
        self._makedirs(os.path.dirname(path))
        try:
            os.link(source, path)
            return
        except FileExistsError:
            if os.path.samefile(source, path):  # adopted already (a resumed roll-forward)
                return
        tmp = temp_name(path, tag)
        _unlink_quiet(tmp)  # (left by an adoption that crashed, resumed now)
        os.link(source, tmp)
        os.replace(tmp, path)

    def sync(self) -> None:
        """Make every object written so far durable, with its directory entry: one ``syncfs``
        per batching file system written to, then an fsync of each directory elsewhere."""
        synced = self._batch.flush()
        with self._dirs_lock:
            dirs = sorted((d for d, dev in self._dirs.items() if dev not in synced), key=len, reverse=True)
        for d in dirs:
            try:
                _fsync_dir(d)
            except FileNotFoundError:
                continue


def _open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``. :class:`FileNotFoundError` where
    nothing can be (a parent is a file, a name is too long); :class:`FormatError` for a
    directory, FIFO, device or socket, which never blocks (``O_NONBLOCK``) or streams
    without end."""
    return _open_regular_sized(path)[0]


def _open_regular_sized(path: str) -> tuple[int, int]:
    """:func:`_open_regular`, and the file's size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, "a parent is a file, not a directory", path) from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise FileNotFoundError(errno.ENOENT, "name too long", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise FormatError(f"{path} is {kind} where a file belongs")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _tmp_name(path: str) -> str:
    """A temporary name beside ``path``, unique to this call."""
    return temp_name(path, uuid.uuid4().hex)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rename_noreplace(src: str, dst: str) -> bool:
    """Move ``src`` to ``dst`` unless ``dst`` exists (then False, ``src`` stays): one
    ``renameat2(RENAME_NOREPLACE)`` on Linux, else a hard link and an unlink."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else: not on this file system
            raise OSError(err, os.strerror(err), dst)
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    os.unlink(src)
    return True


def fill(where: str, requests: Sequence[ReadRequest], datas: Sequence[Any]) -> None:
    """Copy each request's bytes (``datas[i]``, any buffer) into its buffers, one after
    another; :class:`OSError` naming ``where`` for a short read."""
    for (offset, bufs), data in zip(requests, datas):
        view, want = memoryview(data), sum(b.nbytes for b in bufs)
        if view.nbytes != want:
            raise OSError(f"{where}: short read of {view.nbytes} bytes at {offset}, wanted {want}")
        pos = 0
        for b in bufs:
            flat = b.cast("B") if b.format != "B" or b.ndim != 1 else b
            flat[:] = view[pos : pos + flat.nbytes]
            pos += flat.nbytes


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


def _libc(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning int, setting errno), or None where absent."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _libc("syncfs", ctypes.c_int)
_SYNC_FILE_RANGE = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2
_RENAMEAT2 = _libc("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _start_writeback(fd: int) -> None:
    """Start writing back the dirty pages of ``fd`` without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): a hint only; durability still comes from
    ``syncfs`` (which reports any error of this writeback)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _syncfs(fd: int) -> None:
    """``syncfs(2)``: write back and make durable every dirty page, inode and directory entry
    of the file system holding ``fd``; raise :class:`OSError` on failure."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is unavailable")
    if _SYNCFS(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def syncfs_reports_errors() -> bool:
    """Whether ``syncfs`` is available and reports writeback errors (Linux 5.8 and later:
    before, it returned success after a failed writeback, which per-file fsync reports)."""
    if _SYNCFS is None or os.uname().sysname != "Linux":
        return False
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (5, 8)


def file_system_type(dev: int) -> str | None:
    """The type (``ext4``, ``nfs``, ...) of the mounted file system with device number
    ``dev``, from ``/proc/self/mountinfo``; None where unknown."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return None


class _SyncBatch:
    """The file systems a store deferred fsyncs to: for each, a descriptor opened before the
    first deferred write on it, whose ``syncfs`` reports every writeback error since (the
    file system's error sequence is sampled when a descriptor is opened)."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self._fds: dict[int, int] = {}
        self._kinds: dict[int, bool] = {}
        self._lock = threading.Lock()

    def join(self, dev: int, directory: str) -> bool:
        """Whether a file in ``directory`` (on device ``dev``), opened but not written yet,
        may leave its fsync to :meth:`flush`."""
        if not self.allowed:
            return False
        with self._lock:
            if dev in self._fds:
                return True
            if dev not in self._kinds:
                self._kinds[dev] = file_system_type(dev) in BATCH_FILE_SYSTEMS
            if not self._kinds[dev]:
                return False
            self._fds[dev] = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
            return True

    def flush(self) -> set[int]:
        """``syncfs`` every file system joined since the last flush; return their devices."""
        with self._lock:
            fds, self._fds = self._fds, {}
        try:
            for fd in fds.values():
                _syncfs(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return set(fds)

    def __del__(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


class RetryPolicy:
    """Bounded retries with exponential backoff for transient object-store errors
    (connection resets and refusals, timeouts, HTTP 500/503 "slow down")."""

    def __init__(self, attempts: int = 4, first_delay_s: float = 0.2, max_delay_s: float = 4.0) -> None:
        self.attempts = attempts
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s

    def call(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.first_delay_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as e:
                if attempt == self.attempts or not is_transient(e):
                    raise
                log.warning("ucp_zarr: %s failed (%s: %s); retry %d of %d in %.1f s",
                            what, type(e).__name__, e, attempt, self.attempts - 1, delay)
                time.sleep(delay)
                delay = min(2 * delay, self.max_delay_s)
        raise AssertionError("unreachable")


_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH}


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` is worth a retry: a network error, a timeout, or a server that is
    busy or failing (HTTP 5xx as s3fs translates them); never a missing object, an
    existing one, or a refusal."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    # botocore's connection errors (EndpointConnectionError, ConnectionClosedError, ...)
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"HTTPClientError", "ConnectionError", "ClientPayloadError", "ServerDisconnectedError"})


def _precondition_failed(e: BaseException) -> bool:
    """An S3 ``PreconditionFailed`` (HTTP 412), which a conditional create gets when the
    object exists (s3fs says FileExistsError only where the server names the condition)."""
    cause = e.__cause__
    response = getattr(cause, "response", None) or {}
    err = response.get("Error", {}) if isinstance(response, dict) else {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    return err.get("Code") in ("PreconditionFailed", "412") or status == 412


EXCLUSIVE_PROTOCOLS = frozenset({"s3", "s3a", "memory"})
"""fsspec protocols whose exclusive create is atomic: a conditional PUT (``If-None-Match:
*``, AWS S3, SeaweedFS, MinIO) or, in memory, one dictionary insertion. Elsewhere fsspec's
``mode="create"`` is check-then-write, which two racing writers can both pass."""
DURABLE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
"""fsspec protocols of object stores, where an acknowledged PUT is durable."""


class FsspecStore(Store):
    """Any fsspec filesystem. Objects are written whole or multipart by fsspec; a PUT is
    atomic on object stores, so the commit record needs no rename. Exclusive creation is
    atomic only for :data:`EXCLUSIVE_PROTOCOLS` (:attr:`exclusive_create`).

    Every operation is retried on transient errors by ``retry``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.stats = IOStats()
        self.retry = retry or RetryPolicy()
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.exclusive_create = bool(protocols & EXCLUSIVE_PROTOCOLS)
        self.durable = bool(protocols & DURABLE_PROTOCOLS)

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, key)

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        if guard is not None:  # a PUT cannot be made conditional on the owner: check just before it
            guard.check()

        def attempt() -> int:
            total = 0
            with self.fs.open(self._path(key), "wb") as f:
                for b in buffers:
                    total += f.write(memoryview(b).cast("B"))
            return total

        # a one-pass iterator cannot be replayed: its retries are fsspec's own (per request)
        one_pass = isinstance(buffers, Iterator)
        total = attempt() if one_pass else self.retry.call(f"writing {self.url}/{key}", attempt)
        self.stats.add_write(key, total)
        return total

    def write_atomic(self, key: str, data: bytes) -> None:
        self.retry.call(f"writing {self.url}/{key}", lambda: self.fs.pipe_file(self._path(key), data))
        self.stats.add_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def create() -> None:
            if isinstance(self.fs, MemoryFileSystem):  # one dictionary insertion: atomic
                f = MemoryFile(self.fs, self.fs._strip_protocol(path), data)
                if self.fs.store.setdefault(f.path, f) is not f:
                    raise FileExistsError(f"{self.url}/{key} exists")
                return
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                raise
            except OSError as e:
                if _precondition_failed(e):
                    raise FileExistsError(f"{self.url}/{key} exists") from e
                raise

        try:
            self.retry.call(f"creating {self.url}/{key}", create)
        except FileExistsError:
            # a retried create whose first attempt landed: the object is ours
            if not self.holds(key, data):
                raise
        self.stats.add_write(key, len(data))

    def read(self, key: str) -> bytes:
        data = self.retry.call(f"reading {self.url}/{key}", lambda: self.fs.cat_file(self._path(key)))
        self.stats.add_read(len(data))
        return data

    def read_small(self, key: str, limit: int) -> bytes | None:
        # one ranged request for at most limit + 1 bytes: more than limit means a larger object
        data = self.retry.call(
            f"reading {self.url}/{key}", lambda: self.fs.cat_file(self._path(key), start=0, end=limit + 1)
        )
        self.stats.add_read(len(data))
        return data if len(data) <= limit else None

    def read_tail(self, key: str, nbytes: int) -> bytes:
        data = self.retry.call(f"reading {self.url}/{key}", lambda: self.fs.cat_file(self._path(key), start=-nbytes))
        if len(data) != nbytes:
            raise OSError(f"{self._path(key)} is shorter than the {nbytes} bytes read from its end")
        self.stats.add_read(len(data))
        return data

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        path = self._path(key)
        sizes = [sum(b.nbytes for b in bufs) for _, bufs in requests]

        def fetch() -> list[Any]:
            datas = self.fs.cat_ranges(
                [path] * len(requests), [o for o, _ in requests], [o + n for (o, _), n in zip(requests, sizes)]
            )
            for data in datas:
                if isinstance(data, Exception):
                    raise data
            return datas

        fill(path, requests, self.retry.call(f"reading {self.url}/{key}", fetch))
        self.stats.add_read(sum(sizes), len(requests))

    def exists(self, key: str) -> bool:
        return self.retry.call(f"looking up {self.url}/{key}", lambda: self.fs.exists(self._path(key)))

    def list(self) -> list[str]:
        def find() -> list[str]:
            try:
                self.fs.invalidate_cache(self.root)
                return self.fs.find(self.root)
            except FileNotFoundError:
                return []

        prefix = self.root + "/"
        return sorted(p[len(prefix) :] for p in self.retry.call(f"listing {self.url}", find) if p.startswith(prefix))

    def _ls(self, path: str) -> list[str]:
        """The names of the entries under ``path`` (an emptied folder that the server keeps,
        as SeaweedFS's filer does, lists itself: that entry is not a child)."""

        def ls() -> list[str]:
            try:
                self.fs.invalidate_cache(path)
                return self.fs.ls(path, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []

        own = path.strip("/")
        names = {posixpath.basename(p.rstrip("/")) for p in self.retry.call(f"listing {path}", ls) if p.strip("/") != own}
        return sorted(n for n in names if n)

    def child_names(self) -> list[str]:
        return self._ls(self.root)

    def sibling_names(self, prefix: str) -> list[str]:
        return [n for n in self._ls(posixpath.dirname(self.root)) if n.startswith(prefix)]

    def delete(self, key: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

        self.retry.call(f"deleting {self.url}/{key}", rm)

    def prune(self, folders: Iterable[str]) -> None:
        # only object stores that keep folder entries (SeaweedFS's filer) list emptied folders
        for d in [*sorted(set(folders), key=lambda f: (-f.count("/"), f)), ""]:
            path = posixpath.join(self.root, d) if d else self.root
            if not self._ls(path):
                self._remove_folder_entry(path)

    def remove(self) -> None:
        keys = self.list()
        for key in keys:
            self.delete(key)
        # object stores that keep folder entries (SeaweedFS's filer) list emptied prefixes
        # until their "<prefix>/" entries are deleted too; elsewhere these deletes are no-ops
        folders: set[str] = set()
        for key in keys:
            folder = posixpath.dirname(key)
            while folder:
                folders.add(folder)
                folder = posixpath.dirname(folder)
        for folder in sorted(folders, key=lambda f: -f.count("/")):
            self._remove_folder_entry(posixpath.join(self.root, folder))
        self._remove_folder_entry(self.root)

    def _remove_folder_entry(self, path: str) -> None:
        try:
            self.fs.rm_file(path + "/")
        except OSError:
            pass

    def sibling(self, name: str) -> "FsspecStore":
        parent = posixpath.dirname(self.url)
        if not parent or parent.endswith(":/") or parent.endswith(":"):
            raise ValueError(f"{self.url} has no parent to hold a sibling {name!r}")
        return FsspecStore(f"{parent}/{name}", self.storage_options, self.retry)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        if not isinstance(src, FsspecStore) or type(src.fs) is not type(self.fs):
            raise TypeError(f"cannot adopt objects of {src.url} into {self.url}")
        self.retry.call(f"copying {src.url}/{key}", lambda: self.fs.copy(src._path(key), self._path(key)))


def open_store(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """A store for a local path or ``file://`` URL (always the local store: exclusive
    creation, fsync), an object-store URL (``s3://``, ``gs://``, ``az://``: obstore, see
    :mod:`.obstore`), or any other fsspec URL. ``storage_options`` apply to URLs
    only; given for a local path they are refused, never silently ignored."""
    path = os.fspath(path)
    local = path[len("file://") :] if path.startswith("file://") else path if "://" not in path else None
    if local is None:
        from .obstore import open_url

        return open_url(path, storage_options)
    if storage_options:
        raise OptionError(
            Keyword("storage_options"), f" {sorted(storage_options)} do not apply to the local path {local!r} "
            "(it is written with the local store); drop them",
        )
    return LocalStore(local)
