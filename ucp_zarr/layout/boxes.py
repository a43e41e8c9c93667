"""Axis-aligned boxes (hyper-rectangles) of a global tensor: the unit of all layout math.

A box is an ``offset`` and a ``shape`` in global element coordinates. Everything here is
pure and I/O-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Box:
    """The elements ``offset[d] <= i[d] < offset[d] + shape[d]`` of a global tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"offset {self.offset} and shape {self.shape} differ in rank")
        if any(s < 0 for s in self.shape) or any(o < 0 for o in self.offset):
            raise ValueError(f"negative offset or shape in {self}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes, or None when they share no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= l for l, h in zip(lo, hi)) and self.ndim:
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

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
    """All index tuples of a grid with ``counts`` cells per dim, in C (row-major) order."""
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
