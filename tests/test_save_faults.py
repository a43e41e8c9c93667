"""A failure on one rank fails the save on every rank, promptly, whatever phase it hits.

One real 4-process gloo job runs every case in turn; each rank records, per case, what
its ``ucp_zarr.save`` raised and how long it took. Collectives time out after
``PG_TIMEOUT_S``: a rank left waiting for a failed peer (the defect fixed here: staging and
building the boundary exchange used to run after the last agreement) would record a
timeout after that long, so "every rank raised within ``PROMPT_S``" really tests agreement.

Cases: a failure while staging host copies (a tensor whose copy fails), while building the
exchange (the copy of a boundary piece fails), while writing, while committing, a claim
refused, a background save's writer process that does not start on one rank, a plain tensor
that differs between ranks (per-rank state must be explicit), and asynchronous saves over
subgroups (the background group used to be created by a collective that every rank of the
world had to join). A failed save's path is, when the save raises on any rank, as it stays
(rank 0 gives back its claim before the failure reaches the others: before, other ranks saw
the claim still there, and a failure in the claim's agreement left it held by a live lease).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _dist import run

import ucp_zarr

WORLD = 4
PG_TIMEOUT_S = 40.0
PROMPT_S = 10.0


# --- the cases (run on every rank) ---------------------------------------------------------


def _rows(rank: int, local: torch.Tensor | None = None) -> ucp_zarr.Shard:
    """Rows [2r, 2r+2) of an (8, 4096) tensor whose row i is all i (128 KiB: each rank
    writes its own rows)."""
    t = local if local is not None else torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32)[:, None].repeat(1, 4096)
    return ucp_zarr.Shard(t, (8, 4096), (2 * rank, 0))


def _flat(rank: int) -> ucp_zarr.FlatShard:
    """Elements [20r, 20r+20) of a (10, 8) tensor: flat ranges cutting rows (boundary pieces)."""
    return ucp_zarr.FlatShard(torch.arange(20 * rank, 20 * rank + 20, dtype=torch.float32), (10, 8), 20 * rank)


def case_stage_fails(root: Path, rank: int) -> None:
    # rank 1 cannot allocate the host buffer of its staged copies (an asynchronous save
    # stages everything before it returns); only the staging module's allocation fails,
    # in private memory (a thread writes) and in shared memory (the writer process does)
    import ucp_zarr.protocol.staging as staging

    original, shared = torch.empty, staging.SharedMemory

    def failing_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_globals.get("__name__") == "ucp_zarr.protocol.staging":
            raise RuntimeError("injected: no host memory for the staging buffer")
        return original(*args, **kwargs)

    def failing_shared(nbytes: int) -> Any:
        raise RuntimeError("injected: no host memory for the staging buffer")

    if rank == 1:
        torch.empty, staging.SharedMemory = failing_empty, failing_shared
    try:
        ucp_zarr.async_save({"w": _rows(rank)}, root / "stage_fails").result()
    finally:
        torch.empty, staging.SharedMemory = original, shared


def case_exchange_fails(root: Path, rank: int) -> None:
    # the boundary pieces rank 2 sends are copied into one buffer: make that copy fail
    original = torch.cat

    def failing_cat(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in tensors):
            raise RuntimeError("injected: no host memory for the exchange buffer")
        return original(tensors, *args, **kwargs)

    if rank == 2:
        torch.cat = failing_cat
    try:
        ucp_zarr.save({"f": _flat(rank)}, root / "exchange_fails")
    finally:
        torch.cat = original


def case_write_fails(root: Path, rank: int) -> None:
    import ucp_zarr.protocol.saver as saver

    original = saver.write_shard

    def broken(*args: Any, **kwargs: Any) -> bytes:
        raise OSError("injected: disk full")

    if rank == 3:
        saver.write_shard = broken
    try:
        ucp_zarr.save({"w": _rows(rank)}, root / "write_fails", chunk_bytes=4096)
    finally:
        saver.write_shard = original


def case_commit_fails(root: Path, rank: int) -> None:
    from ucp_zarr.io.local import LocalStore

    original = LocalStore.create_exclusive

    def refuse_root(self: LocalStore, key: str, data: bytes) -> None:
        if key == "zarr.json":
            raise OSError("injected: the commit record cannot be written")
        original(self, key, data)

    if rank == 0:
        LocalStore.create_exclusive = refuse_root  # type: ignore[method-assign]
    try:
        ucp_zarr.save({"w": _rows(rank)}, root / "commit_fails")
    finally:
        LocalStore.create_exclusive = original  # type: ignore[method-assign]


def case_claim_refused(root: Path, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        (root / "claim_refused").mkdir()
        (root / "claim_refused" / "notes.txt").write_text("not a checkpoint")
    dist.barrier()
    ucp_zarr.save({"w": _rows(rank)}, root / "claim_refused")


def case_writer_fails(root: Path, rank: int) -> None:
    # rank 1 cannot start the process that writes a background save (rank 0 claims the path
    # meanwhile): rank 0 used to raise without giving the claim back, its lease renewed by a
    # thread for as long as the process lived, so the path stayed held by a live save
    import ucp_zarr.io.writer_process as wp

    original = wp.WriterProcess.start

    def failing_start(self: Any) -> int:
        raise OSError("injected: cannot start the writer process")

    if rank == 1:
        wp.WriterProcess.start = failing_start  # type: ignore[method-assign]
    try:
        ucp_zarr.async_save({"w": _rows(rank)}, root / "writer_fails").result()
    finally:
        wp.WriterProcess.start = original  # type: ignore[method-assign]


def case_plain_tensor_differs(root: Path, rank: int) -> None:
    # rank 0 takes its time to give the path back: the other ranks raise only once it has
    from ucp_zarr.protocol.transaction import Transaction

    original = Transaction.abort

    def slow_abort(self: Transaction, **kwargs: Any) -> None:
        time.sleep(0.5)
        original(self, **kwargs)

    emb = torch.ones(1024, 1024)  # 4 MiB
    if rank == 3:
        emb[517, 3] = 2.0
    if rank == 0:
        Transaction.abort = slow_abort  # type: ignore[method-assign]
    try:
        ucp_zarr.save({"emb": emb, "w": _rows(rank)}, root / "plain_differs")
    finally:
        Transaction.abort = original  # type: ignore[method-assign]


def case_paths_differ(root: Path, rank: int) -> None:
    # rank 2 names another path (a manager's step that differs: another step folder)
    from ucp_zarr import CheckpointManager

    try:
        ucp_zarr.save({"w": _rows(rank)}, root / ("paths_differ" if rank != 2 else "paths_differ_other"))
    except ucp_zarr.OptionError as e:
        assert "ranks [2] passed another path than rank 0" in str(e), str(e)
    else:
        raise AssertionError("the save to different paths returned")
    import torch.distributed as dist

    if rank == 0:
        (root / "paths_link").symlink_to(root)
    dist.barrier()  # (rank 1 spells the same folder through a symbolic link: one path)
    ucp_zarr.save({"w": _rows(rank)}, (root / "paths_link" if rank == 1 else root) / "paths_same")
    manager = CheckpointManager(root / "paths_differ_steps")
    try:
        manager.save(3 if rank == 2 else 2, {"w": _rows(rank)})
    finally:
        manager.close()


def case_redo_after_failures(root: Path, rank: int) -> None:
    """A new save onto each path a failed save left behind works at once (the failed
    save's claim is aborted, so it counts as dead), and loads bit-exactly."""
    for name in ("stage_fails", "exchange_fails", "write_fails", "commit_fails", "writer_fails"):
        ucp_zarr.save({"w": _rows(rank)}, root / name)
        out = {"w": _rows(rank, torch.zeros(2, 4096))}
        ucp_zarr.load(out, root / name)
        assert torch.equal(out["w"].local, _rows(rank).local), name


def case_async_subgroups(root: Path, rank: int) -> None:
    """Ranks {0, 1} save asynchronously over their own subgroup (a pipeline stage, a DP
    group) while ranks {2, 3} do not take part; then {2, 3} do the same on theirs, passing
    their own background group. Only a subgroup's members call save: the background group
    used to be created by ``new_group``, which every rank of the world must call (here the
    world's group numbering then differed between ranks, so the next group hung)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    given = [None, dist.new_group([2, 3], backend="gloo")]  # stage 1 passes its background group
    for stage in (0, 1):
        if rank // 2 == stage:
            sub_rank = rank % 2
            half = torch.full((4, 16), float(rank))
            sd = {"w": ucp_zarr.Shard(half, (8, 16), (4 * sub_rank, 0)), "step": 7}
            path = root / f"async_group{stage}"
            fut = ucp_zarr.async_save(sd, path, process_group=groups[stage], async_group=given[stage])
            result = fut.result(timeout=PROMPT_S * 3)
            assert isinstance(result, ucp_zarr.SaveResult) and result.rank == sub_rank
            want = torch.cat([torch.full((4, 16), float(2 * stage + i)) for i in range(2)])
            assert torch.equal(ucp_zarr.open(path)["w"][...], want)
        dist.barrier()
    # the world's own group bookkeeping is intact: a group every rank creates next works
    after = dist.new_group([0, 1, 2, 3])
    total = torch.ones(1)
    dist.all_reduce(total, group=after)
    assert total.item() == 4


def case_async_given_group(root: Path, rank: int) -> None:
    """The caller may pass the background group (as DCP asks for async saves)."""
    import torch.distributed as dist

    background = dist.new_group(backend="gloo")
    fut = ucp_zarr.async_save({"w": _rows(rank)}, root / "async_given", async_group=background)
    fut.result(timeout=PROMPT_S * 3)
    assert torch.equal(ucp_zarr.open(root / "async_given")["w"][2 * rank : 2 * rank + 2], _rows(rank).local)


CASES: list[tuple[str, Callable[[Path, int], None]]] = [
    ("stage_fails", case_stage_fails),
    ("exchange_fails", case_exchange_fails),
    ("write_fails", case_write_fails),
    ("commit_fails", case_commit_fails),
    ("claim_refused", case_claim_refused),
    ("writer_fails", case_writer_fails),
    ("plain_differs", case_plain_tensor_differs),
    ("paths_differ", case_paths_differ),
    ("redo", case_redo_after_failures),
    ("async_subgroups", case_async_subgroups),
    ("async_given", case_async_given_group),
]


def _job(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    out = Path(root) / "results"
    out.mkdir(exist_ok=True)
    for name, fn in CASES:
        start = time.perf_counter()
        record: dict[str, Any] = {"ok": True}
        try:
            fn(Path(root), rank)
        except Exception as e:  # recorded, and judged by the test of this case
            record = {"ok": False, "types": [c.__name__ for c in type(e).__mro__], "message": str(e),
                      "trace": traceback.format_exc()}
        record["elapsed"] = time.perf_counter() - start
        record["right_after"] = _state(Path(root) / name)  # as this rank found it when its save returned
        record["leases"] = sum(t.name == "ucp_zarr-heartbeat" for t in threading.enumerate())  # renewing now
        dist.barrier()
        record["after"] = _state(Path(root) / name)  # what the case left at its path
        (out / f"{name}.{rank}.json").write_text(json.dumps(record))
        dist.barrier()


def _state(path: Path) -> str:
    try:
        ucp_zarr.open(path)
    except ucp_zarr.IncompleteCheckpointError:
        return "incomplete"
    except ucp_zarr.NotACheckpointError:
        return "nothing"
    return "committed"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, str | None]:
    root = tmp_path_factory.mktemp("faults")
    error = None
    try:
        run(WORLD, _job, str(root), timeout_s=PG_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - each case reports what it recorded
        error = f"{type(e).__name__}: {e}"
    return root, error


def _records(results: tuple[Path, str | None], name: str) -> list[dict[str, Any]]:
    root, error = results
    files = [root / "results" / f"{name}.{r}.json" for r in range(WORLD)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"case {name} never finished on {missing}; the job failed: {error}"
    return [json.loads(f.read_text()) for f in files]


def _assert_failed_everywhere(records: list[dict[str, Any]], error: str, *needles: str) -> None:
    for rank, rec in enumerate(records):
        assert not rec["ok"], f"rank {rank} did not fail"
        assert error in rec["types"], (rank, rec["types"], rec["message"])
        assert "CheckpointError" in rec["types"], (rank, rec["types"])
        for needle in needles:
            assert needle in rec["message"], (rank, needle, rec["message"])
        assert rec["elapsed"] < PROMPT_S, f"rank {rank} took {rec['elapsed']:.1f} s to fail: {rec['message']}"


@pytest.mark.parametrize(
    "name, failing, detail, after",
    [  # a save refused before it wrote anything gives the path back; a failed write leaves it incomplete
        ("stage_fails", 1, "staging buffer", "nothing"),
        ("exchange_fails", 2, "no host memory for the exchange buffer", "nothing"),
        ("write_fails", 3, "disk full", "incomplete"),
        ("commit_fails", 0, "the commit record cannot be written", "incomplete"),
        ("writer_fails", 1, "cannot start the writer process", "nothing"),
    ],
)
def test_a_failure_in_any_phase_fails_every_rank_promptly(results, name, failing, detail, after):
    records = _records(results, name)
    _assert_failed_everywhere(records, "SaveError", f"rank {failing}: ", detail)
    for rank, rec in enumerate(records):
        others = [f"rank {r}: " for r in range(WORLD) if r != failing]
        assert not any(o in rec["message"] for o in others), rec["message"]  # only the failing rank is named
        assert rec["after"] == rec["right_after"] == after, (rec["after"], rec["right_after"])
        assert rec["leases"] == 0, f"rank {rank} still renews a lease of the failed save"


def test_refused_claim_raises_the_same_error_class_everywhere(results):
    records = _records(results, "claim_refused")
    _assert_failed_everywhere(records, "CheckpointExistsError", "rank 0: ", "not empty")
    assert (results[0] / "claim_refused" / "notes.txt").read_text() == "not a checkpoint"


def test_plain_tensor_that_differs_between_ranks_is_refused_naming_it_and_the_ranks(results):
    """Regression: a 4 MiB plain tensor differing in one element on rank 3 used to be stored
    per rank silently (and left untouched on ranks that did not exist at save time)."""
    records = _records(results, "plain_differs")
    _assert_failed_everywhere(records, "LayoutError", "'emb'", "ranks [0, 1, 2] vs ranks [3]", "PerRank")
    # refused before anything was written, and given back before any rank raised
    assert all(rec["after"] == rec["right_after"] == "nothing" for rec in records), records


def test_ranks_that_pass_different_paths_are_refused(results):
    """Ranks passing different paths (a rank's manager at another step) were not compared: the
    plain save failed with a lost claim, leaving an incomplete folder; the manager's saves of
    steps 2 and 3 both returned metrics, and step 2 held rank 2's rows of step 3. Refused on
    every rank before anything is written."""
    records = _records(results, "paths_differ")
    _assert_failed_everywhere(records, "OptionError", "ranks [2] passed another path than rank 0",
                              "step_00000002", "pass the same path on every rank")
    root = results[0]
    assert not (root / "paths_differ").exists() and not (root / "paths_differ_other").exists()
    assert not list((root / "paths_differ_steps").glob("*"))  # (no step folder)
    want = torch.cat([_rows(r).local for r in range(WORLD)])
    assert torch.equal(ucp_zarr.open(root / "paths_same")["w"][...], want)


def test_a_failed_save_leaves_a_path_the_next_save_can_use_at_once(results):
    for rank, rec in enumerate(_records(results, "redo")):
        assert rec["ok"], (rank, rec.get("trace"))


@pytest.mark.parametrize("name", ["async_subgroups", "async_given"])
def test_async_saves_over_subgroups_and_given_groups(results, name):
    for rank, rec in enumerate(_records(results, name)):
        assert rec["ok"], (rank, rec.get("trace"))
        assert rec["elapsed"] < PROMPT_S * 3


def _uneven_groups(rank: int, world: int, root: str) -> None:
    """Ranks that belong to different numbers of process groups (a Megatron embedding group
    of the first and last stage, [0, 3]): a plain async_save of every rank completes (before:
    every rank waited for a background group torch named differently on each, until the
    timeout); on a subgroup whose members differ so, it is refused on every member, naming
    async_group, and with async_group given it completes."""
    import torch.distributed as dist

    dist.new_group([0, 3])  # (every rank calls it; ranks 0 and 3 belong to one more group)
    sd = {"w": ucp_zarr.Shard(torch.full((2, 4), float(rank)), (2 * world, 4), (2 * rank, 0)), "step": 3}
    fut = ucp_zarr.async_save(sd, Path(root) / "all", async_group=None)
    assert isinstance(fut.result(timeout=PROMPT_S * 3), ucp_zarr.SaveResult)
    pair = dist.new_group([0, 1])  # (rank 0 belongs to [0, 3] too, rank 1 does not)
    given = dist.new_group([0, 1], backend="gloo")
    if rank in (0, 1):
        half = {"w": ucp_zarr.Shard(torch.full((2, 4), float(rank)), (4, 4), (2 * rank, 0))}
        with pytest.raises(ucp_zarr.OptionError, match="async_group="):
            ucp_zarr.async_save(half, Path(root) / "pair", process_group=pair)
        fut = ucp_zarr.async_save(half, Path(root) / "pair", process_group=pair, async_group=given)
        fut.result(timeout=PROMPT_S * 3)
    dist.barrier()
    want = torch.cat([torch.full((2, 4), float(r)) for r in range(world)])
    assert torch.equal(ucp_zarr.open(Path(root) / "all")["w"][...], want)


def test_async_save_with_ranks_in_different_numbers_of_groups(tmp_path) -> None:
    run(4, _uneven_groups, str(tmp_path), timeout_s=60)


_DIES_WRITING = """
import datetime, os, sys, torch, torch.distributed as dist, ucp_zarr
from ucp_zarr.protocol import saver
rank, path, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
if rank == 1:
    saver.PreparedSave._write_data = lambda *a, **k: os._exit(3)  # (killed while writing)
try:
    ucp_zarr.save({"w": ucp_zarr.Shard(torch.ones(2, 8), (4, 8), (2 * rank, 0))}, path)
    print("the save returned")
except RuntimeError:  # (gloo: the peer is gone)
    dist.destroy_process_group()
    ucp_zarr.save({"w": torch.zeros(8)}, path)  # (the same process, alone, at the same path)
    print("saved again")
sys.stdout.flush()
os._exit(0)
"""


def test_a_save_whose_peer_died_leaves_the_path_to_this_process(tmp_path) -> None:
    """Rank 1 killed while writing: rank 0's collective raised outside the save's clean-up, so
    its claim was never given back (its lease renewed until the process ended) and this
    process's next save at the path was refused. The coordinator gives the claim back."""
    from s3server import free_ports

    port = str(free_ports(1)[0])
    script, path = tmp_path / "job.py", str(tmp_path / "ck")
    script.write_text(_DIES_WRITING)
    peer = subprocess.Popen([sys.executable, str(script), "1", path, port])
    done = subprocess.run([sys.executable, str(script), "0", path, port], capture_output=True, text=True, timeout=240)
    peer.wait(timeout=60)
    assert "saved again" in done.stdout, done.stdout + done.stderr[-3000:]
    assert torch.equal(ucp_zarr.read_state_dict(path)["w"], torch.zeros(8))


def test_one_path_is_the_same_absolute_path_or_the_same_resolved_one() -> None:
    """Ranks passing one absolute path that their hosts resolve differently (a link on one node,
    a mount on another) save to one path (7ce249b compared the resolved paths alone and refused
    them); so do ranks whose spellings resolve alike; others are refused."""
    from ucp_zarr.protocol.saver import _check_one_path

    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    _check_one_path([(a, b), (a, c)], "P")  # (the same path, resolved otherwise on rank 1)
    _check_one_path([(a, b), (c, b)], "P")  # (another spelling, resolved alike)
    with pytest.raises(ucp_zarr.OptionError, match=r"ranks \[1\] passed another path than rank 0 \(P\)"):
        _check_one_path([(a, b), (c, a)], "P")
