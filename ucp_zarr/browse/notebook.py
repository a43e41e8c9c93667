"""The Jupyter face: rich HTML for checkpoints, tensors, statistics and diffs, and plots.

A thin layer over :class:`~ucp_zarr.protocol.checkpoint.Checkpoint` and :mod:`ucp_zarr.browse.inspect`:

* :func:`checkpoint_html` (``Checkpoint._repr_html_``: facts, values and bytes by module and
  dtype, the tree of groups with a filter box), :class:`CheckpointTree` (``ck.tree(filter)``),
  :func:`summary_html` (``ck.summary()``) and :func:`tensor_html` (``TensorView._repr_html_``)
  read metadata only (the commit record, whose consolidated metadata holds every array's
  ``zarr.json``), never tensor data: no request beyond :func:`ucp_zarr.open`'s on object
  stores, and bounded in size for any checkpoint;
* :func:`run_html` (a :class:`~ucp_zarr.browse.runs.Run`'s steps) reads the steps' commit records;
* :func:`stats_html`, :func:`diff_html`, :func:`series_html` render what
  :func:`ucp_zarr.browse.inspect.tensor_stats`, :func:`ucp_zarr.browse.inspect.diff` and
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
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Sequence

if TYPE_CHECKING:
    from datetime import datetime

    from matplotlib.axes import Axes

    from ..protocol.checkpoint import Checkpoint, TensorView
    from ..format.documents import ArrayMeta, Region, TensorEntry
    from .inspect import CheckpointDiff, CheckpointSummary, DiffRow, SummaryRow, TensorStats
    from .runs import Run, StepHistograms, StepSeries

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


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


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
    from .inspect import group_of

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
    shape = _shape(node.arrays[0][2].shape)
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
    from .inspect import checkpoint_summary

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
        from .inspect import group_of

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
    from .inspect import SummaryRow

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
    entry = ck.meta.tensors[key]
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


_STATUS_TEXT = {
    "equal": "equal", "differs": "values differ", "only_a": "only in A", "only_b": "only in B",
    "shape": "shapes differ", "dtype": "dtypes differ",
}


OPEN_DIFF_ROWS = 20
"""A diff of more rows than this, where every tensor differs, shows its largest relative
updates and keeps the full table folded."""
UNRELATED_UPDATE = 0.5
"""A median ``‖Δw‖/‖w‖`` from this up reads as unrelated checkpoints: steps of one run change
weights by far less; independent initialisations give about 1.4 (√2)."""
TOP_UPDATES = 10


def _rel(v: float | None) -> str:
    return _num(v) if v is None or not math.isfinite(v) else f"{v:.3g}"


def _diff_table(order: list["DiffRow"], max_rows: int, cls: str = "diff") -> str:
    body = []
    for r in order[:max_rows]:
        row_cls = "only" if r.status in ("only_a", "only_b") else ("differs" if r.status != "equal" else "")
        key = r.key if r.rank is None else f"{r.key} (rank {r.rank})"
        dtypes = _e(r.dtype_a or r.dtype_b) if r.dtype_a == r.dtype_b or None in (r.dtype_a, r.dtype_b) else (
            f"{_e(r.dtype_a)} / {_e(r.dtype_b)}")
        body.append(
            f"<tr class='{row_cls}' data-status='{_e(r.status)}'><td class='key'><code>{_e(key)}</code></td>"
            f"<td>{_e(_STATUS_TEXT.get(r.status, r.status))}</td><td class='num'>{_num(r.ndiff)}</td>"
            f"<td class='num'>{_num(r.max_abs)}</td><td class='num'>{_num(r.max_rel)}</td>"
            f"<td class='num rel'>{_rel(r.rel_update)}</td>"
            f"<td>{'' if r.shape_a is None else _shape(r.shape_a)}</td>"
            f"<td>{'' if r.shape_b is None else _shape(r.shape_b)}</td><td>{dtypes}</td></tr>"
        )
    more = f"<div class='dim'>\u2026 and {len(order) - max_rows} more rows</div>" if len(order) > max_rows else ""
    head = ("<tr><th>tensor</th><th>status</th><th>elements differ</th><th>max abs</th><th>max rel</th>"
            "<th title='the L2 norm of b - a over that of a'>\u2016\u0394w\u2016/\u2016w\u2016</th>"
            "<th>shape A</th><th>shape B</th><th>dtype</th></tr>")
    return f"<table class='{cls}'>{head}{''.join(body)}</table>{more}"


def _everything_differs(diff: "CheckpointDiff") -> str | None:
    """The header of a diff where no tensor is equal (None otherwise): no key in common, or
    every compared tensor differs, with the median relative update and what it suggests."""
    rows = diff.rows
    compared = [r for r in rows if r.status not in ("only_a", "only_b")]
    if not rows or any(r.status == "equal" for r in rows):
        return None
    if not compared:
        a = sum(r.status == "only_a" for r in rows)
        return (f"<div class='headline bad'>no tensor in common: A has {_n(a, 'tensor')}, B {len(rows) - a:,}, "
                "none under the same key. These are unrelated checkpoints (or their keys were renamed).</div>")
    from .inspect import tensor_kind

    rels = [r.rel_update for r in compared if r.rel_update is not None]
    model = [r.rel_update for r in compared if r.rel_update is not None and tensor_kind(r.key) == "model"]
    rels = sorted(model or rels)  # (optimizer moments change by more than themselves early on)
    median = rels[len(rels) // 2] if rels else None
    text = f"every one of the {_n(len(compared), 'tensor')} in common differs"
    if median is not None:
        of = "the model's " if model else ""
        text += f"; median \u2016\u0394w\u2016/\u2016w\u2016 of {of}tensors = {_rel(median)}"
    if median is not None and median >= UNRELATED_UPDATE:
        text += (": as large as the weights themselves. These look like unrelated checkpoints (independent "
                 "initialisations give about 1.4), not nearby steps of one run.")
        return f"<div class='headline bad'>{text}</div>"
    shapes = sum(r.status == "shape" for r in compared)
    if shapes * 2 > len(compared):
        return (f"<div class='headline bad'>{text}; {shapes:,} of them in shape: these look like checkpoints of "
                "different models.</div>")
    return f"<div class='headline'><b>{text}</b> (as between steps of training).</div>"


def diff_html(diff: "CheckpointDiff", *, max_rows: int = MAX_DIFF_ROWS) -> str:
    """A comparison of two checkpoints as tables: per tensor its status, elements that
    differ, max absolute and relative difference, the relative update ``‖Δw‖/‖w‖``, shapes and
    dtypes (missing tensors highlighted, differences first), then the non-tensor values that
    differ.

    When no tensor is equal, a header says so first: no key in common, or every tensor
    differs with the median relative update (from :data:`UNRELATED_UPDATE` up: unrelated
    checkpoints); a long table then shows its largest updates and keeps the rest folded."""
    rows = list(diff.rows)
    counts = {s: n for s, n in diff.counts().items() if n}
    summary = ", ".join(f"{n} {_STATUS_TEXT.get(s, s)}" for s, n in counts.items())
    verdict = "<b>identical</b>" if diff.equal else "<b class='bad'>different</b>"
    order = sorted(rows, key=lambda r: (r.status == "equal", r.status not in ("only_a", "only_b")))
    headline = _everything_differs(diff)
    if headline is not None and len(rows) > OPEN_DIFF_ROWS:
        rated = [(r.rel_update, r) for r in rows if r.rel_update is not None]  # finite first (inf: from all zeros)
        top = [r for _, r in sorted(rated, key=lambda x: (not math.isfinite(x[0]), -x[0]))[:TOP_UPDATES]]
        shown = ""
        if top:
            shown = f"<div>the {len(top)} largest relative updates:</div>{_diff_table(top, TOP_UPDATES, 'diff top')}"
        tables = (f"{shown}<details class='all'><summary>all {len(rows):,} rows</summary>"
                  f"{_diff_table(order, max_rows)}</details>")
    else:
        tables = _diff_table(order, max_rows)
    values = ""
    if diff.values:
        cells = "".join(
            f"<tr class='{'only' if v.status != 'differs' else 'differs'}' data-status='{_e(v.status)}'>"
            f"<td class='key'><code>{_e(v.key)}</code></td><td><code>{_e(_short(v.a))}</code></td>"
            f"<td><code>{_e(_short(v.b))}</code></td></tr>"
            for v in diff.values[:max_rows]
        )
        values = (f"<div><b>{_n(len(diff.values), 'non-tensor value')} differ</b></div>"
                  f"<table class='values'><tr><th>key</th><th>A</th><th>B</th></tr>{cells}</table>")
    title = f"<div>{verdict}: <code>{_e(diff.a)}</code> vs <code>{_e(diff.b)}</code>, {len(rows)} tensors ({_e(summary)})</div>"
    return f"{_STYLE}<div class='ucpz'>{title}{headline or ''}{tables}{values}</div>"


# --------------------------------------------------------------------------------------
# plots


_LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def layer_of(key: str) -> tuple[str, int, str] | None:
    """``"model.blocks.3.qkv.weight"`` -> ``("model.blocks", 3, "qkv.weight")``: the first
    numbered component of a key, taken as its layer (None without one)."""
    m = _LAYER.match(key)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def _new_axes(ax: "Axes | None") -> "Axes":
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 3.5))[1]


def _plot_by_layer(ax: "Axes", values: dict[str, float], ylabel: str, log: bool) -> None:
    """Keys with a layer number (:func:`layer_of`) as one line per kind of tensor over the layer
    index; without any, one bar per key."""
    series: dict[str, dict[int, float]] = {}
    for k, v in values.items():
        layer = layer_of(k)
        if layer is not None:
            series.setdefault(f"{layer[0]}.*.{layer[2]}", {})[layer[1]] = v
    if series:
        if len(series) > 10:  # (the default cycle repeats after 10 colours)
            import matplotlib

            ax.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)
        for name, points in series.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        if len(series) <= 12:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.barh(range(len(values)), list(values.values()), tick_label=list(values))
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    if log:
        (ax.set_yscale if series else ax.set_xscale)("log")


def plot_norms(ck: "Checkpoint", pattern: str | None = None, ax: "Axes | None" = None, *,
               max_bytes: int = 64 << 20) -> "Axes":
    """L2 norms of the tensors matching ``pattern`` (as :func:`ucp_zarr.browse.inspect.list_tensors`
    matches), computed block by block: numbered layers (``blocks.3.``) as one line per kind of
    tensor over the layer index, and, without numbered layers, one bar per tensor."""
    from .inspect import list_tensors, tensor_stats

    keys = [row.key for row in list_tensors(ck, pattern)]
    if not keys:
        raise KeyError(f"no tensor of {ck.store.url} matches {pattern!r}")
    ax = _new_axes(ax)
    _plot_by_layer(ax, {k: tensor_stats(ck, k, max_bytes=max_bytes).norm for k in keys}, "L2 norm", False)
    ax.set_title(f"L2 norms{'' if pattern is None else f' of {pattern}'}")
    return ax


def _tail(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def plot_updates(diff: "CheckpointDiff", keys: str | None = None, ax: "Axes | None" = None, *,
                 log: bool = True) -> "Axes":
    """The relative update ``‖Δw‖/‖w‖`` of each tensor of a diff (:func:`ucp_zarr.diff`) by layer:
    numbered layers (``layers.12.``) as one line per kind of tensor over the layer index, else
    one bar per tensor. ``keys``: a pattern (see :func:`ucp_zarr.browse.inspect.matches`) choosing the
    tensors; default: the model's (not optimizer state, see
    :func:`~ucp_zarr.browse.inspect.tensor_kind`)."""
    from .inspect import matches, tensor_kind

    values = {r.key: r.rel_update for r in diff.rows if r.rank is None and r.rel_update is not None
              and (matches(r.key, keys) if keys is not None else tensor_kind(r.key) == "model")}
    if not values:
        raise KeyError(f"no tensor compared in both {diff.a} and {diff.b} matches {keys or 'the model'!r}")
    ax = _new_axes(ax)
    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    _plot_by_layer(ax, finite, "\u2016\u0394w\u2016 / \u2016w\u2016", log and any(v > 0 for v in finite.values()))
    note = f" ({len(values) - len(finite)} infinite left out)" if len(finite) < len(values) else ""
    ax.set_title(f"relative update {_tail(diff.a)} \u2192 {_tail(diff.b)}{note}", fontsize="medium")
    return ax


def plot_histogram(ck_or_view: "Checkpoint | TensorView", key: str | None = None, bins: int = 100,
                   ax: "Axes | None" = None, *, max_bytes: int = 64 << 20, log: bool = False) -> "Axes":
    """The histogram of a tensor's finite values, streamed block by block in two passes (range,
    then counts), so memory stays bounded by ``max_bytes`` whatever the tensor's size.

    Pass a :class:`~ucp_zarr.protocol.checkpoint.TensorView`, or a checkpoint and ``key``."""
    from .inspect import histogram_counts, histogram_edges, value_range

    if key is None:
        if not hasattr(ck_or_view, "checkpoint"):
            raise TypeError("plot_histogram needs a tensor view (ck[key]) or a checkpoint and a key")
        ck, key = ck_or_view.checkpoint, ck_or_view.key  # type: ignore[union-attr]
    else:
        ck = ck_or_view  # type: ignore[assignment]
    found = value_range(ck, key, max_bytes=max_bytes)
    ax = _new_axes(ax)
    if found.count:
        edges = histogram_edges(found.lo, found.hi, bins)
        ax.stairs(histogram_counts(ck, key, edges, max_bytes=max_bytes), edges, fill=True)
    if log:
        ax.set_yscale("log")
    note = f", {found.skipped:,} NaN/Inf left out" if found.skipped else ""
    ax.set_title(f"{key}: {found.count:,} values{note}", fontsize="medium")
    ax.set_ylabel("count")
    return ax


# --------------------------------------------------------------------------------------
# runs: the steps under a root, tensors over steps

MAX_STEP_ROWS = 200
"""Steps a run's table lists (the newest; the rest are counted)."""
MAX_SERIES_COLUMNS = 24
"""Steps a series table shows (the newest)."""
MAX_LINES = 12
"""Tensors a series plot draws one labelled line each; more: grey lines and their median."""


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _when(created: str | None) -> "datetime | None":
    from datetime import datetime

    try:
        return None if created is None else datetime.fromisoformat(created)
    except ValueError:
        return None


