"""The Jupyter face: rich HTML for checkpoints, tensors, statistics and diffs, and plots.

A thin layer over :class:`~ucp_zarr.Checkpoint` and :mod:`ucp_zarr.browse.inspect`:

* :func:`checkpoint_html` (``Checkpoint._repr_html_``: facts, values and bytes by module and
  dtype, the tree of groups with a filter box), :class:`CheckpointTree` (``ck.tree(filter)``),
  :func:`summary_html` (``ck.summary()``) and :func:`tensor_html` (``TensorView._repr_html_``)
  read metadata only (the commit record, whose consolidated metadata holds every array's
  ``zarr.json``), never tensor data: no request beyond :func:`ucp_zarr.open`'s on object
  stores, and bounded in size for any checkpoint;
* :func:`run_html` (a :class:`~ucp_zarr.browse.runs.Run`'s steps) reads the steps' commit records;
* :func:`stats_html`, :func:`diff_html`, :func:`series_html` render what
  :func:`ucp_zarr.browse.inspect.tensor_stats`, :func:`ucp_zarr.browse.diff.diff` and
  :class:`~ucp_zarr.browse.runs.Run` computed;
* :func:`plot_norms`, :func:`plot_histogram`, :func:`plot_updates`, :func:`plot_series` and
  :func:`plot_step_histograms` draw with matplotlib, imported when first called; what they
  draw was streamed block by block (bounded memory).

Every string taken from a checkpoint (keys, paths, values) is HTML-escaped. Importing this
module imports neither torch nor matplotlib.
"""

from __future__ import annotations

import html
import json
import math
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence, TYPE_CHECKING

from ..format.documents import reference_shape
from ..protocol.reader import human_bytes
from .inspect import CheckpointSummary, SummaryRow, TensorStats, checkpoint_summary, group_of

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, TensorView
    from ..format.documents import ArrayMeta, Region
    from ..format.commit_record import TensorEntry

MAX_ROWS = 200
"""Array rows a checkpoint's tree shows in full; further groups show their totals only."""
MAX_NODES = 1000
"""Tree nodes (groups and modules) a checkpoint's tree shows; the rest are summed up."""
MAX_CHILDREN = 64
"""Children one tree node lists; the rest are summed up in one line."""
MAX_VALUES = 40
"""Non-tensor values listed in a checkpoint's facts."""
MAX_BOXES = 256
"""Rectangles a tensor's rank picture draws (the rest are counted)."""
MAX_DIFF_ROWS = 200
"""Rows a diff table lists (differences first)."""

_PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c",
)
_STYLE = (  # ".ucpz.ucpz.ucpz" outranks JupyterLab's table rules (specificity 0,2,1)
    "<style>.ucpz{font-family:var(--jp-content-font-family,sans-serif);font-size:13px;line-height:1.4}"
    ".ucpz.ucpz.ucpz table{border-collapse:collapse;margin:2px 0 4px 18px;border:none}"
    ".ucpz.ucpz.ucpz table td,.ucpz.ucpz.ucpz table th{padding:1px 8px;text-align:left;border:none;border-bottom:1px solid #8882;"
    "vertical-align:top}"
    ".ucpz.ucpz.ucpz table th{font-weight:600}.ucpz.ucpz.ucpz table td.num{text-align:right;font-variant-numeric:tabular-nums}"
    ".ucpz details>details,.ucpz details>div{margin-left:16px}.ucpz summary{cursor:pointer}"
    ".ucpz .dim{color:#888}.ucpz .bad{color:#c0392b;font-weight:600}"
    ".ucpz.ucpz.ucpz table tr.only{background:#f8d7da80}.ucpz.ucpz.ucpz table tr.differs{background:#fff3cd80}"
    ".ucpz.ucpz.ucpz table.facts td:first-child{color:#888}</style>"
)


# --------------------------------------------------------------------------------------
# small formatters


def _n(count: int, noun: str) -> str:
    """``3, "rank"`` -> ``"3 ranks"``."""
    return f"{count:,} {noun}{'s' * (count != 1)}"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _x(shape: Sequence[int]) -> str:
    return "\u00d7".join(str(n) for n in shape) or "scalar"


def _num(v: Any) -> str:
    if v is None:
        return "<span class='dim'>\u2013</span>"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _e(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.6g}"


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


