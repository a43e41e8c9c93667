"""Planning at scale: a Llama-405B-like layout (``sim_layout.py``: TP 8 x PP 16 x DP n with a
distributed optimizer) planned for 64 ... 32768 ranks, without data, on one core.

A save plans in two levels (:meth:`ucp_zarr.protocol.distributed.Comm.coordinate`): each rank sends its
fragment list to its group leader (about sqrt(world) consecutive ranks), which merges equal
fragments (:func:`~ucp_zarr.protocol.planner.shared_infos`) into one message to rank 0; rank 0 plans
and sends each leader its group's part (:meth:`~ucp_zarr.protocol.planner.SavePlan.parts`), which the
leader cuts into its ranks' parts. Each step runs here, one after another, with every
message pickled and unpickled as in a job; leaders work in parallel in a job, so the slowest
leader counts. For each world size:

* ``coord s``: the critical path: slowest leader's gather (unpickle its ranks' lists, merge,
  pickle) + rank 0 (unpickle the leaders' messages, plan, cut the groups' parts, pickle
  them) + slowest leader's split (unpickle, cut its ranks' parts, pickle each). ``root s``
  and ``cpu s``: rank 0's own part of it, wall and CPU seconds (this VM is shared).
* ``root MiB in``: what rank 0 receives (the leaders' merged lists; a one-level gather
  receives ``rank0 MiB``: every rank's list). ``root peak MiB``: rank 0's peak Python heap
  while it unpickles, plans and cuts (tracemalloc, in a second, untimed pass).
* ``check s``: rank 0 comparing every replicated box's digests (each rank sends one integer
  per replicated box of its part).
* ``send KiB``/``recv KiB``: the most any rank sends (its fragment list) and receives (its part).
* ``objects``, ``per pair``: objects written, and the most one rank writes of one array.
* ``exch MiB``: boundary bytes a rank sends to other ranks' shards (max and mean).
* ``meta MiB``: every zarr.json plus the root (with its consolidated copy).
* ``load s``: the slowest of 16 sampled ranks of the smaller job (:func:`load_world`): parse the root, then list the
  chunks its fragments need (no I/O); ``read x``: the bytes of those chunks over the bytes
  its fragments hold (the most over sampled ranks).

Run: ``python benchmarks/bench_planning.py [--worlds 64 128 ...] [--json out.json] [--plot out.png]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pickle
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import sim_layout as S  # noqa: E402

from ucp_zarr.format.documents import METADATA_FILE, ArrayMeta, dump_consolidated, dump_document
from ucp_zarr.format.commit_record import CheckpointMeta, TensorEntry
from ucp_zarr.format.integrity import document_digest  # noqa: E402
from ucp_zarr.protocol.distributed import gc_paused, leader_groups  # noqa: E402
from ucp_zarr.layout import Box  # noqa: E402
from ucp_zarr.protocol.planner import SavePlan, plan_save, shared_infos  # noqa: E402
from ucp_zarr.protocol.replicas import check_replicas  # noqa: E402
from ucp_zarr.io.local import LocalStore  # noqa: E402
from ucp_zarr.protocol.saver import _check_one_path, _digest_of_path, document_dicts  # noqa: E402

WORLDS = (64, 256, 1024, 4096, 8192, 16384, 32768)
DIGEST = "sha256:" + "0" * 64


def _dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _timed(fn, *args):
    """``fn(*args)`` as a leader or rank 0 runs it (cyclic GC paused), and its wall and CPU seconds."""
    with gc_paused():
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        return out, time.perf_counter() - t0, time.process_time() - c0


def two_level(world: int, messages: list[bytes]) -> dict:
    """Plan a save of ``world`` ranks from their pickled messages as a job does (see the
    module docstring); return the plan, each rank's part, and the seconds of each step."""
    groups = leader_groups(world)

    def gather(group: range) -> bytes:
        got = [pickle.loads(messages[r])[1] for r in group]
        return _dumps(({}, list(zip(shared_infos([i for i, _ in got]), (d for _, d in got)))))

    def root(merged: list[bytes]) -> tuple[SavePlan, list[bytes]]:
        payloads = [p for m in merged for p in pickle.loads(m)[1]]
        _check_one_path([d for _, d in payloads], "/ckpt")
        plan = plan_save([i for i, _ in payloads])
        return plan, [_dumps(({}, part)) for part in plan.parts(groups)]

    def split(group: range, answer: bytes) -> list[SavePlan]:
        parts = pickle.loads(answer)[1].parts([(r,) for r in group])
        for p in parts:
            _dumps(({}, p))
        return parts

    merged, gather_s = [], []
    for g in groups:
        m, wall, _ = _timed(gather, g)
        merged.append(m)
        gather_s.append(wall)
    (plan, answers), root_s, root_cpu = _timed(root, merged)
    parts, split_s = [], []
    for g, a in zip(groups, answers):
        ps, wall, _ = _timed(split, g, a)
        parts += ps
        split_s.append(wall)
    tracemalloc.start()
    with gc_paused():
        root(merged)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "plan": plan, "parts": parts, "groups": len(groups), "gather_s": max(gather_s), "root_s": root_s,
        "root_cpu_s": root_cpu, "split_s": max(split_s), "root_in_mib": sum(map(len, merged)) / 2**20,
        "root_peak_mib": peak / 2**20, "recv_kib_max": max(len(_dumps(({}, p))) for p in parts[1:]) / 1024,
    }


