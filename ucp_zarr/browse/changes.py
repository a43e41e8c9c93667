"""The Jupyter HTML of what changes: diffs between two checkpoints, the steps of a run and tensors'
values over steps."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING
from .notebook import MAX_DIFF_ROWS, _STYLE, _e, _n, _num, _shape, _short, human_bytes

if TYPE_CHECKING:
    from datetime import datetime


    from .diff import CheckpointDiff, DiffRow
    from .runs import Run, StepSeries


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
    rels = model or rels  # (optimizer moments change by more than themselves early on)
    median = statistics.median(rels) if rels else None
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