# --------------------------------------------------------------------------------------
# the checkpoint: facts and a tree of groups


@dataclass
class _Node:
    """A node of the tree of groups. Group labels (parameter FQNs) are split at dots: the
    last part names a *group* node (a parameter with its moments: the arrays), the others
    *module* nodes (``blocks`` > ``0`` > ``qkv`` > group ``weight``)."""

    name: str
    group: bool = False
    fqn: str = ""
    """A group's whole name (the parameter's FQN)."""
    children: dict[tuple[str, bool], "_Node"] = field(default_factory=dict)
    arrays: list[tuple[str, str, "TensorEntry"]] = field(default_factory=list)
    """(array name within the group, tensor key, index entry)."""
    count: int = 0
    nbytes: int = 0

    def add(self, parts: list[str], row: tuple[str, str, "TensorEntry"], nbytes: int, fqn: str) -> None:
        """Add an array under the module path ``parts[:-1]``, in the group ``parts[-1]`` (named ``fqn``)."""
        node = self
        for i, part in enumerate(parts):
            node.count += 1
            node.nbytes += nbytes
            at = (part, i == len(parts) - 1)
            child = node.children.get(at)
            if child is None:
                child = node.children[at] = _Node(part, group=at[1], fqn=fqn if at[1] else "")
            node = child
        node.count += 1
        node.nbytes += nbytes
        node.arrays.append(row)

    def collapsed(self) -> "_Node":
        """This node with single-child module chains merged (``head`` > ``weight`` -> ``head.weight``)."""
        node = self
        while not node.group and len(node.children) == 1:
            (child,) = node.children.values()
            node = _Node(f"{node.name}.{child.name}", child.group, child.fqn, child.children, child.arrays, child.count,
                         child.nbytes)
        node.children = {k: c.collapsed() for k, c in node.children.items()}
        return node


def checkpoint_tree(ck: "Checkpoint", keys: "Collection[str] | None" = None) -> _Node:
    """The checkpoint's tensors (those of ``keys``, if given) as a tree of their Zarr groups (one
    group per parameter, which holds its optimizer moments too), group names split at dots,
    single-child chains merged."""
    root = _Node("")
    for key, entry in ck.meta.tensors.items():
        if keys is not None and key not in keys:
            continue
        group, name = group_of(entry.path), urllib.parse.unquote(entry.path.partition("/")[2])
        root.add([p for p in group.split(".") if p] or [group], (name, key, entry), entry.nbytes, group)
    root.children = {k: c.collapsed() for k, c in root.children.items()}
    return root


def _grid_text(meta: "ArrayMeta") -> str:
    g = meta.grid
    chunks = math.prod(g.chunks_per_shard)
    shards = math.prod(g.shard_counts)
    return (f"chunks {_x(g.chunk_shape)}, shards {_x(g.shard_shape)} "
            f"<span class='dim'>({_n(shards, 'shard')} \u00d7 {_n(chunks, 'chunk')})</span>")


class _Budget:
    """How many more array rows, and tree nodes, the tree may show."""

    def __init__(self, rows: int, nodes: int) -> None:
        self.rows = rows
        self.nodes = nodes