def run_html(run: "Run", *, max_rows: int = MAX_STEP_ROWS) -> str:
    """A run's steps (:func:`ucp_zarr.open_run`) as a table: state, size, tensors, saving
    ranks, creation time and the time since the previous step, layout, live readers (the
    newest ``max_rows``). Reads nothing beyond the commit records :attr:`Run.steps` holds."""
    steps = run.steps
    committed = [s for s in steps if s.committed]
    total = sum(s.nbytes or 0 for s in committed)
    head = (f"<div><b>ucp_zarr run</b> <code>{_e(run.url)}</code>: {_n(len(steps), 'step folder')}, "
            f"{len(committed):,} committed ({human_bytes(total)}), latest {_e(run.latest)}</div>")
    layouts, readers = any(s.layout for s in steps), any(s.readers for s in steps)
    rows, prev = [], None
    for s in steps:
        when = _when(s.created)
        since = "" if when is None or prev is None else _seconds((when - prev).total_seconds())
        prev = when or prev
        bad = " bad" * (s.state not in ("committed", "writing"))
        created = "" if s.created is None else _e(s.created[:19].replace("T", " "))
        rows.append(
            f"<tr data-state='{_e(s.state)}'><td class='num'>{s.step:,}</td><td class='{bad.strip()}'>{_e(s.state)}</td>"
            f"<td class='num'>{'' if s.nbytes is None else human_bytes(s.nbytes)}</td>"
            f"<td class='num'>{_num(s.tensors)}</td><td class='num'>{_num(s.world_size)}</td><td>{created}</td>"
            f"<td class='num'>{since}</td>" + (f"<td>{_e(', '.join(s.layout))}</td>" if layouts else "")
            + (f"<td class='num'>{s.readers or ''}</td>" if readers else "") + "</tr>")
    earlier = len(rows) - max_rows
    more = f"<div class='dim'>{earlier:,} earlier steps not listed</div>" if earlier > 0 else ""
    extra = "<th>layout</th>" * layouts + "<th>readers</th>" * readers
    table = ("<table class='steps'><tr><th>step</th><th>state</th><th>size</th><th>tensors</th><th>ranks</th>"
             f"<th>created</th><th>after</th>{extra}</tr>{''.join(rows[-max_rows:])}</table>")
    hint = ("<div class='dim'><code>run[step]</code> opens a step; over steps (streamed): "
            "<code>run.norms(keys).plot()</code>, <code>run.updates(keys).plot()</code>, "
            "<code>run.histograms(key).plot()</code></div>")
    return f"{_STYLE}<div class='ucpz'>{head}{more}{table}{hint}</div>"


