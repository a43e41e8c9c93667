"""The disk's limits, as baselines: parallel raw writes (write + fsync per file) and
in-place parallel ``preadv`` reads of the same files (through the page cache, and around it
with ``O_DIRECT``), shared by the benchmarks."""

from __future__ import annotations

import contextlib
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch


def raw_write(path: str, sizes: list[int], src: torch.Tensor, threads: int) -> None:
    """``len(sizes)`` files of these sizes from consecutive ranges of ``src``, written by
    ``threads`` threads, each ``write`` + ``fsync``; then the directory is fsynced."""
    os.makedirs(path)
    _per_file(path, sizes, src, threads, write_durably)
    fsync_dir(path)


def raw_write_tree(path: str, files: list[tuple[str, int]], src: torch.Tensor, threads: int) -> None:
    """:func:`raw_write` of the same files under their own relative paths (``files``: path,
    size): the directories of the layout made as the files need them (by the writing
    thread), each file ``write`` + ``fsync``, then every directory fsynced, deepest first.
    What any writer of that layout pays durably: a Zarr array is a directory, its shards
    ``c/<i>/<j>`` below it."""
    view = memoryview(src.numpy())
    offsets = [0, *itertools.accumulate(size for _, size in files)]
    os.makedirs(path)

    def one(i: int) -> None:
        target = os.path.join(path, files[i][0])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write_durably(target, view[offsets[i] : offsets[i + 1]])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(files))))
    for d in sorted(tree_directories(files), key=lambda d: -d.count(os.sep)):
        fsync_dir(os.path.join(path, d))
    fsync_dir(path)


def tree_directories(files: list[tuple[str, int]]) -> set[str]:
    """Every directory below the root that ``files`` (relative path, size) lie in, parents
    included, as relative paths."""
    return {os.path.join(*parts[:i]) for rel, _ in files for parts in [rel.split(os.sep)] for i in range(1, len(parts))}


def raw_write_direct(path: str, sizes: list[int], src: tuple[memoryview, list[int]], threads: int) -> None:
    """:func:`raw_write` with ``O_DIRECT`` (around the page cache): each file written whole
    from its page-aligned range of ``src`` (:func:`direct_buffer`), its last block padded,
    then cut to its size and fsynced; then the directory is fsynced."""
    view, offsets = src
    os.makedirs(path)

    def one(i: int) -> None:
        fd = os.open(os.path.join(path, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            done, want = 0, offsets[i + 1] - offsets[i]
            while done < want:
                done += os.pwrite(fd, view[offsets[i] + done : offsets[i + 1]], done)
            os.ftruncate(fd, sizes[i])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(sizes))))
    fsync_dir(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, sizes: list[int], dst: torch.Tensor, threads: int) -> None:
    """Read the files of :func:`raw_write` with ``preadv`` into consecutive ranges of the
    preallocated ``dst``, ``threads`` at a time."""
    _per_file(path, sizes, dst, threads, pread_exact)


BLOCK = 4096


def direct_buffer(sizes: list[int]) -> tuple[memoryview, list[int]]:
    """A page-aligned buffer for :func:`raw_read_direct` of files of ``sizes``, each file's
    range starting on a block and rounded up to whole blocks, and those ranges' offsets."""
    spans = [-(-n // BLOCK) * BLOCK for n in sizes]
    raw = torch.ones(sum(spans) + BLOCK, dtype=torch.uint8)  # (resident: every page written)
    start = -raw.data_ptr() % BLOCK
    return memoryview(raw.numpy())[start : start + sum(spans)], [0, *itertools.accumulate(spans)]


def raw_read_direct(path: str, sizes: list[int], buf: tuple[memoryview, list[int]], threads: int) -> None:
    """Read the files of :func:`raw_write` whole with ``O_DIRECT`` (around the page cache)
    into their ranges of ``buf`` (:func:`direct_buffer`), ``threads`` at a time."""
    view, offsets = buf

    def one(i: int) -> None:
        fd = os.open(os.path.join(path, str(i)), os.O_RDONLY | os.O_DIRECT)
        try:
            done, want = 0, sizes[i]
            while done < want:
                n = os.preadv(fd, [view[offsets[i] + done : offsets[i + 1]]], done)
                if n <= 0:
                    raise OSError(f"{path}/{i}: short read")
                done += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(sizes))))


def read_files(paths: list[str], dst: torch.Tensor, threads: int) -> None:
    """Read the files ``paths`` whole with ``preadv`` into consecutive ranges of the
    preallocated ``dst``, ``threads`` at a time."""
    view = memoryview(dst.numpy())
    offsets = [0, *itertools.accumulate(os.path.getsize(p) for p in paths)]

    def one(i: int) -> None:
        pread_exact(paths[i], view[offsets[i] : offsets[i + 1]])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths))))


def _per_file(path: str, sizes: list[int], buf: torch.Tensor, threads: int, fn: Callable[[str, memoryview], None]) -> None:
    """``fn(file i, its range of buf)`` for the files ``0 .. len(sizes) - 1`` under ``path``,
    whose ranges follow each other in ``buf``, on ``threads`` threads."""
    view = memoryview(buf.numpy())
    offsets = [0, *itertools.accumulate(sizes)]

    def one(i: int) -> None:
        fn(os.path.join(path, str(i)), view[offsets[i] : offsets[i + 1]])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(sizes))))


def write_durably(path: str, mv: memoryview) -> None:
    """Write ``mv`` as file ``path`` (created or truncated), then fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_exact(path: str, mv: memoryview) -> None:
    """Fill ``mv`` from the start of file ``path`` with ``preadv`` (in place, no copy)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], done)
            if n == 0:
                raise OSError(f"{path}: short read")
            done += n
    finally:
        os.close(fd)


def counted_load(state: dict[str, Any], path: str, **load_kwargs: Any) -> int:
    """``ucp_zarr.load`` in place; return the bytes its store read."""
    return load_counts(state, path, **load_kwargs)[0]


def load_counts(state: dict[str, Any], path: str, **load_kwargs: Any) -> tuple[int, int]:
    """``ucp_zarr.load`` in place; return the bytes its store read, and how many of them
    around the page cache (``O_DIRECT``)."""
    import ucp_zarr
    import ucp_zarr.protocol.loader as loader

    with opened_stores(loader) as stores:
        ucp_zarr.load(state, path, **load_kwargs)
    return sum(s.stats.bytes_read for s in stores), sum(s.stats.bytes_read_direct for s in stores)


@contextlib.contextmanager
def opened_stores(module: Any) -> Iterator[list[Any]]:
    """The stores ``module`` (``ucp_zarr.protocol.loader`` or ``.saving``) opens meanwhile,
    through its ``open_store``."""
    stores: list[Any] = []
    real = module.open_store

    def counting(*args: Any, **kwargs: Any) -> Any:
        stores.append(real(*args, **kwargs))
        return stores[-1]

    module.open_store = counting
    try:
        yield stores
    finally:
        module.open_store = real
    if not stores:
        raise RuntimeError(f"ucp_zarr no longer opens its store through {module.__name__}.open_store: fix opened_stores")