def _array_rows(ck: "Checkpoint", arrays: list[tuple[str, str, "TensorEntry"]]) -> str:
    rows = []
    for name, key, e in arrays:
        meta = ck.array_meta(key)
        copies = "" if e.ranks is None else f" <span class='dim'>per rank \u00d7{len(e.ranks)}</span>"
        rule = "" if e.rule is None else f" <span class='dim' title='{_e(json.dumps(e.rule))}'>rule: {_e(e.rule['kind'])}</span>"
        stored = "" if not meta.dtype.bits else f" <span class='dim'>(as {_e(meta.dtype.zarr_dtype)})</span>"
        rows.append(
            f"<tr><td><code>{_e(name)}</code>{copies}{rule}</td><td class='key'><code>{_e(key)}</code></td>"
            f"<td>{_shape(e.shape)}</td><td>{_e(e.dtype)}{stored}</td><td>{_grid_text(meta)}</td>"
            f"<td class='num'>{human_bytes(e.nbytes)}</td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


def _node_html(ck: "Checkpoint", node: _Node, budget: _Budget, opened: bool) -> str:
    totals = f"{_n(node.count, 'tensor')}, {human_bytes(node.nbytes)}"
    if not node.group:
        summary = f"<summary><b>{_e(node.name)}</b> <span class='dim'>{totals}</span></summary>"
        inner = _children_html(ck, list(node.children.values()), budget, opened)
        return f"<details class='module'{' open' * opened}>{summary}{inner}</details>"
    names = ", ".join(name for name, _, _ in node.arrays[:6]) + (", \u2026" if len(node.arrays) > 6 else "")
    shape = _shape(reference_shape([(name, tuple(e.shape)) for name, _, e in node.arrays]))  # (the parameter's)
    summary = (f"<summary><code>{_e(node.name)}</code> {shape} <span class='dim'>{_e(names)} \u00b7 {totals}</span>"
               "</summary>")
    if budget.rows >= len(node.arrays):
        budget.rows -= len(node.arrays)
        body = _array_rows(ck, node.arrays)
    else:
        budget.rows = 0
        body = (f"<div class='dim'>{len(node.arrays)} arrays not listed (over the tree's row limit): "
                "use <code>ck.keys()</code> and <code>ck[key]</code></div>")
    return f"<details class='group' data-name='{_e(node.fqn)}'{' open' * opened}>{summary}{body}</details>"


def _children_html(ck: "Checkpoint", children: list[_Node], budget: _Budget, opened: bool,
                   open_first_group: bool = False) -> str:
    """Tree nodes (at most :data:`MAX_CHILDREN`, while the budget lasts); module nodes
    ``opened`` or not, groups closed but for the first one when ``open_first_group`` (an
    example of what a group holds)."""
    shown = children[: max(0, min(MAX_CHILDREN, budget.nodes))]
    budget.nodes -= len(shown)
    first = next((c for c in shown if c.group), None) if open_first_group else None
    out = [_node_html(ck, c, budget, c is first if c.group else opened) for c in shown]
    rest = children[len(shown):]
    if rest:
        n, b = sum(c.count for c in rest), sum(c.nbytes for c in rest)
        out.append(f"<div class='dim'>\u2026 and {len(rest):,} more groups ({n:,} tensors, {human_bytes(b)})</div>")
    return "".join(out)


def _facts_html(ck: "Checkpoint", nbytes: int, summary: "CheckpointSummary") -> str:
    meta = ck.meta
    md = ck.metadata
    t = summary.total
    facts: list[tuple[str, str]] = [
        ("step", _e(repr(md["step"]))),
        ("tensors", f"{len(meta.tensors):,}, {human_bytes(nbytes)}"),
        ("elements", f"{_counts_text(t)} <span class='dim'>(<code>ck.summary()</code>)</span>"),
        ("by module", f"<details class='summary'><summary>{_n(len(summary.modules), 'module')} at depth "
                      f"{summary.depth}, {_n(len(summary.dtypes), 'dtype')}</summary>{_summary_tables(summary)}</details>"),
        ("saved by", _n(meta.world_size, "rank")),
        ("created", _e(meta.created)),
        ("library", _e(meta.library)),
        ("signed", "yes (HMAC-SHA256)" if meta.authenticated else "no"),
    ]
    layout = meta.layout
    if not layout:
        facts.append(("layout", "tensors saved as given (no rules)"))
    for name, value in layout.items():
        if name == "rules" and isinstance(value, dict):
            n = len(value.get("params", []))
            text = _e(_short(value, 4000))
            facts.append(("rules", f"<details><summary>{_n(n, 'parameter rule')}"
                                   f" (<code>ck.rules</code>)</summary><code>{text}</code></details>"))
        else:
            facts.append((_e(name), f"<code>{_e(_short(value))}</code>"))
    if md["per_rank_tensors"] or md["rank_values"]:
        facts.append(("per-rank state", f"{_n(len(md['per_rank_tensors']), 'tensor')}, {_n(len(md['rank_values']), 'value')}"))
    values = md["values"]
    if values:
        rows = "".join(f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(_short(v))}</code></td></tr>"
                       for k, v in list(values.items())[:MAX_VALUES])
        more = f"<div class='dim'>\u2026 and {len(values) - MAX_VALUES} more</div>" if len(values) > MAX_VALUES else ""
        summary_line = f"<summary>{len(values)} non-tensor values</summary>"
        facts.append(("values", f"<details>{summary_line}<table>{rows}</table>{more}</details>"))
    return "<table class='facts'>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in facts) + "</table>"


