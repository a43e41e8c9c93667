"""The local file system store: plain ``os`` calls (``writev``/``preadv`` straight from and into
tensor memory; large cold spans read and large objects written around the page cache,
:mod:`.direct`), exclusive creation by ``link``/``renameat2``, ``fsync`` of files and directories
or one ``syncfs`` of the file system for a batch of small objects."""

from __future__ import annotations

import ctypes
import logging
import errno
import os
import re
import shutil
import stat
import threading
import uuid
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..errors import FormatError, NotACheckpointError
from . import direct
from .store import Buffer, IOStats, ReadRequest, ShortReadError, Store, WriteGuard, check_document_size, temp_name

log = logging.getLogger(__name__)


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


class LocalStore(Store):
    """A directory on a local (or mounted) file system.

    Every object is durable before :meth:`sync` returns. Large objects, the protocol's
    atomic and exclusive objects and deletions are fsynced (with their directory) as they
    are written. Small objects written with :meth:`write` are not fsynced one by one where
    ``batch_sync`` allows it: :meth:`sync` then makes them, and every directory entry, durable
    with one ``syncfs`` of their file system. ``batch_sync=None`` (the default) allows it
    where that is as safe as per-file fsync: on Linux 5.8 or later (whose ``syncfs`` reports
    writeback errors) and a file system of :data:`BATCH_FILE_SYSTEMS`; ``False`` fsyncs
    every object.

    ``direct_reads``: how large spans are read (:meth:`read_span`, the bulk of a load):
    None (the default) around the page cache (``O_DIRECT``) where the cache holds less than
    half of the span, through it where it holds more, and always through it once
    :meth:`share_reads` says that other processes read too; True always around it (where
    the file system can), False always through it. ``direct_writes``: data objects larger
    than :data:`.direct.WRITE_STAGE_BYTES` are written around the page cache (then fsynced),
    unless False or :meth:`write_in_background` says that the writes run beside training
    (where the device's bursts cost a training step more than writes through the cache)."""

    exclusive_create = True
    durable = True
    stages_writes = True

    def __init__(
        self, root: str, batch_sync: bool | None = None, direct_reads: bool | None = None, direct_writes: bool = True
    ) -> None:
        self.root = os.path.abspath(root)
        self.url = self.local_path = self.root
        self.stats = IOStats()
        self._dirs: dict[str, int] = {}
        """Every directory this store made or found, with the device (``st_dev``) it is on."""
        self._dirs_lock = threading.Lock()
        if batch_sync and _SYNCFS is None:
            raise ValueError(f"{self.root}: batch_sync=True needs syncfs(2), which this system lacks")
        self.batch_sync = batch_sync
        self._batch = _SyncBatch(syncfs_reports_errors() if batch_sync is None else batch_sync)
        self.direct_reads = direct_reads
        self._direct = direct.AVAILABLE and direct_reads is not False
        """False once the file system refused a direct read (then every read goes through the cache)."""
        self.direct_writes = direct_writes
        self._direct_writes = direct_writes and direct.AVAILABLE
        """False once the file system refused a direct write, or writes run beside training."""

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
        rel = d[len(self.root) :].lstrip(os.sep) if d.startswith(self.root) else os.path.relpath(d, self.root)
        for part in rel.split(os.sep) if rel else ():
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
            total, direct_ = self._write_file(path, buffers, defer=True)
        else:
            tmp = temp_name(path, guard.tag)
            try:
                total, direct_ = self._write_file(tmp, buffers, defer=True)
                guard.check()
                if not _rename_noreplace(tmp, path):
                    guard.check(force=True)  # an object is there: replace it only while we own the path
                    os.replace(tmp, path)
            except BaseException:
                _unlink_quiet(tmp)
                raise
        self.stats.add_write(key, total, direct_)
        return total

    def write_atomic(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = _tmp_name(path)
        self._write_file(tmp, [data])
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
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
        fsync_dir(os.path.dirname(path))
        self.stats.add_write(key, len(data))

    def _write_file(self, path: str, buffers: Iterable[Buffer | bytes], defer: bool = False) -> tuple[int, bool]:
        """Create ``path`` from ``buffers``, then ``fsync`` it; with ``defer``, a small file
        on a batching file system is left to :meth:`sync` instead. A data object (``defer``)
        whose ``buffers`` say it is larger than a stage (``nbytes``) is written around the
        page cache (:class:`.direct.StagedWrite`), with :attr:`direct_writes`. Returns the
        file's size and whether it was written around the cache."""
        directory = os.path.dirname(path)
        dev = self._makedirs(directory)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            # joined before the first byte is written: its syncfs reports every later writeback error
            batched = defer and self._batch.join(dev, directory)
            direct_ = False
            if defer and self._direct_writes and getattr(buffers, "nbytes", 0) > direct.WRITE_STAGE_BYTES:
                staged = direct.StagedWrite(fd)
                try:
                    for b in buffers:
                        staged.add(b)
                finally:
                    staged.close()
                total, direct_ = staged.finish(), staged.direct
                if staged.refused:  # (this file system writes nothing directly: through the cache from now on)
                    self._direct_writes = False
            else:
                total = _write_buffers(fd, buffers)
            if direct_ or not batched or total > DEFER_MAX_BYTES:
                os.fsync(fd)
            else:  # start its writeback now, so that the final syncfs mostly waits for what is done
                _start_writeback(fd)
        finally:
            os.close(fd)
        return total, direct_

    def read(self, key: str) -> bytes:
        path = self._path(key)
        fd, size = _open_regular_sized(path)
        with os.fdopen(fd, "rb") as f:
            check_document_size(path, size)
            data = f.read()
        self.stats.add_read(len(data))
        return data

    def read_tail(self, key: str, nbytes: int) -> bytes:
        fd, size = _open_regular_sized(self._path(key))
        try:
            if size < nbytes:
                raise ShortReadError(f"{self._path(key)} has {size} bytes, fewer than its {nbytes}-byte index")
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

    def read_span(
        self, key: str, offset: int, nbytes: int, stage: Callable[[int], np.ndarray], size: int | None = None
    ) -> Buffer | None:
        path = self._path(key)
        fd, actual = _open_regular_sized(path)
        try:
            if size is not None and actual != size:
                return None
            if offset + nbytes > actual:
                raise ShortReadError(f"{path}: short read of {max(0, actual - offset)} bytes at {offset}, wanted {nbytes}")
            start, end = direct.aligned(offset, nbytes)
            if self._direct and nbytes >= direct.MIN_DIRECT_BYTES and (
                self.direct_reads or direct.cached_fraction(fd, start, min(end, actual)) < 0.5
            ):
                buf = stage(end - start)[: end - start]
                try:
                    got = direct.read_direct(fd, buf, start, offset + nbytes - start)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct = False  # (this file system reads nothing directly: through the cache from now on)
                else:
                    if got < offset + nbytes - start:
                        got -= offset - start
                        raise ShortReadError(f"{path}: short read of {got} bytes at {offset}, wanted {nbytes}")
                    self.stats.add_read(got, direct=True)
                    return memoryview(buf)[offset - start : offset - start + nbytes]
            view = memoryview(stage(nbytes)[:nbytes])
            self._readv_fd(fd, path, [(offset, [view])])
            return view
        finally:
            os.close(fd)

    def write_in_background(self) -> None:
        self.direct_writes = self._direct_writes = False

    def share_reads(self) -> None:
        if self.direct_reads is None:
            self._direct = False

    def _readv_fd(self, fd: int, path: str, requests: Sequence[ReadRequest]) -> None:
        total = calls = 0
        for offset, bufs in requests:
            for start in range(0, len(bufs), _IOV_MAX):
                part = bufs[start : start + _IOV_MAX]
                want = sum(b.nbytes for b in part)
                got = _preadv_all(fd, part, offset)
                if got != want:
                    raise ShortReadError(f"{path}: short read of {got} bytes at {offset}, wanted {want}")
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
        parent = os.path.dirname(self.root)
        try:
            return sorted(n for n in os.listdir(parent) if n.startswith(prefix) and not os.path.islink(os.path.join(parent, n)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        folder = self._remove(key, {})
        if folder is not None:
            fsync_dir(folder)

    def delete_many(self, keys: Sequence[str]) -> None:
        """(Each folder fsynced once, after its last removal.)"""
        linked: dict[str, bool] = {}
        for folder in sorted({f for key in keys if (f := self._remove(key, linked)) is not None}):
            fsync_dir(folder)

    def _remove(self, key: str, linked: dict[str, bool]) -> str | None:
        """Remove ``key``'s file; its folder, or None where nothing was there. Never through a
        symbolic link below the root: an object in a linked folder is the link target's, and
        stays (the link too, with a warning naming it)."""
        if self._link_on_the_way(key, linked) is not None:
            return None
        try:
            os.remove(path := self._path(key))
        except _NO_OBJECT:
            return None
        return os.path.dirname(path)

    def _link_on_the_way(self, key: str, linked: dict[str, bool]) -> str | None:
        """The first folder of ``key``'s path below the root that is a symbolic link, or None
        (``linked`` caches the answers for the folders seen; each link found is logged once)."""
        cur = self.root
        for part in key.split("/")[:-1]:
            cur = os.path.join(cur, part)
            if cur not in linked:
                linked[cur] = os.path.islink(cur)
                if linked[cur]:
                    log.warning("ucp_zarr: left %s and what it links to in place (nothing is deleted through a symbolic "
                                "link inside a checkpoint): remove it yourself if it is no longer needed", cur)
            if linked[cur]:
                return cur
        return None

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
            fsync_dir(os.path.dirname(path))

    def remove_link(self) -> bool:
        if not os.path.islink(self.root):
            return False
        os.unlink(self.root)
        fsync_dir(os.path.dirname(self.root))
        return True

    def remove(self) -> None:
        if os.path.isdir(self.root):  # (what another remover took first is gone, as wanted: racing clean-ups)
            shutil.rmtree(self.root, onerror=_unless_gone)
        parent = os.path.dirname(self.root)
        if os.path.isdir(parent):
            fsync_dir(parent)

    def sibling(self, name: str) -> "LocalStore":
        return LocalStore(
            os.path.join(os.path.dirname(self.root), name), self.batch_sync, self.direct_reads, self.direct_writes
        )

    def child(self, name: str) -> "LocalStore":
        return LocalStore(os.path.join(self.root, name), self.batch_sync, self.direct_reads, self.direct_writes)

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
                fsync_dir(d)
            except FileNotFoundError:
                continue


_NO_OBJECT = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""What removing an object that is not there raises: nothing at its path, a folder there (of
other objects' keys: ``c/0`` of ``c/0/0``), or a file where a folder of its path would be."""


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


def _unless_gone(func: Callable[..., Any], path: str, exc_info: Any) -> None:
    """``shutil.rmtree``'s error handler: raise, unless the entry is gone already."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]


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


def _flat(bufs: Sequence[Buffer | bytes]) -> list[memoryview]:
    views = [memoryview(b) for b in bufs]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if v.nbytes]


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (after a partial vectored read or write)."""
    while views and n >= views[0].nbytes:
        n -= views.pop(0).nbytes
    if n:
        views[0] = views[0][n:]


def _write_buffers(fd: int, buffers: Iterable[Buffer | bytes]) -> int:
    """Write ``buffers`` in order; each is written before the next is pulled (producers may
    reuse memory), except ``bytes``, which cannot change: they join the next buffer's writev."""
    total = 0
    held: list[Buffer | bytes] = []
    for b in buffers:
        held.append(b)
        if not isinstance(b, bytes) or len(held) >= 64:
            total += _writev_all(fd, held)
            held = []
    if held:
        total += _writev_all(fd, held)
    return total


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


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's entries (or a file's data) durable: ``fsync`` of it, opened read-only."""
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
_RENAME_EXCHANGE = 2


def exchange_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or file system cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


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

