"""Object stores (``s3://``, ``gs://``, ``az://``) through obstore, the Rust ``object_store``
client that zarr-python's ``ObjectStore`` also uses.

:class:`ObstoreStore` has the semantics of :class:`~ucp_zarr.io.fsspec.FsspecStore` with the
object store's own primitives:

* an object of up to :data:`PART_BYTES` is one PUT; a larger one a multipart upload whose
  parts go up concurrently (``max_concurrency``); a PUT is atomic, so the commit record
  needs no rename;
* exclusive creation is a conditional PUT (``If-None-Match: *`` on S3, the generation or
  etag precondition on GCS and Azure): two creators never both succeed;
* ranged reads that touch are merged into one request, and the requests of one read go
  concurrently (``get_ranges``);
* a server-side copy adopts an object of a sibling (both live in one bucket);
* requests are retried on transient errors (5xx, connection errors, timeouts) by obstore's
  own bounded retry with backoff (:data:`DEFAULT_RETRY`); its errors are mapped to
  :class:`FileNotFoundError`, :class:`FileExistsError`, :class:`PermissionError` and
  :class:`OSError` naming the object.

Object stores have no folders; SeaweedFS's filer keeps folder entries, which
:meth:`ObstoreStore.prune` and :meth:`ObstoreStore.remove` delete once they are empty.

``storage_options`` take the names users pass to s3fs, gcsfs and adlfs today (``key``,
``secret``, ``endpoint_url``, ``client_kwargs={"endpoint_url": ...}``, ``anon``, a region,
``config_kwargs`` timeouts and retries, ``token``, ``account_name``...), obstore's own
configuration keys, ``client_options`` and ``retry_config``; anything else is refused by
name. ``backend="fsspec"`` keeps such a URL on fsspec (:func:`open_url`).
"""

from __future__ import annotations

import datetime
import json
import os
import posixpath
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, Sequence, TypeVar

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)

from ..errors import Keyword, OwnershipError
from .fsspec import FsspecStore
from .store import (
    Buffer, IOStats, ReadRequest, ShortReadError, Store, WriteGuard, at_once, check_document_size, fill, folders_of, no_parent,
)

T = TypeVar("T")

SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure",
           "abfss": "azure", "adl": "azure"}
"""URL schemes served by obstore, and the store each names."""
PART_BYTES = 16 << 20
"""Objects larger than this go up as multipart uploads of parts this size."""
UPLOAD_CONCURRENCY = 8
"""Parts of one object uploaded at once."""
REQUEST_CONCURRENCY = 16
"""Objects a save writes, and a load reads, at once unless ``max_workers`` says otherwise
(:attr:`~ucp_zarr.io.store.Store.request_concurrency`): each request waits a round trip,
so small objects go at the rate of the requests in flight. Measured with 10 ms held on every
request (``bench_object_store.py``'s latency rows, ``benchmarks/results/table.md``): a 17 MiB
state of 225 objects saved in 0.60 s at 16 threads against 1.19 s at 4, loaded in 0.19 s
against 0.43 s."""
BULK_DELETE = 1000
"""Objects deleted by one request at most (S3's ``DeleteObjects`` takes at most 1000)."""
BULK_DELETE_SPLIT = 32
"""Objects deleted by one request at least, where more requests at once would have fewer
each: below it a request's round trip outweighs the store's time per object."""
LARGE_AT_ONCE = 4
"""Objects over :data:`PART_BYTES` sent or fetched at once by one store and its siblings,
whatever the threads: each holds up to ``(1 + UPLOAD_CONCURRENCY) * PART_BYTES`` (a send)
or its whole size (a fetch) in memory, so that the threads :data:`REQUEST_CONCURRENCY` adds
for small objects add no more than ``PART_BYTES`` each."""
DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 3,
    "backoff": {"init_backoff": datetime.timedelta(seconds=0.2), "max_backoff": datetime.timedelta(seconds=4), "base": 2},
    "retry_timeout": datetime.timedelta(seconds=60),
}
"""Bounded retries with exponential backoff, as :class:`~ucp_zarr.io.fsspec.RetryPolicy`
(4 attempts): a failing store fails a save within about a minute, not obstore's default 3."""

