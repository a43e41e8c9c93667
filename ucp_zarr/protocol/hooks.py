"""What a layout that places state dicts plugs into saving and loading.

As DCP's ``SavePlanner``/``LoadPlanner`` let a layout plug in, a :class:`~ucp_zarr.Placed`
tensor carries the :class:`LayoutHooks` of the layout that placed it (``ucp_zarr.place``
gives the rule language's, :class:`ucp_zarr.rules.place.RulesHooks`); the save and the
load call them where only the layout knows the answer, and the protocol itself knows
nothing of rules, patterns or what a tensor's stored form means. The layout's own document
(``Placed.rules``) and each tensor's form (``Placed.meaning``) are opaque JSON to the
protocol: stored with the checkpoint, handed back to the hooks."""

from __future__ import annotations

from typing import Any, Mapping

import torch


class LayoutHooks:
    """The checks a layout adds and how it combines replicas that may differ; these
    defaults accept everything and combine by the mean (a layout overrides what it knows)."""

    def check_placements(self, layout: Mapping[str, Any], used_by_rank: list[frozenset[str]]) -> None:
        """What only every rank's placements together show, given each rank's
        ``Placed.used`` (a save calls it on the coordinator; a strict load on every rank):
        raise a :class:`~ucp_zarr.LayoutError` to refuse."""

    def other_layout(self, saved: Mapping[str, Any], loading: Mapping[str, Any]) -> str | None:
        """What makes a checkpoint saved with layout document ``saved`` (``Placed.rules``)
        mean something else to the state dict placed by ``loading`` (a load refuses then,
        unless ``allow_other_rules``), or None."""
        return None

    def same_form(self, saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> bool:
        """Whether a tensor stored in form ``saved`` (its ``Placed.meaning`` at save) holds
        what a tensor placed in form ``loading`` expects (a load refuses otherwise, unless
        ``allow_other_rules``)."""
        return True

    def stored_padding(self, saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> int | None:
        """Where a tensor stored in form ``saved`` holds, beyond the rows of dim 0 that form
        ``loading`` expects, only padding of the saving layout (a load then reads the first
        rows and leaves the rest out): that row count, or None."""
        return None

    def combine(self, key: str, copies: list[torch.Tensor]) -> torch.Tensor:
        """The one tensor stored for ``key``, whose holders' copies may differ
        (:attr:`~ucp_zarr.Placed.average`), from every holder's copy in rank order (on the
        coordinator): here their mean, accumulated in float64 in rank order."""
        total = torch.zeros(copies[0].shape, dtype=torch.float64)
        for t in copies:
            total += t.to(torch.float64)
        return (total / len(copies)).to(copies[0].dtype)
