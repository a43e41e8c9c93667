"""The save plan of a Llama-405B-like layout on 512 ranks (TP 8 x PP 16 x DP 4 with a
distributed optimizer: ``benchmarks/sim_layout.py``), checked for its invariants: every
object has exactly one writer, every shard is exactly covered by what its writer holds and
the pieces sent to it (each held by its sender), objects are bounded by the layout, each
rank's part of the plan holds what it needs, and the metadata stays small."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import sim_layout as S  # noqa: E402

from ucp_zarr.format import dump_document  # noqa: E402
from ucp_zarr.planner import SavePlan, plan_save  # noqa: E402
from ucp_zarr.saver import document_dicts  # noqa: E402

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
