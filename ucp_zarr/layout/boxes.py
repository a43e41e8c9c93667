"""Axis-aligned boxes (hyper-rectangles) of a global tensor: the unit of all layout math.

A box is an ``offset`` and a ``shape`` in global element coordinates. Everything here is
pure and I/O-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Box:
    """The elements ``offset[d] <= i[d] < offset[d] + shape[d]`` of a global tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"offset {self.offset} and shape {self.shape} differ in rank")
        if min(self.shape, default=0) < 0 or min(self.offset, default=0) < 0:
            raise ValueError(f"negative offset or shape in {self}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes, or None when they share no element."""
        lo: list[int] = []
        size: list[int] = []
        for a, b, c, d in zip(self.offset, other.offset, self.stop, other.stop):
            low, high = (a if a > b else b), (c if c < d else d)
            if high <= low:
                return None
            lo.append(low)
            size.append(high - low)
        return Box(tuple(lo), tuple(size))

    def contains(self, other: "Box") -> bool:
        return all(a <= b for a, b in zip(self.offset, other.offset)) and all(
            a >= b for a, b in zip(self.stop, other.stop)
        )

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


def grid_indices(counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """All index tuples of a grid with ``counts`` cells per dim, in C (row-major) order,
    lazily (a forged count of 2**62 costs nothing until iterated)."""
    if any(c == 0 for c in counts):
        return
    idx = [0] * len(counts)
    while True:
        yield tuple(idx)
        d = len(counts) - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < counts[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return
