"""A load that fails on one rank fails on every rank (``ucp_zarr.load`` is a collective):
before, the failing rank raised and the others returned, filled, into their next collective
(a hang) or into training resumed while the failing rank started fresh. The failing rank
raises its own error; the others a ``SaveError`` naming it. Real 3-process gloo jobs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from _dist import run

import ucp_zarr


def _state() -> dict:
    return {"a": torch.arange(6.0), "b": torch.arange(4.0), "step": 7}


def _one_rank_fails(rank: int, world: int, base: str, case: str) -> None:
    ck = Path(base) / "ck"
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()}
    options: dict = {}
    failing = {"strict": 0, "read": 1, "open": 2}[case]
    if case == "strict" and rank == failing:
        target["extra"] = torch.zeros(2)  # (a key the checkpoint lacks, on this rank only)
    if case == "read":  # each rank reads one tensor; rank 1's is corrupt
        target = {"b": target["b"]} if rank == failing else {"a": target["a"]}
        options["strict"] = False
    if case == "open" and rank == failing:
        options["hmac_key"] = b"k" * 32  # (the checkpoint is unsigned: this rank refuses it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ucp_zarr.load(target, ck, **options)
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
def test_a_load_failing_on_one_rank_fails_on_every_rank(tmp_path: Path, case: str) -> None:
    ucp_zarr.save(_state(), tmp_path / "ck")
    if case == "read":
        ck = ucp_zarr.open(tmp_path / "ck")
        shard = next((tmp_path / "ck" / ck.array_path("b") / "c").iterdir())
        raw = bytearray(shard.read_bytes())
        raw[0] ^= 1
        shard.write_bytes(bytes(raw))
    run(3, _one_rank_fails, str(tmp_path), case, timeout_s=60)
