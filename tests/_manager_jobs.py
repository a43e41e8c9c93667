"""Processes of the checkpoint-manager tests: a training loop that saves through the manager
until it is SIGKILLed (``test_manager.py``), and the jobs of the elastic restart
(``test_elastic_manager.py``). In a module of its own so that forkserver and spawn children
import it."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from _faulty import Crash, FaultyStore, Log

import ucp_zarr
import ucp_zarr.protocol.saver
from ucp_zarr.ops import CheckpointManager
from ucp_zarr.ops.steps import ReadLease, delete_step
from ucp_zarr.io.local import LocalStore

CHUNK_BYTES, SHARD_BYTES = 4096, 16384


def crash_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a function of the step alone, so a test can rebuild it."""
    g = torch.Generator().manual_seed(5000 + step)
    return {
        "model": {"w": torch.randn(64, 128, generator=g), "b": torch.randn(77, generator=g).to(torch.bfloat16)},
        "optim": {"m": torch.randn(32, 33, generator=g), "step": step},
        "step": step,
    }


def empty_state() -> dict[str, Any]:
    like = crash_state(0)
    return {
        "model": {k: torch.zeros_like(v) for k, v in like["model"].items()},
        "optim": {"m": torch.zeros_like(like["optim"]["m"]), "step": -1},
        "step": -1,
    }


def save_until_killed(root: str, keep_last: int, ready: Any) -> None:
    """Resume from the newest step (holding a reader lease), set ``ready``, then save step
    after step, every other one asynchronously, until killed."""
    torch.set_num_threads(1)
    manager = CheckpointManager(root, keep_last=keep_last, lease_s=5.0)
    state = empty_state()
    start = manager.load_latest(state)
    if start is not None and not torch.equal(state["model"]["w"], crash_state(start)["model"]["w"]):
        os._exit(3)  # the parent sees the exit code
    ready.set()
    step = start or 0
    while True:
        step += 1
        manager.save(step, crash_state(step), async_save=step % 2 == 0, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES)


