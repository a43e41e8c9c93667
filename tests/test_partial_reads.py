"""Partial reads fetch exactly the chunks that overlap the selection, and nothing else.

On the local filesystem every byte read goes through ``ck.store.stats``. A read of
``ck[key][index]`` must cost exactly

    (chunks overlapping the selection's bounding box) * (chunk bytes + 4 crc32c bytes)
    + (shard tail: index prod(chunks_per_shard) * 16 + 4 and trailer 80 + 4 * prod(...),
      FORMAT.md section 5) for every shard touched for the first time by this Checkpoint
      (tails are cached; every array is sharded, a one-chunk shard too)

Chunks at the array's edge are stored padded to the full chunk shape, so every stored chunk
has the same size. All expectations are computed from ``ck.array_meta(key).grid``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

import ucp_zarr

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "model.w"
CRC = 4

# name -> (shape, chunk_bytes, shard_bytes or None for the default)
CONFIGS: dict[str, tuple[tuple[int, ...], int, int | None]] = {
    # row chunks, one shard
    "512x256-rows": ((512, 256), 16384, None),
    # a 2-D chunk grid, four shards
    "512x256-grid-4shards": ((512, 256), 512, 131072),
    # row chunks, four shards
    "512x256-rows-4shards": ((512, 256), 16384, 131072),
    # shard == chunk: no sharding codec, one object per chunk, no index
    "512x256-unsharded": ((512, 256), 16384, 16384),
    # odd shape: partial edge chunks in both dims, a clipped last shard
    "509x253-grid": ((509, 253), 600, 131072),
    "509x253-rows": ((509, 253), 16384, 131072),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[str, torch.Tensor]]:
    out = {}
    for name, (shape, chunk_bytes, shard_bytes) in CONFIGS.items():
        path = tmp_path_factory.mktemp("partial") / name
        src = torch.randn(shape, generator=torch.Generator().manual_seed(len(out)))
        kwargs = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
        ucp_zarr.save({"model": {"w": src}}, path, chunk_bytes=chunk_bytes, **kwargs)
        out[name] = (str(path), src)
    return out


def test_configs_give_the_intended_grids(saved):
    """The configurations really cover what the other tests rely on."""
    grids = {name: ucp_zarr.open(p).array_meta(KEY).grid for name, (p, _) in saved.items()}
    for g in grids.values():
        assert math.prod(_counts(g.shape, g.chunk_shape)) > 1, g  # several chunks everywhere
    assert grids["512x256-rows"].sharded and math.prod(grids["512x256-rows"].shard_counts) == 1
    g = grids["512x256-grid-4shards"]
    assert g.sharded and math.prod(g.shard_counts) > 1 and _counts(g.shape, g.chunk_shape)[1] > 1, g
    assert math.prod(grids["512x256-rows-4shards"].shard_counts) > 1
    assert not grids["512x256-unsharded"].sharded
    g = grids["509x253-grid"]
    assert any(n % c for n, c in zip(g.shape, g.chunk_shape)), g  # edge chunks exist
    g = grids["509x253-rows"]
    assert any(n % s for n, s in zip(g.shape, g.shard_shape)), g  # a clipped shard exists


# --- the expectation, computed independently of ucp_zarr's index code ----------------------


def _counts(shape, cell) -> tuple[int, ...]:
    return tuple(-(-n // c) for n, c in zip(shape, cell))


def _expand(index: Any, ndim: int) -> tuple[Any, ...]:
    """``index`` as one int or slice per dim (Ellipsis and missing trailing dims filled)."""
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1 :]
    return index + (slice(None),) * (ndim - len(index))


def _expected_bytes(grid, itemsize: int, index: Any, touched: set[tuple[int, ...]]) -> tuple[int, set]:
    """Bytes a read of ``index`` must cost (the chunks holding a selected element, plus the
    trailer and index of each shard not touched before, read together from the shard's end:
    FORMAT.md section 5); returns them and the shards this read touches."""
    chunk_stored = math.prod(grid.chunk_shape) * itemsize + CRC
    nbytes = len(_selected_cells(index, grid.shape, grid.chunk_shape)) * chunk_stored
    shards = _selected_cells(index, grid.shape, grid.shard_shape)
    nbytes += len(shards - touched) * _tail(grid)
    return nbytes, shards


def _tail(grid) -> int:
    """What is read from the end of a shard before its chunks: its trailer and its index."""
    n = math.prod(grid.chunks_per_shard)
    trailer = 8 + 4 + 4 + 16 + 16 + 4 * n + 32
    return trailer + n * 16 + CRC


def _reset(ck) -> None:
    ck.store.stats = type(ck.store.stats)()


def _check_read(ck, src: torch.Tensor, index: Any, touched: set) -> None:
    grid = ck.array_meta(KEY).grid
    want_bytes, shards = _expected_bytes(grid, src.element_size(), index, touched)
    _reset(ck)
    got = ck[KEY][index]
    want = src[index]
    assert got.dtype == want.dtype and got.shape == want.shape, (index, got.shape, want.shape)
    assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)), index
    stats = ck.store.stats
    assert stats.bytes_read == want_bytes, (index, grid, stats.bytes_read, want_bytes)
    assert (stats.read_calls == 0) == (want_bytes == 0), (index, stats)
    touched |= shards


# --- explicit slices, one Checkpoint (so the shard index cache is exercised) ----------------


def _examples(shape: tuple[int, int]) -> list[Any]:
    a, b = shape
    return [
        (slice(0, 1), slice(0, 1)),
        (slice(3, 17), slice(5, 9)),
        (slice(100, 300), slice(None)),
        (slice(100, 300), slice(None)),  # again: shard indexes are cached now
        (7, slice(None)),
        (slice(None), 3),
        (-1, -1),
        (slice(-40, -2), slice(-100, None)),
        (slice(None, None, 7), slice(1, None, 50)),
        (slice(5, a, 64), 0),
        (Ellipsis, 9),
        (10, Ellipsis),
        (Ellipsis, slice(20, 60)),
        Ellipsis,
        slice(a - 3, None),
        np.int64(a // 2),
        (slice(50, 50), slice(None)),  # empty
        (slice(a + 5, a + 10), 0),  # empty, beyond the end
        (slice(200, 100), slice(None)),  # empty, stop before start
        (),
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_partial_reads_read_only_overlapping_chunks(saved, name):
    path, src = saved[name]
    ck = ucp_zarr.open(path)
    ck.array_meta(KEY)  # read the array's zarr.json before counting
    touched: set[tuple[int, ...]] = set()
    for index in _examples(tuple(src.shape)):
        _check_read(ck, src, index, touched)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_small_read_is_a_small_fraction(saved, name):
    """A one-element read costs one chunk (plus one shard index), not the tensor."""
    path, src = saved[name]
    ck = ucp_zarr.open(path)
    grid = ck.array_meta(KEY).grid
    _reset(ck)
    assert ck[KEY][src.shape[0] - 1, src.shape[1] - 1].item() == src[-1, -1].item()
    assert ck.store.stats.bytes_read == math.prod(grid.chunk_shape) * 4 + CRC + _tail(grid)
    assert ck.store.stats.bytes_read < src.numel() * 4 // 8


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_read_reads_every_chunk_once(saved, name):
    path, src = saved[name]
    ck = ucp_zarr.open(path)
    grid = ck.array_meta(KEY).grid
    _reset(ck)
    assert torch.equal(ck[KEY][...], src)
    nchunks = math.prod(_counts(grid.shape, grid.chunk_shape))
    nshards = math.prod(grid.shard_counts)
    assert ck.store.stats.bytes_read == nchunks * (math.prod(grid.chunk_shape) * 4 + CRC) + nshards * _tail(grid)


# --- random slices --------------------------------------------------------------------------


@st.composite
def _index(draw, shape: tuple[int, ...]) -> Any:
    parts: list[Any] = []
    for n in shape:
        kind = draw(st.sampled_from(["int", "slice", "slice", "full"]))
        if kind == "int":
            parts.append(draw(st.integers(-n, n - 1)))
        elif kind == "full":
            parts.append(slice(None))
        else:
            bound = st.none() | st.integers(-n - 8, n + 8)
            parts.append(slice(draw(bound), draw(bound), draw(st.none() | st.integers(1, 80))))
    form = draw(st.sampled_from(["tuple", "ellipsis", "short", "bare"]))
    if form == "ellipsis":
        k = draw(st.integers(0, len(parts)))
        at = draw(st.integers(0, len(parts) - k))
        return tuple(parts[:at]) + (Ellipsis,) + tuple(parts[at + k :])
    if form == "short":
        return tuple(parts[: draw(st.integers(0, len(parts)))])
    if form == "bare":
        return parts[0]
    return tuple(parts)


@st.composite
def _case(draw) -> tuple[str, Any]:
    name = draw(st.sampled_from(list(CONFIGS)))
    return name, draw(_index(CONFIGS[name][0]))


@settings(max_examples=50, deadline=None)
@given(case=_case())
def test_random_partial_reads(saved, case):
    name, index = case
    path, src = saved[name]
    ck = ucp_zarr.open(path)  # fresh: every touched shard's index is read once
    ck.array_meta(KEY)
    touched: set[tuple[int, ...]] = set()
    _check_read(ck, src, index, touched)
    # the same read again costs only the chunks: the indexes are cached
    _check_read(ck, src, index, touched)


# --- known limitation -----------------------------------------------------------------------


def _selected_cells(index: Any, shape: tuple[int, ...], cell: tuple[int, ...]) -> set[tuple[int, ...]]:
    """Cells (chunks or shards) that hold at least one selected element."""
    per_dim = []
    for i, n, c in zip(_expand(index, len(shape)), shape, cell):
        picked = range(n)[i] if isinstance(i, slice) else [range(n)[int(i)]]
        per_dim.append(sorted({p // c for p in picked}))
    return set(itertools.product(*per_dim))


@pytest.mark.parametrize("name", ["512x256-rows", "512x256-grid-4shards"])
def test_stepped_read_skips_chunks_without_selected_elements(saved, name):
    path, src = saved[name]
    ck = ucp_zarr.open(path)
    grid = ck.array_meta(KEY).grid
    index = (slice(None, None, 64), slice(None, None, 200))
    chunks = _selected_cells(index, tuple(src.shape), grid.chunk_shape)
    shards = _selected_cells(index, tuple(src.shape), grid.shard_shape)
    want = len(chunks) * (math.prod(grid.chunk_shape) * 4 + CRC) + len(shards) * _tail(grid)
    _reset(ck)
    assert torch.equal(ck[KEY][index], src[index])
    assert ck.store.stats.bytes_read == want, (ck.store.stats.bytes_read, want)
