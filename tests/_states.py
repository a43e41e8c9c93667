"""Global reference states (the oracle of the reshard tests) and the fragments layouts hold.

Everything here is deterministic and independent of ``ucp_zarr``'s own layout code: slabs
follow ``torch.chunk`` (``ceil(n / k)`` per part, the tail shorter or empty), flat ranges
are cut from one ``torch.cat`` of the flattened tensors, DTensor slices come from torch's
own ``distribute_tensor``.
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from typing import Any, Mapping

import torch

import ucp_zarr

SENTINEL = -777.0
"""What load targets are filled with, so that an element load never wrote is noticed."""


# --- reference tensors -----------------------------------------------------------------------


def ref_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """The same tensor in every process: seeded from ``(seed, name)``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-(2**20), 2**20, shape, generator=g, dtype=dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if bits_equal(actual, expected):
        return
    detail = f"{what}: got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
    if actual.shape == expected.shape and actual.dtype == expected.dtype:
        diff = (actual.detach().double() != expected.detach().double()).nonzero()
        detail += f"; {len(diff)} elements differ, first at {diff[0].tolist() if len(diff) else '?'}"
    raise AssertionError(detail)


# --- slabs (TP, Megatron-style Shard) --------------------------------------------------------


def bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``-style part ``index`` of ``n`` items in ``parts`` parts."""
    size = -(-n // parts)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def slab(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    lo, hi = bounds(t.shape[dim], parts, index)
    return t.narrow(dim, lo, hi - lo)


def shard_of(t: torch.Tensor, dim: int | None, parts: int, index: int, replica_id: int = 0) -> ucp_zarr.Shard:
    """A ``ucp_zarr.Shard`` holding a copy of part ``index`` of ``t`` along ``dim``
    (``dim=None``: the whole tensor, a replica)."""
    if dim is None:
        return ucp_zarr.Shard(t.clone(), tuple(t.shape), (0,) * t.dim(), replica_id)
    lo, _ = bounds(t.shape[dim], parts, index)
    offset = tuple(lo if d == dim else 0 for d in range(t.dim()))
    return ucp_zarr.Shard(slab(t, dim, parts, index).clone(), tuple(t.shape), offset, replica_id)


def shard_target(shape: tuple[int, ...], dtype: torch.dtype, dim: int | None, parts: int, index: int) -> ucp_zarr.Shard:
    """A load target like :func:`shard_of`, filled with :data:`SENTINEL`."""
    return shard_of(torch.full(shape, SENTINEL, dtype=dtype), dim, parts, index)


# --- flat ranges (ZeRO-1/2/3, distributed optimizers) ----------------------------------------


def flat_partition(shapes: Mapping[str, tuple[int, ...]], world: int, rank: int) -> tuple[dict[str, int], int, int]:
    """ZeRO's partition of one flattened buffer holding ``shapes`` in order: each tensor's
    offset in the buffer, and this rank's ``[lo, hi)`` (``ceil(total / world)`` each, the
    last partition shorter)."""
    offsets, pos = {}, 0
    for name, shape in shapes.items():
        offsets[name] = pos
        pos += math.prod(shape)
    lo, hi = bounds(pos, world, rank)
    return offsets, lo, hi


def flat_buffer(tensors: Mapping[str, torch.Tensor], world: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's partition of the flattened buffer of ``tensors`` (the expected data)."""
    _, lo, hi = flat_partition({k: tuple(v.shape) for k, v in tensors.items()}, world, rank)
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors.values()])
    return flat[lo:hi].clone()


def flat_fragments(
    buffer: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], world: int, rank: int
) -> dict[str, ucp_zarr.FlatShard]:
    """``ucp_zarr.FlatShard`` views into this rank's partition ``buffer``, one per tensor
    (an empty one where the partition misses the tensor)."""
    offsets, lo, hi = flat_partition(shapes, world, rank)
    assert buffer.numel() == hi - lo
    out = {}
    for name, shape in shapes.items():
        a, b = max(lo, offsets[name]), min(hi, offsets[name] + math.prod(shape))
        if a < b:
            out[name] = ucp_zarr.FlatShard(buffer[a - lo : b - lo], shape, a - offsets[name])
        else:
            out[name] = ucp_zarr.FlatShard(buffer[:0], shape, 0)
    return out


# --- DTensors --------------------------------------------------------------------------------


def dtensor_of(t: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """``t`` (identical on every rank) as a DTensor, sliced by torch itself, no communication."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.clone(), mesh, placements, src_data_rank=None)


def assert_dtensor_equals(actual: Any, expected: torch.Tensor, what: str) -> None:
    """Compare what this rank holds of DTensor ``actual`` with the slice torch computes from
    the global ``expected``; ``_StridedShard`` layouts are compared whole (a collective)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    expected = expected.to(actual.dtype)
    if any(isinstance(p, _StridedShard) for p in actual.placements):
        assert_bits_equal(actual.full_tensor(), expected, what)
        return
    local = dtensor_of(expected, actual.device_mesh, list(actual.placements)).to_local()
    assert_bits_equal(actual.to_local(), local, f"{what} (local part of {actual.placements})")


def full_copy(obj: Any) -> Any:
    """A nested state dict with every DTensor gathered whole (a collective: every rank must
    call it on the same structure) and every tensor copied to the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, Mapping):
        return {k: full_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_copy(v) for v in obj]
    return copy.deepcopy(obj)


def record_text(doc: Any) -> str:
    """A commit record edited by a test (``doc``, parsed) as text, its ``record_digest``
    recomputed as a consistent foreign writer would: so that the checks behind the digest
    are what the test reaches."""
    from ucp_zarr.format.integrity import RECORD_DIGEST, record_digest

    attrs = doc["attributes"]["ucp_zarr"]
    attrs[RECORD_DIGEST] = record_digest(attrs)
    return json.dumps(doc)