def checkpoint_html(ck: "Checkpoint", *, max_rows: int = MAX_ROWS, max_nodes: int = MAX_NODES) -> str:
    """A checkpoint as HTML: its facts (step, size, saving world, date, signature, layout and
    rules, non-tensor values) and a collapsible tree of its groups, each parameter with its
    optimizer moments, listing shape, dtype, chunk and shard grid and size per array.

    At most ``max_rows`` arrays are listed (further groups show their totals only) and
    ``max_nodes`` groups and modules (the rest are summed up), so the HTML stays small for
    any checkpoint. Reads metadata only: the commit record (with its consolidated copy of
    the arrays' ``zarr.json``)."""
    tree = checkpoint_tree(ck)
    head = f"<div><b>ucp_zarr checkpoint</b> <code>{_e(ck.store.url)}</code></div>"
    facts = _facts_html(ck, tree.nbytes, checkpoint_summary(ck))
    return f"{_STYLE}<div class='ucpz'>{head}{facts}{_tree_html(ck, tree, max_rows, max_nodes)}</div>"


_FILTER_JS = (  # the tree's filter box: groups whose name, or whose arrays' keys, hold the text
    "var q=this.value.trim().toLowerCase(),t=this.closest('.ucpz-tree'),n=0;"
    "t.querySelectorAll('details.group').forEach(function(g){"
    "var own=!q||g.dataset.name.toLowerCase().indexOf(q)>=0,hit=own;"
    "g.querySelectorAll('tr').forEach(function(r){var k=r.querySelector('td.key'),"
    "m=own||(k!==null&&k.textContent.toLowerCase().indexOf(q)>=0);r.hidden=!m;hit=hit||m;});"
    "g.hidden=!hit;if(hit&&q)n++;});"
    "t.querySelectorAll('details.module').forEach(function(m){"
    "var v=!q||m.querySelector('details.group:not([hidden])')!==null;m.hidden=!v;if(q&&v)m.open=true;});"
    "t.querySelector('.ucpz-matches').textContent=q?n+(n==1?' group matches':' groups match'):'';"
)


def _tree_html(ck: "Checkpoint", tree: _Node, max_rows: int, max_nodes: int) -> str:
    """The tree of groups with its filter box (JavaScript in the page, no library: it works
    where the notebook's HTML is trusted, nbconvert's pages among them; elsewhere use
    ``ck.tree(filter=...)``)."""
    budget = _Budget(max_rows, max_nodes)
    body = _children_html(ck, list(tree.children.values()), budget, tree.count <= 40, True)
    box = (f"<div><input type='search' class='ucpz-filter' placeholder='filter by name' "
           f"title='groups whose name or keys hold the text (of those listed)' oninput='{_e(_FILTER_JS)}'> "
           "<span class='ucpz-matches dim'></span></div>")
    return f"<div class='ucpz-tree'>{box}{body}</div>"


class CheckpointTree:
    """The tree of a checkpoint's groups restricted to the tensors whose key, or whose
    parameter's name, holds ``filter`` (case-insensitive; None: all), as ``ck.tree(filter)``
    gives it. Reads metadata only."""

    def __init__(self, ck: "Checkpoint", filter: str | None = None, *, max_rows: int = MAX_ROWS,
                 max_nodes: int = MAX_NODES) -> None:
        self.checkpoint = ck
        self.filter = filter
        self.max_rows, self.max_nodes = max_rows, max_nodes
        q = None if filter is None else filter.lower()
        self.keys = [k for k, e in ck.meta.tensors.items()
                     if q is None or q in k.lower() or q in group_of(e.path).lower()]
        """The keys shown."""

    def __repr__(self) -> str:
        match = "" if self.filter is None else f" matching {self.filter!r}"
        return f"<CheckpointTree {self.checkpoint.store.url}: {len(self.keys)} of {len(self.checkpoint)} tensors{match}>"

    def _repr_html_(self) -> str:
        ck = self.checkpoint
        tree = checkpoint_tree(ck, set(self.keys))
        match = "" if self.filter is None else f" whose name holds <code>{_e(self.filter)}</code>"
        head = (f"<div><b>tree</b> of <code>{_e(ck.store.url)}</code>: {len(self.keys):,} of "
                f"{_n(len(ck), 'tensor')}{match} ({human_bytes(tree.nbytes)})</div>")
        return f"{_STYLE}<div class='ucpz'>{head}{_tree_html(ck, tree, self.max_rows, self.max_nodes)}</div>"


