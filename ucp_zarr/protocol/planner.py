"""The save planner: which arrays exist, with which grid, and which rank writes each shard.

Pure and I/O-free, like ``torch.distributed.checkpoint``'s planners. Every rank runs it on
the same gathered :class:`FragmentInfo` lists (small metadata, no tensor bytes) and gets the
same :class:`SavePlan`:

1. **validate** the global layout of every tensor: shapes and dtypes agree across ranks,
   the distinct regions do not overlap and cover the tensor;
2. choose each array's **grid** from its regions' boundaries (see :func:`grid_for_regions`),
   so that shards fall inside one region wherever the boundaries allow;
3. give every shard exactly **one writer**: a rank holding it whole (spreading replicas by
   bytes), or else the rank holding most of it, to which the other holders send their
   boundary pieces (:attr:`ShardTask.sources`; at most one shard each, shards being
   chunk-sized where fragments cut chunks);
4. list every box that several ranks hold (:attr:`SavePlan.replicas`): their copies are
   compared by digest before anything is written (:mod:`.replicas`), whatever the kind of
   fragment, so that a layout mistake (two pipeline stages holding "layer 0", shards of
   one box with different values) is an error, not the first rank's copy saved.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Sequence

import torch

from ..format.dtypes import stored_dtype
from ..errors import LayoutError
from ..format.documents import METADATA_FILE, ArrayMeta, Region, dimension_names
from ..layout import Box, ChunkGrid, choose_grid
from ..layout.chunking import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES, MIN_ALIGNED_CHUNK_BYTES
from ..format.statedict import assign_array_paths


@dataclass(frozen=True)
class FragmentInfo:
    """What one rank holds of one tensor: metadata only, exchanged between ranks."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...]
    flat: tuple[int, int] | None = None
    plain: bool = False
    per_rank: bool = False
    """Wrapped in :class:`~ucp_zarr.PerRank`: this rank's own copy, stored per rank."""
    meaning: str | None = None
    """What the consolidated tensor is, by the rule that placed it (canonical JSON)."""
    rule: str = ""
    """The rule pattern that placed it (for messages)."""
    alias: str | None = None
    """The key its array path is named after, when not ``key``: optimizer state keyed by
    parameter number, named by its parameter (``optim.state.0.exp_avg`` ->
    ``optim.state.fc.weight.exp_avg``), so that moments sit beside their parameter."""


class ShardTask(NamedTuple):
    """Write shard ``shard`` of the array of ``key``; done by rank ``writer``.

    ``sources`` lists ``(rank, box)`` pieces to assemble when the writer does not hold the
    shard whole in one piece; pieces from other ranks are sent to the writer. (A named
    tuple: a large plan has one per object, made, pickled and sent quickly.)"""

    key: str
    path: str
    shard: tuple[int, ...]
    writer: int
    nbytes: int
    sources: tuple[tuple[int, Box], ...] = ()


@dataclass(frozen=True)
class Replicated:
    """Boxes of one tensor that several ranks hold: each box with its holders."""

    key: str
    boxes: tuple[tuple[Box, tuple[int, ...]], ...]
    plain: bool = False
    """A plain tensor (held whole, as-is, by every rank)."""
    rule: str = ""
    """The rule pattern that placed it (for messages)."""


