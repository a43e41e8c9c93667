"""Plots with matplotlib (imported on first use): norms by layer, updates between checkpoints,
histograms, series over steps and their histograms."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING
from .notebook import _PALETTE
from .changes import MAX_LINES, _QUANTITY

if TYPE_CHECKING:

    from matplotlib.axes import Axes

    from .checkpoint import Checkpoint, TensorView
    from .diff import CheckpointDiff
    from .runs import StepHistograms, StepSeries


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


def _plot_by_layer(ax: "Axes", values: dict[str, float], ylabel: str, log: bool) -> str:
    """Keys with a layer number (:func:`layer_of`) as one line per kind of tensor over the layer
    index; without any, one bar per key. Returns a note for the title naming the keys without
    a layer number left out beside numbered ones ("" when none are)."""
    series: dict[str, dict[int, float]] = {}
    for k, v in values.items():
        layer = layer_of(k)
        if layer is not None:
            series.setdefault(f"{layer[0]}.*.{layer[2]}", {})[layer[1]] = v
    if series:
        if len(series) > 10:  # (the default cycle repeats after 10 colours)
            import matplotlib

            ax.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)
        lines = []
        for name, points in series.items():
            xs = sorted(points)
            lines += ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        if len(series) <= 12:  # (labels given: matplotlib leaves out a found label starting with '_')
            ax.legend(lines, list(series), fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.barh(range(len(values)), list(values.values()), tick_label=list(values))
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    if log:
        (ax.set_yscale if series else ax.set_xscale)("log")
    alone = [k for k in values if layer_of(k) is None] if series else []
    return f"; {len(alone)} without a layer number left out ({', '.join(alone[:3])}{' ...' * (len(alone) > 3)})" if alone else ""


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
    note = _plot_by_layer(ax, {k: tensor_stats(ck, k, max_bytes=max_bytes).norm for k in keys}, "L2 norm", False)
    ax.set_title(f"L2 norms{'' if pattern is None else f' of {pattern}'}{note}")
    return ax


def _tail(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def plot_updates(diff: "CheckpointDiff", keys: str | None = None, ax: "Axes | None" = None, *,
                 log: bool = True) -> "Axes":
    """The relative update ``‖Δw‖/‖w‖`` of each tensor of a diff (:func:`ucp_zarr.diff`) by layer:
    numbered layers (``layers.12.``) as one line per kind of tensor over the layer index, else
    one bar per tensor. ``keys``: a pattern (see :func:`ucp_zarr.browse.inspect.selector`) choosing the
    tensors; default: the model's (not optimizer state, see
    :func:`~ucp_zarr.browse.inspect.tensor_kind`)."""
    from .inspect import selector, tensor_kind

    rows = [r for r in diff.rows if r.rank is None and r.rel_update is not None]
    hit = selector(None if keys is None else [keys], [r.key for r in rows])
    values = {r.key: r.rel_update for r in rows if (hit(r.key) if keys is not None else tensor_kind(r.key) == "model")}
    if not values:
        raise KeyError(f"no tensor compared in both {diff.a} and {diff.b} matches {keys or 'the model'!r}")
    ax = _new_axes(ax)
    finite = {k: v for k, v in values.items() if math.isfinite(v)}
    alone = _plot_by_layer(ax, finite, "\u2016\u0394w\u2016 / \u2016w\u2016", log and any(v > 0 for v in finite.values()))
    note = f" ({len(values) - len(finite)} infinite left out{alone})" if len(finite) < len(values) else (
        f" ({alone[2:]})" if alone else "")
    ax.set_title(f"relative update {_tail(diff.a)} \u2192 {_tail(diff.b)}{note}", fontsize="medium")
    return ax


def plot_histogram(ck_or_view: "Checkpoint | TensorView", key: str | None = None, bins: int = 100,
                   ax: "Axes | None" = None, *, max_bytes: int = 64 << 20, log: bool = False) -> "Axes":
    """The histogram of a tensor's finite values, streamed block by block in two passes (range,
    then counts), so memory stays bounded by ``max_bytes`` whatever the tensor's size.

    Pass a :class:`~ucp_zarr.TensorView`, or a checkpoint and ``key``."""
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


def plot_series(series: "StepSeries", ax: "Axes | None" = None, *, log: bool | None = None) -> "Axes":
    """Values of tensors over steps: one labelled line per tensor, or, for more than
    :data:`MAX_LINES`, thin grey lines and their median. ``log``: a logarithmic y axis
    (default: for updates)."""
    import numpy as np

    ax = _new_axes(ax)
    xs = np.array(series.steps)
    ys = np.array([[np.nan if v is None else v for v in values] for values in series.values.values()], dtype=float)
    if len(ys) <= MAX_LINES:
        lines = [line for key, y in zip(series.values, ys) for line in ax.plot(xs, y, marker="o", label=key)]
        # (labels given: matplotlib leaves out a found label starting with '_', as torch.compile's keys do)
        ax.legend(lines, list(series.values), fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
