"""A sharded load that fails on one rank fails on every rank (``ucp_zarr.load`` of DTensors,
``Shard``, ``FlatShard`` or placed tensors is a collective): before, the failing rank raised
and the others returned, filled, into their next collective (a hang) or into training
resumed while the failing rank started fresh. The failing rank raises its own error; the
others a ``SaveError`` naming it. A load of whole tensors stays one rank's own, as
``torch.load`` is. Real 3-process gloo jobs."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

import ucp_zarr

STATE = {"a": torch.arange(6.0), "step": 7}


def _target(rank: int, world: int) -> dict:
    """``a`` as a DTensor sharded over the ranks (made without a collective)."""
    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(6 // world)
    return {"a": DTensor.from_local(local, mesh, [DShard(0)], run_check=False), "step": 0}


def _one_rank_fails(rank: int, world: int, base: str, case: str) -> None:
    target = _target(rank, world)
    options: dict = {}
    failing = {"strict": 0, "read": 1, "open": 2}[case]
    if case == "strict" and rank == failing:
        target["extra"] = torch.zeros(2)  # (a key the checkpoint lacks, on this rank only)
    if case == "open" and rank == failing:
        options["hmac_key"] = b"k" * 32  # (the checkpoint is unsigned: this rank refuses it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ucp_zarr.load(target, Path(base) / "ck", **options)  # (case "read": only rank 1's chunk is corrupt)
        except ucp_zarr.SaveError as e:
            assert rank != failing, f"rank {rank}: its own error expected, got {e!r}"
            assert f"rank {failing}: " in str(e) and "1 of 3 ranks" in str(e), str(e)
            return
        except ucp_zarr.CheckpointError as e:
            assert rank == failing, f"rank {rank}: {e!r}"
            expected = {"strict": ucp_zarr.KeyMismatchError, "read": ucp_zarr.CorruptChunkError,
                        "open": ucp_zarr.AuthenticationError}[case]
            assert isinstance(e, expected), repr(e)
            return
    raise AssertionError(f"rank {rank}: the load returned, though rank {failing}'s failed")


@pytest.mark.parametrize("case", ["strict", "read", "open"])
def test_a_sharded_load_failing_on_one_rank_fails_on_every_rank(tmp_path: Path, case: str) -> None:
    ucp_zarr.save(STATE, tmp_path / "ck", chunk_bytes=4)  # (a chunk per element: 4 bytes and its crc32c)
    if case == "read":
        shard = next((tmp_path / "ck" / ucp_zarr.open(tmp_path / "ck").array_path("a") / "c").iterdir())
        raw = bytearray(shard.read_bytes())
        raw[2 * 8] ^= 1  # (element 2's chunk: rank 1 reads elements 2 and 3)
        shard.write_bytes(bytes(raw))
    run(3, _one_rank_fails, str(tmp_path), case, timeout_s=60)


def _alone(rank: int, world: int, base: str) -> None:
    if rank == 0:  # a load of whole tensors waits for no other rank
        got = ucp_zarr.load({"a": torch.zeros(6), "step": 0}, Path(base) / "ck")
        assert torch.equal(got["a"], STATE["a"]) and got["step"] == 7


def test_a_load_of_whole_tensors_is_one_ranks_own(tmp_path: Path) -> None:
    ucp_zarr.save(STATE, tmp_path / "ck")
    run(3, _alone, str(tmp_path), timeout_s=60)


def _other_paths(rank: int, world: int, base: str) -> None:
    target = _target(rank, world)
    path = Path(base) / ("other" if rank == 1 else "ck")
    with pytest.raises(ucp_zarr.OptionError, match=r"the ranks opened different checkpoints \(rank 0: .*ck \(save "
                                                   r"[0-9a-f]{32}\); rank 1: .*other .*pass the same path on every rank"):
        ucp_zarr.load(target, path)
    assert not target["a"].to_local().any()  # (nothing read)
    same = Path(base) / ("copy" if rank == 1 else "ck")  # (another path to the same checkpoint: loads)
    assert torch.equal(ucp_zarr.load(target, same)["a"].full_tensor(), STATE["a"])


def test_ranks_that_pass_different_checkpoints_are_refused(tmp_path: Path) -> None:
    """A sharded load whose rank 1 passed another checkpoint's path filled each rank's part
    from its own (the replicated state then differed between ranks, nothing said): refused
    on every rank, naming each rank's checkpoint; a copy of the same save loads."""
    ucp_zarr.save(STATE, tmp_path / "ck")
    ucp_zarr.save({"a": STATE["a"] + 100, "step": 8}, tmp_path / "other")
    shutil.copytree(tmp_path / "ck", tmp_path / "copy")
    run(3, _other_paths, str(tmp_path), timeout_s=60)
