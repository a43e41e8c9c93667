"""Large spans of local files read and written around the page cache (``ucp_zarr/io/direct.py``):
the bytes exactly as a plain read gives them (read only where the cache does not hold the
span), files holding exactly the bytes written, refusing file systems read and written
through the cache, background saves through it, and damage still found."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp_zarr
import ucp_zarr.protocol.loader as loader
from ucp_zarr.errors import CorruptChunkError
from ucp_zarr.io import direct
from ucp_zarr.io.arrayio import _stage
from ucp_zarr.io.local import LocalStore

pytestmark = pytest.mark.skipif(not direct.AVAILABLE, reason="O_DIRECT and mincore are Linux's")


def evict(path: str) -> None:
    """Write back and drop every file under ``path`` from the page cache."""
    for root, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def needs_direct_reads(folder: os.PathLike[str] | str) -> None:
    """Skip unless the file system under ``folder`` reads with ``O_DIRECT`` (overlay and
    some FUSE file systems refuse it: those loads read through the cache, tested below)."""
    probe = os.path.join(folder, "probe")
    with open(probe, "wb") as f:
        f.write(b"x" * direct.ALIGN)
    fd = os.open(probe, os.O_RDONLY)
    try:
        direct.read_direct(fd, _stage(direct.ALIGN)[: direct.ALIGN], 0, direct.ALIGN)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        pytest.skip(f"{folder} is on a file system that refuses O_DIRECT")
    finally:
        os.close(fd)
        os.unlink(probe)


def cached(path: str) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        return direct.cached_fraction(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def loading_with(monkeypatch: pytest.MonkeyPatch, direct_reads: bool | None) -> list[LocalStore]:
    """Make ``ucp_zarr.load`` open its local stores with ``direct_reads``; return them as opened."""
    stores: list[LocalStore] = []

    def opening(path: str, storage_options: object = None) -> LocalStore:
        stores.append(LocalStore(os.fspath(path), direct_reads=direct_reads))
        return stores[-1]

    monkeypatch.setattr(loader, "open_store", opening)
    return stores


def saving_with(monkeypatch: pytest.MonkeyPatch) -> list[LocalStore]:
    """The stores ``ucp_zarr.save`` and ``async_save`` open, as opened."""
    import ucp_zarr.protocol.saving as saving

    stores: list[LocalStore] = []
    real = saving.open_store
    monkeypatch.setattr(saving, "open_store", lambda *a, **k: stores.append(real(*a, **k)) or stores[-1])
    return stores


def tiled_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Matrices stored in tiles (chunks aligned with TP degrees along both dims): their
    shards land through the staging buffer, the spans a direct read serves."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1024, 1536, generator=g),
        "b": torch.randn(2048, 1024, generator=g).to(torch.bfloat16),
        "v": torch.randn(3000, generator=g),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy()
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_span_reads_the_bytes_a_plain_read_gives(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    size = data.draw(st.integers(1, 3 * direct.ALIGN + 5000))
    offset = data.draw(st.integers(0, size - 1))
    nbytes = data.draw(st.integers(1, size - offset))
    mode = data.draw(st.sampled_from([True, False, None]))
    root = tmp_path_factory.mktemp("span")
    if mode:
        needs_direct_reads(root)
    blob = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (root / "obj").write_bytes(blob)
    store = LocalStore(str(root), direct_reads=mode)
    minimum, direct.MIN_DIRECT_BYTES = direct.MIN_DIRECT_BYTES, 1
    try:  # (each view is of this thread's staging buffer: kept as bytes before the next read)
        view = store.read_span("obj", offset, nbytes, _stage)
        assert view is not None and bytes(view) == blob[offset : offset + nbytes]
        whole = store.read_span("obj", 0, size, _stage, size=size)
        assert whole is not None and bytes(whole) == blob
        assert store.read_span("obj", 0, size, _stage, size=size + 1) is None
    finally:
        direct.MIN_DIRECT_BYTES = minimum
    if mode:  # every span went around the cache, padded to whole blocks
        assert store.stats.bytes_read_direct == store.stats.bytes_read > 0
    elif mode is False:
        assert store.stats.bytes_read_direct == 0


def test_a_span_beyond_the_end_is_a_short_read(tmp_path) -> None:
    needs_direct_reads(tmp_path)
    (tmp_path / "obj").write_bytes(b"x" * (2 << 20))
    store = LocalStore(str(tmp_path), direct_reads=True)
    with pytest.raises(OSError, match="short read"):
        store.read_span("obj", 1 << 20, (1 << 20) + 1, _stage)


def test_a_cold_load_reads_around_the_cache_and_a_warm_one_through_it(tmp_path, monkeypatch) -> None:
    needs_direct_reads(tmp_path)
    state = tiled_state()
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    evict(path)
    shard = os.path.join(path, "w", "w", "c", "0", "0")
    if cached(shard) > 0:
        pytest.skip("this file system keeps its files in memory (tmpfs?): nothing is cold")
    stores = loading_with(monkeypatch, None)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    cold = stores[-1].stats
    assert cold.bytes_read_direct >= (1024 * 1536 * 4 + 2048 * 1024 * 2)  # both matrices' shards, whole
    assert cached(shard) == 0  # (the direct read left nothing in the cache)

    with open(shard, "rb") as f:  # now the cache holds the shard: read through it
        f.read()
    assert cached(shard) == 1
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    warm = stores[-1].stats
    assert warm.bytes_read_direct < cold.bytes_read_direct
    assert warm.bytes_read_direct <= 2048 * 1024 * 2 + direct.ALIGN  # ("b" may still be cold)


def test_bands_at_unaligned_offsets_land_exactly(tmp_path, monkeypatch) -> None:
    """A shard larger than the staging limit is read a few bands of chunks at a time, at
    offsets that are no multiple of a block."""
    needs_direct_reads(tmp_path)
    import ucp_zarr.io.arrayio as arrayio

    state = tiled_state(1)
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    monkeypatch.setattr(arrayio, "MAX_STAGED_BYTES", 1 << 20)
    monkeypatch.setattr(direct, "MIN_DIRECT_BYTES", 1 << 10)
    stores = loading_with(monkeypatch, True)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    assert stores[-1].stats.bytes_read_direct > 4 << 20


def test_a_file_system_that_refuses_direct_reads_is_read_through_the_cache(tmp_path, monkeypatch) -> None:
    state = tiled_state(2)
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    calls = []

    def refused(fd: int, buf: np.ndarray, start: int, want: int) -> int:
        calls.append(start)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct, "read_direct", refused)
    stores = loading_with(monkeypatch, True)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    assert len(calls) == 1 and stores[-1].stats.bytes_read_direct == 0  # asked once, then never again


def test_a_damaged_chunk_read_directly_is_named(tmp_path, monkeypatch) -> None:
    needs_direct_reads(tmp_path)
    state = tiled_state(3)
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    shard = os.path.join(path, "w", "w", "c", "0", "0")
    with open(shard, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x10]))
    evict(path)
    stores = loading_with(monkeypatch, True)
    with pytest.raises(CorruptChunkError, match=r"crc32c mismatch.*tensor 'w'"):
        ucp_zarr.load({k: torch.zeros_like(v) for k, v in state.items()}, path)
    assert stores[-1].stats.bytes_read_direct > 0



def _load_on_ranks(rank: int, world: int, path: str, direct_reads: bool | None, expect_direct: bool) -> None:
    import pytest as _pytest

    state = tiled_state(4)
    monkeypatch = _pytest.MonkeyPatch()
    stores = loading_with(monkeypatch, direct_reads)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    assert (stores[-1].stats.bytes_read_direct > 0) is expect_direct, (rank, stores[-1].stats)


def test_ranks_of_a_job_read_through_the_shared_cache(tmp_path) -> None:
    """Ranks of one node that read one shard (replicas) share the page cache's read of it:
    a load by several ranks (real gloo processes) reads nothing around the cache unless
    its store is told to."""
    needs_direct_reads(tmp_path)
    from _dist import run

    path = str(tmp_path / "ck")
    ucp_zarr.save(tiled_state(4), path)
    for direct_reads, expect_direct in ((None, False), (True, True)):
        evict(path)
        run(2, _load_on_ranks, path, direct_reads, expect_direct, timeout_s=120)


# --- writes ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_staged_write_writes_the_bytes_given(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Whatever the pieces, the file holds exactly their bytes: written around the cache a
    stage at a time once they outgrow one stage (the last block padded, the file cut)."""
    sizes = data.draw(st.lists(st.integers(0, 5 * 8192 + 100), max_size=8))
    root = tmp_path_factory.mktemp("write")
    needs_direct_reads(root)
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    want = b"".join(p.tobytes() for p in pieces)
    stage, direct.WRITE_STAGE_BYTES = direct.WRITE_STAGE_BYTES, 8192
    try:
        fd = os.open(root / "obj", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            staged = direct.StagedWrite(fd)
            for p in pieces:
                staged.add(memoryview(p))
                p[:] = 0  # (the producer may reuse its buffer once the store took it)
            total = staged.finish()
        finally:
            os.close(fd)
    finally:
        direct.WRITE_STAGE_BYTES = stage
    assert total == len(want) and (root / "obj").read_bytes() == want
    assert staged.direct is (len(want) >= 8192) and not staged.refused


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_pieces_filled_in_place_are_written_as_copied_ones(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """A producer may gather a piece where the staged write takes it next (``reserve``) and
    hand over that view: no copy, the same bytes; mixed with copied pieces, across stages."""
    pieces = data.draw(st.lists(st.tuples(st.integers(0, 3 * 8192 + 100), st.booleans()), max_size=10))
    root = tmp_path_factory.mktemp("reserve")
    rng = np.random.default_rng(len(pieces))
    chunks = [rng.integers(0, 256, n, dtype=np.uint8) for n, _ in pieces]
    stage, direct.WRITE_STAGE_BYTES = direct.WRITE_STAGE_BYTES, 8192
    try:
        fd = os.open(root / "obj", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            staged = direct.StagedWrite(fd)
            for chunk, (n, in_place) in zip(chunks, pieces):
                where = direct.reserve(n) if in_place else None
                if where is None:
                    staged.add(memoryview(chunk))
                else:
                    where[:] = chunk
                    staged.add(memoryview(where))
            total = staged.finish()
        finally:
            os.close(fd)
        assert direct.reserve(1) is None  # (closed)
    finally:
        direct.WRITE_STAGE_BYTES = stage
    want = b"".join(c.tobytes() for c in chunks)
    assert total == len(want) and (root / "obj").read_bytes() == want


@pytest.mark.parametrize("nbytes", [2 * 8192, 2 * 8192 - 1, 2 * 8192 + 1, 8192 + 4096])
def test_a_staged_write_ends_on_a_stage_or_block_boundary_or_not(tmp_path, monkeypatch, nbytes: int) -> None:
    needs_direct_reads(tmp_path)
    monkeypatch.setattr(direct, "WRITE_STAGE_BYTES", 8192)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    fd = os.open(tmp_path / "obj", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        staged = direct.StagedWrite(fd)
        staged.add(memoryview(data))
        assert staged.finish() == nbytes and staged.direct
    finally:
        os.close(fd)
    assert (tmp_path / "obj").read_bytes() == data.tobytes()


def test_a_save_writes_large_shards_around_the_cache_and_loads_back(tmp_path, monkeypatch) -> None:
    import zarr

    needs_direct_reads(tmp_path)
    monkeypatch.setattr(direct, "WRITE_STAGE_BYTES", 64 << 10)
    stores = saving_with(monkeypatch)
    state = tiled_state(5)
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    stats = stores[-1].stats
    assert stats.bytes_written_direct >= 1024 * 1536 * 4 + 2048 * 1024 * 2  # both matrices' shards
    assert stats.bytes_written_direct < stats.bytes_written  # (the vector and the documents: through the cache)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
    stored = zarr.open_array(os.path.join(path, "w", "w"), mode="r")  # (another reader, the same bytes)
    assert np.array_equal(stored[100:300, 500:900], state["w"][100:300, 500:900].numpy())


def test_a_file_system_that_refuses_direct_writes_is_written_through_the_cache(tmp_path, monkeypatch) -> None:
    import fcntl

    monkeypatch.setattr(direct, "WRITE_STAGE_BYTES", 64 << 10)
    real_fcntl = fcntl.fcntl
    refusals = []

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refusals.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    stores = saving_with(monkeypatch)
    state = tiled_state(6)
    path = str(tmp_path / "ck")
    ucp_zarr.save(state, path)
    # asked once per writer thread at most (those already writing when the first refusal came), then never again
    assert 1 <= len(refusals) <= 4 and stores[-1].stats.bytes_written_direct == 0
    assert not stores[-1]._direct_writes
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)


def test_a_background_save_writes_through_the_cache(tmp_path, monkeypatch) -> None:
    """A background save's writes run beside training: around the cache they cost a step
    more (profiles.md, 2026-12-06), so its store writes through it."""
    needs_direct_reads(tmp_path)
    monkeypatch.setattr(direct, "WRITE_STAGE_BYTES", 64 << 10)
    stores = saving_with(monkeypatch)
    state = tiled_state(7)
    path = str(tmp_path / "ck")
    ucp_zarr.async_save(state, path, writer="thread").result()
    assert stores[-1].stats.bytes_written > 0 and stores[-1].stats.bytes_written_direct == 0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ucp_zarr.load(out, path)
    assert all(bit_equal(out[k], state[k]) for k in state)