# --------------------------------------------------------------------------------------
# summaries: values and bytes by module and dtype

MAX_SUMMARY_ROWS = 100
"""Modules a summary lists (the rest are summed up in one row)."""


def _counts_text(t: "SummaryRow") -> str:
    return (f"{t.model:,} model <span class='dim'>(parameters and buffers)</span> \u00b7 "
            f"{t.optimizer:,} optimizer state \u00b7 {t.other:,} other")


def _summary_row(row: "SummaryRow", total: int, label: str, dtypes: bool) -> str:
    share = row.nbytes / total if total else 0.0
    bar = (f"<span style='display:inline-block;height:9px;width:{60 * share:.1f}px;background:{_PALETTE[0]};"
           f"margin-right:4px'></span>{100 * share:.1f}%")
    kinds = "".join(f"<td class='num'>{_num(getattr(row, k))}</td>" for k in ("model", "optimizer", "other"))
    extra = ""
    if dtypes:
        by_size = sorted(row.dtypes.items(), key=lambda x: -x[1])
        extra = "<td>" + ", ".join(f"{_e(d)} {human_bytes(b)}" for d, b in by_size) + "</td>"
    return (f"<tr><td>{label}</td><td class='num'>{row.tensors:,}</td>{kinds}"
            f"<td class='num'>{human_bytes(row.nbytes)}</td><td>{bar}</td>{extra}</tr>")


def _summary_tables(summary: "CheckpointSummary", max_rows: int = MAX_SUMMARY_ROWS) -> str:
    total = summary.total.nbytes
    head = ("<th>tensors</th><th>model</th><th>optimizer</th><th>other</th><th>bytes</th><th>share</th>")
    rows = [_summary_row(r, total, f"<code>{_e(r.name)}</code>" if r.name else "<span class='dim'>(top level)</span>", True)
            for r in summary.modules[:max_rows]]
    rest = summary.modules[max_rows:]
    if rest:
        more = SummaryRow(f"\u2026 {len(rest):,} more modules")
        for r in rest:
            for field_name in ("tensors", "model", "optimizer", "other", "nbytes"):
                setattr(more, field_name, getattr(more, field_name) + getattr(r, field_name))
        rows.append(_summary_row(more, total, f"<span class='dim'>{_e(more.name)}</span>", False))
    rows.append(_summary_row(summary.total, total, "<b>total</b>", True))
    modules = f"<table class='modules'><tr><th>module</th>{head}<th>dtypes</th></tr>{''.join(rows)}</table>"
    by_dtype = "".join(_summary_row(r, total, f"<code>{_e(r.name)}</code>", False) for r in summary.dtypes)
    dtypes = f"<table class='dtypes'><tr><th>dtype</th>{head}</tr>{by_dtype}</table>"
    return modules + dtypes


def summary_html(summary: "CheckpointSummary", *, max_rows: int = MAX_SUMMARY_ROWS) -> str:
    """A :class:`~ucp_zarr.browse.inspect.CheckpointSummary` as HTML: the values of each kind, and
    tables by module (at most ``max_rows``, the rest summed) and by dtype, with each one's
    share of the bytes."""
    t = summary.total
    title = (f"<div><b>summary</b> of <code>{_e(summary.url)}</code> <span class='dim'>(modules: FQNs cut to "
             f"{summary.depth} names)</span></div><div>{_counts_text(t)}; {human_bytes(t.nbytes)}</div>")
    return f"{_STYLE}<div class='ucpz'>{title}{_summary_tables(summary, max_rows)}</div>"


# --------------------------------------------------------------------------------------
# one tensor: facts and the picture of its writers


