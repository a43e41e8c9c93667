"""Every box that several ranks hold is written only after their copies are shown equal
(issue 18): before, only plain tensors were compared, so two ``Shard``s of one box with
different values, or two ranks' ``FlatShard``s of one range, saved the first rank's copy
silently. Real 2-process gloo jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _dist import run
from torch.distributed.tensor import Replicate, Shard as DShard, distribute_tensor, init_device_mesh

import ucp_zarr
from ucp_zarr import FlatShard, Shard


def _expect_layout_error(path: str, state: dict, match: str) -> None:
    with pytest.raises(ucp_zarr.LayoutError, match=match):
        ucp_zarr.save(state, path)
    assert not Path(path, "zarr.json").exists() and not any(Path(path).rglob("c/*"))  # nothing committed or left


def _differing_shards(rank: int, world: int, path: str) -> None:
    w = torch.arange(32.0).reshape(8, 4)
    state = {"w": Shard(w + (rank == 1), (8, 4), (0, 0))}  # both ranks claim the whole tensor, with different values
    _expect_layout_error(path, state, r"tensor 'w': ranks \[0, 1\] all hold \[0:8, 0:4\].*differ \(ranks \[0\] vs ranks \[1\]\)")


def _differing_flat(rank: int, world: int, path: str) -> None:
    flat = torch.arange(12.0) * (1 + rank)  # both ranks hold the whole flattened range
    _expect_layout_error(path, {"w": FlatShard(flat, (3, 4), 0)}, r"tensor 'w'.*differ")


def _differing_dtensor_replicas(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    local = torch.full((4, 4), float(rank))
    dt = torch.distributed.tensor.DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    _expect_layout_error(path, {"w": dt}, r"tensor 'w'.*differ")


def _equal_replicas_save(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(64.0).reshape(8, 8)
    state = {
        "s": Shard(w, (8, 8), (0, 0)),  # both ranks hold all of it, equal
        "d": distribute_tensor(w, mesh, [Replicate()]),
        "f": distribute_tensor(w, mesh, [DShard(0)]),
        "plain": w,
    }
    ucp_zarr.save(state, path)
    ck = ucp_zarr.open(path)
    ck.verify()
    assert all(torch.equal(ck.read(k), w) for k in ("s", "d", "f", "plain"))


def _all(rank: int, world: int, base: str) -> None:
    for job in (_differing_shards, _differing_flat, _differing_dtensor_replicas, _equal_replicas_save):
        job(rank, world, os.path.join(base, job.__name__))


def test_replicas_are_compared_for_every_kind_of_fragment(tmp_path):
    run(2, _all, str(tmp_path), timeout_s=120)
