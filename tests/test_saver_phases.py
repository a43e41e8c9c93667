"""The save's agreed phases, in one process: ranks are threads talking through a fake
communicator, each writing through a recording store that shares one log.

Fast, deterministic checks of what the multi-process tests check for real
(``test_save_faults.py``): a failure in any phase on one rank makes every rank raise the
same error naming it; nothing is committed before every rank's objects are written; no
object is written by two ranks; exchange sizes are checked before any transfer.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _faulty import FaultyStore, Log

import ucp_zarr
from ucp_zarr.protocol.distributed import Comm
from ucp_zarr.errors import LayoutError
from ucp_zarr.protocol.exchange import check_sizes, planned_sizes
from ucp_zarr.protocol.collect import collect
from ucp_zarr.protocol.saver import SaveOptions, prepare
from ucp_zarr.io.local import LocalStore


class World:
    """What the ranks of a fake job share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list[Any] = [None] * size
        self._lock = threading.Lock()
        self._mail: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {}

    def mailbox(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        """The messages from ``src`` to ``dst``, in order (as point-to-point sends are)."""
        with self._lock:
            return self._mail.setdefault((src, dst), queue.Queue())


class ThreadComm(Comm):
    """A :class:`Comm` whose collectives run between threads of one process."""

    def __init__(self, world: World, rank: int) -> None:
        self.group = None
        self.active = True
        self.rank = rank
        self.world = world.size
        self._w = world

    def all_gather(self, obj: Any) -> list[Any]:
        w = self._w
        w.barrier.wait()
        w.slots[self.rank] = obj
        w.barrier.wait()
        out = list(w.slots)
        w.barrier.wait()
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out = self.all_gather(obj)
        return out if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        return self.all_gather(obj)[0]

    def scatter(self, parts: list[Any] | None) -> Any:
        return self.all_gather(parts)[0][self.rank]

    def exchange(self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Point to point, as the real one: only the ranks named meet (no barrier)."""
        for dst, t in sends.items():
            self._w.mailbox(self.rank, dst).put(t.clone())
        got = {src: self._w.mailbox(src, self.rank).get(timeout=20) for src in recv_sizes}
        assert all(got[s].numel() == n for s, n in recv_sizes.items())
        return got


def _run(size: int, fn: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """Run ``fn(rank, comm)`` on ``size`` threads; return each rank's result or exception."""
    world = World(size)
    out: list[Any] = [None] * size

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank, ThreadComm(world, rank))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def _state(rank: int, size: int) -> dict[str, Any]:
    a, b = 16 * rank // size, 16 * (rank + 1) // size  # uneven rows
    w = torch.arange(16 * 2048, dtype=torch.float32).reshape(16, 2048)
    flat = torch.arange(30 * 7, dtype=torch.float32)
    lo, hi = 210 * rank // size, 210 * (rank + 1) // size
    return {
        "w": ucp_zarr.Shard(w[a:b].clone(), (16, 2048), (a, 0)),
        "f": ucp_zarr.FlatShard(flat[lo:hi].clone(), (30, 7), lo),  # boundary pieces move
        "step": 3,
    }


def _save(path: Path, log: Log, size: int = 3, hook: Callable[[int], None] | None = None) -> list[Any]:
    def fn(rank: int, comm: ThreadComm) -> Any:
        store = FaultyStore(LocalStore(str(path)), log)
        if hook is not None:
            hook(rank)
        return prepare(lambda: collect(_state(rank, size)), store, comm, SaveOptions(chunk_bytes=2048), copy=False).finish()

    return _run(size, fn)


def test_the_commit_follows_every_write_of_every_rank_and_no_object_has_two_writers(tmp_path):
    log = Log()
    results = _save(tmp_path / "ck", log)
    assert all(isinstance(r, ucp_zarr.SaveResult) for r in results), results
    ops = log.ops
    root = ops.index(("create_exclusive", str(tmp_path / "ck"), "zarr.json"))
    writes = [i for i, (op, _, key) in enumerate(ops) if op == "write" and not key.startswith(".ucp_zarr")]
    assert writes and max(writes) < root
    objects = [o for r in results for o in r.objects]
    assert len(objects) == len(set(objects))  # each object written by one rank
    ck = ucp_zarr.open(tmp_path / "ck")
    assert torch.equal(ck["w"][...], torch.arange(16 * 2048, dtype=torch.float32).reshape(16, 2048))
    assert torch.equal(ck["f"][...], torch.arange(210, dtype=torch.float32).reshape(30, 7))


def _saver() -> Any:
    import ucp_zarr.protocol.saver

    return ucp_zarr.protocol.saver


@pytest.mark.parametrize(
    "phase, where, name",
    [
        ("collect", _saver, "fragment_infos"),
        ("stage", _saver, "Staging"),
        ("exchange", _saver, "build_exchange"),
        ("write", lambda: _saver().PreparedSave, "_write_data"),  # runs on the rank's own thread
    ],
)
def test_a_failure_on_one_rank_in_any_phase_fails_every_rank(tmp_path, monkeypatch, phase, where, name):
    mod = where()
    original = getattr(mod, name)
    rank1: list[int] = []  # the thread running rank 1

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() in rank1:
            raise RuntimeError(f"injected {phase} failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(mod, name, wrapper)
    results = _save(tmp_path / "ck", Log(), hook=lambda r: rank1.append(threading.get_ident()) if r == 1 else None)
    for rank, r in enumerate(results):
        assert isinstance(r, ucp_zarr.SaveError), (rank, r)
        assert f"rank 1: RuntimeError: injected {phase} failure" in str(r) and "rank 0:" not in str(r)
    # nothing committed: a save refused before it wrote gives the path back as it found it;
    # one that wrote deletes its objects and keeps its marker (an incomplete checkpoint)
    with pytest.raises(ucp_zarr.IncompleteCheckpointError if phase == "write" else ucp_zarr.NotACheckpointError):
        ucp_zarr.open(tmp_path / "ck")
    left = sorted(p.name for p in (tmp_path / "ck").rglob("*") if p.is_file()) if (tmp_path / "ck").exists() else []
    assert all(name.startswith(".ucp_zarr") for name in left), left


def test_exchange_sizes_are_checked_against_the_plan_before_any_transfer():
    from ucp_zarr.protocol.exchange import Exchange
    from ucp_zarr.layout.flat import flat_range_boxes
    from ucp_zarr.protocol.planner import FragmentInfo, plan_save

    infos = [[FragmentInfo("f", (30, 7), "float32", tuple(flat_range_boxes((30, 7), 70 * r, 70 * (r + 1))), (70 * r, 70 * (r + 1)))] for r in range(3)]
    plan = plan_save(infos, chunk_bytes=2048)
    sizes = planned_sizes(plan)
    assert sizes  # this layout moves boundary pieces
    (src, dst), n = next(iter(sizes.items()))
    for rank, part in enumerate(plan.split(3)):
        mine = {k: v for k, v in planned_sizes(part).items() if rank in k}
        assert mine == {k: v for k, v in sizes.items() if rank in k}  # each rank's part knows its pairs
    part = plan.split(3)[src]
    built = Exchange(sends={d: torch.zeros(m, dtype=torch.uint8) for (s_, d), m in sizes.items() if s_ == src})
    built.expect = {}
    for n_, task in part.numbered():  # what the rank expects to receive, as build_exchange would
        for i, (s_, box) in enumerate(task.sources):
            if task.writer == src and s_ != src:
                built.expect.setdefault(s_, []).append(((n_, i), box, part.arrays[task.key][1]))
    check_sizes(part, src, built)
    built.sends[dst] = torch.zeros(n + 64, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="boundary exchange mismatch on rank"):
        check_sizes(part, src, built)


def test_of_two_failing_writes_the_first_in_the_plans_order_is_raised(tmp_path, monkeypatch):
    """A save whose writes fail raises the failure of the first failing shard in the plan's
    order, whatever the timing: every shard before it has started and runs to its end (the
    pool takes them in order). Before, the first failure to be noticed was raised: of two
    tensors whose shards both failed, which one the error named depended on the threads
    (``test_convert_deepspeed_parallel.py`` saw either of AutoTP's two differing tensors)."""
    import time

    import ucp_zarr.protocol.saver as saver

    write_shard = saver.write_shard

    def failing(store: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        if path.startswith("a"):
            time.sleep(0.3)  # the first shard fails last
            raise OSError("injected: a failed")
        if path.startswith("b"):
            raise OSError("injected: b failed")
        return write_shard(store, path, *args, **kwargs)

    monkeypatch.setattr(saver, "write_shard", failing)
    with pytest.raises(OSError, match="injected: a failed"):
        ucp_zarr.save({"a": torch.ones(4), "b": torch.ones(4)}, tmp_path / "ck", max_workers=2)
