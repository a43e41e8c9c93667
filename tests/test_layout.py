"""Property tests of the pure layout math: boxes, chunk grids, the grid policy."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr.layout import Box, ChunkGrid, choose_grid, grid_indices
from ucp_zarr.layout.chunking import MIN_ALIGNED_CHUNK_BYTES

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@st.composite
def box_in(draw, shape):
    off = tuple(draw(st.integers(0, n)) for n in shape)
    return Box(off, tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, off)))


@st.composite
def grid_and_box(draw):
    shape = draw(st.lists(st.integers(1, 30), min_size=1, max_size=3).map(tuple))
    chunk = tuple(draw(st.integers(1, n)) for n in shape)
    shard = tuple(c * draw(st.integers(1, 4)) for c in chunk)
    return ChunkGrid(shape, shard, chunk), draw(box_in(shape))


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(
        tuple(o + i for o, i in zip(box.offset, idx)) for idx in grid_indices(box.shape)
    ) if box.ndim else {()}


@given(grid_and_box())
@settings(max_examples=200, deadline=None)
def test_overlapping_chunks_cover_the_box_exactly_once(gb):
    grid, box = gb
    covered: list[tuple[int, ...]] = []
    for shard in grid.shards_overlapping(box):
        assert grid.shard_box(shard).intersect(box) is not None
        for local in grid.chunks_overlapping(shard, box):
            cbox = grid.chunk_box(shard, local)
            assert cbox is not None and grid.shard_box(shard).contains(cbox)
            inter = cbox.intersect(box)
            assert inter is not None and not inter.is_empty()
            covered.extend(_cells(inter))
    expected = _cells(box) if not box.is_empty() else set()
    assert len(covered) == len(set(covered)) and set(covered) == expected


@given(grid_and_box())
@settings(max_examples=100, deadline=None)
def test_shards_tile_the_array(gb):
    grid, _ = gb
    cells: list[tuple[int, ...]] = []
    for shard in grid.all_shards():
        cells.extend(_cells(grid.shard_box(shard)))
    assert sorted(cells) == sorted(_cells(Box.whole(grid.shape)))


@given(
    st.lists(st.integers(0, 5000), min_size=0, max_size=3).map(tuple),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([256, 4096, 1 << 16, 1 << 20]),
)
@settings(max_examples=300, deadline=None)
def test_grid_policy_invariants(shape, itemsize, chunk_bytes):
    g = choose_grid(shape, itemsize, chunk_bytes=chunk_bytes, shard_bytes=64 * chunk_bytes)
    assert g.shape == shape
    assert all(s % c == 0 for s, c in zip(g.shard_shape, g.chunk_shape))
    assert all(s >= n or s % c == 0 for s, n, c in zip(g.shard_shape, shape, g.chunk_shape))
    # bounded chunks: only a chunk of single rows/elements may exceed the bound
    if math.prod(g.chunk_shape) * itemsize > chunk_bytes:
        assert all(c == 1 for c in g.chunk_shape[:-1]) or len(shape) <= 1
    # chunks never exceed the array (no needless padding)
    assert all(c <= max(n, 1) for c, n in zip(g.chunk_shape, shape))


@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=2).map(lambda xs: tuple(8 * x * 16 for x in xs)),
    st.sampled_from([2, 4]),
)
@settings(max_examples=100, deadline=None)
def test_chunks_align_with_target_degrees(shape, itemsize):
    g = choose_grid(shape, itemsize)
    for d in range(len(shape)):
        if math.prod(shape) * itemsize // 8 >= MIN_ALIGNED_CHUNK_BYTES * 8:
            assert (shape[d] // 8) % g.chunk_shape[d] == 0, (shape, g)


@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=2),
    st.lists(st.integers(1, 50), min_size=2, max_size=2),
    st.sampled_from([1024, 1 << 16]),
)
@settings(max_examples=200, deadline=None)
def test_chunks_never_straddle_region_boundaries(parts, base, chunk_bytes):
    """With a region grid (one writer per region), every chunk and shard lies in one region."""
    region = tuple(b * 3 for b in base[: len(parts)])
    shape = tuple(r * p for r, p in zip(region, parts))
    g = choose_grid(shape, 4, region_shape=region, chunk_bytes=chunk_bytes, shard_bytes=8 * chunk_bytes)
    for d, (r, n) in enumerate(zip(region, shape)):
        if r < n:
            assert r % g.shard_shape[d] == 0 and r % g.chunk_shape[d] == 0
    # shards stay bounded, unless already down to one chunk
    assert math.prod(g.shard_shape) * 4 <= 8 * chunk_bytes or g.shard_shape == g.chunk_shape


@given(st.data())
def test_box_intersection_is_the_common_cells(data):
    shape = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple))
    a, b = data.draw(box_in(shape)), data.draw(box_in(shape))
    inter = a.intersect(b)
    common = _cells(a) & _cells(b) if not (a.is_empty() or b.is_empty()) else set()
    assert (set() if inter is None else _cells(inter)) == common


def _read_bytes(grid: ChunkGrid, box: Box, itemsize: int) -> int:
    """The bytes of every chunk a reader of ``box`` fetches."""
    total = 0
    for shard in grid.shards_overlapping(box):
        for local in grid.chunks_overlapping(shard, box):
            cbox = grid.chunk_box(shard, local)
            assert cbox is not None
            total += cbox.numel * itemsize
    return total


def test_elastic_reshard_reads_little_beyond_the_slice():
    """A Shard(0) save on 4 ranks resumed on 3 (dims of 2**k rows have no third to align
    with): each loading rank's chunks hold at most 1.1x its slice, over the tensors of a
    7B-like model (the benchmark's measure). Chunks of up to 4 MiB read 1.2x."""
    shapes = [((4096, 4096), 4), ((11008, 4096), 4), ((4096, 11008), 2), ((32000, 4096), 4), ((8003, 4096), 2)]
    for r in range(3):
        read = need = 0
        for shape, itemsize in shapes:
            grid = choose_grid(shape, itemsize, region_shape=(-(-shape[0] // 4), shape[1]))
            rows = -(-shape[0] // 3)
            box = Box((r * rows, 0), (min(rows, shape[0] - r * rows), shape[1]))
            read += _read_bytes(grid, box, itemsize)
            need += box.numel * itemsize
        assert read <= 1.1 * need, (r, read / need)
