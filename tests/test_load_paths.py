"""Every read path of a load lands every element where it belongs, bit for bit.

A shard reaches its target by one of several paths (``io/arrayio.py``): read whole with the
chunks straight into the target, read whole into the staging buffer and copied chunk by
chunk, read whole and landed by one strided pass (column-block chunks), read in bands after
its index, or chunk runs after its index. Which one runs depends on the grid, the target's
box and strides, and the size thresholds. Here hypothesis draws all of them (the thresholds
too, lowered so that small arrays take the large arrays' paths) and checks each load against
the saved tensor, through ``load`` (whole, transposed and strided targets; ``Shard`` and
``FlatShard`` locals) and ``Checkpoint.read`` (a box into a view)."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import pytest
import torch

import ucp_zarr
from ucp_zarr import FlatShard, Shard
from ucp_zarr.io import arrayio
from ucp_zarr.layout import Box

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.int16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)  # (dense, whatever the strides)
    return flat.view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@st.composite
def _box(draw: Any, shape: tuple[int, ...]) -> Box:
    offset, size = [], []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        offset.append(lo)
        size.append(draw(st.integers(1, n - lo)))
    return Box(tuple(offset), tuple(size))


def _target(shape: tuple[int, ...], dtype: torch.dtype, form: str) -> torch.Tensor:
    """A target of ``shape`` filled with a sentinel: contiguous, transposed (dims reversed)
    or every other element of a larger buffer along the last dim."""
    fill = 7 if not dtype.is_floating_point else -3.5
    if form == "transposed":
        return torch.full(shape[::-1], fill, dtype=dtype).permute(*reversed(range(len(shape))))
    if form == "strided":
        return torch.full((*shape[:-1], 2 * shape[-1]), fill, dtype=dtype)[..., ::2]
    return torch.full(shape, fill, dtype=dtype)


@st.composite
def _case(draw: Any) -> dict[str, Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, [300, 48, 12][ndim - 1]), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    chunk_bytes = draw(st.sampled_from([16, 64, 256, 1024, 4096, 1 << 20]))
    shard_bytes = chunk_bytes * draw(st.sampled_from([1, 2, 4, 16, 1 << 20]))
    return {
        "shape": shape,
        "dtype": dtype,
        "chunk_bytes": chunk_bytes,
        "shard_bytes": shard_bytes,
        # the size thresholds: at their defaults, or low enough that small shards are read in
        # bands after their index, or that no shard is read in one request
        "staged": draw(st.sampled_from([arrayio.MAX_STAGED_BYTES, 4096, 256, 1])),
        "request": draw(st.sampled_from([arrayio.MAX_REQUEST_BYTES, 4096, 1])),
        "target": draw(st.sampled_from(["whole", "shard", "flat", "read"])),
        "form": draw(st.sampled_from(["contiguous", "transposed", "strided"])),
        "box": draw(_box(shape)),
        "flat": sorted(draw(st.lists(st.integers(0, math.prod(shape)), min_size=2, max_size=2))),
        "seed": draw(st.integers(0, 1000)),
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_case())
def test_every_read_path_lands_bit_exact(case: dict[str, Any]) -> None:
    shape, dtype = case["shape"], case["dtype"]
    saved = _values(shape, dtype, case["seed"])
    other = _values(shape, dtype, case["seed"] + 1)  # (a second array in the same checkpoint)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(arrayio, "MAX_STAGED_BYTES", case["staged"])
        mp.setattr(arrayio, "MAX_REQUEST_BYTES", case["request"])
        path = f"{tmp}/ck"
        ucp_zarr.save({"t": saved, "o": other}, path, chunk_bytes=case["chunk_bytes"], shard_bytes=case["shard_bytes"])
        box: Box = case["box"]
        if case["target"] == "whole":
            out = _target(shape, dtype, case["form"])
            ucp_zarr.load({"t": out, "o": torch.empty_like(other)}, path)
            assert _same(out, saved), case
        elif case["target"] == "shard":
            local = _target(box.shape, dtype, case["form"])
            ucp_zarr.load({"t": Shard(local, shape, box.offset)}, path, strict=False)
            assert _same(local, saved[box.slices()]), case
        elif case["target"] == "flat":
            start, stop = case["flat"]
            buf = _target((2 * (stop - start) + 1,), dtype, "contiguous")
            local = buf[1::2] if case["form"] != "contiguous" else buf[: stop - start]
            ucp_zarr.load({"t": FlatShard(local, shape, start)}, path, strict=False)
            assert _same(local, saved.reshape(-1)[start:stop]), case
        else:
            full = _target(shape, dtype, case["form"])
            ucp_zarr.open(path).read("t", box, out=full[box.slices()])
            assert _same(full[box.slices()], saved[box.slices()]), case
            outside = torch.ones(shape, dtype=torch.bool)
            outside[box.slices()] = False
            assert _same(full[outside], _target(shape, dtype, case["form"])[outside]), case  # nothing else written