_IGNORED = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "asynchronous", "loop"})
"""fsspec options about its own caches and event loop: nothing to do here."""


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store of a non-local URL: obstore for object-store schemes (:data:`SCHEMES`),
    fsspec for every other one, or for any with ``storage_options["backend"] == "fsspec"``."""
    options = dict(storage_options or {})
    backend = options.pop("backend", None)
    scheme = url.split("://", 1)[0].lower()
    if backend not in (None, "obstore", "fsspec"):
        raise ValueError(f"storage_options backend={backend!r}: use 'obstore' (object stores) or 'fsspec'")
    if backend == "fsspec" or (backend is None and scheme not in SCHEMES):
        return FsspecStore(url, options)
    if scheme not in SCHEMES:
        raise ValueError(f"{url}: backend='obstore' serves {sorted(SCHEMES)} URLs only; drop the backend option")
    return ObstoreStore(url, options)


def _message(e: Exception) -> str:
    """obstore's message, without the debug dump of its Rust error it appends."""
    return str(e).split("\n\nDebug source:", 1)[0]


def _beyond_the_end(e: Exception) -> bool:
    """Whether obstore's error says a ranged read started at or after the object's end (HTTP
    416 from S3, GCS and Azure; the message of its local and in-memory stores)."""
    text = str(e)
    return any(s in text for s in ("416 Range Not Satisfiable", "<Code>InvalidRange</Code>", "Invalid range: Wanted range"))


