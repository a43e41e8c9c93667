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
    """What DeepSpeed does: per group [p0, pad0, p1, pad1, ..., p_last], padded to a multiple
    of 2 * world and cut into world equal partitions; returns (values per param, partitions)."""
    values, parts = {}, [[] for _ in range(world)]
    for g, group in enumerate(shapes):
        flat = []
        for i, ((name, shape), pad) in enumerate(zip(group.items(), pads[g])):
            v = torch.randn(math.prod(shape))
            values[name] = v.reshape(shape)
            flat.append(v)
            if i < len(group) - 1:
                flat.append(torch.full((pad,), float("nan")))
        vec = torch.cat(flat) if flat else torch.zeros(0)
        padded = -(-vec.numel() // (2 * world)) * 2 * world
        vec = torch.cat([vec, torch.full((padded - vec.numel(),), float("nan"))])
        size = padded // world
        for r in range(world):
            parts[r].append(vec[r * size:(r + 1) * size])
    return values, parts


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
    values, parts = simulate_zero12(shapes, world, pads)
    pieces = zero12_pieces(shapes, world, pads)
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


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ZeroLayoutError, match="group 0: 1 alignment paddings for 2 parameters"):
        zero12_pieces([{"a": (3,), "b": (3,)}], 2, [[0]])
    with pytest.raises(ZeroLayoutError, match="world size 0"):
        zero3_pieces([{"a": (3,)}], 0)
