"""Where bytes live: the store interface every backend implements.

Keys are ``/``-separated paths relative to the checkpoint root. One module per backend:
:mod:`.local` (plain ``os`` calls, ``writev``/``preadv`` straight from and into tensor memory,
``fsync`` or one ``syncfs`` for a batch of small objects), :mod:`.fsspec` (any fsspec URL,
with retries of transient errors), :mod:`.obstore` (object stores); :mod:`.factory` opens
the one a path names. Every store counts what it reads and writes in :class:`IOStats`.
"""

from __future__ import annotations

import posixpath
import threading
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from ..errors import OptionError


Buffer = memoryview
ReadRequest = tuple[int, Sequence[memoryview]]

"""Fill these writable buffers, one after another, from this byte offset of an object."""
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class IOStats:
    """Counters of one store's traffic (thread-safe)."""

    bytes_read: int = 0
    read_calls: int = 0
    bytes_read_direct: int = 0
    """Of ``bytes_read``, those read around the page cache (:mod:`.direct`)."""
    bytes_written: int = 0
    bytes_written_direct: int = 0
    """Of ``bytes_written``, those written around the page cache (:mod:`.direct`)."""
    written: list[str] = field(default_factory=list)
    """Keys of the objects written, in order."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, nbytes: int, calls: int = 1, direct: bool = False) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_calls += calls
            if direct:
                self.bytes_read_direct += nbytes

    def add_write(self, key: str, nbytes: int, direct: bool = False) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.written.append(key)
            if direct:
                self.bytes_written_direct += nbytes


class WriteGuard(Protocol):
    """A save's right to write into a store (:class:`~ucp_zarr.protocol.liveness.Fence`)."""

    tag: str
    """The save's id: names its temporary objects (:func:`temp_name`)."""

    def check(self, force: bool = False) -> None:
        """Raise unless the save still owns the path (``force``: ask the store now)."""


def temp_name(key: str, tag: str) -> str:
    """Where a guarded write of ``key`` by save ``tag`` is staged before it is moved into place."""
    return f"{key}.tmp-{tag}"