def replica_check(plan: SavePlan, parts: list[SavePlan]) -> float:
    """Rank 0's digest comparison: unpickle each rank's digests (one integer per replicated
    box of its part, all equal here), then :func:`check_replicas`."""
    messages = [_dumps((None, [7] * sum(len(r.boxes) for r in p.replicas))) for p in parts]
    t0 = time.perf_counter()
    check_replicas(plan, [pickle.loads(m)[1] for m in messages])
    return time.perf_counter() - t0


def measure(world: int, samples: int = 16) -> dict[str, float]:
    infos = S.all_infos(world)
    path = _digest_of_path(LocalStore("/ckpt"))  # (what every rank sends with its fragments)
    messages = [_dumps((None, (i, path))) for i in infos]
    sent = [len(m) for m in messages]
    run = two_level(world, messages)
    plan: SavePlan = run["plan"]

    pairs = collections.Counter((t.writer, t.key) for t in plan.shards)
    exch = collections.Counter()
    for t in plan.shards:
        size = plan.arrays[t.key][1].dtype.itemsize
        for src, box in t.sources:
            if src != t.writer:
                exch[src] += box.numel * size
    share = [sum(b.numel for f in fs for b in f.boxes) for fs in infos]  # elements each rank holds

    docs = document_dicts(plan)
    raw = {p: dump_document(d) for p, d in docs}
    meta = CheckpointMeta(
        tensors={k: TensorEntry(p, m.shape, m.dtype.name, DIGEST) for k, (p, m) in plan.arrays.items()},
        values={}, created="2026-01-01T00:00:00+00:00", library="ucp_zarr", save_id="0" * 32, world_size=world,
        documents={p: document_digest(r) for p, r in raw.items()},
    )
    root = dump_consolidated(meta.to_zarr_json(), list(raw.items()), {f"{g}/{METADATA_FILE}" for g in plan.groups})
    load_s, read_x = _load_plan(root, load_world(world), samples)
    return {
        "world": world,
        "coord_s": run["gather_s"] + run["root_s"] + run["split_s"],
        "gather_s": run["gather_s"],
        "root_s": run["root_s"],
        "root_cpu_s": run["root_cpu_s"],
        "split_s": run["split_s"],
        "groups": run["groups"],
        "root_in_mib": run["root_in_mib"],
        "root_peak_mib": run["root_peak_mib"],
        "check_s": replica_check(plan, run["parts"]),
        "replicated_boxes": sum(len(r.boxes) for r in plan.replicas),
        "send_kib_max": max(sent) / 1024,
        "recv_kib_max": run["recv_kib_max"],
        "rank0_recv_mib": sum(sent) / 2**20,
        "objects": len(plan.shards),
        "pairs": len(pairs),
        "per_pair_max": max(pairs.values()),
        "exch_mib_max": max(exch.values(), default=0) / 2**20,
        "exch_mib_mean": sum(exch.values()) / world / 2**20,
        "exch_frac_max": max((exch[r] / 4 / s for r, s in enumerate(share) if s), default=0.0),
        "meta_mib": (sum(map(len, raw.values())) + len(root)) / 2**20,
        "root_mib": len(root) / 2**20,
        "load_world": load_world(world),
        "load_s": load_s,
        "read_x": read_x,
    }


