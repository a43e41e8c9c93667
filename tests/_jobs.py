"""Run a command as a job of its own (its own process group: a timeout kills every process it
started, such as the ranks a launcher spawned) and fail with its output unless it succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

JOB_ENV_DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Variables of an enclosing distributed job that must not leak into a new one."""
TESTS = Path(__file__).parent


def run_job(args: list[str], cwd: Path, *, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """Run ``args`` in ``cwd`` (the tests folder on ``PYTHONPATH``, one OpenMP thread per
    process, no Hugging Face downloads); its stdout."""
    base = {k: v for k, v in os.environ.items() if k not in JOB_ENV_DROPPED}
    base |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), base.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(args, cwd=cwd, env=base | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{args} ran over {timeout} s:\n{out[-3000:]}{err[-6000:]}") from None
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{out[-3000:]}{err[-6000:]}"
    return out
