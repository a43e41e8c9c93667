"""Ranks of one process group that call different collective operations at once (one saving
while another loads, or saves in the background), or one of which fails before the first
collective (its arguments, its store): before, each waited in its own next collective until
the group's timeout and ended in raw gloo errors (the others never learnt of the failing
rank's error). Now every rank raises at once, naming what happened. Real 2-process gloo
jobs; the group's timeout (120 s) is far above what the test allows each rank (20 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _dist import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

import ucp_zarr

STATE = {"a": torch.arange(4.0), "step": 3}


def _sharded(world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return {"a": DTensor.from_local(torch.zeros(4 // world), mesh, [DShard(0)], run_check=False), "step": 0}


def _mixed(rank: int, world: int, base: str, other: str) -> None:
    start = time.monotonic()
    path = Path(base) / ("ck" if rank == 1 and other == "load" else "new")
    try:
        if rank == 0:
            ucp_zarr.save(_sharded(world), path)
        elif other == "load":
            ucp_zarr.load(_sharded(world), path)
        else:
            ucp_zarr.async_save(_sharded(world), path).result()
    except ucp_zarr.OptionError as e:
        assert "different operations" in str(e) and other in str(e), str(e)
        assert time.monotonic() - start < 20, "refused, but only after a collective timed out"
        assert not (Path(base) / "new").exists(), "a refused save left something at its path"
        return
    raise AssertionError(f"rank {rank}: returned, though the other rank called {other}")


@pytest.mark.parametrize("other", ["load", "async_save"])
def test_ranks_calling_different_operations_are_refused_at_once(tmp_path: Path, other: str) -> None:
    ucp_zarr.save(STATE, tmp_path / "ck")
    run(2, _mixed, str(tmp_path), other, timeout_s=120)


def _fails_before(rank: int, world: int, base: str) -> None:
    start = time.monotonic()
    options = {"storage_options": {"bogus": 1}} if rank == 1 else {}
    try:
        ucp_zarr.save(_sharded(world), Path(base) / "ck", **options)
    except ucp_zarr.SaveError as e:
        assert rank == 0 and "rank 1" in str(e), f"rank {rank}: {e!r}"
    except ucp_zarr.OptionError as e:
        assert rank == 1 and "bogus" in str(e), f"rank {rank}: {e!r}"
    else:
        raise AssertionError(f"rank {rank}: the save returned, though rank 1 could not open its store")
    assert time.monotonic() - start < 20, f"rank {rank}: failed only after a collective timed out"
    assert not (Path(base) / "ck").exists()


def test_a_rank_failing_before_the_first_collective_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    run(2, _fails_before, str(tmp_path), timeout_s=120)