@dataclass(frozen=True)
class SavePlan:
    arrays: dict[str, tuple[str, ArrayMeta]]
    """array key (``key``, or ``key@rankN`` for per-rank state) -> (path, metadata)."""
    shards: list[ShardTask]
    per_rank: dict[str, dict[int, str]]
    """Per-rank tensors: key -> {rank: array key in ``arrays``}."""
    doc_writers: dict[str, int]
    """zarr.json path -> the rank that writes it."""
    meanings: dict[str, str] = field(default_factory=dict)
    """key -> what its consolidated tensor is, for tensors placed by rules (canonical JSON)."""
    groups: list[str] = field(default_factory=list)
    """The Zarr groups (one per parameter)."""
    numbers: list[int] | None = None
    """In a rank's part of a plan (:meth:`for_rank`): the plan-wide number of each task."""
    replicas: list[Replicated] = field(default_factory=list)
    """The boxes held by several ranks (in a part of the plan: those its ranks hold, each
    with those of its ranks that hold it)."""

    def numbered(self) -> list[tuple[int, ShardTask]]:
        """``(number, task)`` of every task here, numbered as in the whole plan."""
        return list(zip(self.numbers, self.shards)) if self.numbers is not None else list(enumerate(self.shards))

    def split(self, world: int) -> list["SavePlan"]:
        """Each rank's part of the plan: ``parts([(0,), (1,), ...])``."""
        return self.parts([(r,) for r in range(world)])

    def parts(self, rank_sets: Sequence[Sequence[int]]) -> list["SavePlan"]:
        """The part of the plan of each set of ranks (what a coordinator sends a group
        leader, or a rank): the tasks its ranks write or send a piece to, the documents they
        write, the arrays of both (without region records where none of them writes the
        array's document: only documents need them), and the replicated boxes they hold,
        each with those of its ranks that hold it. A part of a part is the part of the
        whole. One pass over each list: the work is that of the plan, not ranks x plan."""
        owner = {r: i for i, rs in enumerate(rank_sets) for r in rs}
        tasks: list[list[tuple[int, ShardTask]]] = [[] for _ in rank_sets]
        for n, t in self.numbered():
            for i in {owner.get(t.writer), *(owner.get(src) for src, _ in t.sources)}:
                if i is not None:
                    tasks[i].append((n, t))
        docs: list[dict[str, int]] = [{} for _ in rank_sets]
        for path, w in self.doc_writers.items():
            if (i := owner.get(w)) is not None:
                docs[i][path] = w
        held: list[dict[int, list[tuple[Box, tuple[int, ...]]]]] = [{} for _ in rank_sets]
        for k, rep in enumerate(self.replicas):
            for box, holders in rep.boxes:
                by_part: dict[int, list[int]] = {}
                for r in holders:
                    if (i := owner.get(r)) is not None:
                        by_part.setdefault(i, []).append(r)
                for i, rs in by_part.items():
                    held[i].setdefault(k, []).append((box, tuple(rs)))
        by_doc = {f"{p}/{METADATA_FILE}": a for a, (p, _) in self.arrays.items()}
        group_doc = {f"{g}/{METADATA_FILE}": g for g in self.groups}
        bare: dict[str, tuple[str, ArrayMeta]] = {}  # (one copy, shared by every part)

        def without_regions(a: str) -> tuple[str, ArrayMeta]:
            if a not in bare:
                bare[a] = (self.arrays[a][0], replace(self.arrays[a][1], regions=()))
            return bare[a]

        out = []
        for i in range(len(rank_sets)):
            documented = dict.fromkeys(by_doc[d] for d in docs[i] if d in by_doc)
            written = dict.fromkeys(t.key for _, t in tasks[i] if t.key not in documented)
            out.append(SavePlan(
                arrays={**{a: without_regions(a) for a in written}, **{a: self.arrays[a] for a in documented}},
                shards=[t for _, t in tasks[i]],
                per_rank={},
                doc_writers=docs[i],
                groups=sorted(group_doc[d] for d in docs[i] if d in group_doc),
                numbers=[n for n, _ in tasks[i]],
                replicas=[Replicated(self.replicas[k].key, tuple(b), self.replicas[k].plain, self.replicas[k].rule)
                          for k, b in held[i].items()],
            ))
        return out


def shared_infos(lists: list[list[FragmentInfo]]) -> list[list[FragmentInfo]]:
    """``lists`` with equal infos replaced by one object (a group leader's merge: ranks of one
    tensor-parallel and pipeline position hold equal lists, which then travel and are
    unpickled once, and are checked and looked up once by :func:`plan_save`)."""
    one: dict[FragmentInfo, FragmentInfo] = {}
    return [[one.setdefault(f, f) for f in fs] for fs in lists]


def per_rank_key(key: str, rank: int) -> str:
    return f"{key}@rank{rank}"


