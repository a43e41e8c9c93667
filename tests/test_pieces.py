"""Property tests of ``ucp_zarr.layout.pieces``, against numpy references (numpy arrays stand in for tensors)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr.layout.boxes import Box
from ucp_zarr.layout.pieces import (
    Piece,
    PieceError,
    check_cover,
    check_pieces,
    clip,
    even_widths,
    flat_range,
    split,
    sub_params,
    whole,
)

SETTINGS = settings(max_examples=150, deadline=None)


# --- reference helpers (independent of the module) ---------------------------------------


def view(local: np.ndarray, p: Piece) -> np.ndarray:
    """The region of ``local`` that ``p`` names: its base view, sliced with ``p.step``."""
    base = local
    if p.base is not None:
        start, shape = p.base
        base = local.reshape(-1)[start : start + math.prod(shape)].reshape(shape)
    step = p.step or (1,) * p.src.ndim
    region = base[tuple(slice(o, o + (n - 1) * s + 1 if n else o, s) for o, n, s in zip(p.src.offset, p.src.shape, step))]
    assert region.shape == p.dst.shape, (p, region.shape)
    return region


def assemble(global_shape, ranks) -> tuple[np.ndarray, np.ndarray]:
    """Every piece of every ``(local, pieces)`` written into a global array (``-1`` where
    nothing is written), and the number of writes per element."""
    out = np.full(global_shape, -1, dtype=np.int64)
    count = np.zeros(global_shape, dtype=np.int64)
    for local, pieces in ranks:
        for p in pieces:
            out[p.dst.slices()] = view(local, p)
            count[p.dst.slices()] += 1
    return out, count


def mapping(local_shape, pieces) -> list[tuple[int, tuple[int, ...]]]:
    """The sorted (local flat index, destination index) pairs the pieces map."""
    ids = np.arange(math.prod(local_shape)).reshape(local_shape)
    pairs = []
    for p in pieces:
        v = view(ids, p)
        for idx in np.ndindex(*p.dst.shape):
            pairs.append((int(v[idx]), tuple(o + i for o, i in zip(p.dst.offset, idx))))
    return sorted(pairs)


def index_array(shape) -> np.ndarray:
    """A global tensor whose values are its own flat indices."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def take(a: np.ndarray, dim: int, lo: int, hi: int) -> np.ndarray:
    return a[(slice(None),) * dim + (slice(lo, hi),)]


def fused_locals(glob: np.ndarray, dim: int, sizes, widths, tp: int) -> list[np.ndarray]:
    """Rank ``r``'s local tensor: ``widths[j][r]`` rows of each sub-parameter ``j``, in order."""
    bounds = np.cumsum([0, *sizes])
    subs = [take(glob, dim, bounds[j], bounds[j + 1]) for j in range(len(sizes))]
    out = []
    for r in range(tp):
        parts = [take(s, dim, sum(w[:r]), sum(w[:r + 1])) for s, w in zip(subs, widths)]
        out.append(np.concatenate(parts, axis=dim))
    return out


# --- strategies ----------------------------------------------------------------------------


