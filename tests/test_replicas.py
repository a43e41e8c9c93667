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


def _one_element_strided(rank: int, world: int, base: str) -> None:
    """Rank 0's local is a strided view; one element of it goes to rank 1's shard (alone, and
    as the boundary element of a ZeRO-style flat range crossing a row); and a strided
    one-element replica is compared."""
    import ucp_zarr

    one = torch.zeros(2)[::2]  # (torch calls it contiguous, with stride 2)
    one.fill_(0.0)
    ref = torch.arange(4.0)
    value = ucp_zarr.FlatShard(one, (4,), 0) if rank == 0 else ucp_zarr.FlatShard(ref[1:].clone(), (4,), 1)
    ucp_zarr.save({"x": value}, f"{base}/one")
    assert torch.equal(ucp_zarr.open(f"{base}/one").read("x"), ref)
    big = torch.arange(40000.0).reshape(2, 20000)
    if rank == 0:
        local = torch.zeros(2 * 20001)[::2]
        local.copy_(big.reshape(-1)[:20001])
        value = ucp_zarr.FlatShard(local, (2, 20000), 0)
    else:
        value = ucp_zarr.FlatShard(big.reshape(-1)[20001:].clone(), (2, 20000), 20001)
    ucp_zarr.save({"x": value}, f"{base}/row", chunk_bytes=4096)
    assert torch.equal(ucp_zarr.open(f"{base}/row").read("x"), big)
    replica = torch.full((4,), 5.0)[::2][:1]
    ucp_zarr.save({"s": ucp_zarr.Shard(replica, (1,), (0,), replica_id=rank)}, f"{base}/replica")
    assert torch.equal(ucp_zarr.open(f"{base}/replica").read("s"), torch.tensor([5.0]))


def test_a_one_element_strided_piece_is_sent_and_compared(tmp_path):
    """A one-element piece of a strided local sent to another rank's shard failed the save
    with torch's "stride(-1) must be 1 to view Float as Byte" naming no tensor: torch calls a
    one-element view contiguous whatever its stride, so ``contiguous()`` kept it strided."""
    run(2, _one_element_strided, str(tmp_path), timeout_s=60)