def vanish(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` and exit at once, without any clean-up, as a killed process would:
    code 7 when ``fn`` raised the injected :class:`Crash`, 0 when it returned."""
    code = 0
    try:
        fn(*args)
    except Crash:
        code = 7
    os._exit(code)


def interrupted_save(root: str, step: int) -> None:
    """Save ``step`` through a manager and die in the middle of writing its shards."""

    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(0)

    ucp_zarr.protocol.saver.write_shard = die
    CheckpointManager(root).save(step, crash_state(step), chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES)


def overwrite_dying(root: str, step: int, adopted: int) -> None:
    """Overwrite ``step`` through a manager and die (no clean-up) while its staging copy is put
    in place, after ``adopted`` objects were."""
    from ucp_zarr.io import local

    adopt, done = local.LocalStore.adopt, [0]

    def dying(self: Any, *args: Any, **kwargs: Any) -> None:
        if done[0] == adopted:
            os._exit(0)
        done[0] += 1
        adopt(self, *args, **kwargs)

    local.LocalStore.adopt = dying  # type: ignore[method-assign]
    CheckpointManager(root).save(step, crash_state(step + 100), overwrite=True, chunk_bytes=CHUNK_BYTES,
                                 shard_bytes=SHARD_BYTES)


def hold_lease(folder: str) -> None:
    """Take a reader lease on the step folder and keep it (until the process dies)."""
    ReadLease(LocalStore(folder)).__enter__()


def delete_crashing(folder: str, crash_at: int) -> None:
    """Delete the step folder, crashing at its ``crash_at``-th mutating storage operation."""
    delete_step(FaultyStore(LocalStore(folder), Log(crash_at=crash_at)))


# --- elastic restart ---------------------------------------------------------------------------


def _model(world: int, seed: int) -> tuple[Any, Any, Any]:
    """TinyGPT (small) sharded with FSDP2 over ``world`` ranks, its AdamW and the DP group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucp_zarr.examples.elastic_resume import TinyGPT

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(seed)
    model = TinyGPT(ELASTIC_CONFIG)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, mesh


def _train_step(model: Any, opt: Any, step: int, mesh: Any) -> float:
    """One step on this rank's part of the global batch; the global-batch mean loss."""
    import torch.distributed as dist

    from ucp_zarr.examples.elastic_resume import local_batch

    x, y = local_batch(step, ELASTIC_CONFIG, mesh.get_local_rank(), mesh.size())
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / mesh.size()


def _state(model: Any, opt: Any, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def _elastic_config() -> Any:
    from ucp_zarr.examples.elastic_resume import GPTConfig

    return GPTConfig(vocab=48, dim=32, heads=2, layers=1, seq=16)


ELASTIC_CONFIG = _elastic_config()
EVERY = 2
KEEP_LAST = 2


def elastic_job(rank: int, world: int, root: str, out: str, steps: int, stop_at: int, resume: bool) -> None:
    """A job on ``world`` ranks (FSDP2): start fresh (seed 0) or resume with ``load_latest``
    (a model initialised otherwise: every value must come from the checkpoint), train, save
    every ``EVERY`` steps through the manager (async), and stop after step ``stop_at`` as a
    crash would stop it. A fresh job trains on to ``steps`` without saving: the
    uninterrupted reference run. Rank 0 writes the losses to ``out``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, mesh = _model(world, seed=1 if resume else 0)
    manager = CheckpointManager(root, keep_last=KEEP_LAST, every_n_steps=EVERY)
    start = 0
    if resume:
        state = _state(model, opt, -1)
        start = manager.load_latest(state)
        assert start is not None and state["step"] == start, (start, state["step"])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = {}
    for step in range(start, stop_at if resume else steps):
        losses[step] = _train_step(model, opt, step, mesh)
        done = step + 1
        if done <= stop_at and manager.should_save(done):
            manager.save(done, _state(model, opt, done), async_save=True)
    manager.close()
    if resume and world == 2:  # the adaptive schedule is rank 0's decision on every rank
        import torch.distributed as dist

        adaptive = CheckpointManager(root, mtbf_s=600.0)
        decisions = [adaptive.should_save(s) for s in range(100, 104)]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, decisions)
        assert decisions[0] and all(d == decisions for d in every), every
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"start": start, "losses": losses, "world": world}, f)


def async_error_on_collective_calls(rank: int, world: int, root: str, out: str) -> None:
    """A background save fails on every rank, slowly; rank 1 calls ``load`` while its save
    is still writing, rank 0 once its save has failed: both must raise the save's error
    (a rank raising before the load's collective left the other waiting in it). Then the
    error raised by ``load_latest`` once on every rank, both save step 3."""
    import time

    import ucp_zarr.protocol.saver as saver
    from ucp_zarr import CheckpointManager, Shard

    def state(i: int) -> dict[str, Any]:
        return {"w": Shard(torch.full((1000,), float(i)), (2000,), (rank * 1000,)), "step": i}

    m = CheckpointManager(root, keep_last=3)
    m.save(1, state(1))
    write = saver.PreparedSave._write_data

    def fail(self: Any, *args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        raise OSError("disk full (injected)")

    saver.PreparedSave._write_data = fail
    got = []
    for call in ("load", "load_latest"):
        m.save(2, state(2), async_save=True)
        time.sleep(0.2 if rank == 1 else 2.0)
        try:
            m.load(1, state(0)) if call == "load" else m.load_latest(state(0))
            got.append(f"{call}: loaded")
        except Exception as e:
            got.append(f"{call}: {type(e).__name__}")
    saver.PreparedSave._write_data = write
    m.save(3, state(3))
    got.append(f"latest {m.latest()}")
    # the failure taken on rank 0 alone (its latest(), caught): the next save raises on both ranks
    saver.PreparedSave._write_data = fail
    m.save(4, state(4), async_save=True)
    time.sleep(2.0)
    saver.PreparedSave._write_data = write
    if rank == 0:
        try:
            m.latest()
        except Exception as e:
            got.append(f"latest: {type(e).__name__}")
    try:
        m.save(5, state(5))
        got.append("save 5: saved")
    except Exception as e:
        got.append(f"save 5: {type(e).__name__}")
    m.save(6, state(6))
    got.append(f"latest {m.latest()}")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def manager_made_before_init(rank: int, world: int, port: int, root: str, out: str) -> None:
    """A manager made before ``init_process_group`` (every rank, at the top of a script): its
    rank 0 decides when to save once the group is up, whatever each rank measures."""
    import datetime
    import os

    import torch.distributed as dist

    from ucp_zarr import CheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    m = CheckpointManager(root, keep_last=2, mtbf_s=3600.0, save_cost_s=1.0)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    first = next(s for s in range(1, 1000) if m.should_save(s, step_time_s=0.5 + 0.1 * rank))
    m.save(first, {"step": first})
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"first": first, "steps": m.steps()}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def per_rank_save(rank: int, world: int, root: str) -> None:
    manager = CheckpointManager(root)
    manager.save(1, {"w": torch.ones(4), "pos": ucp_zarr.PerRank(torch.tensor([rank]))})
    manager.close()


def per_rank_load(rank: int, world: int, root: str, out: str) -> None:
    """``load_latest`` of :func:`per_rank_save`'s step: each rank writes what it got (a
    rank that did not save has no copy of ``pos``: a strict load fails there)."""
    manager = CheckpointManager(root)
    try:
        manager.load_latest({"w": torch.zeros(4), "pos": ucp_zarr.PerRank(torch.tensor([-1]))})
        got = "loaded"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        got = type(e).__name__
    manager.close()
    with open(f"{out}_{rank}.json", "w") as f:
        json.dump(got, f)
