"""Restart on whatever ranks are left: a job saves through the CheckpointManager and stops
(as a crash stops it), the next job starts on another number of ranks with ``load_latest``
and carries on; its losses equal the uninterrupted run's within fp32 rounding.

2 ranks -> 3 ranks (more ranks, 2 does not divide 3) -> 2 ranks (fewer, 2 does not divide 3),
all FSDP2 (DTensors sharded on dim 0, unevenly over 3 ranks), async saves every 2 steps,
keep_last=2.
"""

from __future__ import annotations

import json
import multiprocessing
from typing import Any, Callable

import torch.multiprocessing as mp
from _dist import _entry, free_port
from _manager_jobs import elastic_job, per_rank_load, per_rank_save

from ucp_zarr.examples.elastic_resume import FIRST_STEP_RTOL, LATER_STEPS_RTOL
from ucp_zarr.ops import CheckpointManager

STEPS = 12
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "ucp_zarr.api", "_manager_jobs"]


def run(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float) -> None:
    """``_dist.run`` from a forkserver that imported torch once (seconds per process saved)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)  # no-op once the server runs
    mp.start_processes(_entry, args=(world, free_port(), fn, args, timeout_s), nprocs=world, start_method="forkserver")


def _losses(path) -> tuple[int, dict[int, float]]:
    with open(path) as f:
        d = json.load(f)
    return d["start"], {int(k): v for k, v in d["losses"].items()}


def _check_continues(reference: dict[int, float], resumed: dict[int, float], start: int) -> list[float]:
    """The resumed losses against the reference: the first step within FIRST_STEP_RTOL (same
    weights, other fp32 summation order), later ones within LATER_STEPS_RTOL (see
    ucp_zarr.examples.elastic_resume for why and for what a broken resume differs by)."""
    rels = []
    for step, loss in sorted(resumed.items()):
        rel = abs(loss - reference[step]) / abs(reference[step])
        rels.append(rel)
        assert rel <= (FIRST_STEP_RTOL if step == start else LATER_STEPS_RTOL), (step, loss, reference[step], rel)
    return rels


def test_restart_on_more_then_fewer_ranks(tmp_path):
    root = str(tmp_path / "ckpt")
    # 1. two ranks train; the manager saves steps 2 and 4; the job "crashes" after step 5
    #    (the same processes train on to STEPS without saving: the uninterrupted reference)
    run(2, elastic_job, root, str(tmp_path / "ref.json"), STEPS, 5, False, timeout_s=120)
    _, reference = _losses(tmp_path / "ref.json")
    assert sorted(reference) == list(range(STEPS))
    assert CheckpointManager(root).steps() == [2, 4]
    # 2. three ranks resume from step 4 (redoing step 4), save 6 and 8, "crash" after step 9
    run(3, elastic_job, root, str(tmp_path / "three.json"), STEPS, 9, True, timeout_s=120)
    start3, three = _losses(tmp_path / "three.json")
    assert start3 == 4 and sorted(three) == list(range(4, 9))
    assert CheckpointManager(root).steps() == [6, 8]  # keep_last=2
    # 3. two ranks resume from step 8 and finish
    run(2, elastic_job, root, str(tmp_path / "two.json"), STEPS, STEPS, True, timeout_s=120)
    start2, two = _losses(tmp_path / "two.json")
    assert start2 == 8 and sorted(two) == list(range(8, STEPS))
    assert CheckpointManager(root).steps() == [10, 12]
    rels = _check_continues(reference, three, 4) + _check_continues(reference, two, 8)
    print(f"max relative loss difference to the uninterrupted run: {max(rels):.2e}")


def test_a_load_failing_on_a_new_rank_fails_on_every_rank(tmp_path):
    """Per-rank state saved by 2 ranks, load_latest on 3 (strict): rank 2 has no copy and
    raises PerRankStateError; ranks 0 and 1 raise too, naming it (before: they returned with
    their state filled and would wait at the next collective for a rank that had failed)."""
    root = str(tmp_path / "ckpt")
    run(2, per_rank_save, root, timeout_s=120)
    run(3, per_rank_load, root, str(tmp_path / "got"), timeout_s=120)
    got = [json.loads((tmp_path / f"got_{r}.json").read_text()) for r in range(3)]
    assert got[2] == "PerRankStateError" and "loaded" not in got, got
