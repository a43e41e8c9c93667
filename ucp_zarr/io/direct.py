"""Reading and writing large spans of local files around the page cache (Linux ``O_DIRECT``).

Read through the page cache, a cold load pays the kernel's copy of every byte into the
caller's buffer: as much CPU as all of the load's own work (checksums, landing chunks in
tensors). Read with ``O_DIRECT``, the device writes straight into the load's page-aligned
staging buffer and the kernel copies nothing. Spans the page cache already holds (a
checkpoint just written or read before) are read through it: memory is faster than the
device. Measured in ``benchmarks/results/profiles.md`` ("2026-12-06").

Written through the page cache, a save's threads copy every byte into it and then do much of
its writeback; a large object written with ``O_DIRECT`` from an aligned stage (:class:`StagedWrite`)
costs neither, and is fsynced as before. Background saves write through the cache: beside
a training loop, the device's bursts cost a step more.

Coherence: a direct read first writes back any dirty cached pages of its range (the
kernel's rule for ``O_DIRECT``), and every chunk read is checked against its crc32c and
its shard's trailer, whichever way it was read.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import numpy as np

try:
    import fcntl
except ImportError:  # (not a POSIX system: nothing is read or written around a cache)
    fcntl = None  # type: ignore[assignment]

ALIGN = 4096
"""Direct reads start, end and land on multiples of this (every common logical block size
divides it)."""
MIN_DIRECT_BYTES = 1 << 20
"""Shorter spans are read through the page cache: a direct read's alignment padding and
fixed cost do not pay for less."""

_O_DIRECT = getattr(os, "O_DIRECT", 0) if fcntl is not None else 0


def aligned(offset: int, nbytes: int) -> tuple[int, int]:
    """The smallest span of whole ``ALIGN`` blocks holding ``[offset, offset + nbytes)``."""
    return offset - offset % ALIGN, -(-(offset + nbytes) // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer of ``nbytes`` starting on an ``ALIGN`` boundary (a direct read or
    write may use it)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_MMAP = getattr(_LIBC, "mmap", None)
_MINCORE = getattr(_LIBC, "mincore", None)
_MUNMAP = getattr(_LIBC, "munmap", None)
if _MMAP is not None and _MINCORE is not None and _MUNMAP is not None:
    _MMAP.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    _MMAP.restype = ctypes.c_void_p
    _MINCORE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _MINCORE.restype = ctypes.c_int
    _MUNMAP.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _MUNMAP.restype = ctypes.c_int
else:
    _MMAP = None
_MAP_FAILED = ctypes.c_void_p(-1).value

AVAILABLE = bool(_O_DIRECT) and _MMAP is not None
"""This system has ``O_DIRECT`` and ``mincore`` (Linux)."""


def cached_fraction(fd: int, start: int, end: int) -> float:
    """The share of the pages of ``[start, end)`` (inside the file) that the page cache holds
    (``mincore`` of a mapping that is never touched: nothing is read). 1.0 where that cannot
    be told."""
    page = os.sysconf("SC_PAGE_SIZE")
    start -= start % page
    length = end - start
    if _MMAP is None or length <= 0:
        return 1.0
    addr = _MMAP(None, length, 1, 1, fd, start)  # PROT_READ, MAP_SHARED
    if addr is None or addr == _MAP_FAILED:
        return 1.0
    try:
        vec = np.zeros(-(-length // page), dtype=np.uint8)
        if _MINCORE(addr, length, vec.ctypes.data) != 0:
            return 1.0
        return float(np.count_nonzero(vec & 1)) / vec.size
    finally:
        _MUNMAP(addr, length)


def read_direct(fd: int, buf: np.ndarray, start: int, want: int) -> int:
    """Read bytes ``start`` (a multiple of :data:`ALIGN`) to at least ``start + want`` of the
    file ``fd`` into ``buf`` (uint8, :data:`ALIGN`-aligned, its size a multiple of
    :data:`ALIGN` and at least ``want``) with ``O_DIRECT``, up to the file's end; return the
    bytes read (fewer than ``want`` only at the file's end). ``fd`` keeps ``O_DIRECT`` set.
    :class:`OSError` with ``EINVAL`` where the file system reads nothing directly."""
    if not _O_DIRECT:
        raise OSError(errno.EINVAL, "O_DIRECT is unavailable on this system")
    assert buf.ctypes.data % ALIGN == 0 and buf.size % ALIGN == 0 and start % ALIGN == 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    view, got = memoryview(buf), 0
    try:
        while got < want:
            n = os.preadv(fd, [view[got:]], start + got)
            if n <= 0:
                break
            got += n
            if got % ALIGN:  # (a partial block: the file's end)
                break
    except OSError:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # (the caller may read through the cache instead)
        raise
    return got


# --- writing ---------------------------------------------------------------------------------

WRITE_STAGE_BYTES = 8 << 20
"""An object larger than this is written around the page cache, this many bytes at a time;
a smaller one through it, in one write."""
MAX_RESERVE_BYTES = 1 << 20
"""The most a producer may fill in place at once (:func:`reserve`): the stage has this much
room beyond :data:`WRITE_STAGE_BYTES`."""

_write_local = threading.local()


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _write_stage() -> np.ndarray:
    """This thread's page-aligned buffer for :class:`StagedWrite`, of :data:`WRITE_STAGE_BYTES`
    and :data:`MAX_RESERVE_BYTES` beyond (its own: a producer's buffers may be views of the
    read and write staging buffer)."""
    n = WRITE_STAGE_BYTES + MAX_RESERVE_BYTES
    buf = getattr(_write_local, "stage", None)
    if buf is None or buf.size != n:
        buf = _write_local.stage = aligned_empty(n)
    return buf


def reserve(nbytes: int) -> np.ndarray | None:
    """Where this thread's staged write (:class:`StagedWrite`, while one is open) takes its
    next ``nbytes``: a producer may gather them there and hand over that very view, which
    then costs no copy. None without an open staged write, or for more than
    :data:`MAX_RESERVE_BYTES`."""
    staged = getattr(_write_local, "open", None)
    if staged is None or nbytes > MAX_RESERVE_BYTES:
        return None
    return staged.stage[staged._pos : staged._pos + nbytes]


class StagedWrite:
    """One new file's bytes, gathered in this thread's stage: an object that fits is written
    through the page cache in one call; a larger one with ``O_DIRECT`` a stage at a time (the
    last block padded, then the file cut to its size), unless the file system refuses it
    (``EINVAL``: then through the cache, and :attr:`refused` says so). The caller makes the
    file durable (``fsync``) either way."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.stage = _write_stage()
        self.direct = False
        """Whether the file is written around the cache."""
        self.refused = False
        self._pos = 0
        self._offset = 0
        _write_local.open = self

    def add(self, data: memoryview | bytes) -> None:
        """Copy ``data`` in (written once the stage is full): ``data`` may change afterwards.
        ``data`` filled in place (:func:`reserve`) is taken as it is."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        stage, size = self.stage, WRITE_STAGE_BYTES
        if view.nbytes and _address(view) == stage.ctypes.data + self._pos:  # (filled in place)
            self._pos += view.nbytes
            while self._pos >= size:  # the stage, then the rest (in its spare room) moved to its start
                self._flush(size, start_direct=True, keep=self._pos - size)
            return
        while view.nbytes:
            n = min(view.nbytes, size - self._pos)
            stage[self._pos : self._pos + n] = np.frombuffer(view[:n], dtype=np.uint8)
            self._pos += n
            view = view[n:]
            if self._pos == size:  # (more to come: around the cache from here)
                self._flush(size, start_direct=True)

    def finish(self) -> int:
        """Write what is left; return the file's size. The staged write is closed."""
        self.close()
        total = self._offset + self._pos
        if self._pos:
            if self.direct:  # whole blocks only: pad the last, then cut the file to its size
                end = aligned(0, self._pos)[1]
                self.stage[self._pos : end] = 0
                self._flush(end)
                os.ftruncate(self.fd, total)
            else:
                self._flush(self._pos)
        return total

    def close(self) -> None:
        """No more producers fill this stage in place (:func:`reserve`)."""
        if getattr(_write_local, "open", None) is self:
            _write_local.open = None

    def _flush(self, n: int, start_direct: bool = False, keep: int = 0) -> None:
        """Write the stage's first ``n`` bytes; then the ``keep`` bytes after them are the
        stage's first."""
        if start_direct and _O_DIRECT and not self.direct and not self.refused:
            self._start_direct()
        view, done = memoryview(self.stage)[:n], 0
        while done < n:
            try:
                done += os.pwrite(self.fd, view[done:], self._offset + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL and done == 0):
                    raise
                self._stop_direct()  # (the file system took the flag but not the write)
        self._offset += n
        if keep:
            self.stage[:keep] = self.stage[n : n + keep]
        self._pos = keep

    def _start_direct(self) -> None:
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | _O_DIRECT)
            self.direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.refused = True

    def _stop_direct(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct, self.refused = False, True