_QUANTITY = {"norm": "L2 norm", "update": "\u2016\u0394w\u2016 / \u2016w\u2016"}


def series_html(series: "StepSeries", *, max_rows: int = MAX_DIFF_ROWS, max_columns: int = MAX_SERIES_COLUMNS) -> str:
    """Values of tensors over steps (:meth:`Run.norms`, :meth:`Run.updates`) as a table: one
    row per tensor (at most ``max_rows``), one column per step (the newest ``max_columns``)."""
    steps = series.steps[-max_columns:]
    cut = len(series.steps) - len(steps)
    head = "".join(f"<th class='num'>{s:,}</th>" for s in steps)
    rows = []
    for key, values in list(series.values.items())[:max_rows]:
        cells = "".join(f"<td class='num'>{_rel(v)}</td>" for v in values[cut:])
        rows.append(f"<tr><td class='key'><code>{_e(key)}</code></td>{cells}</tr>")
    notes = []
    if cut:
        notes.append(f"{cut} earlier steps not shown")
    if len(series.values) > max_rows:
        notes.append(f"{len(series.values) - max_rows} more tensors")
    note = f"<div class='dim'>{'; '.join(notes)}</div>" if notes else ""
    what = "L2 norm"
    if series.quantity == "update":
        what = "relative update \u2016\u0394w\u2016/\u2016w\u2016 from the previous step"
    title = (f"<div><b>{_e(what)}</b> of {_n(len(series.values), 'tensor')} at {_n(len(series.steps), 'step')} of "
             f"<code>{_e(series.root)}</code> <span class='dim'>(<code>.plot()</code>)</span></div>")
    return (f"{_STYLE}<div class='ucpz'>{title}<table class='series'><tr><th>tensor \\ step</th>{head}</tr>"
            f"{''.join(rows)}</table>{note}</div>")