def _region_boxes(region: "Region", shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A region as (offset, shape) boxes of the global tensor."""
    from ..layout.flat import flat_range_boxes

    if region.flat is not None:
        return [(b.offset, b.shape) for b in flat_range_boxes(shape, *region.flat)]
    return [(tuple(region.offset), tuple(region.shape))]


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 8:
        return f"{', '.join(map(str, ranks[:8]))}, \u2026 ({len(ranks)} ranks)"
    return ", ".join(map(str, ranks))


def _holder(region: "Region") -> int:
    """The rank a region is drawn for: the rank that held it, or, for replicas, the one
    among them that wrote it."""
    if len(region.replicas) == 1:
        return region.replicas[0]
    return next((w for w in region.writers if w in region.replicas), region.replicas[0] if region.replicas else 0)


def rank_picture_svg(meta: "ArrayMeta", *, width: int = 360, height: int = 180) -> str:
    """An inline SVG of the tensor (its first two dims; 1-D as a bar) with one rectangle per
    region of the saving layout, coloured by the rank that held it (replicated regions: by
    the replica that wrote it), and the shard boundaries dashed. Empty for a scalar."""
    shape = meta.shape
    if not shape or math.prod(shape) == 0:
        return ""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
    scale = min(width / cols, height / rows)
    w = max(cols * scale, 24.0) if len(shape) > 1 else float(width)
    h = max(rows * scale, 24.0) if len(shape) > 1 else 24.0
    sx, sy = w / cols, h / rows

    def rect(offset: tuple[int, ...], size: tuple[int, ...]) -> tuple[float, float, float, float]:
        if len(shape) == 1:
            return offset[0] * sx, 0.0, size[0] * sx, h
        return offset[1] * sx, offset[0] * sy, size[1] * sx, size[0] * sy

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w + 2:.0f}' height='{h + 2:.0f}' "
           f"viewBox='-1 -1 {w + 2:.1f} {h + 2:.1f}' role='img'><title>regions of {_e(meta.key)} by rank</title>"]
    drawn = skipped = 0
    for region in meta.regions:
        holder = _holder(region)
        color = _PALETTE[holder % len(_PALETTE)]
        for offset, size in _region_boxes(region, shape):
            if drawn >= MAX_BOXES:
                skipped += 1
                continue
            drawn += 1
            x, y, bw, bh = rect(offset, size)
            where = ", ".join(f"{o}:{o + n}" for o, n in zip(offset, size))
            tip = (f"[{where}] held by rank{'s' * (len(region.replicas) > 1)} {_ranks_text(region.replicas)}, "
                   f"its shards written by rank{'s' * (len(region.writers) > 1)} {_ranks_text(region.writers)}")
            out.append(f"<rect class='region' data-rank='{holder}' x='{x:.2f}' y='{y:.2f}' width='{bw:.2f}' "
                       f"height='{bh:.2f}' fill='{color}' fill-opacity='0.75' stroke='white' stroke-width='0.5'>"
                       f"<title>{_e(tip)}</title></rect>")
            if bw >= 18 and bh >= 12:
                out.append(f"<text x='{x + bw / 2:.1f}' y='{y + bh / 2 + 4:.1f}' font-size='11' text-anchor='middle' "
                           f"fill='white' pointer-events='none'>{holder}</text>")
    grid = meta.grid
    lines = []
    if len(shape) == 1:
        cuts = [("v", i * grid.shard_shape[0] * sx) for i in range(1, grid.shard_counts[0])]
    else:
        cuts = [("h", i * grid.shard_shape[0] * sy) for i in range(1, grid.shard_counts[0])][:64]
        cuts += [("v", i * grid.shard_shape[1] * sx) for i in range(1, grid.shard_counts[1])][:64]
    for kind, at in cuts[:128]:
        x1, y1, x2, y2 = (at, 0, at, h) if kind == "v" else (0, at, w, at)
        lines.append(f"<line x1='{x1:.2f}' y1='{y1:.2f}' x2='{x2:.2f}' y2='{y2:.2f}' stroke='#333' "
                     "stroke-width='1' stroke-dasharray='3,2'/>")
    out += lines
    out.append(f"<rect x='0' y='0' width='{w:.2f}' height='{h:.2f}' fill='none' stroke='#555' stroke-width='1'/></svg>")
    note = f"<div class='dim'>{skipped} more rectangles not drawn</div>" if skipped else ""
    return "".join(out) + note


def _legend(meta: "ArrayMeta") -> str:
    ranks = sorted({_holder(r) for r in meta.regions})
    chips = "".join(f"<span style='display:inline-block;width:10px;height:10px;background:{_PALETTE[r % len(_PALETTE)]};"
                    f"margin:0 3px 0 8px'></span>rank {r}" for r in ranks[:32])
    more = f" \u2026 ({len(ranks)} ranks)" if len(ranks) > 32 else ""
    proj = " <span class='dim'>(projected onto dims 0, 1)</span>" if len(meta.shape) > 2 else ""
    cuts = "; dashed: shard boundaries" if meta.grid.shard_counts and math.prod(meta.grid.shard_counts) > 1 else ""
    return f"<div>held by{chips}{more}{proj}{cuts}</div>"


def tensor_html(view: "TensorView", stats: "TensorStats | None" = None) -> str:
    """A tensor as HTML: shape, dtype, where it is stored, chunk and shard grid, size, the
    regions the saving ranks held (a picture, coloured by rank), and ``stats`` when given
    (statistics are never computed here: call ``view.stats()``)."""
    ck, key = view.checkpoint, view.key
    entry = ck._entry(key)  # (a tied alias: its kept tensor's entry)
    meta = ck.array_meta(key)
    g = meta.grid
    stored = (f" <span class='dim'>stored as its {_e(meta.dtype.zarr_dtype)} bits (reinterpret them, do not convert)</span>"
              if meta.dtype.bits else "")
    facts = [
        ("shape", _shape(meta.shape) + ("" if not meta.dims else f" <span class='dim'>dims {_e(', '.join(meta.dims))}</span>")),
        ("dtype", f"{_e(meta.dtype.name)}{stored}"),
        ("size", f"{human_bytes(entry.nbytes)} ({math.prod(meta.shape):,} elements)"),
        ("array", f"<code>{_e(ck.store.url)}/{_e(entry.path)}</code>"),
        ("chunks", f"{_x(g.chunk_shape)} <span class='dim'>({math.prod(g.chunks_per_shard)} per shard)</span>"),
        ("shards", f"{_x(g.shard_shape)} <span class='dim'>(grid {_x(g.shard_counts)} = "
                   f"{math.prod(g.shard_counts)} objects)</span>"),
        ("regions", f"{len(meta.regions)} held by {_n(ck.meta.world_size, 'saving rank')}"),
    ]
    if entry.ranks is not None:
        copies = _ranks_text(list(entry.ranks))
        facts.append(("per rank", f"one copy per saving rank ({copies}); shown: rank {min(entry.ranks)}'s"))
    if entry.rule is not None:
        facts.append(("rule", f"<code>{_e(json.dumps(entry.rule))}</code>"))
    table = "<table class='facts'>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in facts) + "</table>"
    svg = rank_picture_svg(meta)
    picture = f"<div style='margin-left:18px'>{svg}{_legend(meta)}</div>" if svg else ""
    tail = _stats_table(stats) if stats is not None else (
        "<div class='dim'>statistics: <code>view.stats()</code> (reads the whole tensor, chunk by chunk)</div>")
    return f"{_STYLE}<div class='ucpz'><div><b>tensor</b> <code>{_e(key)}</code></div>{table}{picture}{tail}</div>"


# --------------------------------------------------------------------------------------
# statistics and diffs


_STAT_FIELDS = ("count", "min", "max", "mean", "std", "norm", "nan", "inf")


def _stats_table(stats: "TensorStats") -> str:
    cells = []
    for name in _STAT_FIELDS:
        v = getattr(stats, name)
        bad = name in ("nan", "inf") and isinstance(v, int) and v > 0
        cells.append(f"<td class='num{' bad' * bad}'>{_num(v)}</td>")
    head = "".join(f"<th>{n}</th>" for n in _STAT_FIELDS)
    return f"<table><tr>{head}</tr><tr>{''.join(cells)}</tr></table>"


def stats_html(stats: "TensorStats") -> str:
    """One tensor's statistics (count, min, max, mean, std, L2 norm, NaN and Inf counts)."""
    title = (f"<div><b>statistics</b> of <code>{_e(stats.key)}</code> "
             f"<span class='dim'>{_shape(stats.shape)} {_e(stats.dtype)}</span></div>")
    return f"{_STYLE}<div class='ucpz'>{title}{_stats_table(stats)}</div>"
