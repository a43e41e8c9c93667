"""Property tests of the pure save planner: one writer per shard, exact assembly, no exchange
when fragments align with the grid, writes spread over replicas."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr.layout import Box
from ucp_zarr.layout.flat import flat_range_boxes
from ucp_zarr.protocol.replicas import check_replicas
from ucp_zarr.protocol.planner import FragmentInfo, LayoutError, plan_save


def _cells(box: Box) -> set[tuple[int, ...]]:
    import itertools

    return set(itertools.product(*(range(o, o + s) for o, s in zip(box.offset, box.shape))))


def _check_plan(infos: list[list[FragmentInfo]], chunk_bytes: int) -> None:
    plan = plan_save(infos, chunk_bytes=chunk_bytes)
    held = {r: {f.key: f.boxes for f in frags} for r, frags in enumerate(infos)}
    seen: dict[str, set] = {}
    for task in plan.shards:
        grid = plan.arrays[task.key][1].grid
        sbox = grid.shard_box(task.shard)
        assert (task.key, task.shard) not in seen.setdefault("tasks", set()), "two tasks for one shard"
        seen["tasks"].add((task.key, task.shard))
        if not task.sources:
            assert any(b.contains(sbox) for b in held[task.writer][task.key]), task
            continue
        union: set = set()
        for rank, box in task.sources:
            assert any(b.contains(box) for b in held[rank][task.key]), (rank, box)
            cells = _cells(box)
            assert not (union & cells), "sources overlap"
            union |= cells
        assert union == _cells(sbox), "sources do not assemble the shard"
    shards = {k: set(m.grid.all_shards()) for k, (_, m) in plan.arrays.items()}
    assert {(k, s) for k, ss in shards.items() for s in ss} == seen.get("tasks", set())


@st.composite
def flat_layout(draw):
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    total = math.prod(shape)
    world = draw(st.integers(1, 6))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, total]
    infos = []
    for r in range(world):
        boxes = tuple(flat_range_boxes(shape, bounds[r], bounds[r + 1]))
        infos.append([FragmentInfo("w", shape, "float32", boxes, (bounds[r], bounds[r + 1]))])
    return infos


@given(flat_layout(), st.sampled_from([64, 256, 4096]))
@settings(max_examples=150, deadline=None)
def test_flat_fragments_plan(infos, chunk_bytes):
    _check_plan(infos, chunk_bytes)


@st.composite
def chunked_layout(draw):
    """torch.chunk-style splits of dim 0 and dim 1 over a mesh, with DP replicas."""
    shape = (draw(st.integers(1, 300)), draw(st.integers(1, 300)))
    rows, cols, reps = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    infos = []
    for rep in range(reps):
        for i in range(rows):
            for j in range(cols):
                r0, r1 = _chunk(shape[0], rows, i)
                c0, c1 = _chunk(shape[1], cols, j)
                box = Box((r0, c0), (r1 - r0, c1 - c0))
                boxes = (box,) if box.numel else ()
                infos.append([FragmentInfo("w", shape, "float32", boxes)])
    return infos


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


@given(chunked_layout())
@settings(max_examples=150, deadline=None)
def test_aligned_fragments_need_no_exchange(infos):
    plan = plan_save(infos, chunk_bytes=4096)
    _check_plan(infos, 4096)
    nbytes = math.prod(infos[0][0].shape) * 4
    if nbytes > 64 << 10:
        assert all(not t.sources for t in plan.shards)


def test_replicated_tensor_is_written_by_every_replica():
    infos = [[FragmentInfo("w", (1024, 256), "float32", (Box.whole((1024, 256)),), plain=True)] for _ in range(4)]
    plan = plan_save(infos, chunk_bytes=64 << 10)
    assert {t.writer for t in plan.shards} == {0, 1, 2, 3}
    assert all(not t.sources for t in plan.shards)


@pytest.mark.parametrize("shape", [(0, 2**60), (2**40, 0, 3), (0,)])
def test_an_empty_tensor_plans_no_shard_however_long_its_other_dims(shape):
    """A tensor with no element has no shard to write: planned at once (before, a list of
    one entry per shard of its other dims was built: 16 s for (0, 2**56), minutes and
    gigabytes for (0, 2**60))."""
    import time

    infos = [[FragmentInfo("e", shape, "float32", (Box.whole(shape),), plain=True)] for _ in range(2)]
    started = time.monotonic()
    plan = plan_save(infos)
    assert time.monotonic() - started < 5.0
    assert not plan.shards and plan.arrays["e"][1].shape == shape


def test_per_rank_state_gets_one_array_per_rank():
    infos = [[FragmentInfo("rng", (16,), "uint8", (Box.whole((16,)),), plain=True, per_rank=True)] for r in range(3)]
    plan = plan_save(infos)
    assert plan.per_rank == {"rng": {r: f"rng@rank{r}" for r in range(3)}}
    assert {plan.arrays[f"rng@rank{r}"][0] for r in range(3)} == {f"rng/rng~rank{r}" for r in range(3)}
    assert sorted(t.writer for t in plan.shards) == [0, 1, 2]


def test_plain_tensor_differing_between_ranks_is_an_error_naming_the_ranks():
    """Regression: a plain tensor whose copies differ used to be stored per rank silently
    (and then left untouched on new ranks at load); per-rank state must be PerRank."""
    infos = [[FragmentInfo("emb", (16,), "float32", (Box.whole((16,)),), plain=True)] for d in (7, 7, 8, 7)]
    plan = plan_save(infos)
    whole = Box.whole((16,))
    assert [(r.key, r.boxes, r.plain) for r in plan.replicas] == [("emb", ((whole, (0, 1, 2, 3)),), True)]
    digests = [[d] for d in (7, 7, 8, 7)]  # (each rank's part lists the one box)
    with pytest.raises(LayoutError, match=r"'emb'.*differ.*\[0, 1, 3\] vs ranks \[2\].*PerRank"):
        check_replicas(plan, digests)
    check_replicas(plan, [[7]] * 4)
    assert [[(r.key, r.boxes) for r in p.replicas] for p in plan.split(4)] == [[("emb", ((whole, (r,)),))] for r in range(4)]
    # per-rank tensors of other shapes: the error says what PerRank needs (it spoke of a "global shape")
    pending = [[FragmentInfo("pending", (r + 2,), "int64", (Box.whole((r + 2,)),), plain=True, per_rank=True)]
               for r in range(2)]
    with pytest.raises(LayoutError, match=r"'pending' \(per-rank state, PerRank\): rank 0 has shape \[2\].*rank 1 has "
                                          r"\[3\].*needs the same on every rank: pad it"):
        plan_save(pending)
    mixed = [[FragmentInfo("rng", (4,), "uint8", (Box.whole((4,)),), plain=True, per_rank=r == 0)] for r in range(2)]
    with pytest.raises(LayoutError, match=r"'rng': ranks \[0\] wrap it in PerRank, ranks \[1\] do not"):
        plan_save(mixed)


def test_invalid_layouts_name_the_tensor_and_ranks():
    a = FragmentInfo("layer.w", (10, 4), "float32", (Box((0, 0), (6, 4)),))
    b = FragmentInfo("layer.w", (10, 4), "float32", (Box((5, 0), (5, 4)),))
    with pytest.raises(LayoutError, match=r"'layer\.w'.*overlap.*\[0\].*\[1\]"):
        plan_save([[a], [b]])
    c = FragmentInfo("layer.w", (10, 4), "float32", (Box((0, 0), (4, 4)),))
    with pytest.raises(LayoutError, match=r"'layer\.w'.*cover 36 of its 40"):
        plan_save([[c], [b]])
    d = FragmentInfo("layer.w", (10, 4), "bfloat16", (Box((6, 0), (4, 4)),))
    with pytest.raises(LayoutError, match=r"rank 0 .*float32, rank 1 .*bfloat16"):
        plan_save([[a], [d]])