def plot_series(series: "StepSeries", ax: "Axes | None" = None, *, log: bool | None = None) -> "Axes":
    """Values of tensors over steps: one labelled line per tensor, or, for more than
    :data:`MAX_LINES`, thin grey lines and their median. ``log``: a logarithmic y axis
    (default: for updates)."""
    import numpy as np

    ax = _new_axes(ax)
    xs = np.array(series.steps)
    ys = np.array([[np.nan if v is None else v for v in values] for values in series.values.values()], dtype=float)
    if len(ys) <= MAX_LINES:
        for key, y in zip(series.values, ys):
            ax.plot(xs, y, marker="o", label=key)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        for y in ys:
            ax.plot(xs, y, color="#999", linewidth=0.6, alpha=0.6)
        ax.plot(xs, np.nanmedian(np.where(np.isfinite(ys), ys, np.nan), axis=0), color=_PALETTE[0], linewidth=2.5,
                marker="o", label=f"median of {len(ys)} tensors")
        ax.legend(fontsize="small")
    if log if log is not None else series.quantity == "update":
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(_QUANTITY.get(series.quantity, series.quantity))
    title = "relative updates from the previous step" if series.quantity == "update" else "L2 norms over steps"
    ax.set_title(title, fontsize="medium")
    return ax


HISTOGRAM_KINDS = ("ridge", "heatmap", "overlay")


