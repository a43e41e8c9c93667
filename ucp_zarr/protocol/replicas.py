"""Replicas are shown equal before they are written.

A box of a tensor that several ranks hold (a plain tensor on every rank, a DTensor
``Replicate`` placement, two ``Shard``s or ``FlatShard``s of one region, two pipeline stages
that both place "layer 0") is written once, by one of its holders. So before anything is
written every holder computes a digest of its copy (:func:`replica_digests`, from its part
of the plan, :attr:`~ucp_zarr.protocol.planner.SavePlan.replicas`), the coordinator compares them
(:func:`check_replicas`), and a difference is a :class:`~ucp_zarr.LayoutError` naming the
tensor, the box and the ranks, raised on every rank with nothing committed.

Digests are crc32c of the copy's bytes on the host; a large copy on an accelerator is
digested where it lives (:func:`device_fingerprint`), so nothing large crosses to the host.

Replicas a layout marks as averaged (:attr:`~ucp_zarr.Placed.average`) may differ: the
tensor the layout's hooks combine them into (their mean, by default) is saved instead
(:func:`combine_replicas`, :func:`set_combined`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch

from ..format.codec import checksum
from ..errors import LayoutError
from .fragments import Fragment, flat_bytes
from .hooks import LayoutHooks
from ..layout import Box
from .planner import Replicated, SavePlan

DIGEST_COPY_BYTES = 16 << 20
"""Off-CPU copies up to this size are copied to the host for their digest."""

Digests = list[int]
"""The digests of this rank's copies of the replicated boxes of its part of the plan, in
the part's order (replicas, then their boxes): a few bytes per box to send."""


def replica_digests(plan: SavePlan, fragments: Mapping[str, Fragment]) -> Digests:
    """The digest of each box this rank holds that other ranks hold too (``plan``: this
    rank's part, :meth:`~ucp_zarr.protocol.planner.SavePlan.split`, which lists only boxes it holds)."""
    out: Digests = []
    for rep in plan.replicas:
        held = dict(fragments[rep.key].pieces)
        out += [fingerprint(held[box]) for box, _ in rep.boxes]
    return out


def check_replicas(plan: SavePlan, digests: list[Digests]) -> None:
    """Raise :class:`LayoutError` unless, for every replicated box of ``plan`` (the whole
    plan), every holder's digest is the same (``digests[rank]``: in the order of its part
    of ``plan``, so the boxes are walked once, in that order)."""
    pending = [iter(d) for d in digests]
    for rep in plan.replicas:
        for box, ranks in rep.boxes:
            groups: dict[int | None, list[int]] = defaultdict(list)
            for r in ranks:
                groups[next(pending[r], None)].append(r)
            if len(groups) > 1:
                raise LayoutError(_message(rep, box, sorted(groups.values())))
    extra = [r for r, rest in enumerate(pending) if next(rest, None) is not None]
    if extra:
        raise LayoutError(f"ranks {extra} sent digests of more replicated boxes than their parts of the plan list")


def _message(rep: Replicated, box: Box, groups: list[list[int]]) -> str:
    shown = " vs ".join(f"ranks {rs}" for rs in groups)
    holders = sorted(r for g in groups for r in g)
    where = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offset, box.shape)) + "]"
    if rep.rule:
        return (
            f"tensor {rep.key!r}: ranks {holders} all place {where} of it (rule {rep.rule!r}), so their copies "
            f"must be equal, but they differ ({shown} hold different values). Replicated parameters must hold "
            "the same value; if these ranks hold different layers or experts (pipeline stages, expert "
            "parallelism), the rules need a pipeline or experts entry that renumbers them; a parameter the rules "
            "list in 'pipeline_replicated' (or rename onto another) must be tied, equal on every stage that holds it"
        )
    if rep.plain:
        return (
            f"tensor {rep.key!r} is a plain tensor, so every rank must hold the same value, but its "
            f"copies differ ({shown} hold different values). Wrap per-rank state (RNG states, "
            "data positions) in ucp_zarr.PerRank(...), or make the replicas equal"
        )
    return (
        f"tensor {rep.key!r}: ranks {holders} all hold {where} of it, so they are replicas and must be "
        f"equal, but they differ ({shown}): two ranks claim the same part of the tensor with different "
        "values (check the global offsets and shapes of the fragments)"
    )


def fingerprint(t: torch.Tensor) -> int:
    """A digest of a tensor's bytes (crc32c on the host; for a large tensor elsewhere, see
    :func:`device_fingerprint`)."""
    t = t.detach()
    if t.dtype.is_complex:
        t = torch.view_as_real(t.contiguous())
    raw = flat_bytes(t)
    if t.device.type == "cpu" or raw.numel() <= DIGEST_COPY_BYTES:
        return checksum(memoryview(raw.cpu().numpy()))
    return device_fingerprint(raw)


def device_fingerprint(raw: torch.Tensor, block: int = 16 << 20) -> int:
    """A fingerprint of a flat ``uint8`` tensor computed where it lives: the sum of its bytes
    and of its bytes weighted by position (mod 65521), ``block`` bytes at a time, so that
    the temporaries stay about ``24 * block`` bytes whatever the tensor's size."""
    total = weighted = 0
    for start in range(0, raw.numel(), block):
        v = raw[start : start + block].to(torch.int64)
        pos = torch.arange(start + 1, start + v.numel() + 1, device=v.device) % 65521
        total += int(v.sum())
        weighted += int((v * pos).sum())
    return hash((total, weighted))


def combine_replicas(per_rank: list[dict[str, torch.Tensor]], hooks: LayoutHooks) -> dict[str, torch.Tensor]:
    """Each combined tensor (:attr:`~ucp_zarr.Placed.average`: replicas that may differ)
    as the layout's ``hooks`` combine the copies of the ranks holding it, in rank order."""
    copies: dict[str, list[torch.Tensor]] = {}
    for d in per_rank:
        for key, t in d.items():
            copies.setdefault(key, []).append(t)
    return {key: hooks.combine(key, ts) for key, ts in copies.items()}


def set_combined(fragments: dict[str, Fragment], combined: dict[str, torch.Tensor]) -> None:
    """Replace each combined fragment's tensor by the tensor its replicas combined into."""
    for key, t in combined.items():
        box, _ = fragments[key].pieces[0]
        fragments[key].pieces[0] = (box, t)