@st.composite
def composition(draw, n: int, parts: int) -> list[int]:
    """``n`` as ``parts`` non-negative integers (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def split_case(draw, max_ndim: int = 4, max_n: int = 6):
    local_shape = tuple(draw(st.lists(st.integers(0, max_n), min_size=1, max_size=max_ndim)))
    dim = draw(st.integers(0, len(local_shape) - 1))
    size = draw(st.integers(1, 4))
    return local_shape, dim, size


@st.composite
def fused_case(draw, max_ndim: int = 3):
    ndim = draw(st.integers(1, max_ndim))
    dim = draw(st.integers(0, ndim - 1))
    tp = draw(st.integers(1, 4))
    n_sub = draw(st.integers(1, 4))
    if draw(st.booleans()):
        sizes = [tp * draw(st.integers(0, 3)) for _ in range(n_sub)]
        widths = [[n // tp] * tp for n in sizes]
    else:
        sizes = [draw(st.integers(0, 8)) for _ in range(n_sub)]
        widths = [draw(composition(n, tp)) for n in sizes]
    other = [draw(st.integers(0, 4)) for _ in range(ndim)]
    glob_shape = tuple(sum(sizes) if d == dim else other[d] for d in range(ndim))
    return glob_shape, dim, sizes, widths, tp


@st.composite
def layout(draw):
    """A consolidated shape and, per rank, the reference local (of global flat indices) and
    the module's pieces, from an even split or fused sub-parameters."""
    if draw(st.booleans()):
        local_shape, dim, size = draw(split_case(max_ndim=3, max_n=5))
        ranks = [split(local_shape, dim, r, size) for r in range(size)]
        glob_shape = ranks[0][0]
        locals_ = np.split(index_array(glob_shape), size, axis=dim)
    else:
        glob_shape, dim, sizes, widths, tp = draw(fused_case())
        ranks = []
        locals_ = fused_locals(index_array(glob_shape), dim, sizes, widths, tp)
        ranks = [sub_params(loc.shape, dim, sizes, widths, r) for r, loc in enumerate(locals_)]
    assert all(g == glob_shape for g, _ in ranks)
    return glob_shape, [(loc, ps) for loc, (_, ps) in zip(locals_, ranks)]


def exact(glob_shape, ranks) -> None:
    """The ranks assemble the consolidated tensor exactly, each element written once."""
    out, count = assemble(glob_shape, ranks)
    np.testing.assert_array_equal(out, index_array(glob_shape))
    assert (count == 1).all()


# --- 1. split -------------------------------------------------------------------------------


@SETTINGS
@given(split_case())
def test_split_assembles_global(case) -> None:
    """Locals cut with ``np.split`` assemble the global array exactly; the cover checks pass."""
    local_shape, dim, size = case
    glob_shape = tuple(n * size if d == dim else n for d, n in enumerate(local_shape))
    locals_ = np.split(index_array(glob_shape), size, axis=dim)
    results = [split(local_shape, dim, r, size) for r in range(size)]
    assert all(g == glob_shape for g, _ in results)
    ranks = [(loc, ps) for loc, (_, ps) in zip(locals_, results)]
    exact(glob_shape, ranks)
    for loc, ps in ranks:
        check_pieces(ps, loc.shape, glob_shape)
    check_cover(glob_shape, [ps for _, ps in ranks])


def test_split_rejects_bad_dim() -> None:
    for dim in (-1, 2):
        with pytest.raises(PieceError):
            split((2, 3), dim, 0, 2)


# --- 2. sub_params / even_widths ------------------------------------------------------------


@SETTINGS
@given(fused_case())
def test_sub_params_assembles_global(case) -> None:
    """Even and uneven widths: the concatenated rank slices of each sub-parameter assemble exactly."""
    glob_shape, dim, sizes, widths, tp = case
    locals_ = fused_locals(index_array(glob_shape), dim, sizes, widths, tp)
    ranks = []
    for r, loc in enumerate(locals_):
        g, ps = sub_params(loc.shape, dim, sizes, widths, r)
        assert g == glob_shape
        check_pieces(ps, loc.shape, glob_shape)
        ranks.append((loc, ps))
    exact(glob_shape, ranks)
    check_cover(glob_shape, [ps for _, ps in ranks])


