"""Shards whose chunks need a copy (column blocks, strided sources) are written in runs of
chunks, each one buffer laid out as stored (:func:`ucp_zarr.io.arrayio._tiled_batches`):
zarr-python (another implementation, checking every chunk's crc32c and the index) reads
them back bit-exact whatever the run size, and a store gets one buffer per run, not two
per chunk (every buffer is a system call, and each releases the GIL)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ucp_zarr.io.arrayio as arrayio
from ucp_zarr.format.documents import ArrayMeta
from ucp_zarr.format.dtypes import stored_dtype
from ucp_zarr.io.arrayio import Seal, write_shard
from ucp_zarr.io.local import LocalStore
from ucp_zarr.layout import Box, ChunkGrid

zarr = pytest.importorskip("zarr")


@st.composite
def _arrays(draw):
    nd = draw(st.integers(1, 3))
    chunk = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    per_shard = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    shard = tuple(c * k for c, k in zip(chunk, per_shard))
    shape = tuple(max(1, s * draw(st.integers(1, 2)) - draw(st.sampled_from([0, 0, 1]))) for s in shard)
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int16, torch.uint8]))
    strided = draw(st.booleans())
    batch = draw(st.sampled_from([1, 64, 300, 1 << 20]))
    return shape, shard, chunk, dtype, strided, batch


@settings(max_examples=60, deadline=None)
@given(case=_arrays())
def test_runs_of_chunks_read_back_bit_exact_by_zarr_python(tmp_path_factory, case) -> None:
    shape, shard, chunk, dtype, strided, batch = case
    root = tmp_path_factory.mktemp("runs")
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    if strided:  # a transposed source: no chunk is a contiguous block of it
        t = t.flip(0).t().contiguous().t().flip(-1) if t.ndim == 2 else t.flip(0)
    grid = ChunkGrid(shape, shard, chunk)
    meta = ArrayMeta("a", stored_dtype(dtype), grid, ())
    store = LocalStore(str(root))
    sizes = []  # (what the buffers said the object would take, what it took)
    real_write = store.write
    def write(key, buffers, guard=None):
        sizes.append((buffers.nbytes, real_write(key, buffers, guard)))
        return sizes[-1][1]

    store.write = write
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arrayio, "WRITE_BATCH_BYTES", batch)
        for index in itertools.product(*(range(-(-n // s)) for n, s in zip(shape, shard))):
            write_shard(store, "a", meta, index, t, Box((0,) * len(shape), shape), Seal("0" * 32))
    (root / "a" / "zarr.json").write_text(json.dumps(meta.to_zarr_json()))
    got = zarr.open_array(str(root / "a"), mode="r")[...]
    assert np.array_equal(got, t.numpy()), case
    assert sizes and all(said == took for said, took in sizes), sizes


def test_a_shard_of_column_blocks_goes_to_the_store_in_runs(tmp_path) -> None:
    class Counting(LocalStore):
        def write(self, key, buffers, guard=None):
            bufs = [bytes(memoryview(b)) for b in buffers]
            self.counts.append(len(bufs))
            return super().write(key, bufs, guard)

    shape, chunk = (768, 768), (96, 192)  # 8 x 4 chunks of 72 KiB, each a column block
    t = torch.randn(shape)
    grid = ChunkGrid(shape, shape, chunk)
    meta = ArrayMeta("a", stored_dtype(torch.float32), grid, ())
    store = Counting(str(tmp_path))
    store.counts = []
    write_shard(store, "a", meta, (0, 0), t, Box((0, 0), shape), Seal("0" * 32))
    band = 4 * (math.prod(chunk) * 4 + 4)  # a row of the chunk grid, stored
    runs = math.ceil(8 / (arrayio.WRITE_BATCH_BYTES // band))  # (3 bands of 288 KiB per MiB: 3 runs)
    assert store.counts == [runs + 2]  # the runs, the trailer, the index (before: 2 per chunk, 66)
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(meta.to_zarr_json()))
    assert np.array_equal(zarr.open_array(str(tmp_path / "a"), mode="r")[...], t.numpy())


def test_the_written_index_is_made_once_and_read_only() -> None:
    """The index a shard is written with is made once per layout and shared by every shard
    of that layout, written or read (``arrayio._layout_index``): a change to it would
    corrupt every later one, so it refuses changes; edge shards get their own."""
    seal = Seal("s", False)
    a = ArrayMeta("a", stored_dtype(torch.float32), ChunkGrid((8, 6), (4, 6), (2, 3)), ())
    b = ArrayMeta("b", stored_dtype(torch.float32), ChunkGrid((4, 6), (4, 6), (2, 3)), ())
    index, size = arrayio.written_index(a, (0, 0), seal)
    assert arrayio.written_index(b, (0, 0), seal)[0] is index  # (another array of the layout: the same index)
    assert not index.flags.writeable
    with pytest.raises(ValueError):
        index[0, 0] = 1
    assert index[:, 0].tolist() == [0, 28, 56, 84] and size == 4 * 28 + arrayio._head_nbytes(a, seal)
    edge = ArrayMeta("c", stored_dtype(torch.float32), ChunkGrid((6, 6), (4, 6), (2, 3)), ())
    assert arrayio.written_index(edge, (1, 0), seal)[0][:, 0].tolist() == [0, 28, 2**64 - 1, 2**64 - 1]


def test_a_large_index_is_not_kept() -> None:
    """Only small indexes are shared: a shard of more chunks gets its own, not cached."""
    n = arrayio.SHARED_INDEX_CHUNKS + 1
    meta = ArrayMeta("a", stored_dtype(torch.uint8), ChunkGrid((n,), (n,), (1,)), ())
    first = arrayio.written_index(meta, (0,), Seal("s", False))[0]
    assert arrayio.written_index(meta, (0,), Seal("s", False))[0] is not first
    assert first[-1].tolist() == [(n - 1) * 5, 5] and not first.flags.writeable


@pytest.mark.parametrize("chunk", [(256, 1024), (4096, 1024)])  # 1 MiB chunks; one 16 MiB chunk
def test_a_paced_shard_waits_for_each_piece_before_the_store_takes_it(tmp_path, chunk) -> None:
    """``write_shard(..., pace=...)``: the store pulls no piece before ``pace`` gave its slot,
    and a piece is at most ``PACE_PIECE_BYTES`` (so one large shard, or chunk, is spread)."""
    events: list[tuple[str, int]] = []

    class Recording(LocalStore):
        def write(self, key, buffers, guard=None):
            def pulled():
                for b in buffers:
                    events.append(("pulled", memoryview(b).nbytes))
                    yield b
            return super().write(key, pulled(), guard)

    shape = (4096, 1024)  # 16 MiB of float32, one shard
    t = torch.randn(shape)
    meta = ArrayMeta("a", stored_dtype(torch.float32), ChunkGrid(shape, shape, chunk), ())
    write_shard(Recording(str(tmp_path)), "a", meta, (0, 0), t, Box((0, 0), shape), Seal("0" * 32),
                pace=lambda n: events.append(("slot", n)))
    slots = [n for what, n in events if what == "slot"]
    assert sum(slots) == sum(n for what, n in events if what == "pulled") >= t.nbytes
    assert len(slots) >= 16 and max(slots) <= arrayio.PACE_PIECE_BYTES
    assert all(a == ("slot", b[1]) and b[0] == "pulled" for a, b in zip(events[::2], events[1::2]))
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(meta.to_zarr_json()))
    assert np.array_equal(zarr.open_array(str(tmp_path / "a"), mode="r")[...], t.numpy())