def load_world(world: int) -> int:
    """The job a checkpoint of ``world`` ranks is resharded onto: 3/4 of the data-parallel
    degree (4096 -> 3072), or half the ranks when that degree is 1."""
    tp, pp, dp = S.degrees(world)
    return tp * pp * (dp * 3 // 4) if dp * 3 // 4 else world // 2


def _load_plan(root: bytes, world: int, samples: int) -> tuple[float, float]:
    """The slowest sampled rank's read plan of a ``world``-rank job (no I/O)."""
    worst_s, worst_x = 0.0, 0.0
    for rank in sorted({world * i // samples for i in range(samples)}):
        infos = S.rank_infos(world, rank)
        t0 = time.perf_counter()
        doc = json.loads(root)
        meta = CheckpointMeta.from_zarr_json(doc, "root")
        arrays: dict[str, ArrayMeta] = {}
        needed = read = 0
        for f in infos:
            path = meta.tensors[f.key].path
            if f.key not in arrays:
                arrays[f.key] = ArrayMeta.from_zarr_json(json.loads(meta.consolidated_document(f"{path}/zarr.json")), path)
            grid, size = arrays[f.key].grid, arrays[f.key].dtype.itemsize
            chunks: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
            for box in f.boxes:
                needed += box.numel * size
                for shard in grid.shards_overlapping(box):
                    for c in grid.chunks_overlapping(shard, box):
                        chunks.add((shard, c))
            read += sum(_chunk_numel(grid, s, c) for s, c in chunks) * size
        worst_s = max(worst_s, time.perf_counter() - t0)
        worst_x = max(worst_x, read / needed if needed else 1.0)
    return worst_s, worst_x


def _chunk_numel(grid, shard, chunk) -> int:
    box: Box | None = grid.chunk_box(shard, chunk)
    return box.numel if box is not None else 0


def _plot(rows: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    w = [r["world"] for r in rows]
    a.plot(w, [r["coord_s"] for r in rows], "o-", label="save: critical path (leaders + rank 0)")
    a.plot(w, [r["root_s"] for r in rows], "^--", label="save: rank 0 alone")
    a.plot(w, [r["load_s"] for r in rows], "s-", label="reshard load: slowest rank's read plan")
    a.axhline(10, color="grey", ls=":", label="target 10 s")
    a.set(xscale="log", xlabel="ranks", ylabel="seconds (one core)", title="Planning time, 405B-like layout")
    a.legend(fontsize=8)
    b.plot(w, [r["objects"] for r in rows], "o-", label="objects written")
    b.plot(w, [r["pairs"] for r in rows], "s--", label="(writer rank, array) pairs")
    b.set(xscale="log", yscale="log", xlabel="ranks", ylabel="count", title="Objects per save")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


COLUMNS = [
    ("world", "ranks", "{:.0f}"), ("coord_s", "coord s", "{:.2f}"), ("gather_s", "leader gather s", "{:.2f}"),
    ("root_s", "root s", "{:.2f}"), ("root_cpu_s", "root cpu s", "{:.2f}"), ("split_s", "leader split s", "{:.2f}"),
    ("root_in_mib", "root MiB in", "{:.1f}"), ("rank0_recv_mib", "rank0 MiB", "{:.1f}"),
    ("root_peak_mib", "root peak MiB", "{:.0f}"), ("check_s", "check s", "{:.2f}"), ("send_kib_max", "send KiB", "{:.0f}"),
    ("recv_kib_max", "recv KiB", "{:.0f}"), ("objects", "objects", "{:.0f}"),
    ("per_pair_max", "per pair", "{:.0f}"), ("exch_mib_max", "exch MiB max", "{:.0f}"),
    ("exch_mib_mean", "exch MiB mean", "{:.0f}"), ("meta_mib", "meta MiB", "{:.1f}"),
    ("load_world", "load ranks", "{:.0f}"), ("load_s", "load s", "{:.2f}"), ("read_x", "read x", "{:.3f}"),
]


def table(rows: list[dict[str, float]]) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    body = ["| " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    rows = []
    for w in args.worlds:
        rows.append(measure(w))
        print(json.dumps({k: round(v, 4) for k, v in rows[-1].items()}), flush=True)
    print(table(rows))
    if len(rows) > 1:
        growth = [(b["coord_s"] / a["coord_s"]) ** (1 / math.log2(b["world"] / a["world"])) for a, b in zip(rows, rows[1:])]
        print(f"coordinator time growth per doubling: median {statistics.median(growth):.2f}x "
              f"(linear: 2x); {rows[-1]['world']} ranks / {rows[0]['world']}: "
              f"{rows[-1]['coord_s'] / rows[0]['coord_s']:.1f}x for {rows[-1]['world'] / rows[0]['world']:.0f}x ranks")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot)
    assert all(math.isfinite(r["coord_s"]) for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