def plot_step_histograms(h: "StepHistograms", kind: str = "ridge", ax: "Axes | None" = None, *,
                         log: bool = False) -> "Axes":
    """One tensor's histograms at several steps (:meth:`Run.histograms`): ``"ridge"`` (each
    scaled to its peak, stacked, the first step at the top), ``"heatmap"`` (steps by bins) or
    ``"overlay"`` (outlines on one axis). ``log``: counts on a log scale (log1p for ridge and
    heatmap)."""
    import numpy as np

    if kind not in HISTOGRAM_KINDS:
        raise ValueError(f"kind is one of {HISTOGRAM_KINDS}, got {kind!r}")
    ax = _new_axes(ax)
    counts = np.log1p(h.counts) if log and kind != "overlay" else h.counts.astype(float)
    n = len(h.steps)
    labels = [f"step {s:,}" for s in h.steps]
    if kind == "ridge":
        peak = counts.max(axis=1, keepdims=True)
        scaled = counts / np.where(peak > 0, peak, 1) * 1.4
        for i in range(n):
            base = n - 1 - i
            ax.stairs(scaled[i] + base, h.edges, baseline=base, fill=True, facecolor=_PALETTE[i % len(_PALETTE)],
                      edgecolor="white", linewidth=0.8, alpha=0.85, zorder=i)
        ax.set_yticks(range(n - 1, -1, -1), labels)
        ax.set_ylim(-0.1, n + 0.5)
    elif kind == "heatmap":
        mesh = ax.pcolormesh(h.edges, np.arange(n + 1), counts, cmap="viridis")
        ax.set_yticks(np.arange(n) + 0.5, labels)
        ax.invert_yaxis()
        ax.figure.colorbar(mesh, ax=ax, label="log(1 + count)" if log else "count")
    else:
        import matplotlib

        colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, n))
        for i in range(n):
            ax.stairs(counts[i], h.edges, color=colors[i], label=labels[i])
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_ylabel("count")
        if log:
            ax.set_yscale("log")
    skipped = sum(h.skipped)
    note = f", {skipped:,} NaN/Inf left out" if skipped else ""
    ax.set_title(f"{h.key} at {n} steps{note}", fontsize="medium")
    ax.set_xlabel("value")
    return ax
