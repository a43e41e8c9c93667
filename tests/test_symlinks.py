"""Nothing is deleted through a symbolic link: a link named like a staging copy beside a
checkpoint, a linked array folder inside a step retention retires, a step folder that is a link
(a checkpoint linked into a run). Before, each deleted files of the checkpoint the link named
(another user's, outside the run): its commit record, or all of it, reporting success. The
victims here are checkpoints of their own, compared byte for byte."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

import ucp_zarr
from ucp_zarr import CheckpointManager


def _state(v: int) -> dict:
    return {"model": {"w": torch.full((3, 4), float(v))}, "step": v}


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _victim(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    victim = tmp_path / "victim"
    ucp_zarr.save(_state(7), victim)
    return victim, _snapshot(victim)


def test_a_link_named_like_a_staging_copy_is_left_alone(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path)
    os.symlink(victim, tmp_path / (".ck.ucp_zarr-" + "a" * 32))
    ucp_zarr.save(_state(1), tmp_path / "ck")
    ucp_zarr.save(_state(2), tmp_path / "ck", overwrite=True)
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(victim, root / (".step_00000001.ucp_zarr-" + "b" * 32))
    manager = CheckpointManager(str(root), keep_last=1)
    for step in (1, 2):
        manager.save(step, _state(step))
    assert manager.history()[-1].retention_error is None
    assert _snapshot(victim) == before and ucp_zarr.read_state_dict(victim)["step"] == 7
    assert ucp_zarr.read_state_dict(tmp_path / "ck")["step"] == 2


def test_retention_deletes_nothing_through_a_linked_array_folder(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1)
    manager.save(1, _state(7))
    step1 = Path(manager.path(1))
    moved = tmp_path / "elsewhere"
    os.rename(step1 / "w", moved)  # (its arrays moved to another disk and linked back)
    os.symlink(moved, step1 / "w")
    before = _snapshot(moved)
    assert torch.equal(ucp_zarr.read_state_dict(step1)["model"]["w"], _state(7)["model"]["w"])
    assert manager.save(2, _state(2)).deleted == (1,)
    assert _snapshot(moved) == before and manager.steps() == [2]


def test_retention_of_a_linked_step_removes_the_link_only(tmp_path: Path) -> None:
    victim, before = _victim(tmp_path)
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(victim, root / "step_00000001")  # (resuming from a checkpoint linked in)
    manager = CheckpointManager(str(root), keep_last=1)
    assert manager.latest() == 1
    assert manager.save(2, _state(2)).deleted == (1,)
    assert sorted(os.listdir(root)) == ["step_00000002"] and _snapshot(victim) == before