class ObstoreStore(Store):
    """A prefix of a bucket (container) of S3, GCS or Azure, through one obstore client
    shared with its siblings. Every object is durable once its request returned."""

    exclusive_create = True
    durable = True
    own_buffers = True
    request_concurrency = REQUEST_CONCURRENCY

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, client: Any = None,
        large: threading.Semaphore | None = None, exclusive_checked: threading.Event | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        scheme, rest = self.url.split("://", 1)
        self.bucket, _, self.root = rest.partition("/")
        if scheme.lower() not in SCHEMES or not self.bucket:
            raise ValueError(f"{url} is not an s3://, gs:// or az:// URL of a bucket")
        self.storage_options = dict(storage_options or {})
        self.client = client if client is not None else _client(scheme.lower(), self.bucket, self.storage_options)
        self.large = large or threading.BoundedSemaphore(LARGE_AT_ONCE)
        """Held while an object over :data:`PART_BYTES` is sent or fetched (:data:`LARGE_AT_ONCE`)."""
        self.stats = IOStats()
        self.exclusive_checked = exclusive_checked or threading.Event()
        """Set once the server was seen to refuse a second conditional create (shared with the
        siblings and children on this client), or from the start where it is known to: AWS S3
        itself (no other endpoint configured), GCS and Azure."""
        if exclusive_checked is None and not _other_endpoint(scheme.lower(), self.client):
            self.exclusive_checked.set()

    def holding(self, nbytes: int) -> AbstractContextManager[Any]:
        return self.large if nbytes > PART_BYTES else nullcontext()

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _where(self, path: str) -> str:
        """The URL of ``path`` (a path in the bucket), for messages."""
        return f"{self.url.split('://', 1)[0]}://{self.bucket}/{path}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` (obstore retried what was transient), its errors as the library's."""
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, PermissionError, ValueError):
            raise
        except (AlreadyExistsError, PreconditionError) as e:
            raise FileExistsError(f"{what}: {e}") from e
        except (PermissionDeniedError, UnauthenticatedError) as e:
            raise PermissionError(f"{what}: {e}") from e
        except Exception as e:  # obstore's GenericError and the like: the store failed, after retries
            if _beyond_the_end(e):
                raise ShortReadError(f"{what}: the object ends before the bytes asked for: {_message(e)}") from e
            raise OSError(f"{what} failed: {_message(e)}") from e

    def write(self, key: str, buffers: Iterable[Buffer | bytes], guard: WriteGuard | None = None) -> int:
        if guard is not None:  # a PUT cannot be made conditional on the owner: check just before it
            guard.check()
        it = iter(buffers)
        head = bytearray()
        for b in it:  # (each buffer is copied before the next is pulled: producers reuse memory)
            head += memoryview(b).cast("B")
            if len(head) > PART_BYTES:
                break
        else:
            self._put(f"writing {self.url}/{key}", key, head, use_multipart=False)
            self.stats.add_write(key, len(head))
            return len(head)
        total = len(head)

        def parts() -> Iterable[bytes | bytearray]:
            nonlocal total
            yield head
            for b in it:
                data = bytes(memoryview(b).cast("B"))
                total += len(data)
                yield data

        with self.holding(total):
            self._put(f"writing {self.url}/{key}", key, parts(), use_multipart=True)
        self.stats.add_write(key, total)
        return total

    def _put(self, what: str, key: str, data: Any, **kwargs: Any) -> None:
        self._call(what, lambda: obstore.put(
            self.client, self._path(key), data, chunk_size=PART_BYTES, max_concurrency=UPLOAD_CONCURRENCY, **kwargs
        ))

    def write_atomic(self, key: str, data: bytes) -> None:
        self._put(f"writing {self.url}/{key}", key, data, use_multipart=False)
        self.stats.add_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        """A conditional PUT. On an S3-compatible server of another endpoint than AWS S3, the
        first that succeeds on this client is repeated, to see the server refuse it
        (:meth:`_check_exclusive`): a server that ignores the condition would let two saves
        both claim a path, and is refused (:class:`OwnershipError`)."""
        try:
            self._put(f"creating {self.url}/{key}", key, data, mode="create")
        except FileExistsError:
            if not self.holds(key, data):
                raise FileExistsError(f"{self.url}/{key} exists") from None
        else:
            self._check_exclusive(key, data)
        self.stats.add_write(key, len(data))

    def _check_exclusive(self, key: str, data: bytes) -> None:
        """Once per client, on an S3-compatible server of another endpoint: a second conditional
        create of ``key`` (just created, with the same ``data``: replacing it changes nothing)
        must fail."""
        if self.exclusive_checked.is_set():
            return
        try:
            self._put(f"creating {self.url}/{key} again", key, data, mode="create")
        except FileExistsError:
            self.exclusive_checked.set()
            return
        raise OwnershipError(
            f"{self.url}: the server accepted a second conditional create of {key} (If-None-Match: *, or the "
            "generation or etag precondition): it does not create objects exclusively, so two saves racing for "
            "a path could both claim it and corrupt each other. Use a server that honours conditional writes, "
            "or, if no other save can ever target this path, storage_options backend='fsspec' with ",
            Keyword("unsafe_non_exclusive_store", True),
        )

    def _get_buffer(self, key: str, options: dict[str, Any] | None = None, document: bool = False) -> Any:
        """The object (or the range ``options`` name) in obstore's own buffer (``obstore.Bytes``,
        with the buffer protocol): no copy. A ``document``'s size is checked before its body
        is read (:func:`~.store.check_document_size`)."""
        got = self._call(f"reading {self.url}/{key}", lambda: obstore.get(self.client, self._path(key), options=options))
        if document:
            check_document_size(f"{self.url}/{key}", got.meta["size"])
        data = self._call(f"reading {self.url}/{key}", got.bytes)
        self.stats.add_read(len(data))
        return data

    def _get(self, key: str, options: dict[str, Any] | None = None) -> bytes:
        return bytes(self._get_buffer(key, options))

    def read(self, key: str) -> bytes:
        return bytes(self._get_buffer(key, document=True))

    def read_small(self, key: str, limit: int) -> Buffer | None:
        # one ranged request for at most limit + 1 bytes: more than limit means a larger object
        data = memoryview(self._get_buffer(key, {"range": (0, limit + 1)}))  # (a view of obstore's buffer: no copy)
        return data if data.nbytes <= limit else None

    def read_tail(self, key: str, nbytes: int) -> bytes:
        data = self._get(key, {"range": {"suffix": nbytes}})
        if len(data) != nbytes:
            raise ShortReadError(f"{self.url}/{key} is shorter than the {nbytes} bytes read from its end")
        return data

    def readv(self, key: str, requests: Sequence[ReadRequest]) -> None:
        sizes = [sum(b.nbytes for b in bufs) for _, bufs in requests]
        starts = [o for o, _ in requests]
        ends = [o + n for o, n in zip(starts, sizes)]
        with self.holding(sum(sizes)):
            datas = self._call(f"reading {self.url}/{key}", lambda: obstore.get_ranges(
                self.client, self._path(key), starts=starts, ends=ends, coalesce=0
            ))
            fill(f"{self.url}/{key}", requests, datas)
        self.stats.add_read(sum(sizes), _runs(starts, ends))

    def read_whole(self, key: str, size: int) -> Buffer | None:
        # one GET; its response head gives the size before the body is read
        where = f"{self.url}/{key}"
        got = self._call(f"reading {where}", lambda: obstore.get(self.client, self._path(key)))
        if got.meta["size"] != size:
            return None
        data = memoryview(self._call(f"reading {where}", got.bytes))  # (a view of obstore's buffer)
        self.stats.add_read(size, 1)
        return data

    def readv_whole(self, key: str, requests: Sequence[ReadRequest], size: int) -> bool:
        with self.holding(size):
            data = self.read_whole(key, size)
            if data is None:
                return False
            fill(f"{self.url}/{key}", requests, [data])
        return True

    def exists(self, key: str) -> bool:
        try:
            self._call(f"looking up {self.url}/{key}", lambda: obstore.head(self.client, self._path(key)))
        except FileNotFoundError:
            return False
        return True

    def list(self) -> list[str]:
        return self._keys("")

    def is_empty(self) -> bool:
        """(One request: the first page of the listing answers, however many objects.)"""
        prefix = f"{self.root}/" if self.root else ""

        def empty() -> bool:
            pages = obstore.list(self.client, prefix or None, chunk_size=1)
            return not any(m["path"].startswith(prefix) for page in pages for m in page)

        return self._call(f"listing {self.url}", empty)

    def _keys(self, under: str) -> list[str]:
        """The keys of the objects in folder ``under`` ("" for the root) at any depth."""
        base = f"{self.root}/" if self.root else ""
        prefix = f"{base}{under}/" if under else base
        pages = self._call(f"listing {self.url}", lambda: obstore.list(self.client, prefix or None).collect())
        return sorted(m["path"][len(base) :] for m in pages if m["path"].startswith(prefix))

    def _names(self, folder: str) -> list[str]:
        """The names in ``folder`` (a path in the bucket, "" for its top): objects and
        folders, without the folder's own entry (which SeaweedFS lists)."""
        got = self._call(f"listing {self.url}", lambda: obstore.list_with_delimiter(self.client, folder or None))
        paths = [*got["common_prefixes"], *(m["path"] for m in got["objects"])]
        return sorted({posixpath.basename(p.rstrip("/")) for p in paths if p.rstrip("/") != folder})

    def child_names(self) -> list[str]:
        return self._names(self.root)

    def sibling_names(self, prefix: str) -> list[str]:
        return [n for n in self._names(posixpath.dirname(self.root)) if n.startswith(prefix)]

    def delete(self, key: str) -> None:
        self._delete_path(self._path(key))

    def _delete_path(self, path: str) -> None:
        """Delete ``path``; none there is no error (S3 answers so, GCS and Azure do not)."""
        try:
            self._call(f"deleting {self._where(path)}", lambda: obstore.delete(self.client, path))
        except FileNotFoundError:
            pass

    def delete_many(self, keys: Sequence[str]) -> None:
        self._delete_paths([self._path(k) for k in keys])

    def _delete_paths(self, paths: Sequence[str], one_by_one_if_refused: bool = True) -> None:
        """Delete ``paths`` in bulk requests of at most :data:`BULK_DELETE`, split so that
        :attr:`request_concurrency` of them run at once (a store deletes one request's objects
        one after another: SeaweedFS's filer takes about 0.7 ms each), down to
        :data:`BULK_DELETE_SPLIT` each. A request refused for an absent object (GCS, Azure)
        is sent again path by path, unless ``one_by_one_if_refused`` is False."""
        if not paths:
            return
        split = max(BULK_DELETE_SPLIT, -(-len(paths) // (self.request_concurrency or 1)))
        size = min(BULK_DELETE, split)

        def batch(chunk: Sequence[str]) -> None:
            try:
                self._call(f"deleting {self._where(chunk[0])} and {len(chunk) - 1} more",
                           lambda: obstore.delete(self.client, chunk))
            except FileNotFoundError:
                if not one_by_one_if_refused:
                    raise
                for path in chunk:
                    self._delete_path(path)

        at_once(self, batch, [paths[i : i + size] for i in range(0, len(paths), size)])

    def prune(self, folders: Iterable[str]) -> None:
        # only stores that keep folder entries (SeaweedFS's filer) list emptied folders: one
        # listing (of the folders' common ancestor: an overwrite that changed one tensor's
        # grid lists that tensor's objects, not the checkpoint's) tells which folders still
        # hold objects, bulk requests remove the others
        if folders := set(folders):
            self._remove_folder_entries(folders - folders_of(self._keys(posixpath.commonpath(list(folders)))))
        if not self._names(self.root):
            self._remove_folder_entries({""})

    def remove(self) -> None:
        keys = self.list()
        self._delete_paths([self._path(k) for k in keys])
        self._remove_folder_entries(folders_of(keys) | {""})

    def _remove_folder_entries(self, folders: Iterable[str]) -> None:
        """Delete the entries of ``folders`` ("" for the root) where the store keeps any,
        children before parents (each depth at once)."""
        depths: dict[int, list[str]] = {}
        for f in folders:
            if f or self.root:
                depths.setdefault(f.count("/") + bool(f), []).append(f"{self._path(f) if f else self.root}/")
        for depth in sorted(depths, reverse=True):
            try:  # (a store that refuses to delete what is absent keeps no folder entries)
                self._delete_paths(sorted(depths[depth]), one_by_one_if_refused=False)
            except Exception:  # (a store without folder entries: nothing to remove)
                pass

    def sibling(self, name: str) -> "ObstoreStore":
        if not self.root:
            raise no_parent(self.url, name)
        return ObstoreStore(f"{posixpath.dirname(self.url)}/{name}", self.storage_options, client=self.client,
                            large=self.large, exclusive_checked=self.exclusive_checked)

    def child(self, name: str) -> "ObstoreStore":
        """(One client for a run's root and all its steps.)"""
        return ObstoreStore(f"{self.url}/{name}", self.storage_options, client=self.client, large=self.large,
                            exclusive_checked=self.exclusive_checked)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        """A server-side copy (one request; S3 copies objects of up to 5 GiB this way)."""
        if not isinstance(src, ObstoreStore) or src.client is not self.client:
            raise TypeError(f"cannot adopt objects of {src.url} into {self.url}")
        self._call(f"copying {src.url}/{key}", lambda: obstore.copy(self.client, src._path(key), self._path(key)))


ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT")
"""Environment variables that point an S3 client at another server."""


def _other_endpoint(scheme: str, client: Any) -> bool:
    """Whether ``client`` talks to an S3-compatible server other than AWS S3 (an endpoint in
    its configuration or the environment), whose conditional writes are not known to hold.
    (AWS S3 has honoured ``If-None-Match: *`` since 2024; GCS and Azure their preconditions.)"""
    if SCHEMES.get(scheme) != "s3":
        return False
    config = getattr(client, "config", None) or {}
    return bool(config.get("endpoint") or config.get("aws_endpoint") or any(os.environ.get(v) for v in ENDPOINT_VARIABLES))


def _runs(starts: Sequence[int], ends: Sequence[int]) -> int:
    """How many requests ranges become once those that touch or overlap are merged."""
    runs, reach = 0, -1
    for a, z in sorted(zip(starts, ends)):
        if a > reach:
            runs += 1
        reach = max(reach, z)
    return runs


# --- storage_options -> obstore's configuration ------------------------------------------------


def _client(scheme: str, bucket: str, options: dict[str, Any]) -> Any:
    """An obstore client of ``bucket`` from fsspec-style or obstore ``options``."""
    from obstore.store import AzureStore, GCSStore, S3Store

    kind = SCHEMES[scheme]
    config, client_options, retry = _config(kind, options)
    if client_options and os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true" and kind == "s3":
        client_options.setdefault("allow_http", True)  # (client options given replace those of the environment)
    cls = {"s3": S3Store, "gcs": GCSStore, "azure": AzureStore}[kind]
    try:  # (no client options: obstore reads them from the environment, AWS_ALLOW_HTTP with an http endpoint)
        return cls.from_url(f"{scheme}://{bucket}", config=config, client_options=client_options or None,
                            retry_config=retry)
    except UnknownConfigurationKeyError as e:
        raise ValueError(
            f"storage_options for {scheme}://{bucket}: {e} (accepted: the s3fs/gcsfs/adlfs names "
            f"{sorted(_ALIASES[kind])}, obstore's configuration keys, client_options, retry_config)"
        ) from None


_ALIASES: dict[str, dict[str, str]] = {
    "s3": {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
           "aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
           "aws_session_token": "session_token", "region_name": "region", "endpoint_url": "endpoint",
           "requester_pays": "request_payer"},
    "gcs": {"endpoint_url": "base_url"},
    "azure": {"sas_token": "sas_key", "endpoint_url": "endpoint"},
}
"""fsspec option names (s3fs, gcsfs, adlfs) that are obstore keys under another name."""


def _config(kind: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(config, client_options, retry_config)`` from ``storage_options``; refuses what it
    cannot honour by name."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    retry: dict[str, Any] = dict(DEFAULT_RETRY)
    aliases = _ALIASES[kind]
    for name, value in options.items():
        if name in _IGNORED:
            continue
        if name == "client_options":
            client.update(value)
        elif name == "retry_config":
            retry.update(value)
        elif name == "anon":
            if value:
                config["skip_signature"] = True
        elif name == "client_kwargs" and kind == "s3":
            for k, v in value.items():
                if k not in ("endpoint_url", "region_name"):
                    raise ValueError(f"storage_options client_kwargs {k!r} has no obstore equivalent; "
                                     "accepted: endpoint_url, region_name")
                config[aliases[k]] = v
        elif name == "config_kwargs" and kind == "s3":
            _botocore(value, client, retry)
        elif name == "token" and kind == "gcs":
            _gcs_token(value, config)
        elif name == "project" and kind == "gcs":
            continue  # (names the project buckets are created in: no bucket is created here)
        elif name == "connection_string" and kind == "azure":
            config.update(_azure_connection_string(value))
        else:
            config[aliases.get(name, name)] = value
    endpoint = config.get("endpoint") or config.get("base_url")
    if isinstance(endpoint, str) and endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    return config, client, retry


def _botocore(config_kwargs: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]) -> None:
    """s3fs's ``config_kwargs`` (a botocore ``Config``): timeouts, retries and proxies."""
    for k, v in config_kwargs.items():
        if k == "connect_timeout":
            client["connect_timeout"] = datetime.timedelta(seconds=v)
        elif k == "read_timeout":
            client["read_timeout"] = datetime.timedelta(seconds=v)
        elif k == "retries":
            # (on fsspec the library retries on top of botocore: never fewer than its own bound)
            attempts = v.get("total_max_attempts", v.get("max_attempts"))
            if attempts is not None:
                retry["max_retries"] = max(DEFAULT_RETRY["max_retries"], int(attempts) - ("total_max_attempts" in v))
            unknown = set(v) - {"total_max_attempts", "max_attempts", "mode"}
            if unknown:
                raise ValueError(f"storage_options config_kwargs retries {sorted(unknown)} have no obstore equivalent")
        elif k == "proxies":
            urls = set(v.values())
            if len(urls) > 1:
                raise ValueError("storage_options config_kwargs proxies: obstore takes one proxy for every scheme")
            if urls:
                client["proxy_url"] = urls.pop()
        else:
            raise ValueError(f"storage_options config_kwargs {k!r} has no obstore equivalent; accepted: "
                             "connect_timeout, read_timeout, retries, proxies (or pass client_options)")


def _gcs_token(token: Any, config: dict[str, Any]) -> None:
    """gcsfs's ``token``: "anon", a service account file, or its JSON contents."""
    if token == "anon":
        config["skip_signature"] = True
    elif isinstance(token, dict):
        config["service_account_key"] = json.dumps(token)
    elif isinstance(token, str) and token not in ("google_default", "cloud", "cache"):
        config["service_account"] = token
    elif token is not None and token not in ("google_default", "cloud", "cache"):
        raise ValueError(f"storage_options token of type {type(token).__name__}: give 'anon', a path or a dict")


def _azure_connection_string(text: str) -> dict[str, str]:
    """An Azure storage connection string's account, key, SAS token and endpoint."""
    parts = dict(p.split("=", 1) for p in text.split(";") if "=" in p)
    names = {"AccountName": "account_name", "AccountKey": "account_key", "SharedAccessSignature": "sas_key",
             "BlobEndpoint": "endpoint"}
    return {names[k]: v for k, v in parts.items() if k in names}
