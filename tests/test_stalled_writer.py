"""A writer that stalls past its lease writes nothing after a successor took over (issue 18).

Trials: a process saves to a path; it is stopped (SIGSTOP) at a random point of its save
(half the trials at a random time from outside, half by itself right after its fence let a
random shard's write go on, the narrowest window);
once its lease has lapsed another save takes the path over (``overwrite_incomplete=True``,
as an operator would for a hung job) and commits; the first process is continued
(SIGCONT). The successor's checkpoint must still verify bit-exactly, and the stalled save
must raise (it did not save), never return success.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ucp_zarr

HERE = Path(__file__).resolve().parent
LEASE_S = 2.0
SHARDS = 64
"""Shards one save writes (8 tensors of 8 one-chunk shards)."""


def _wait_stopped(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("the saving process never stopped itself")


def _successor_state(value: float) -> dict:
    state = {f"t{i}": torch.full((32, 64), value) for i in range(8)}
    state["step"] = int(value)
    return state


def _holds(path: Path, value: float) -> bool:
    ck = ucp_zarr.open(path)
    try:
        ck.verify()
    except ucp_zarr.CorruptChunkError:
        return False
    return all(torch.equal(ck.read(f"t{i}"), torch.full((32, 64), value)) for i in range(8)) and ck.metadata["step"] == int(value)


def run_trials(tmp_path: Path, trials: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen(
        [sys.executable, str(HERE / "_stall_job.py"), str(LEASE_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    counts: dict[str, float] = {"trials": 0, "taken_over": 0, "stalled_won": 0, "successors_corrupted": 0, "stalled_returned_success": 0}
    try:
        assert json.loads(job.stdout.readline())["ready"]
        start = time.monotonic()  # an unstopped save: how long one takes (stops land anywhere in it)
        job.stdin.write(f"{tmp_path / 'warm-up'} 1 -1\n")
        job.stdin.flush()
        assert json.loads(job.stdout.readline())["ok"]
        duration = time.monotonic() - start
        counts["save_s"] = round(duration, 3)
        for i in range(trials):
            path = tmp_path / f"ck{i}"
            stop_at = rng.randrange(SHARDS) if i % 2 else -1
            job.stdin.write(f"{path} 1 {stop_at}\n")
            job.stdin.flush()
            if stop_at < 0:
                time.sleep(rng.uniform(0.0, duration))
                job.send_signal(signal.SIGSTOP)
            else:
                _wait_stopped(job.pid)
            time.sleep(LEASE_S * 1.3)  # its lease lapses
            try:
                ucp_zarr.save(_successor_state(2.0), path, overwrite_incomplete=True, chunk_bytes=1024, shard_bytes=1024)
                took_over = True
            except ucp_zarr.CheckpointExistsError:  # the stalled save had committed before it stopped
                took_over = False
            job.send_signal(signal.SIGCONT)
            stalled = json.loads(job.stdout.readline())
            counts["trials"] += 1
            if took_over:
                counts["taken_over"] += 1
                counts["successors_corrupted"] += not _holds(path, 2.0)
                counts["stalled_returned_success"] += bool(stalled["ok"])
            else:
                counts["stalled_won"] += 1
                assert stalled["ok"] and _holds(path, 1.0)
    finally:
        job.kill()
        job.wait()
    return counts


@pytest.mark.parametrize(
    "trials", [pytest.param(4, id="4"), pytest.param(24, id="24", marks=pytest.mark.long)]
)
def test_a_stalled_writer_never_corrupts_its_successor(tmp_path, trials):
    counts = run_trials(tmp_path, trials)
    print(counts)
    assert counts["successors_corrupted"] == 0 and counts["stalled_returned_success"] == 0, counts
    assert counts["taken_over"] > 0, counts
