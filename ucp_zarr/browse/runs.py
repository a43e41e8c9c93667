"""A training run as a notebook sees it: the steps under a root, and their tensors over steps.

:func:`open_run` opens a root of step checkpoints (what :class:`~ucp_zarr.CheckpointManager`
writes: ``<root>/step_00000100``, ...) read-only, on a local path or any fsspec URL. Its
display lists the steps (state, size, time) from their commit records alone; the values over
steps are computed only when asked, block by block with memory bounded by ``max_bytes``:

* :meth:`Run.norms`: L2 norms of chosen tensors at each step;
* :meth:`Run.updates`: the relative update ``‖w_s − w_prev‖ / ‖w_prev‖`` of chosen tensors
  between consecutive steps (:func:`ucp_zarr.diff`'s ``rel_update``);
* :meth:`Run.histograms`: one tensor's histogram at several steps, on common bins.

Torch is never imported. A run reads without reader leases (it writes nothing): a step that
retention deletes while it is read fails with an error naming its files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from .checkpoint import Checkpoint, open_store_checkpoint
from ..errors import NotACheckpointError
from ..format.documents import METADATA_FILE
from .diff import diff
from .inspect import histogram_counts, histogram_edges, select_keys, tensor_kind, tensor_stats, value_range
from .values import MAX_BYTES
from ..ops.steps import StepInfo, list_steps, step_store
from ..io.factory import open_store

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Patterns = str | Iterable[str] | None
"""Tensor keys, subtrees or globs (see :func:`ucp_zarr.browse.inspect.selector`); one string is one pattern."""


def _patterns(keys: Patterns) -> list[str] | None:
    return None if keys is None else [keys] if isinstance(keys, str) else list(keys)


@dataclass(frozen=True)
class StepSeries:
    """Values of tensors over steps (:meth:`Run.norms`, :meth:`Run.updates`):
    ``values[key][i]`` at ``steps[i]``, None where that step lacks the tensor.

    ``quantity`` is ``"norm"`` (L2 norm) or ``"update"`` (``‖w_s − w_prev‖ / ‖w_prev‖``, where
    ``previous[i]`` is the step before ``steps[i]``)."""

    root: str
    quantity: str
    steps: tuple[int, ...]
    values: dict[str, tuple[float | None, ...]]
    previous: tuple[int, ...] = ()

    def plot(self, ax: "Axes | None" = None, *, log: bool | None = None) -> "Axes":
        """One line per tensor over the steps (more than 12: thin grey lines and their median);
        ``log``: a logarithmic y axis (default: for updates)."""
        from .plots import plot_series

        return plot_series(self, ax, log=log)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "quantity": self.quantity, "steps": list(self.steps),
                "previous": list(self.previous), "values": {k: list(v) for k, v in self.values.items()}}

    def __repr__(self) -> str:
        return f"<StepSeries {self.quantity} of {len(self.values)} tensors at {len(self.steps)} steps of {self.root}>"

    def _repr_html_(self) -> str:
        from .changes import series_html

        return series_html(self)


@dataclass(frozen=True)
class StepHistograms:
    """One tensor's histograms at several steps on common bins (:meth:`Run.histograms`):
    ``counts[i]`` counts the finite values of ``steps[i]`` in the bins ``edges``;
    ``skipped[i]`` its NaN/Inf elements."""

    root: str
    key: str
    steps: tuple[int, ...]
    edges: np.ndarray
    counts: np.ndarray
    skipped: tuple[int, ...]

    def plot(self, kind: str = "ridge", ax: "Axes | None" = None, *, log: bool = False) -> "Axes":
        """``kind``: ``"ridge"`` (one filled histogram per step, stacked upwards),
        ``"heatmap"`` (steps by bins, coloured by count) or ``"overlay"`` (outlines on one
        axis); ``log``: logarithmic counts."""
        from .plots import plot_step_histograms

        return plot_step_histograms(self, kind, ax, log=log)

    def __repr__(self) -> str:
        return (f"<StepHistograms {self.key} at {len(self.steps)} steps, {len(self.edges) - 1} bins "
                f"[{self.edges[0]:.4g}, {self.edges[-1]:.4g}]>")


KEEP_OPEN = 2
"""Steps a run keeps open (their commit records in memory): the pair an update compares."""


class Run:
    """The step checkpoints under a root (see :func:`open_run`). ``run[step]`` opens one
    (a :class:`~ucp_zarr.Checkpoint`; the last :data:`KEEP_OPEN` opened are kept); :attr:`steps`
    lists every step folder as :func:`~ucp_zarr.ops.list_steps` found it when the run was
    opened (:meth:`refresh` looks again)."""

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options
        self.store = open_store(root, storage_options)
        self.url = self.store.url
        self.steps: list[StepInfo] = []
        self._open: dict[int, Checkpoint] = {}
        self.refresh()

    def refresh(self) -> None:
        """List the step folders again (commit records only)."""
        self.steps = list_steps(self.url, storage_options=self.storage_options)
        self._open.clear()

    @property
    def committed(self) -> list[int]:
        """The committed steps, ascending."""
        return [s.step for s in self.steps if s.committed]

    @property
    def latest(self) -> int | None:
        """The newest committed step (None when there is none)."""
        return max(self.committed, default=None)

    def __getitem__(self, step: int) -> Checkpoint:
        ck = self._open.pop(step, None)
        if ck is None:
            if step not in self.committed:
                raise KeyError(f"no committed step {step} under {self.url}; committed: {self.committed}")
            ck = open_store_checkpoint(step_store(self.store, step))
        self._open[step] = ck  # (the newest last)
        while len(self._open) > KEEP_OPEN:
            del self._open[next(iter(self._open))]
        return ck

    def _chosen(self, steps: Sequence[int] | None) -> list[int]:
        if steps is None:
            return self.committed
        missing = [s for s in steps if s not in self.committed]
        if missing:
            raise KeyError(f"steps {missing} are not committed under {self.url}; committed: {self.committed}")
        return sorted(set(steps))

    def norms(self, keys: Patterns, steps: Sequence[int] | None = None, *, max_bytes: int = MAX_BYTES) -> StepSeries:
        """The L2 norms of the tensors ``keys`` selects at each of ``steps`` (default: every
        committed step), each tensor streamed block by block."""
        chosen = self._chosen(steps)
        found: dict[str, dict[int, float]] = {}
        for step in chosen:
            ck = self[step]
            for key in select_keys(ck, _patterns(keys)):
                found.setdefault(key, {})[step] = tensor_stats(ck, key, max_bytes=max_bytes).norm
        if not found:
            raise KeyError(f"no tensor of the steps {chosen} of {self.url} matches {keys!r}")
        return StepSeries(self.url, "norm", tuple(chosen), {k: tuple(v.get(s) for s in chosen) for k, v in found.items()})

    def updates(self, keys: Patterns = None, steps: Sequence[int] | None = None, *,
                max_bytes: int = MAX_BYTES) -> StepSeries:
        """The relative update ``‖w_s − w_prev‖ / ‖w_prev‖`` of the tensors ``keys`` selects
        (default: the model's, see :func:`~ucp_zarr.browse.inspect.tensor_kind`) from each of ``steps``
        (default: every committed step) to the next, tensor by tensor as :func:`ucp_zarr.diff`
        compares them."""
        chosen = self._chosen(steps)
        if len(chosen) < 2:
            raise ValueError(f"updates need two committed steps; {self.url} has {chosen}")
        found: dict[str, dict[int, float | None]] = {}
        for before, after in zip(chosen, chosen[1:]):
            a, b = self[before], self[after]
            pats = _patterns(keys)
            if pats is None:
                pats = [k for k, e in a.meta.tensors.items() if tensor_kind(k, e.ranks) == "model"]
            for row in diff(a, b, keys=pats, max_bytes=max_bytes).rows:
                if row.rank is None and row.rel_update is not None:
                    found.setdefault(row.key, {})[after] = row.rel_update
        if not found:
            raise KeyError(f"no tensor of the steps {chosen} of {self.url} matches {keys!r} in two consecutive steps")
        later = chosen[1:]
        return StepSeries(self.url, "update", tuple(later), {k: tuple(v.get(s) for s in later) for k, v in found.items()},
                          tuple(chosen[:-1]))

    def histograms(self, key: str, steps: Sequence[int] | None = None, *, bins: int = 60,
                   max_bytes: int = MAX_BYTES) -> StepHistograms:
        """Tensor ``key``'s histograms at ``steps`` (default: every committed step holding it)
        on common bins over all their finite values: two streamed passes per step (range,
        then counts)."""
        chosen = [s for s in self._chosen(steps) if key in self[s]]
        if not chosen:
            raise KeyError(f"no committed step of {self.url} holds tensor {key!r}")
        ranges = [value_range(self[s], key, max_bytes=max_bytes) for s in chosen]
        los = [r.lo for r in ranges if r.lo is not None]
        his = [r.hi for r in ranges if r.hi is not None]
        edges = histogram_edges(min(los, default=None), max(his, default=None), bins)
        counts = np.stack([histogram_counts(self[s], key, edges, max_bytes=max_bytes) for s in chosen])
        return StepHistograms(self.url, key, tuple(chosen), edges, counts, tuple(r.skipped for r in ranges))

    def __repr__(self) -> str:
        n = len(self.committed)
        return f"<ucp_zarr.Run {self.url}: {len(self.steps)} step folders, {n} committed, latest {self.latest}>"

    def _repr_html_(self) -> str:
        from .changes import run_html

        return run_html(self)


def open_run(root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Run:
    """The step checkpoints under ``root`` (a path or fsspec URL), read-only, torch-free.

    Refuses (:class:`~ucp_zarr.NotACheckpointError`) a root holding no step folder, naming
    what it found: a checkpoint itself (open it with :func:`ucp_zarr.open`) or nothing."""
    run = Run(root, storage_options)
    if not run.steps:
        names = run.store.child_names()
        if METADATA_FILE in names:
            raise NotACheckpointError(f"{run.url} is a checkpoint, not a root of steps: open it with ucp_zarr.open")
        raise NotACheckpointError(
            f"{run.url} holds no step folder (step_00000100, ... as CheckpointManager names them)"
            + ("" if names else ": it is empty or missing"))
    return run

