"""Flat ranges: a 1-D fragment of the row-major flattened global tensor, as ZeRO holds it.

A flat range ``[start, stop)`` of a tensor of ``shape`` is decomposed into at most
``2 * ndim - 1`` boxes, each contiguous in row-major order, in flat order: a partial
trailing part of the first row, a block of whole rows, a partial leading part of the last
row (recursively along the trailing dims).
"""

from __future__ import annotations

import math
from typing import Sequence

from .boxes import Box


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes, in flat order, that make up elements ``[start, stop)`` of ``shape``."""
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {total} elements {list(shape)}")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    return _boxes(shape, start, stop)


def _boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    row = math.prod(shape[1:])
    rest = shape[1:]

    def in_row(i: int, lo: int, hi: int) -> list[Box]:
        if not rest:
            return [Box((i,), (1,))]
        return [Box((i, *x.offset), (1, *x.shape)) for x in _boxes(rest, lo, hi)]

    first, last = a // row, (b - 1) // row
    if first == last:
        if b - a == row:
            return [Box((first,) + (0,) * len(rest), (1, *rest))]
        return in_row(first, a - first * row, b - first * row)
    out: list[Box] = []
    if a % row:
        out += in_row(first, a % row, row)
        first += 1
    tail: list[Box] = []
    if b % row:
        tail = in_row(last, 0, b % row)
        last -= 1
    if last >= first:
        out.append(Box((first,) + (0,) * len(rest), (last - first + 1, *rest)))
    return out + tail


def box_flat_start(shape: Sequence[int], box: Box) -> int:
    """The flat (row-major) index of a box's first element."""
    idx = 0
    for o, n in zip(box.offset, shape):
        idx = idx * n + o
    return idx
