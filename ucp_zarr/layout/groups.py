"""Interleaved per-group fused tensors (pure, no torch): ``G`` groups along one dim, each
``[sub_1; ...; sub_k]`` of the same sizes.

Megatron-core's ``linear_qkv`` is one: per query group, the group's query heads, then its key
head, then its value head (``[ng, (np/ng + 2) * hn, h]``). The consolidated tensor is the TP=1
tensor itself, the groups one after another; TP rank ``r`` of ``t`` holds the contiguous block
``[r * n/t, (r + 1) * n/t)`` (``n = G * sum(sizes)``): ``G/t`` whole groups when ``t`` divides
``G``, the ``r mod (t/G)``-th of ``t/G`` equal parts of group ``r // (t/G)`` when ``G`` divides
``t``. Sub-parameter ``j`` of the whole model (all query heads, say) is the ``j``-th block of every
group, in group order (:func:`sub_ranges`).
"""

from __future__ import annotations

from typing import Sequence

from .pieces import Piece, PieceError, split


def check_degree(groups: int, sizes: Sequence[int], size: int) -> None:
    """Raise :class:`PieceError` unless ``size`` ranks can split ``groups`` groups of
    ``sizes``: each rank whole groups (``size`` divides ``groups``), or an equal part of one
    group (``groups`` divides ``size`` and the parts are whole rows)."""
    if groups < 1 or size < 1 or not sizes or min(sizes) < 1:
        raise PieceError(f"{groups} groups of sizes {list(sizes)} over {size} ranks: need >= 1 of each")
    per_group = sum(sizes)
    if size <= groups:
        if groups % size:
            raise PieceError(f"{groups} groups cannot be split evenly over {size} ranks")
    elif size % groups or per_group % (size // groups):
        raise PieceError(
            f"{groups} groups of {per_group} rows cannot be split over {size} ranks: {size} must be a multiple "
            f"of {groups} and {per_group} a multiple of {size} // {groups}"
        )


def grouped(
    local_shape: Sequence[int], dim: int, groups: int, sizes: Sequence[int], rank: int, size: int
) -> tuple[tuple[int, ...], list[Piece]]:
    """Rank ``rank`` of ``size`` holds its contiguous block of the groups along ``dim``.
    Returns the consolidated shape and the pieces."""
    check_degree(groups, sizes, size)
    local_shape = tuple(local_shape)
    total = groups * sum(sizes)
    if not 0 <= dim < len(local_shape) or local_shape[dim] * size != total:
        raise PieceError(
            f"a local tensor of shape {list(local_shape)} is not 1/{size} of {groups} groups of sizes "
            f"{list(sizes)} ({total} along dim {dim})"
        )
    return split(local_shape, dim, rank, size)


def sub_ranges(groups: int, sizes: Sequence[int], index: int) -> list[tuple[int, int]]:
    """The ranges ``[start, stop)`` along the fused dim that sub-parameter ``index`` occupies
    in the consolidated tensor, one per group in group order: concatenated, they are that
    sub-parameter of the whole model (all query heads, all key heads, ...)."""
    if not 0 <= index < len(sizes):
        raise PieceError(f"sub-parameter {index} of {len(sizes)}")
    per_group, before = sum(sizes), sum(sizes[:index])
    return [(g * per_group + before, g * per_group + before + sizes[index]) for g in range(groups)]
