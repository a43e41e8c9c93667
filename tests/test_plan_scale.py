"""The save plan of a Llama-405B-like layout on 512 ranks (TP 8 x PP 16 x DP 4 with a
distributed optimizer: ``benchmarks/sim_layout.py``), checked for its invariants: every
object has exactly one writer, every shard is exactly covered by what its writer holds and
the pieces sent to it (each held by its sender), objects are bounded by the layout, each
rank's part of the plan holds what it needs, and the metadata stays small.

Planning in two levels (group leaders merge equal fragments, rank 0 plans and cuts each
group its part, leaders cut their ranks' parts) gives every rank exactly the part a flat
plan gives it, on random layouts and in a real gloo job; the replica check compares one
integer per replicated box."""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import sim_layout as S  # noqa: E402

import ucp_zarr  # noqa: E402
from ucp_zarr.protocol.distributed import leader_groups  # noqa: E402
from ucp_zarr.errors import LayoutError  # noqa: E402
from ucp_zarr.format.documents import dump_document  # noqa: E402
from ucp_zarr.layout import Box  # noqa: E402
from ucp_zarr.layout.flat import flat_range_boxes  # noqa: E402
from ucp_zarr.protocol.planner import FragmentInfo, SavePlan, plan_save, shared_infos  # noqa: E402
from ucp_zarr.protocol.replicas import check_replicas  # noqa: E402
from ucp_zarr.protocol.saver import document_dicts  # noqa: E402

WORLD = 512


@pytest.fixture(scope="module")
def planned() -> tuple[list, SavePlan]:
    infos = S.all_infos(WORLD)
    return infos, plan_save(infos)


def test_every_shard_has_one_writer_and_is_exactly_covered(planned) -> None:
    infos, plan = planned
    held = collections.defaultdict(list)  # (rank, key) -> boxes
    for r, fs in enumerate(infos):
        for f in fs:
            held[(r, f.key)] += f.boxes
    tasks = collections.Counter((t.key, t.shard) for t in plan.shards)
    assert max(tasks.values()) == 1  # one writer per object
    for akey, (_, meta) in plan.arrays.items():
        assert {s for k, s in tasks if k == akey} == set(meta.grid.all_shards()), akey
    for t in plan.shards:
        sbox = plan.arrays[t.key][1].grid.shard_box(t.shard)
        if not t.sources:  # written from what the writer holds
            assert any(b.contains(sbox) for b in held[(t.writer, t.key)]), t
            continue
        assert sum(b.numel for _, b in t.sources) == sbox.numel, t
        for i, (src, box) in enumerate(t.sources):
            assert sbox.contains(box)
            assert any(b.contains(box) for b in held[(src, t.key)]), (t.key, src, box)
            for _, other in t.sources[i + 1 :]:
                inter = box.intersect(other)
                assert inter is None or inter.is_empty(), (t, box, other)


def test_objects_are_bounded_by_the_layout(planned) -> None:
    infos, plan = planned
    pairs = collections.Counter((t.writer, t.key) for t in plan.shards)
    assert max(pairs.values()) <= 2
    assert len(plan.shards) <= 1.05 * len(pairs)
    # every rank writes; none writes more than its share of objects by far
    per_rank = collections.Counter(t.writer for t in plan.shards)
    assert len(per_rank) == WORLD
    assert max(per_rank.values()) <= 4 * len(plan.shards) / WORLD
    # a boundary piece is at most about half a shard, and most ranks send little
    sent = collections.Counter()
    for t in plan.shards:
        for src, box in t.sources:
            if src != t.writer:
                sent[src] += box.numel
    held = [sum(b.numel for f in fs for b in f.boxes) for fs in infos]
    assert sum(sent.values()) <= 0.05 * sum(held)


def test_each_rank_part_holds_what_it_needs(planned) -> None:
    _, plan = planned
    parts = plan.split(WORLD)
    seen = collections.Counter()
    for rank, part in enumerate(parts):
        for n, t in part.numbered():
            assert plan.shards[n] == t and (t.writer == rank or rank in {s for s, _ in t.sources})
            assert t.key in part.arrays
            seen[n] += t.writer == rank
        assert all(w == rank for w in part.doc_writers.values())
        for path in part.doc_writers:
            assert path.count("/") == 1 or any(f"{p}/zarr.json" == path for p, _ in part.arrays.values())
    assert set(seen) == set(range(len(plan.shards))) and set(seen.values()) == {1}
    assert sorted(d for p in parts for d in p.doc_writers) == sorted(plan.doc_writers)


def test_metadata_is_compact(planned) -> None:
    _, plan = planned
    docs = document_dicts(plan)
    total = sum(len(dump_document(d)) for _, d in docs)
    assert total < 16 << 20
    # the replicas of a data-parallel group are a rank range, not a list per rank
    doc = dict(docs)[f"{plan.arrays['model.layers.0.attn.qkv.weight'][0]}/zarr.json"]
    region = doc["attributes"]["ucp_zarr"]["regions"][0]
    assert region["replicas"] == {"start": 0, "step": 8, "count": 4}, region
    json.dumps(doc)


# --- two levels: the same parts as one level ----------------------------------------------


