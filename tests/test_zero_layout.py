"""Property tests of ZeRO's flat partition math (layout/zero.py) against a direct
simulation: parameters flattened into one vector per group, cut into per-rank partitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr.layout.zero import ZeroLayoutError, pieces_in, zero3_group_sizes, zero3_pieces, zero12_pieces

shapes_st = st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)


def named(groups: list[list[tuple[int, ...]]]) -> list[dict[str, tuple[int, ...]]]:
    return [{f"g{g}.p{i}": s for i, s in enumerate(group)} for g, group in enumerate(groups)]


def simulate_zero12(shapes: list[dict[str, tuple[int, ...]]], world: int, pads: list[list[int]]):
    """What DeepSpeed does: per group, [p0, pad0, p1, pad1, ...] padded to world equal partitions;
    returns (values per param, partitions[rank][group], mappings[rank][group])."""
    values, parts, maps = {}, [[] for _ in range(world)], [[] for _ in range(world)]
    for g, group in enumerate(shapes):
        flat, where = [], {}
        for (name, shape), pad in zip(group.items(), pads[g]):
            v = torch.randn(math.prod(shape))
            values[name] = v.reshape(shape)
            where[name] = sum(x.numel() for x in flat)
            flat += [v, torch.full((pad,), float("nan"))]
        vec = torch.cat(flat) if flat else torch.zeros(0)
        size = -(-vec.numel() // world) if vec.numel() else 0
        vec = torch.cat([vec, torch.full((size * world - vec.numel(),), float("nan"))])
        for r in range(world):
            lo, hi = r * size, (r + 1) * size
            parts[r].append(vec[lo:hi])
            m = {}
            for name, shape in group.items():
                a, b = where[name], where[name] + math.prod(shape)
                if min(b, hi) > max(a, lo):
                    m[name] = (min(b, hi) - max(a, lo), max(a, lo) - lo)
            maps[r].append(m)
    return values, parts, maps


def assemble(pieces, parts, shape):
    out = torch.full((math.prod(shape),), float("nan"))
    for p in pieces:
        out[p.param_start:p.param_start + p.numel] = parts[p.rank][p.group][p.start:p.start + p.numel]
    return out.reshape(shape)


@settings(max_examples=200, deadline=None)
@given(shapes_st, st.integers(1, 5), st.data())
def test_zero12_pieces_rebuild_every_parameter(groups, world, data) -> None:
    shapes = named([groups[: len(groups) // 2 + 1], groups[len(groups) // 2 + 1:]])
    pads = [[data.draw(st.integers(0, 3)) for _ in g] for g in shapes]
    values, parts, maps = simulate_zero12(shapes, world, pads)
    pieces = zero12_pieces(maps, shapes)
    for g in shapes:
        for name, shape in g.items():
            assert torch.equal(assemble(pieces[name], parts, shape), values[name]), name
            assert [p.rank for p in pieces[name]] == sorted(p.rank for p in pieces[name])


@settings(max_examples=200, deadline=None)
@given(shapes_st, st.integers(1, 5))
def test_zero3_pieces_rebuild_every_parameter(groups, world) -> None:
    shapes = named([groups])
    values = {n: torch.randn(s) for n, s in shapes[0].items()}
    sizes = zero3_group_sizes(shapes, world)
    parts = []
    for r in range(world):
        chunks = []
        for n, s in shapes[0].items():
            part = -(-math.prod(s) // world)
            padded = torch.cat([values[n].reshape(-1), torch.full((part * world - math.prod(s),), float("nan"))])
            chunks.append(padded[r * part:(r + 1) * part])
        parts.append([torch.cat(chunks) if chunks else torch.zeros(0)])
        assert parts[-1][0].numel() == sizes[0]
    pieces = zero3_pieces(shapes, world)
    for n, s in shapes[0].items():
        assert torch.equal(assemble(pieces[n], parts, s), values[n])
        for a in range(0, math.prod(s) + 1):
            got = pieces_in(pieces[n], a, math.prod(s))
            assert sum(b - x for _, x, b in got) == math.prod(s) - a


def test_partitions_that_do_not_add_up_are_refused() -> None:
    shapes = [{"w": (4, 3)}]
    with pytest.raises(ZeroLayoutError, match=r"'w' \(group 0, shape \[4, 3\]\) has 12 elements, but ranks \[0, 1\] hold 10"):
        zero12_pieces([[{"w": (6, 0)}], [{"w": (4, 0)}]], shapes)
    with pytest.raises(ZeroLayoutError, match="overlap"):
        zero12_pieces([[{"a": (3, 0), "b": (3, 2)}]], [{"a": (3,), "b": (3,)}])
    with pytest.raises(ZeroLayoutError, match="rank 1 has 0 parameter groups"):
        zero12_pieces([[{"w": (12, 0)}], []], shapes)
