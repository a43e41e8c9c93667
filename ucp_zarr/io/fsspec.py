"""The fsspec store: every URL without a backend of its own (``memory://``, ``s3://`` with
``backend="fsspec"``, ...), with bounded retries of transient errors."""

from __future__ import annotations

import errno
import logging
import posixpath
import time
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from .store import (
    Buffer, IOStats, ReadRequest, ShortReadError, Store, WriteGuard, check_document_size, fill, folders_of, no_parent,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        check_document_size(f"{self.url}/{key}", len(data))  # (after: a ranged read takes another path in s3fs, around this store's retries)
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
            raise ShortReadError(f"{self._path(key)} is shorter than the {nbytes} bytes read from its end")
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
                if isinstance(data, OSError) and data.errno == errno.EINVAL and "range" in str(data).lower():
                    raise ShortReadError(f"{path}: the object ends before the bytes asked for: {data}") from data
                if isinstance(data, Exception):  # (s3fs: HTTP 416 is an OSError(EINVAL) naming the range)
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
        for folder in sorted(folders_of(keys), key=lambda f: -f.count("/")):
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
            raise no_parent(self.url, name)
        return FsspecStore(f"{parent}/{name}", self.storage_options, self.retry)

    def child(self, name: str) -> "FsspecStore":
        return FsspecStore(f"{self.url}/{name}", self.storage_options, self.retry)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        if not isinstance(src, FsspecStore) or type(src.fs) is not type(self.fs):
            raise TypeError(f"cannot adopt objects of {src.url} into {self.url}")
        self.retry.call(f"copying {src.url}/{key}", lambda: self.fs.copy(src._path(key), self._path(key)))