@st.composite
def layouts(draw) -> list[list[FragmentInfo]]:
    """A random job: data-parallel groups of ranks holding row slabs (replicated within the
    group), flat ranges of a tensor, plain tensors, and per-rank state."""
    world = draw(st.integers(1, 12))
    infos: list[list[FragmentInfo]] = [[] for _ in range(world)]
    for k in range(draw(st.integers(1, 4))):
        shape = (draw(st.integers(1, 24)), draw(st.integers(1, 12)))
        kind = draw(st.sampled_from(["rows", "flat", "plain", "per_rank"]))
        if kind == "rows":  # TP slabs, each held by a data-parallel group of ranks
            tp = draw(st.integers(1, min(world, shape[0])))
            for r in range(world):
                lo, hi = shape[0] * (r % tp) // tp, shape[0] * (r % tp + 1) // tp
                infos[r].append(FragmentInfo(f"w{k}", shape, "bfloat16", (Box((lo, 0), (hi - lo, shape[1])),)))
        elif kind == "flat":  # ZeRO: flat ranges cutting rows anywhere
            n = math.prod(shape)
            cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
            bounds = [0, *cuts, n]
            for r in range(world):
                boxes = tuple(flat_range_boxes(shape, bounds[r], bounds[r + 1]))
                infos[r].append(FragmentInfo(f"m{k}", shape, "float32", boxes, (bounds[r], bounds[r + 1])))
        else:
            for r in range(world):
                infos[r].append(FragmentInfo(f"p{k}", shape, "float32", (Box.whole(shape),), plain=True,
                                             per_rank=kind == "per_rank"))
    return infos


def two_level(infos: list[list[FragmentInfo]], groups: list[range], **sizes: int) -> tuple[SavePlan, list[SavePlan]]:
    """What a job does (:meth:`ucp_zarr.protocol.distributed.Comm.coordinate`): leaders merge equal
    fragments, rank 0 plans and cuts the groups' parts, leaders cut their ranks' parts."""
    merged = [f for g in groups for f in shared_infos([infos[r] for r in g])]
    plan = plan_save(merged, **sizes)
    return plan, [p for g, part in zip(groups, plan.parts(groups)) for p in part.parts([(r,) for r in g])]


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), data=st.data())
def test_two_level_planning_gives_every_rank_the_flat_plans_part(layout, data) -> None:
    world = len(layout)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, world - 1), max_size=4)) if world > 1 else []))
    groups = [range(a, b) for a, b in zip([0, *cuts], [*cuts, world])]
    flat = plan_save(layout, chunk_bytes=256, shard_bytes=1024)
    plan, parts = two_level(layout, groups, chunk_bytes=256, shard_bytes=1024)
    assert plan == flat
    assert parts == flat.split(world)
    for rank, part in enumerate(parts):  # a rank's part lists the replicated boxes it holds, and only those
        held = {(f.key, b) for f in layout[rank] for b in f.boxes}
        assert all((rep.key, b) in held and h == (rank,) for rep in part.replicas for b, h in rep.boxes)
    digests = [[7] * sum(len(r.boxes) for r in p.replicas) for p in parts]
    check_replicas(flat, digests)
    if any(digests):
        r = next(r for r, d in enumerate(digests) if d)
        digests[r][-1] = 8
        with pytest.raises(LayoutError, match="differ"):
            check_replicas(flat, digests)


def test_leader_groups_cover_the_ranks_in_order() -> None:
    for world in (1, 2, 64, 65, 1000, 16384, 32768):
        groups = leader_groups(world)
        assert [r for g in groups for r in g] == list(range(world))
        assert len(groups) == (1 if world <= 64 else math.isqrt(world - 1) + 1)
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_the_405b_layout_plans_the_same_in_two_levels(planned) -> None:
    infos, plan = planned
    groups = leader_groups(WORLD)
    assert len(groups) == 23
    two, parts = two_level(infos, groups)
    assert two == plan and parts == plan.split(WORLD)


def _two_level_job(rank: int, world: int, root: str) -> None:
    import ucp_zarr.protocol.distributed as D

    D.FLAT_MAX_WORLD = 2  # (this process only: 6 ranks in three groups of two)
    assert [list(g) for g in D.leader_groups(world)] == [[0, 1], [2, 3], [4, 5]]
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(12, 10, generator=g), "m": torch.randn(7, 9, generator=g), "b": torch.randn(5, generator=g)}
    tp, dp = rank % 2, rank // 2
    lo, hi = 63 * rank // world, 63 * (rank + 1) // world
    sd: dict[str, Any] = {
        "w": ucp_zarr.Shard(full["w"][6 * tp : 6 * tp + 6].clone(), (12, 10), (6 * tp, 0), replica_id=dp),
        "m": ucp_zarr.FlatShard(full["m"].reshape(-1)[lo:hi].clone(), (7, 9), lo),
        "b": full["b"].clone(),
        "rng": ucp_zarr.PerRank(torch.tensor([rank])),
    }
    ucp_zarr.save(sd, f"{root}/ok", chunk_bytes=64, shard_bytes=128)
    ck = ucp_zarr.open(f"{root}/ok")
    for k in ("w", "m", "b"):
        assert torch.equal(ck[k][...], full[k]), k
    assert ck.meta.world_size == world
    sd["b"] = full["b"] + (1 if rank == 5 else 0)
    with pytest.raises(LayoutError, match=r"'b'.*ranks \[0, 1, 2, 3, 4\] vs ranks \[5\]"):
        ucp_zarr.save(sd, f"{root}/bad", chunk_bytes=64, shard_bytes=128)


def test_a_save_plans_through_group_leaders_in_a_real_job(tmp_path) -> None:
    """Six gloo processes, leaders of three groups: the save is bit-exact, and a replica that
    differs on a rank of the last group is refused on every rank, naming it."""
    from _dist import run

    run(6, _two_level_job, str(tmp_path), timeout_s=120)
