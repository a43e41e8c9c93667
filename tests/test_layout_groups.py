"""Properties of the per-group fused layout (``ucp_zarr.layout.groups``), against oracles
written here in plain numpy: which degrees split the groups, what each rank holds, and the
sub-parameters' rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucp_zarr.layout.groups import check_degree, grouped, sub_ranges
from ucp_zarr.layout.pieces import PieceError, check_cover

layouts = st.tuples(
    st.integers(1, 8),  # groups
    st.lists(st.integers(1, 6), min_size=1, max_size=4),  # sizes per group
    st.integers(1, 24),  # TP degree
)


def _splits(groups: int, sizes: list[int], size: int) -> bool:
    """The oracle: ``size`` equal contiguous blocks, each whole groups or inside one group."""
    per, n = sum(sizes), groups * sum(sizes)
    if n % size:
        return False
    b = n // size
    return all((r * b) % per == 0 and b % per == 0 or (r * b) // per == ((r + 1) * b - 1) // per for r in range(size))


@given(layouts)
def test_the_degrees_accepted_are_those_that_split_groups_evenly(layout: tuple[int, list[int], int]) -> None:
    groups, sizes, size = layout
    try:
        check_degree(groups, sizes, size)
        accepted = True
    except PieceError:
        accepted = False
    assert accepted == _splits(groups, sizes, size)


@given(layouts, st.integers(1, 3))
def test_ranks_hold_contiguous_blocks_that_tile_the_groups(layout: tuple[int, list[int], int], cols: int) -> None:
    groups, sizes, size = layout
    if not _splits(groups, sizes, size):
        return
    per = sum(sizes)
    full = np.arange(groups * per * cols).reshape(groups * per, cols)  # labelled consolidated tensor
    local_rows = groups * per // size
    pieces = []
    for r in range(size):
        glob, ps = grouped((local_rows, cols), 0, groups, sizes, r, size)
        assert glob == full.shape
        local = full[r * local_rows : (r + 1) * local_rows]  # what Megatron's rank r holds: rows of its groups
        for p in ps:
            src = local[p.src.offset[0] : p.src.offset[0] + p.src.shape[0]]
            dst = full[p.dst.offset[0] : p.dst.offset[0] + p.dst.shape[0]]
            assert np.array_equal(src, dst)
        if size > groups:  # part of one group: group r // (size / groups), as Megatron's attention picks it
            assert {(r * local_rows + i) // per for i in range(local_rows)} == {r // (size // groups)}
        pieces.append(ps)
    check_cover(full.shape, pieces)


@given(st.integers(1, 8), st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_sub_ranges_deinterleave_the_groups(groups: int, sizes: list[int]) -> None:
    per = sum(sizes)
    rows = np.arange(groups * per)
    starts = np.cumsum([0] + sizes)
    seen = []
    for j in range(len(sizes)):
        got = np.concatenate([rows[a:b] for a, b in sub_ranges(groups, sizes, j)])
        want = rows.reshape(groups, per)[:, starts[j] : starts[j + 1]].reshape(-1)
        assert np.array_equal(got, want)
        seen.append(got)
    assert np.array_equal(np.sort(np.concatenate(seen)), rows)


def test_refusals_name_the_degree() -> None:
    with pytest.raises(PieceError, match="4 groups cannot be split evenly over 3 ranks"):
        check_degree(4, [2, 1, 1], 3)
    with pytest.raises(PieceError, match="2 groups of 3 rows cannot be split over 4 ranks"):
        check_degree(2, [1, 1, 1], 4)
    with pytest.raises(PieceError, match="is not 1/2 of 2 groups"):
        grouped((5, 2), 0, 2, [2, 1, 1], 0, 2)
    with pytest.raises(PieceError, match="sub-parameter 3 of 3"):
        sub_ranges(2, [2, 1, 1], 3)