def plan_save(
    infos: list[list[FragmentInfo]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> SavePlan:
    """Plan a save from every rank's fragments (``infos[rank]``)."""
    by_key: dict[str, list[tuple[int, FragmentInfo]]] = {}
    for rank, frags in enumerate(infos):
        for f in frags:
            held = by_key.get(f.key)
            if held is None:
                by_key[f.key] = [(rank, f)]
            else:
                held.append((rank, f))

    # per-rank tensors (PerRank) become one array per rank
    layouts: dict[str, list[tuple[int, FragmentInfo]]] = {}
    per_rank: dict[str, dict[int, str]] = {}
    for key, held in by_key.items():
        _check_consistent(key, held)
        if held[0][1].per_rank:
            per_rank[key] = {r: per_rank_key(key, r) for r, _ in held}
            for r, f in held:
                layouts[per_rank_key(key, r)] = [(r, f)]
        else:
            layouts[key] = held

    base_paths = assign_array_paths(list(by_key), {k: held[0][1].alias for k, held in by_key.items()})
    loads = Loads(len(infos))
    grids: dict[tuple[Any, ...], ChunkGrid] = {}  # (the layers of a model repeat their shapes and layouts)
    arrays: dict[str, tuple[str, ArrayMeta]] = {}
    shards: list[ShardTask] = []
    replicas: list[Replicated] = []
    for akey, held in layouts.items():
        f0 = held[0][1]
        rank = held[0][0] if f0.key in per_rank else None
        path = base_paths[f0.key] + (f"~rank{rank}" if rank is not None else "")
        regions = _regions(f0.key, held)
        shared = tuple((b, rs) for b, rs in regions.items() if len(rs) > 1)
        if shared and rank is None:
            replicas.append(Replicated(f0.key, shared, f0.plain, f0.rule))
        sd = stored_dtype(getattr(torch, f0.dtype), key=f0.key)
        layout = (f0.shape, sd.itemsize, tuple(regions.items()))
        grid = grids.get(layout)
        if grid is None:
            grid = grids[layout] = grid_for_regions(
                f0.shape, sd.itemsize, regions, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes
            )
        writers: dict[Box, set[int]] = defaultdict(set)
        shards += _assign(akey, path, grid, regions, sd.itemsize, loads, writers)
        records = _region_records(held, regions, writers)
        arrays[akey] = (path, ArrayMeta(f0.key, sd, grid, tuple(records), rank=rank))
    arrays = _name_dimensions(arrays)
    doc_writers = _spread_documents(arrays, shards, len(infos))
    meanings = {k: held[0][1].meaning for k, held in by_key.items() if held[0][1].meaning is not None}
    groups = sorted({path.split("/")[0] for path, _ in arrays.values()})
    return SavePlan(arrays, shards, per_rank, doc_writers, meanings, groups, replicas=replicas)


def _check_consistent(key: str, held: list[tuple[int, FragmentInfo]]) -> None:
    r0, f0 = held[0]
    checked = {id(f0)}  # (lists gathered through a group leader share equal infos: each checked once)
    for r, f in held[1:]:
        if id(f) in checked:
            continue
        checked.add(id(f))
        if (f.shape, f.dtype) != (f0.shape, f0.dtype):
            if f.per_rank and f0.per_rank:
                raise LayoutError(
                    f"tensor {key!r} (per-rank state, PerRank): rank {r0} has shape {list(f0.shape)} {f0.dtype}, rank {r} "
                    f"has {list(f.shape)} {f.dtype}; the checkpoint records one shape and dtype for every rank's copy, "
                    "so a PerRank tensor needs the same on every rank: pad it to one shape (and keep its length "
                    "beside it), or save it as a list of numbers in a PerRank value"
                )
            raise LayoutError(
                f"tensor {key!r}: rank {r0} has global shape {list(f0.shape)} {f0.dtype}, "
                f"rank {r} has {list(f.shape)} {f.dtype}"
            )
        if f.meaning != f0.meaning:
            raise LayoutError(
                f"tensor {key!r}: rank {r0} placed it as {f0.meaning} (rule {f0.rule!r}), rank {r} as "
                f"{f.meaning} (rule {f.rule!r})"
            )
        if f.per_rank != f0.per_rank:
            wrapped = sorted(q for q, g in held if g.per_rank)
            raise LayoutError(
                f"tensor {key!r}: ranks {wrapped} wrap it in PerRank, ranks "
                f"{sorted(q for q, _ in held if q not in wrapped)} do not; per-rank state must be per-rank on every rank"
            )


def _regions(key: str, held: list[tuple[int, FragmentInfo]]) -> dict[Box, tuple[int, ...]]:
    """Distinct boxes (in the order of their offsets) -> the ranks holding them, ascending;
    checks overlap and coverage."""
    lists: dict[Box, list[int]] = {}
    seen: dict[int, list[list[int]]] = {}  # an info shared by several ranks is looked up once
    for r, f in held:  # (in rank order: a rank listing a box twice repeats the last entry)
        holders = seen.get(id(f))
        if holders is None:
            holders = seen[id(f)] = [lists.setdefault(b, []) for b in f.boxes]
        for rs in holders:
            if not rs or rs[-1] != r:
                rs.append(r)
    regions = {b: tuple(lists[b]) for b in sorted(lists, key=lambda b: b.offset)}
    shape = held[0][1].shape
    active: list[tuple[int, Box]] = []  # (where along dim 0 it ends, box)
    for b in regions:
        if b.ndim:
            active = [x for x in active if x[0] > b.offset[0]]
        for _, a in active:
            inter = a.intersect(b)
            if inter is not None and 0 not in inter.shape:
                raise LayoutError(
                    f"tensor {key!r}: fragments overlap without being replicas: ranks {list(regions[a])} hold "
                    f"{_fmt(a)}, ranks {list(regions[b])} hold {_fmt(b)}"
                )
        active.append((b.offset[0] + b.shape[0] if b.ndim else 0, b))
    covered = sum(math.prod(b.shape) for b in regions)
    total = math.prod(shape)
    if covered != total:
        raise LayoutError(
            f"tensor {key!r}: the ranks' fragments cover {covered} of its {total} elements "
            f"(global shape {list(shape)}; held by ranks {sorted({r for r, _ in held})})"
        )
    return regions


def _fmt(b: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(b.offset, b.shape)) + "]"


def grid_for_regions(
    shape: tuple[int, ...],
    itemsize: int,
    regions: dict[Box, tuple[int, ...]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ChunkGrid:
    """The grid of an array saved from ``regions`` (distinct boxes -> holders).

    * A tensor of at most ``MIN_ALIGNED_CHUNK_BYTES`` split between ranks is one object; the
      pieces other ranks hold are sent to its writer.
    * Along each dim the region size is the gcd of the interior region boundaries when that
      gives at most four shards per boundary: then every shard lies in one region.
    * Along a dim where it does not (fragments cutting rows anywhere, as ZeRO's flat ranges
      do), the dim is treated as whole and shards are about the size of a typical region
      (:func:`_typical_region_bytes`): each rank writes one or two objects per array, and the
      parts of a shard held by others (at most half a shard per boundary) are sent to its
      writer. So the number of objects follows the layout, not the bytes.
    * A region held by several replicas is split into at least as many shards, to spread
      the writing over them.
    """
    nbytes = math.prod(shape) * itemsize
    if len(regions) > 1 and nbytes <= MIN_ALIGNED_CHUNK_BYTES:
        return choose_grid(shape, itemsize, chunk_bytes=max(chunk_bytes, nbytes), shard_bytes=max(chunk_bytes, nbytes))
    region_shape = list(shape)
    misaligned = False
    typical = _typical_region_bytes(regions, itemsize)
    # small pieces (the partial rows between two flat ranges) do not shape the grid: they
    # are sent to the writer of the shard they fall in
    major = [b for b in regions if b.numel * itemsize * MINOR_REGION_FACTOR >= typical]
    for d, n in enumerate(shape):
        cuts = ({b.offset[d] for b in major} | {b.stop[d] for b in major}) - {0, n}
        if not cuts:
            continue
        g = math.gcd(*cuts)
        if -(-n // g) <= 4 * (len(cuts) + 1):
            region_shape[d] = g
        else:
            misaligned = True
    if misaligned:
        # shards about the size of a typical region: each rank writes one or two objects
        # per array, and sends the writer of a shard it shares its piece of that shard
        return choose_grid(
            shape, itemsize, region_shape=region_shape, chunk_bytes=chunk_bytes,
            shard_bytes=max(chunk_bytes, min(shard_bytes, typical)),
        )
    replicas = max((len(r) for r in regions.values()), default=1)
    if replicas > 1 and nbytes > 4 * chunk_bytes:
        shard_bytes = min(shard_bytes, -(-nbytes // replicas))
    return choose_grid(shape, itemsize, region_shape=region_shape, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes)


MINOR_REGION_FACTOR = 64
"""A region this many times smaller than a typical one does not shape the grid."""


def _typical_region_bytes(regions: dict[Box, tuple[int, ...]], itemsize: int) -> int:
    """The bytes of the region holding the median byte: the size of the ranks' main
    pieces, whatever small pieces (partial rows of flat ranges) lie between them."""
    sizes = sorted(b.numel for b in regions)
    half, seen = sum(sizes) / 2, 0
    for n in sizes:
        seen += n
        if seen >= half:
            return n * itemsize
    return 0


def _region_records(
    held: list[tuple[int, FragmentInfo]], regions: dict[Box, tuple[int, ...]], writers: dict[Box, set[int]]
) -> list[Region]:
    """What the array's metadata says of the saving layout: its boxes (or flat ranges when
    every rank held a flat range), the ranks holding each, and the ranks that wrote it."""
    if held and all(f.flat is not None for _, f in held):
        flats: dict[tuple[int, int], tuple[list[int], set[int]]] = {}
        for r, f in held:
            assert f.flat is not None
            ranks, wrote = flats.setdefault(f.flat, ([], set()))
            ranks.append(r)
            for b in f.boxes:
                wrote |= writers.get(b, set())
        return [
            Region.flat_range(a, b, tuple(rs), tuple(sorted(w))) for (a, b), (rs, w) in sorted(flats.items()) if b > a
        ]
    return [
        Region(b.offset, b.shape, tuple(rs), tuple(sorted(writers.get(b, ()))))
        for b, rs in sorted(regions.items(), key=lambda x: x[0].offset)
    ]


class Loads:
    """The bytes each rank was given to write so far, and the least loaded of a set of
    holders (ties to the lowest rank), found in O(log holders) for large sets: a heap per
    set of holders, its stale entries (a rank given more since) refreshed when they surface."""

    def __init__(self, world: int) -> None:
        self.bytes = [0] * world
        self._heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def least(self, ranks: tuple[int, ...]) -> int:
        if len(ranks) <= 8:
            return min(ranks, key=lambda r: (self.bytes[r], r))
        heap = self._heaps.get(ranks)
        if heap is None:
            heap = self._heaps[ranks] = sorted((self.bytes[r], r) for r in ranks)
        loads = self.bytes
        while True:
            load, r = heap[0]
            if load == loads[r]:  # every entry is at most its rank's load: this one is the least
                return r
            heapq.heapreplace(heap, (loads[r], r))


def _assign(
    akey: str,
    path: str,
    grid: ChunkGrid,
    regions: dict[Box, tuple[int, ...]],
    itemsize: int,
    loads: Loads,
    writers: dict[Box, set[int]],
) -> list[ShardTask]:
    """One writer for every shard of an array: each region is intersected only with the
    shards it overlaps (per dim, from the grid), so the work is that of the overlaps; a
    shard lying whole in one region goes to its least loaded holder."""
    if 0 in grid.shape:  # (no shard: nothing per shard, however many the other dims would cut)
        return []
    whole: dict[tuple[int, ...], tuple[Box, tuple[int, ...]]] = {}
    parts: dict[tuple[int, ...], list[tuple[Box, Box, tuple[int, ...]]]] = defaultdict(list)
    for b, ranks in regions.items():
        if 0 in b.shape:
            continue
        per_dim = []
        for o, n, s, size in zip(b.offset, b.shape, grid.shard_shape, grid.shape):
            stop, cells, i = o + n, [], o // s
            while i * s < stop:  # (shard i along this dim: its part [a, z) in the region, whole or not)
                lo, hi = i * s, (i + 1) * s if (i + 1) * s < size else size
                a, z = o if o > lo else lo, stop if stop < hi else hi
                cells.append((i, a, z - a, a == lo and z == hi))
                i += 1
            per_dim.append(cells)
        for cells in itertools.product(*per_dim):
            idx, lo, n, full = zip(*cells) if cells else ((), (), (), ())
            if all(full):
                whole[idx] = (b, ranks)
            else:
                parts[idx].append((b, Box(lo, n), ranks))
    sizes = [[(s if (i + 1) * s <= n else n - i * s) for i in range(c)] for s, n, c in
             zip(grid.shard_shape, grid.shape, grid.shard_counts)]  # (clipped at the array's edge)
    tasks = []
    for idx in grid.all_shards():
        nbytes = itemsize
        for d, i in enumerate(idx):
            nbytes *= sizes[d][i]
        held = whole.get(idx)
        if held is None:
            tasks.append(_gathered(akey, path, idx, parts[idx], nbytes, loads, writers))
            continue
        writer = loads.least(held[1])
        loads.bytes[writer] += nbytes
        writers[held[0]].add(writer)
        tasks.append(ShardTask(akey, path, idx, writer, nbytes))
    return tasks


def _gathered(
    akey: str,
    path: str,
    index: tuple[int, ...],
    parts: list[tuple[Box, Box, tuple[int, ...]]],
    nbytes: int,
    loads: Loads,
    writers: dict[Box, set[int]],
) -> ShardTask:
    """The task of a shard no rank holds whole: the rank holding most of it writes it, and
    the other holders send it their pieces."""
    held: dict[int, int] = defaultdict(int)
    for _, inter, ranks in parts:
        n = math.prod(inter.shape)
        for r in ranks:
            held[r] += n
    writer = min(held, key=lambda r: (-held[r], loads.bytes[r], r))
    sources = []
    for b, inter, ranks in sorted(parts, key=lambda p: p[1].offset):
        writers[b].add(writer)
        sources.append((writer if writer in ranks else loads.least(ranks), inter))
    loads.bytes[writer] += nbytes
    return ShardTask(akey, path, index, writer, nbytes, tuple(sources))


def _name_dimensions(arrays: dict[str, tuple[str, ArrayMeta]]) -> dict[str, tuple[str, ArrayMeta]]:
    """Every array with its ``dimension_names``, chosen per group (see :func:`format.dimension_names`)."""
    by_group: dict[str, list[str]] = defaultdict(list)
    for akey, (path, _) in arrays.items():
        by_group[path.split("/")[0]].append(akey)
    out = dict(arrays)
    for akeys in by_group.values():
        dims = dimension_names([(arrays[a][0].split("/")[1], arrays[a][1].shape) for a in akeys])
        for a, d in zip(akeys, dims):
            path, meta = arrays[a]
            out[a] = (path, replace(meta, dims=d))
    return out


def _spread_documents(arrays: dict[str, tuple[str, ArrayMeta]], shards: list[ShardTask], world: int) -> dict[str, int]:
    """Each array's zarr.json is written by the writer of its first shard; groups round-robin."""
    first: dict[str, int] = {}
    for t in shards:
        first.setdefault(t.key, t.writer)
    docs = {f"{p}/zarr.json": first.get(k, 0) for k, (p, _) in arrays.items()}
    groups = sorted({p.split("/")[0] for p, _ in arrays.values()})
    docs.update({f"{g}/zarr.json": i % world for i, g in enumerate(groups)})
    return docs