@SETTINGS
@given(st.lists(st.integers(0, 12), min_size=1, max_size=4), st.integers(1, 4))
def test_even_widths(sizes, tp) -> None:
    """Equal shares when every size divides evenly, else PieceError."""
    if all(n % tp == 0 for n in sizes):
        assert even_widths(sizes, tp) == [[n // tp] * tp for n in sizes]
    else:
        with pytest.raises(PieceError):
            even_widths(sizes, tp)


@SETTINGS
@given(fused_case(), st.data())
def test_sub_params_rejects_bad_widths(case, data) -> None:
    """Widths that do not add up to the sizes, negative widths, or a local size that is not the
    rank's widths summed raise PieceError."""
    glob_shape, dim, sizes, widths, tp = case
    locals_ = fused_locals(index_array(glob_shape), dim, sizes, widths, tp)
    r = data.draw(st.integers(0, tp - 1))
    shape = locals_[r].shape
    j = data.draw(st.integers(0, len(sizes) - 1))
    k = data.draw(st.integers(0, tp - 1))
    delta = data.draw(st.sampled_from([-1, 1]))
    bad = [list(w) for w in widths]
    bad[j][k] += delta
    with pytest.raises(PieceError):  # sub-parameter j no longer adds up
        sub_params(shape, dim, sizes, bad, r)
    if tp > 1:  # same sum, one width negative
        neg = [list(w) for w in widths]
        neg[j][0] -= neg[j][0] + 1
        neg[j][1] += widths[j][0] + 1
        with pytest.raises(PieceError):
            sub_params(shape, dim, sizes, neg, r)
    wrong = tuple(n + 1 if d == dim else n for d, n in enumerate(shape))
    with pytest.raises(PieceError):
        sub_params(wrong, dim, sizes, widths, r)
    with pytest.raises(PieceError):
        sub_params(shape, dim, sizes, widths[:-1] if len(widths) > 1 else [*widths, [0] * tp], r)


# --- 3. clip ----------------------------------------------------------------------------------


@st.composite
def vocab_case(draw):
    vocab, hidden, tp = draw(st.integers(1, 12)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    padded = tp * -(-(vocab + draw(st.integers(0, 5))) // tp)
    return vocab, hidden, tp, padded


@SETTINGS
@given(vocab_case())
def test_clip_padded_vocab(case) -> None:
    """Kept pieces assemble exactly the first ``vocab`` rows; pad pieces cover exactly the local
    rows whose padded row is ``>= vocab``."""
    vocab, hidden, tp, padded = case
    padded_glob = index_array((padded, hidden))
    per = padded // tp
    ranks, kept_by_rank = [], []
    for r, loc in enumerate(np.split(padded_glob, tp, axis=0)):
        _, pieces = split(loc.shape, 0, r, tp)
        kept, pad = clip(pieces, 0, vocab)
        check_pieces(kept, loc.shape, (vocab, hidden), pad)
        ranks.append((loc, kept))
        kept_by_rank.append(kept)
        assert all(p.dst.offset[0] >= vocab for p in pad)
        pad_rows = sorted({i for i, _ in mapping(loc.shape, pad)})
        want = [i * hidden + c for i in range(per) if r * per + i >= vocab for c in range(hidden)]
        assert pad_rows == want
        assert sorted(mapping(loc.shape, kept) + mapping(loc.shape, pad)) == mapping(loc.shape, pieces)
    out, count = assemble((vocab, hidden), ranks)
    np.testing.assert_array_equal(out, padded_glob[:vocab])
    assert (count == 1).all()
    check_cover((vocab, hidden), kept_by_rank)


@SETTINGS
@given(layout(), st.data())
def test_clip_partitions_mapping(case, data) -> None:
    """For any dim and size, clip splits each piece's element map by destination index."""
    glob_shape, ranks = case
    dim = data.draw(st.integers(0, len(glob_shape) - 1))
    size = data.draw(st.integers(0, glob_shape[dim] + 1))
    for loc, pieces in ranks:
        kept, pad = clip(pieces, dim, size)
        full = mapping(loc.shape, pieces)
        assert mapping(loc.shape, kept) == [m for m in full if m[1][dim] < size]
        assert mapping(loc.shape, pad) == [m for m in full if m[1][dim] >= size]
        clipped = tuple(min(n, size) if d == dim else n for d, n in enumerate(glob_shape))
        check_pieces(kept, loc.shape, clipped, pad)


@SETTINGS
@given(vocab_case(), st.data())
def test_clip_then_flat_range(case, data) -> None:
    """A distributed optimizer's flat range of a padded-vocab slab (clip, then flat_range of
    kept and pad): kept maps the range's real rows, pad its padding rows, each element once."""
    vocab, hidden, tp, padded = case
    ranks = []
    for r, loc in enumerate(np.split(index_array((padded, hidden)), tp, axis=0)):
        kept, pad = clip(split(loc.shape, 0, r, tp)[1], 0, vocab)
        for a, b in ranges(data, loc.size):
            flat = loc.reshape(-1)[a:b]
            fk, fp = flat_range(loc.shape, kept, a, b), flat_range(loc.shape, pad, a, b)
            check_pieces(fk, flat.shape, (vocab, hidden), fp)
            both = sorted(mapping(flat.shape, fk) + mapping(flat.shape, fp))
            assert [i for i, _ in both] == list(range(b - a))
            assert all(g[0] < vocab for _, g in mapping(flat.shape, fk))
            assert all(g[0] >= vocab for _, g in mapping(flat.shape, fp))
            ranks.append((flat, fk))
    exact((vocab, hidden), ranks)


# --- 4. flat_range ----------------------------------------------------------------------------


def ranges(data, n: int) -> list[tuple[int, int]]:
    """A random partition of ``[0, n)`` into consecutive ranges (empty ones allowed)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


@SETTINGS
@given(layout(), st.data())
def test_flat_range_single(case, data) -> None:
    """``local.reshape(-1)[start:stop]`` through the returned pieces writes exactly the global
    elements those local elements are, each once."""
    glob_shape, ranks = case
    loc, pieces = ranks[data.draw(st.integers(0, len(ranks) - 1))]
    start = data.draw(st.integers(0, loc.size))
    stop = data.draw(st.integers(start, loc.size))
    flat = loc.reshape(-1)[start:stop]
    fp = flat_range(loc.shape, pieces, start, stop)
    check_pieces(fp, flat.shape, glob_shape)
    out, count = assemble(glob_shape, [(flat, fp)])
    want = np.zeros(math.prod(glob_shape), dtype=np.int64)
    want[flat] = 1
    np.testing.assert_array_equal(count.reshape(-1), want)
    np.testing.assert_array_equal(out.reshape(-1)[flat], flat)


@SETTINGS
@given(layout(), st.data())
def test_flat_range_partition_covers(case, data) -> None:
    """Partitioning each rank's flat elements into ranges covers the consolidated tensor exactly once."""
    glob_shape, ranks = case
    flats = []
    for loc, pieces in ranks:
        for a, b in ranges(data, loc.size):
            flats.append((loc.reshape(-1)[a:b], flat_range(loc.shape, pieces, a, b)))
    exact(glob_shape, flats)
    check_cover(glob_shape, [ps for _, ps in flats])


@SETTINGS
@given(st.lists(st.integers(0, 4), max_size=3).map(tuple), st.data())
def test_flat_range_whole_offset(shape, data) -> None:
    """A whole tensor placed at an offset (0-d included): flat ranges map to the same elements."""
    offset = tuple(data.draw(st.integers(0, 2)) for _ in shape)
    glob_shape = tuple(o + n for o, n in zip(offset, shape))
    g = index_array(glob_shape)
    loc = g[Box(offset, shape).slices()]
    pieces = whole(shape, offset)
    assert len(pieces) == (1 if loc.size else 0)
    out, count = assemble(glob_shape, [(loc, pieces)])
    np.testing.assert_array_equal(out[Box(offset, shape).slices()], loc)
    assert count.sum() == loc.size
    flats = [(loc.reshape(-1)[a:b], flat_range(shape, pieces, a, b)) for a, b in ranges(data, loc.size)]
    out2, count2 = assemble(glob_shape, flats)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(count2, count)


def test_flat_range_rejects_strided_and_flat_pieces() -> None:
    strided = Piece(Box((0,), (2,)), Box((0,), (2,)), step=(2,))
    based = Piece(Box((0,), (2,)), Box((0,), (2,)), base=(0, (2,)))
    for p in (strided, based):
        with pytest.raises(PieceError):
            flat_range((4,), [p], 0, 4)


# --- 5. check_pieces / check_cover rejections -------------------------------------------------


def P(dst_off, src_off, shape, step=None, base=None) -> Piece:
    return Piece(Box(tuple(dst_off), tuple(shape)), Box(tuple(src_off), tuple(shape)), step, base)


@pytest.mark.parametrize(
    "pieces, local, glob, pad",
    [
        pytest.param([P((3,), (0,), (2,))], (4,), (4,), [], id="dst-outside-global"),
        pytest.param([P((0, 2), (0, 0), (2, 2))], (2, 2), (2, 3), [], id="dst-outside-global-2d"),
        pytest.param([P((0,), (3,), (2,))], (4,), (4,), [], id="src-outside-local"),
        pytest.param([P((0,), (0,), (2,)), P((1,), (2,), (2,))], (4,), (4,), [], id="dst-overlap"),
        pytest.param([P((0,), (0,), (2,)), P((2,), (1,), (2,))], (4,), (4,), [], id="src-overlap"),
        pytest.param([P((0,), (0,), (2,)), P((0,), (2,), (2,))], (4,), (4,), [], id="same-dst-twice"),
        pytest.param([P((0,), (0,), (2,)), P((2,), (0,), (2,))], (4,), (4,), [], id="same-src-twice"),
        pytest.param([P((0,), (0,), (2,))], (4,), (2,), [P((2,), (1,), (2,))], id="pad-reuses-local"),
        pytest.param([P((0,), (0,), (2,), base=(3, (2,)))], (4,), (4,), [], id="base-outside-local"),
        pytest.param([P((0,), (0,), (2,), base=(0, (2,))), P((2,), (0,), (2,), base=(1, (2,)))], (4,), (4,), [],
                     id="flat-runs-overlap"),
        pytest.param([P((0,), (0,), (2,), base=(0, (2,))), P((2,), (2,), (2,))], (4,), (4,), [], id="mix-flat-and-local"),
        pytest.param([P((0,), (0,), (2,), step=(2,)), P((2,), (2,), (2,), step=(1,))], (4,), (4,), [],
                     id="strided-reuses-element"),
        pytest.param([P((0,), (1,), (2,), step=(3,))], (4,), (4,), [], id="strided-extent-outside"),
    ],
)
def test_check_pieces_rejects(pieces, local, glob, pad) -> None:
    with pytest.raises(PieceError):
        check_pieces(pieces, local, glob, pad)


def test_check_pieces_accepts_valid() -> None:
    """Disjoint pieces, interleaved strides, disjoint flat runs and pad on unused elements pass."""
    check_pieces([P((2,), (0,), (2,)), P((0,), (2,), (2,))], (4,), (4,))
    check_pieces([P((0,), (0,), (2,), step=(2,)), P((2,), (1,), (2,), step=(2,))], (4,), (4,))
    check_pieces([P((0,), (0,), (2,), base=(0, (2,))), P((2,), (0,), (2,), base=(2, (2,)))], (4,), (4,))
    check_pieces([P((0,), (0,), (2,))], (4,), (2,), [P((2,), (2,), (2,))])


@pytest.mark.parametrize(
    "glob, by_rank",
    [
        pytest.param((4,), [[P((0,), (0,), (2,))], [P((3,), (0,), (1,))]], id="gap"),
        pytest.param((4,), [[P((0,), (0,), (3,))], [P((2,), (0,), (2,))]], id="overlap-across-ranks"),
        pytest.param((2, 2), [[P((0, 0), (0, 0), (2, 2))], [P((0, 0), (0, 0), (1, 2))]], id="nested-not-identical"),
        pytest.param((4,), [[P((0,), (0,), (2,)), P((1,), (0,), (2,))], [P((3,), (0,), (1,))]], id="overlap-in-rank"),
    ],
)
def test_check_cover_rejects(glob, by_rank) -> None:
    with pytest.raises(PieceError):
        check_cover(glob, by_rank)


def test_check_cover_rejects_out_of_bounds() -> None:
    """[0:2] and [3:5] of a (4,) tensor: element 2 is missing and 4 lies outside."""
    with pytest.raises(PieceError):
        check_cover((4,), [[P((0,), (0,), (2,))], [P((3,), (0,), (2,))]])


def test_check_cover_accepts_replicas() -> None:
    full = whole((2, 3))
    check_cover((2, 3), [full, full])
    halves = [split((1, 3), 0, r, 2)[1] for r in range(2)]
    check_cover((2, 3), [halves[0], halves[1], halves[0], halves[1]])


@SETTINGS
@given(layout(), st.data())
def test_check_cover_detects_missing_piece(case, data) -> None:
    """Dropping any non-empty piece of a valid layout leaves a gap."""
    glob_shape, ranks = case
    by_rank = [list(ps) for _, ps in ranks]
    check_cover(glob_shape, by_rank)
    held = [(r, i) for r, ps in enumerate(by_rank) for i, p in enumerate(ps) if p.dst.numel]
    if not held:
        return
    r, i = data.draw(st.sampled_from(held))
    del by_rank[r][i]
    with pytest.raises(PieceError):
        check_cover(glob_shape, by_rank)


# --- 6. strided pieces --------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), st.integers(1, 3), st.integers(1, 4))
def test_strided_interleaved_qkv(k, m, hidden, tp) -> None:
    """Rank-local rows interleaved ``[q0 k0 v0 q1 k1 v1 ...]`` map with step pieces onto a
    consolidated ``[Q; K; V]`` (``k`` sub-parameters of ``m * tp`` rows each)."""
    n = m * tp
    glob_shape = (k * n, hidden)
    g = index_array(glob_shape)
    subs = np.split(g, k, axis=0)
    ranks = []
    for r in range(tp):
        loc = np.empty((k * m, hidden), dtype=np.int64)
        for j in range(k):
            loc[j::k] = subs[j][r * m : (r + 1) * m]
        pieces = [P((j * n + r * m, 0), (j, 0), (m, hidden), step=(k, 1)) for j in range(k) if m]
        check_pieces(pieces, loc.shape, glob_shape)
        ranks.append((loc, pieces))
    exact(glob_shape, ranks)
    check_cover(glob_shape, [ps for _, ps in ranks])
    if k > 1 and m > 1:  # a contiguous second piece reuses the first one's strided rows
        loc, pieces = ranks[0]
        bad = [pieces[0], P(pieces[1].dst.offset, (0, 0), (m, hidden), step=(1, 1))]
        with pytest.raises(PieceError):
            check_pieces(bad, loc.shape, glob_shape)


def test_strided_clip_and_base() -> None:
    """clip narrows a strided piece along its stride; a strided piece of a flat base view."""
    loc = np.arange(12).reshape(6, 2)
    p = P((0, 0), (1, 0), (3, 2), step=(2, 1))  # local rows 1, 3, 5
    kept, pad = clip([p], 0, 2)
    assert [view(loc, q).tolist() for q in kept] == [loc[[1, 3]].tolist()]
    assert [view(loc, q).tolist() for q in pad] == [loc[[5]].tolist()]
    check_pieces(kept, loc.shape, (2, 2), pad)
    flat = np.arange(100, 110)
    q = P((0,), (1,), (3,), step=(3,), base=(2, (8,)))  # flat elements 3, 6, 9
    np.testing.assert_array_equal(view(flat, q), [103, 106, 109])
    check_pieces([q, P((3,), (0,), (3,))], (10,), (6,))
    with pytest.raises(PieceError):
        check_pieces([q, P((3,), (6,), (3,))], (10,), (6,))


def test_piece_validation() -> None:
    with pytest.raises(PieceError):
        Piece(Box((0,), (2,)), Box((0,), (3,)))
    for step in ((0,), (1, 1), (-1,)):
        with pytest.raises(PieceError):
            Piece(Box((0,), (2,)), Box((0,), (2,)), step)
    assert whole((0, 3)) == []
    assert whole((2, 3)) == [P((0, 0), (0, 0), (2, 3))]
    assert whole((2, 3), (4, 0)) == [Piece(Box((4, 0), (2, 3)), Box((0, 0), (2, 3)))]


# --- 7. JSON ------------------------------------------------------------------------------------


@st.composite
def pieces(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    dst = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    src = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    step = draw(st.none() | st.tuples(*[st.integers(1, 4)] * ndim))
    return P(dst, src, shape, step)


@SETTINGS
@given(pieces())
def test_json_round_trip(p) -> None:
    assert Piece.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_json_round_trip_flat_base() -> None:
    p = flat_range((2, 3), whole((2, 3)), 1, 5)[0]
    assert p.base is not None
    assert Piece.from_json(json.loads(json.dumps(p.to_json()))) == p
