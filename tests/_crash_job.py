"""One rank of a 4-process save that may be killed (SIGKILL) at a chosen point: the worker
of ``test_crash_consistency.py``. Kept in its own module so that forkserver children import
it (and torch, and ucp_zarr) once, in the server.

The state each rank saves is a function of (rank, generation), so the test can rebuild the
expected global state of any generation without the processes.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

import ucp_zarr
from ucp_zarr.io.local import LocalStore

WORLD = 4
ROWS, COLS = 64, 1024  # 256 KiB, 16 rows per rank
FLAT = 1000  # a (40, 25) tensor saved as flat ranges cutting rows: boundary pieces move
CHUNK_BYTES, SHARD_BYTES = 4096, 16384
MUTATING = ("write", "write_atomic", "create_exclusive", "delete", "adopt", "remove")


def full_state(generation: int) -> dict[str, torch.Tensor]:
    """The global tensors of a generation, as every rank's fragments assemble them."""
    g = torch.Generator().manual_seed(1000 + generation)
    return {"w": torch.randn(ROWS, COLS, generator=g), "f": torch.randn(40, 25, generator=g)}


def rank_state(rank: int, generation: int) -> dict[str, Any]:
    full = full_state(generation)
    rows = ROWS // WORLD
    lo, hi = FLAT * rank // WORLD, FLAT * (rank + 1) // WORLD
    return {
        "w": ucp_zarr.Shard(full["w"][rows * rank : rows * (rank + 1)].clone(), (ROWS, COLS), (rows * rank, 0)),
        "f": ucp_zarr.FlatShard(full["f"].reshape(-1)[lo:hi].clone(), (40, 25), lo),
        "rng": ucp_zarr.PerRank(torch.tensor([generation, rank])),
        "step": generation,
    }


def _kill_after(ops: int, counter: list[int]) -> None:
    """SIGKILL this process at its ``ops``-th mutating storage operation."""
    for name in MUTATING:
        original = getattr(LocalStore, name)

        def wrapped(self: LocalStore, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if counter[0] == ops:
                os.kill(os.getpid(), signal.SIGKILL)
            counter[0] += 1
            return _original(self, *args, **kwargs)

        setattr(LocalStore, name, wrapped)


def worker(rank: int, port: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    counter = [0]
    if rank == spec["victim"]:
        if spec["kill_ops"] is not None:
            _kill_after(spec["kill_ops"], counter)
        else:
            threading.Timer(spec["kill_delay"], lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    else:
        _kill_after(-1, counter)  # count only
    dist.barrier()
    ucp_zarr.save(rank_state(rank, spec["generation"]), spec["path"], overwrite=spec["overwrite"],
                  chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES)
    Path(spec["done"], f"{rank}.json").write_text(json.dumps({"ops": counter[0]}))
    dist.barrier()
    os._exit(0)  # a pending kill timer must not outlive the save
