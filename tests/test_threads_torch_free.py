"""The threads of a save and of a load make (almost) no torch calls: each torch call
releases the GIL, and with several threads on few cores every release is a handoff that
costs more than the call (issue 21: 4 threads on 2 cores doubled a 16 MiB load's time).
Reads are prepared in the calling thread; shards are cut into chunks with numpy."""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

import torch

import ucp_zarr


class _Counted(torch.Tensor):
    """A plain tensor that counts the torch calls made on it, by thread kind."""

    calls: Counter = Counter()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        main = threading.current_thread() is threading.main_thread()
        cls.calls["main" if main else "pool"] += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _counted(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_Counted)


def test_save_threads_cut_a_shard_into_chunks_without_torch(tmp_path) -> None:
    src = torch.randn(64, 48).t()  # (a transposed source: every chunk is copied out of it)
    _Counted.calls.clear()
    ucp_zarr.save({"w": _counted(src)}, tmp_path / "ck", chunk_bytes=256)
    grid = ucp_zarr.open(tmp_path / "ck").array_meta("w").grid
    chunks = math.prod(grid.chunks_per_shard) * math.prod(grid.shard_counts)
    assert chunks >= 32, grid
    assert _Counted.calls["pool"] < chunks // 4, _Counted.calls  # (per shard, not per chunk)
    out = ucp_zarr.load({"w": torch.zeros(48, 64)}, tmp_path / "ck")
    assert torch.equal(out["w"], src)


def test_load_threads_make_no_torch_call(tmp_path) -> None:
    sd = {f"t{i}": torch.randn(16, 8) for i in range(8)}
    ucp_zarr.save(sd, tmp_path / "ck")
    targets = {k: _counted(torch.zeros(16, 8)) for k in sd}
    _Counted.calls.clear()
    ucp_zarr.load(targets, tmp_path / "ck")
    assert all(torch.equal(targets[k].as_subclass(torch.Tensor), sd[k]) for k in sd)
    assert _Counted.calls["pool"] == 0 and _Counted.calls["main"] > 0, _Counted.calls