def no_parent(url: str, name: str) -> OptionError:
    """The error of :meth:`Store.sibling` for a store at the top of its bucket or file
    system, which an overwrite cannot stage a new checkpoint beside."""
    return OptionError(f"{url} has no parent to hold a sibling {name!r} (an overwrite stages the new checkpoint "
                       "beside the old one): keep checkpoints in a folder below the store's root")

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
    own_buffers: bool = False
    """Reads come back in the store's own buffer (an object store client's), so a read into
    the caller's memory is one more copy: :meth:`read_whole` hands that buffer over instead."""
    local_path: str | None = None
    """The root's folder on this machine's file system, where the store has one (what may
    be checked for symbolic links, or handed to tools that take a path)."""
    request_concurrency: int | None = None
    """How many objects a save writes, and a load reads, at once when the caller does not
    say (``max_workers``): where each request waits a network round trip (an object store),
    more than this machine's CPU threads; None: the library's default (4), right for disks.
    Also how many of the protocol's own requests go at once (an overwrite's copies, bulk
    deletes, a manager's step checks, a listing of a run's steps: :func:`at_once`; the
    shards ``verify`` checks: :func:`in_order`), and, where set, a save's first reads of
    its path are two listings at once (``Transaction.begin``)."""

    def holding(self, nbytes: int) -> AbstractContextManager[Any]:
        """Entered while ``nbytes`` of this store's traffic are in memory (an object fetched
        and not yet landed, a large object's parts being sent), where the store bounds how
        many such are at once (see :attr:`request_concurrency`); bounds nothing by default.
        Never entered twice by one thread."""
        return nullcontext()

    @property
    def name(self) -> str:
        """The last component of the root (the checkpoint's directory name)."""
        return posixpath.basename(self.url.rstrip("/"))

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        """Write an object from ``buffers`` in order, durably; return its size.

        Each buffer is consumed (written, or copied) before the next is pulled from
        ``buffers``, so a producer may reuse one buffer's memory for the next. A store may
        iterate ``buffers`` again to retry a failed write, unless it is an iterator.
        ``buffers`` may tell the object's size in advance (an ``nbytes`` attribute): a local
        store writes a large object around the page cache.

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
        """A whole object (a document: at most :data:`MAX_DOCUMENT_BYTES`, else
        :class:`~ucp_zarr.FormatError`, before it is read where the store can tell its size
        first); :class:`FileNotFoundError` if absent."""
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

    def read_small(self, key: str, limit: int) -> Buffer | None:
        """The whole object (bytes, or a view of the store's own buffer) in one request if it
        has at most ``limit`` bytes, else None; None
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

    def read_span(
        self, key: str, offset: int, nbytes: int, stage: Callable[[int], np.ndarray], size: int | None = None
    ) -> Buffer | None:
        """Bytes ``offset`` to ``offset + nbytes`` of an object, read into the buffer that
        ``stage(n)`` gives (uint8, page-aligned, at least ``n`` bytes; the store picks
        ``n >= nbytes``) and returned as a view of it. With ``size``, as
        :meth:`readv_whole`: None, reading nothing, unless the object has exactly ``size``
        bytes. A local store reads a large span the page cache does not hold around it
        (:mod:`.direct`); :class:`ShortReadError` when the object ends first."""
        buf = memoryview(stage(nbytes)[:nbytes])
        if size is None:
            self.readv(key, [(offset, [buf])])
        elif not self.readv_whole(key, [(offset, [buf])], size):
            return None
        return buf

    def write_in_background(self) -> None:
        """This store's writes run beside training (a background save): write as gently as
        the store can (a local store: through the page cache, at the pace writeback takes)."""

    def share_reads(self) -> None:
        """Other processes (the ranks of one job) may read the same objects at the same time:
        read through caches they share rather than around them (a local store: through the
        page cache, so that ranks of one node reading one shard read it from the device
        once)."""

    def read_whole(self, key: str, size: int) -> Buffer | None:
        """The whole object in one request, in the store's own buffer (no copy), if it has
        exactly ``size`` bytes; None, reading nothing more, if it has another size. Only
        stores with :attr:`own_buffers`."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self) -> list[str]:
        """The keys of every object under the root (recursively), sorted."""
        raise NotImplementedError

    def child_names(self) -> list[str]:
        """The names of the root's immediate children (objects and folders), sorted."""
        return sorted({k.split("/", 1)[0] for k in self.list()})

    def sibling_names(self, prefix: str) -> list[str]:
        """The names beside the root (in its parent) that start with ``prefix`` (a symbolic
        link is none of the protocol's: never named, so never removed through)."""
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

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every object of ``keys`` (absent ones are no error), durably once it
        returns, in no order among them: in bulk requests where the store has them."""
        for key in keys:
            self.delete(key)

    def remove(self) -> None:
        """Remove every object under the root, and the root itself where that means anything."""
        raise NotImplementedError

    def remove_link(self) -> bool:
        """Where the root is a symbolic link (a folder linked into a run), remove the link,
        never what it names, and return True; else False (the default: no links here)."""
        return False

    def sibling(self, name: str) -> "Store":
        """A store of the same kind at ``name`` beside this one (same parent);
        :func:`no_parent` where it has none."""
        raise NotImplementedError

    def child(self, name: str) -> "Store":
        """A store of the same kind, with the same client and options, rooted at the
        folder ``name`` under this one (a step folder of a run's root)."""
        raise NotImplementedError

    def adopt(self, src: "Store", key: str, tag: str) -> None:
        """Make ``key`` of this store hold what ``key`` of ``src`` (a sibling) holds,
        replacing any object there: a hard link on local disks (staged under
        ``temp_name(key, tag)``, ``tag`` being the adopting save's id), a server-side copy
        on object stores. ``src`` keeps its object."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the directory entries of everything written so far durable."""


MAX_DOCUMENT_BYTES = 1 << 30
"""The largest object :meth:`Store.read` reads (documents and the protocol's records: a commit
record of 16,384 ranks is about 30 MiB): a larger one is no document of a checkpoint, and is
refused before its bytes are read (a crafted or damaged checkpoint must not exhaust memory)."""


def check_document_size(where: str, size: int) -> None:
    """Refuse (:class:`~ucp_zarr.FormatError`) an object of ``size`` bytes read as a document."""
    from ..errors import FormatError

    if size > MAX_DOCUMENT_BYTES:
        raise FormatError(f"{where} has {size:,} bytes, more than any document of a checkpoint "
                          f"({MAX_DOCUMENT_BYTES:,}): damaged, or not a ucp_zarr checkpoint")


def folders_of(keys: Iterable[str]) -> set[str]:
    """Every folder holding one of ``keys`` (``a/b`` for ``a/b/c``, and ``a``), at any depth;
    not the root."""
    folders: set[str] = set()
    for key in keys:
        while (key := key.rpartition("/")[0]) and key not in folders:
            folders.add(key)
    return folders


def wait_all(jobs: Sequence[Future[Any]]) -> None:
    """Wait for ``jobs``, submitted in this order to one pool. Once one fails, those not
    started are cancelled and, when the running ones are done, the first failure in the
    jobs' order is raised: the same one whatever the timing (every job before a failing one
    has started, as a pool takes them in order, and runs to its end)."""
    wait(jobs, return_when=FIRST_EXCEPTION)
    for job in jobs:
        job.cancel()
    wait(jobs)
    for job in jobs:
        if not job.cancelled():
            job.result()


def at_once(store: Store, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``fn(item)`` for every item, :attr:`Store.request_concurrency` at a time where the
    store waits a round trip per request (one after another where it declares none): the
    results in the items' order; once none runs any more, the first failure is raised."""
    items = list(items)
    workers = min(store.request_concurrency or 1, len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        jobs = [pool.submit(fn, item) for item in items]
    return [job.result() for job in jobs]


def in_order(store: Store, fn: Callable[[T], R], items: Iterable[T]) -> Generator[R, None, None]:
    """``fn(item)`` for every item, lazily, in the items' order, :attr:`Store.request_concurrency`
    running at once where the store declares one (one after another where not), at most
    twice that many taken from ``items`` ahead of the caller. A caller that stops early
    cancels what has not started."""
    workers = store.request_concurrency or 1
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(workers)
    try:
        ahead: deque[Future[R]] = deque()
        for item in items:
            ahead.append(pool.submit(fn, item))
            if len(ahead) >= 2 * workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


class ShortReadError(OSError):
    """An object ended before the bytes a read asked for (a truncated object: damage, unlike
    an OSError of the store itself, which a retry may get past)."""


def fill(where: str, requests: Sequence[ReadRequest], datas: Sequence[Any]) -> None:
    """Copy each request's bytes (``datas[i]``, any buffer) into its buffers, one after
    another; :class:`ShortReadError` naming ``where`` for a short read."""
    for (offset, bufs), data in zip(requests, datas):
        view, want = memoryview(data), sum(b.nbytes for b in bufs)
        if view.nbytes != want:
            raise ShortReadError(f"{where}: short read of {view.nbytes} bytes at {offset}, wanted {want}")
        pos = 0
        for b in bufs:
            copy_bytes(b, view[pos : pos + b.nbytes])
            pos += b.nbytes


COPY_WITHOUT_GIL_BYTES = 64 << 10
"""Copies from this size on go through numpy, which lets go of the GIL while it copies (the
other threads of a load decode, check and copy meanwhile); smaller ones stay memoryview
copies, cheaper to start."""


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` (flat bytes) into ``dst`` (a contiguous buffer of as many bytes), without
    the GIL when large."""
    if dst.nbytes >= COPY_WITHOUT_GIL_BYTES:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        (dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst)[:] = src


