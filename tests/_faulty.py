"""A store that records every operation and can crash at the n-th mutating one, and a
liveness judge that declares chosen saves dead: for unit tests of the save transaction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ucp_zarr.io.store import Store
from ucp_zarr.protocol.liveness import Liveness, Owner

MUTATING = {"write", "write_atomic", "create_exclusive", "delete", "remove", "adopt"}


class Crash(BaseException):
    """The process dies here (a BaseException, so that no library code handles it)."""


@dataclass
class Log:
    ops: list[tuple[str, str, str]] = field(default_factory=list)
    """(operation, store url, key) in order."""
    crash_at: int | None = None
    """Crash on this (0-based) mutating operation."""
    mutations: int = 0


class FaultyStore(Store):
    """Wraps a real store; its siblings share the log (so a crash can hit either)."""

    def __init__(self, inner: Store, log: Log | None = None) -> None:
        self.inner = inner
        self.log = log or Log()
        self.url = inner.url
        self.stats = inner.stats
        self.exclusive_create = inner.exclusive_create
        self.durable = inner.durable
        self.stages_writes = inner.stages_writes
        self.local_path = inner.local_path

    def _op(self, name: str, key: str = "") -> None:
        self.log.ops.append((name, self.url, key))
        if name in MUTATING:
            if self.log.crash_at is not None and self.log.mutations == self.log.crash_at:
                self.log.crash_at = None
                raise Crash(f"crash at {name} {self.url}/{key}")
            self.log.mutations += 1

    def write(self, key: str, buffers: Any, guard: Any = None) -> int:
        self._op("write", key)
        return self.inner.write(key, buffers, guard)

    def write_atomic(self, key: str, data: bytes) -> None:
        self._op("write_atomic", key)
        self.inner.write_atomic(key, data)

    def create_exclusive(self, key: str, data: bytes) -> None:
        self._op("create_exclusive", key)
        self.inner.create_exclusive(key, data)

    def read(self, key: str) -> bytes:
        self._op("read", key)
        return self.inner.read(key)

    def read_tail(self, key: str, nbytes: int) -> bytes:
        return self.inner.read_tail(key, nbytes)

    def readv(self, key: str, requests: Any) -> None:
        self.inner.readv(key, requests)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self) -> list[str]:
        self._op("list")
        return self.inner.list()

    def child_names(self) -> list[str]:
        return self.inner.child_names()

    def sibling_names(self, prefix: str) -> list[str]:
        return self.inner.sibling_names(prefix)

    def delete(self, key: str) -> None:
        self._op("delete", key)
        self.inner.delete(key)

    def prune(self, folders: Any) -> None:
        self.inner.prune(folders)

    def remove(self) -> None:
        self._op("remove")
        self.inner.remove()

    def sibling(self, name: str) -> "FaultyStore":
        return FaultyStore(self.inner.sibling(name), self.log)

    def child(self, name: str) -> "FaultyStore":
        return FaultyStore(self.inner.child(name), self.log)

    def adopt(self, src: Store, key: str, tag: str) -> None:
        self._op("adopt", key)
        self.inner.adopt(src.inner if isinstance(src, FaultyStore) else src, key, tag)

    def sync(self) -> None:
        self.inner.sync()


class Judge(Liveness):
    """Liveness where exactly the save ids in ``dead`` are dead."""

    def __init__(self, dead: set[str] | None = None) -> None:
        super().__init__(("test-host", "test-boot"))
        object.__setattr__(self, "dead", dead if dead is not None else set())

    def is_dead(self, owner: Owner, renewed: float | None) -> bool:
        return owner.save_id in self.dead or renewed == float("-inf")
