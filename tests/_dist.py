"""Run a function on N real processes with a gloo process group (torch.multiprocessing spawn)."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, timeout_s: float | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A finished rank leaves without the interpreter's teardown, where gloo's native threads
    # were seen to abort a finished process under load (exit -6, "terminate called without an
    # active exception"); a failure above still exits through the normal path, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; re-raise the first failure.
    ``timeout_s`` bounds every collective (default: torch's 30 minutes)."""
    mp.start_processes(
        _entry, args=(world, free_port(), fn, args, timeout_s), nprocs=world, start_method="spawn", join=True
    )
