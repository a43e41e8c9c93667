"""Save with one parallel layout, load with another, on real multi-process gloo jobs.

The oracle is the global state: deterministic reference tensors (identical in every
process), or, for trained models, the full tensors gathered at save time and written by the
test to a ``.pt`` file. Every rank builds its fragments from that, and after a load every
rank compares, bit for bit, what it holds with the corresponding slice of the reference.

Processes are expensive (a few seconds of torch import each, on 2 cores), so the cases are
grouped into one job per world size, run once per module by fixtures:

* a single-process save in this process (1 -> FSDP2(5));
* ``saved4``: 4 ranks save every source layout, and check the failure cases;
* ``loaded3``, ``loaded2``, ``loaded5``: 3, 2 and 5 ranks load them into other layouts
  (``loaded2`` also runs the async save and a small mixed-dtype exchange save).

Each rank records ``<case>.<rank>.ok`` (or ``.err`` with its traceback) per case, so every
test below checks its own case; a failing case aborts its job (the other processes are
terminated rather than left waiting in a collective), and the tests of the cases the job
never reached fail with the job's error.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _dist import run
from _states import (
    SENTINEL,
    assert_bits_equal,
    assert_dtensor_equals,
    bounds,
    dtensor_of,
    flat_buffer,
    flat_fragments,
    flat_partition,
    full_copy,
    ref_tensor,
    shard_of,
    shard_target,
)
from torch import nn

import ucp_zarr

# --- models ----------------------------------------------------------------------------------


class Net(nn.Module):
    """Odd sizes: 37 rows over 4 ranks is 10/10/10/7, over 3 is 13/13/11, over 5 is
    8/8/8/8/5; 11 rows over 5 leaves rank 4 empty."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 50)
        self.fc1 = nn.Linear(50, 37)
        self.norm = nn.LayerNorm(37)
        self.fc2 = nn.Linear(37, 11)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(self.emb(idx)))))


class MLP(nn.Module):
    """``up`` is column-parallel, ``down`` row-parallel (TP activations must split evenly:
    DTensor assumes even local shards of activations); 38 rows over FSDP2(3) are 13/13/12,
    under FSDP2(2) x TP(2) 10/9 per TP part."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(50, 38)
        self.down = nn.Linear(38, 50)
        self.norm = nn.LayerNorm(50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def _train(model: nn.Module, opt: torch.optim.Optimizer, inputs: Callable[[int], torch.Tensor], steps: int = 2) -> None:
    for i in range(steps):
        out = model(inputs(i))
        loss = (out.full_tensor() if hasattr(out, "full_tensor") else out).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _net_inputs(i: int) -> torch.Tensor:
    return torch.randint(0, 37, (6, 5), generator=torch.Generator().manual_seed(100 + i))


def _mlp_inputs(i: int) -> torch.Tensor:
    return torch.randn(8, 50, generator=torch.Generator().manual_seed(200 + i))


def _fsdp_target(model_cls: type, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict, dict]:
    """A fresh FSDP2 model (other weights than the saved one) and its optimizer state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(12345)
    model = model_cls()
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)  # creates the (zero) optimizer state
    return model, opt, msd, osd


def _check_trained(model: nn.Module, opt: torch.optim.Optimizer, ref: dict, what: str) -> None:
    """Every parameter and Adam moment equals the reference's (each rank checks its slice)."""
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref["model"]), (names, list(ref["model"]))
    for name, p in model.named_parameters():
        assert_dtensor_equals(p.data, ref["model"][name], f"{what}: {name}")
        state = opt.state[p]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert_dtensor_equals(state[moment], ref["optim"]["state"][name][moment], f"{what}: {name}.{moment}")
        assert_bits_equal(state["step"], ref["optim"]["state"][name]["step"], f"{what}: {name}.step")
    assert opt.param_groups[0]["lr"] == ref["optim"]["param_groups"][0]["lr"]


def _load_trained_into_fsdp(path: Path, ref_file: Path, model_cls: type, mesh: Any, what: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, msd, osd = _fsdp_target(model_cls, mesh)
    sd = {"model": msd, "optim": osd}
    ucp_zarr.load(sd, path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref = torch.load(ref_file, weights_only=True)
    _check_trained(model, opt, ref, what)


def _save_trained(model: nn.Module, opt: torch.optim.Optimizer, path: Path, ref_file: Path, rank: int) -> dict:
    """Save ``get_state_dict(model, opt)`` and (rank 0) the gathered full state as the oracle."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    full = full_copy(sd)  # collective, before the save: the reference
    result = ucp_zarr.save(sd, path)
    assert isinstance(result, ucp_zarr.protocol.saver.SaveResult)
    if rank == 0:
        torch.save(full, ref_file)
    return sd


# --- per-case bookkeeping ---------------------------------------------------------------------


def _case(root: str, name: str, rank: int, fn: Callable[..., None], *args: Any) -> None:
    """Run one case on this rank and record the outcome; a failure aborts the job."""
    results = Path(root, "results")
    results.mkdir(exist_ok=True)
    start = time.perf_counter()
    try:
        fn(*args)
    except BaseException:
        (results / f"{name}.{rank}.err").write_text(traceback.format_exc())
        raise
    (results / f"{name}.{rank}.ok").write_text(f"ok in {time.perf_counter() - start:.2f} s")


def _job(root: Path, world: int, fn: Callable[..., None]) -> str | None:
    """Run a job; return its error as text (None when it succeeded)."""
    try:
        run(world, fn, str(root))
    except Exception as e:  # noqa: BLE001 - reported by the tests of the unfinished cases
        return f"{type(e).__name__}: {e}"
    return None


def _expect_ok(root: Path, job_error: str | None, name: str, world: int) -> None:
    results = root / "results"
    errors = [(r, (results / f"{name}.{r}.err")) for r in range(world) if (results / f"{name}.{r}.err").exists()]
    if errors:
        pytest.fail(f"case {name!r} failed on rank(s) {[r for r, _ in errors]}:\n" + "\n".join(p.read_text() for _, p in errors))
    missing = [r for r in range(world) if not (results / f"{name}.{r}.ok").exists()]
    if missing:
        pytest.fail(f"case {name!r} never finished on rank(s) {missing}; the job failed: {job_error}")


# === the save job: 4 ranks ======================================================================


def _save_fsdp4(root: Path, rank: int) -> None:
    """Case 1 source: FSDP2 over 4 ranks, Adam state after two steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(1)
    model = Net()
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, _net_inputs)
    sd = _save_trained(model, opt, root / "ck_fsdp4", root / "ref_fsdp4.pt", rank)
    assert all(type(v).__name__ == "DTensor" for v in sd["model"].values())


def _save_tp2dp2(root: Path, rank: int, mesh2d: Any) -> None:
    """Case 2 source: TP=2 (Colwise/Rowwise DTensors on the "tp" dim) x DP=2 replicas."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(2)
    model = parallelize_module(MLP(), mesh2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, _mlp_inputs)  # same batch on every rank: DP replicas stay identical
    sd = _save_trained(model, opt, root / "ck_tp2dp2", root / "ref_tp2dp2.pt", rank)
    assert sd["model"]["up.weight"].placements == (Shard(0),)
    assert sd["model"]["down.weight"].placements == (Shard(1),)
    assert sd["optim"]["state"]["up.weight"]["exp_avg"].placements == (Shard(0),)


def _save_fsdp_tp(root: Path, rank: int, mesh2d: Any) -> None:
    """Case 7 source: TP=2 then FSDP2 over DP=2 on a 2x2 mesh (``_StridedShard`` placements)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    torch.manual_seed(7)
    model = parallelize_module(MLP(), mesh2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh2d["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, _mlp_inputs)
    sd = _save_trained(model, opt, root / "ck_fsdp_tp", root / "ref_fsdp_tp.pt", rank)
    placements = sd["model"]["up.weight"].placements
    assert isinstance(placements[0], _StridedShard), placements
    assert isinstance(sd["optim"]["state"]["up.weight"]["exp_avg"].placements[0], _StridedShard)


UNEVEN = {
    # name: (shape, dtype, saving mesh ("1d" over 4 or "2d" 2x2), saving placements)
    "rows10": ((10, 7), torch.float32, "1d", ["S0"]),  # 3/3/3/1
    "rows5": ((5, 3), torch.float32, "1d", ["S0"]),  # 2/2/1/0: rank 3 empty
    "rows2": ((2, 9), torch.float32, "1d", ["S0"]),  # 1/1/0/0
    "cols10": ((6, 10), torch.float32, "1d", ["S1"]),  # 3/3/3/1 columns
    "bf16": ((13, 5), torch.bfloat16, "1d", ["S0"]),  # 4/4/4/1
    "grid": ((7, 5), torch.float32, "2d", ["S0", "S1"]),  # 4/3 rows x 3/2 columns
    "nested": ((9, 4), torch.float32, "2d", ["S0", "S0"]),  # 5/4 then 3/2, 2/2
    "halfrep": ((11, 3), torch.float32, "2d", ["R", "S0"]),  # 6/5, replicated over dim 0
}
UNEVEN_TARGETS = {
    # name: placements over a 1-D mesh of the loading world
    "rows10": ["S0"],
    "rows5": ["S0"],
    "rows2": ["S0"],
    "cols10": ["S0"],
    "bf16": ["S1"],
    "grid": ["S1"],
    "nested": ["S0"],
    "halfrep": ["S0"],
}


def _placements(spec: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if s == "R" else Shard(int(s[1:])) for s in spec]


def _save_uneven(root: Path, rank: int, mesh1d: Any, mesh2d: Any) -> None:
    """Case 6 source: DTensors whose dims do not divide by the mesh (some ranks empty)."""
    sd = {}
    for name, (shape, dtype, mesh, spec) in UNEVEN.items():
        ref = ref_tensor(name, shape, dtype, seed=6)
        sd[name] = dtensor_of(ref, mesh1d if mesh == "1d" else mesh2d, _placements(spec))
    assert sd["rows5"].to_local().shape[0] == (2, 2, 1, 0)[rank]
    ucp_zarr.save({"uneven": sd}, root / "ck_uneven")


def _load_uneven(root: Path, rank: int, world: int) -> None:
    """Case 6 target: the same tensors over a 1-D mesh of ``world`` ranks, other splits."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for name, (shape, dtype, _, _) in UNEVEN.items():
        sd[name] = dtensor_of(torch.full(shape, SENTINEL, dtype=dtype), mesh, _placements(UNEVEN_TARGETS[name]))
    ucp_zarr.load({"uneven": sd}, root / "ck_uneven")
    for name, (shape, dtype, _, _) in UNEVEN.items():
        assert_dtensor_equals(sd[name], ref_tensor(name, shape, dtype, seed=6), f"uneven {name} on {world} ranks")


ZERO_SHAPES = {
    # a ZeRO group: one flattened buffer of 23291 elements, 5823 per rank over 4 (the last
    # 5822); the partition boundaries cut rows of col.weight, emb.weight and big.weight
    "col.weight": (37, 50),
    "col.bias": (37,),
    "row.weight": (50, 37),
    "row.bias": (50,),
    "emb.weight": (101, 24),
    "norm.weight": (50,),
    "big.weight": (130, 131),  # 68 KB of fp32: chunk-sized shards cut by the partitions
}
ZERO_TP = {
    # how TP(2) splits each: dim 0 (column-parallel, vocab-parallel), dim 1 (row-parallel),
    # None (replicated, held whole as a plain tensor)
    "col.weight": 0,
    "col.bias": 0,
    "row.weight": 1,
    "row.bias": None,
    "emb.weight": 0,
    "norm.weight": None,
    "big.weight": 1,
}
ZERO_STATES = ("master", "exp_avg", "exp_avg_sq")


def _zero_ref(name: str, which: str) -> torch.Tensor:
    """The global tensors of the ZeRO case: fp32 master, bf16 params, fp32 moments."""
    shape = ZERO_SHAPES[name]
    master = ref_tensor(name, shape, seed=3)
    if which == "param":
        return master.to(torch.bfloat16)
    if which == "master":
        return master
    t = ref_tensor(f"{name}.{which}", shape, seed=3)
    return t.abs() if which == "exp_avg_sq" else t


def _zero_state_dict(leaf: Callable[[str, str], Any], step: int) -> dict:
    """``{"model": {name: param}, "optim": {"state": {name: {master, exp_avg, exp_avg_sq}}}}``."""
    return {
        "model": {n: leaf(n, "param") for n in ZERO_SHAPES},
        "optim": {"state": {n: {s: leaf(n, s) for s in ZERO_STATES} for n in ZERO_SHAPES}},
        "step": step,
    }


def _save_zero(root: Path, rank: int, world: int) -> None:
    """Case 3 source: ZeRO-1/2 style, every rank holds one partition of each flat buffer
    (bf16 params, fp32 master and moments), the FlatShards being views into it."""
    frags = {}
    for kind in ("param", *ZERO_STATES):
        dtype = torch.bfloat16 if kind == "param" else torch.float32
        buffer = flat_buffer({n: _zero_ref(n, kind) for n in ZERO_SHAPES}, world, rank, dtype)
        frags[kind] = flat_fragments(buffer, ZERO_SHAPES, world, rank)
    # the partition boundaries really cut rows (of big.weight on ranks 2 and 3)
    assert rank in (0, 1) or frags["master"]["big.weight"].flat_offset % 131
    sd = _zero_state_dict(lambda n, k: frags[k][n], 5)
    ucp_zarr.save(sd, root / "ck_zero", chunk_bytes=8192)


def _load_zero_tp2(root: Path, rank: int, world: int) -> None:
    """Case 3 target: TP(2) with ucp_zarr.Shard column (dim 0) and row (dim 1) splits."""

    def target(name: str, kind: str) -> Any:
        dtype = torch.bfloat16 if kind == "param" else torch.float32
        dim = ZERO_TP[name]
        if dim is None:
            return torch.full(ZERO_SHAPES[name], SENTINEL, dtype=dtype)
        return shard_target(ZERO_SHAPES[name], dtype, dim, world, rank)

    def check(value: Any, name: str, kind: str) -> None:
        ref, dim, what = _zero_ref(name, kind), ZERO_TP[name], f"{name} {kind}"
        if dim is None:
            assert_bits_equal(value, ref, what)
        else:
            lo, hi = bounds(ref.shape[dim], world, rank)
            assert value.global_offset[dim] == lo and value.local.shape[dim] == hi - lo
            assert_bits_equal(value.local, ref.narrow(dim, lo, hi - lo), what)

    sd = _zero_state_dict(target, 0)
    ucp_zarr.load(sd, root / "ck_zero")
    assert sd["step"] == 5
    for n in ZERO_SHAPES:
        check(sd["model"][n], n, "param")
        for s in ZERO_STATES:
            check(sd["optim"]["state"][n][s], n, s)


MANUAL_TP = {
    # name: (shape, dtype, split dim or None for replicated)
    "col.weight": ((37, 50), torch.float32, 0),  # 10/10/10/7 rows
    "col.bias": ((37,), torch.float32, 0),
    "row.weight": ((24, 38), torch.float32, 1),  # 10/10/10/8 columns
    "row.bias": ((24,), torch.float32, None),
    "qkv.weight": ((48, 16), torch.float32, 0),  # 12 each
    "head.weight": ((20, 9), torch.float32, 1),  # 3/3/3/0 columns: rank 3 holds nothing
}
MANUAL_TP_MIXED = {
    # the same splits in several dtypes, in one checkpoint
    "col.weight": ((37, 50), torch.bfloat16, 0),
    "col.bias": ((37,), torch.float32, 0),
    "row.weight": ((24, 38), torch.float16, 1),
    "row.bias": ((24,), torch.bfloat16, None),
    "head.weight": ((20, 9), torch.float16, 1),
    "index": ((12, 5), torch.int64, 0),
}
MANUAL_VARIANTS = {"ck_manual_tp": MANUAL_TP, "ck_manual_tp_mixed": MANUAL_TP_MIXED}


def _save_manual_tp(root: Path, rank: int, world: int, ck: str) -> None:
    """Case 4 source: Megatron-style manual TP(4), column and row splits as ucp_zarr.Shard;
    plus a TP(2) x DP(2) slab with replicas told apart by replica_id."""
    tp = {}
    for name, (shape, dtype, dim) in MANUAL_VARIANTS[ck].items():
        ref = ref_tensor(name, shape, dtype, seed=4)
        tp[name] = ref.clone() if dim is None else shard_of(ref, dim, world, rank)
    tp["dp_rep"] = shard_of(ref_tensor("dp_rep", (16, 6), seed=4), 0, 2, rank % 2, replica_id=rank // 2)
    ucp_zarr.save({"tp": tp, "iteration": 40}, root / ck)


def _load_manual_tp_in_one_process(root: Path, ck: str) -> None:
    """Case 4 target: this process, no process group, plain whole tensors."""
    spec = MANUAL_VARIANTS[ck]
    target = {name: torch.full(shape, SENTINEL).to(dtype) for name, (shape, dtype, _) in spec.items()}
    target["dp_rep"] = torch.full((16, 6), SENTINEL)
    sd = {"tp": target, "iteration": 0}
    ucp_zarr.load(sd, root / ck)
    for name, (shape, dtype, _) in spec.items():
        assert_bits_equal(target[name], ref_tensor(name, shape, dtype, seed=4), name)
    assert_bits_equal(target["dp_rep"], ref_tensor("dp_rep", (16, 6), seed=4), "dp_rep")
    assert sd["iteration"] == 40


def _save_one_writer(root: Path, rank: int, world: int) -> None:
    """Case 8 source: a flat-partitioned tensor cut into 4096-byte chunks at odd places, and
    a replicated tensor of 10 chunks; every rank records the objects it wrote."""
    shapes = {"zero": (203, 97)}
    buf = flat_buffer({"zero": ref_tensor("zero", (203, 97), seed=8)}, world, rank, torch.float32)
    sd = {
        "zero": flat_fragments(buf, shapes, world, rank)["zero"],
        "rep": ref_tensor("rep", (128, 80), seed=8),  # 40 KiB on every rank
    }
    result = ucp_zarr.save(sd, root / "ck_one_writer", chunk_bytes=4096)
    assert isinstance(result, ucp_zarr.protocol.saver.SaveResult) and result.rank == rank
    (root / f"objects.{rank}.json").write_text(json.dumps(list(result.objects)))


def _save_per_rank(root: Path, rank: int, world: int) -> None:
    """Case 9 source: RNG-state-like tensor and data position that differ per rank."""
    sd = {
        "rng": ucp_zarr.PerRank(torch.tensor([rank] * 3)),
        "loader": {"pos": ucp_zarr.PerRank(rank * 10)},
        "shared": ref_tensor("shared", (4, 4), seed=9),
        "step": 9,
    }
    ucp_zarr.save(sd, root / "ck_per_rank")


def _load_per_rank(root: Path, rank: int, world: int) -> None:
    sd = {"rng": torch.tensor([100 + rank] * 3), "loader": {"pos": -1}, "shared": torch.zeros(4, 4), "step": 0}
    if rank >= 4:  # a new rank: strict loading refuses to leave its per-rank state unrestored
        with pytest.raises(ucp_zarr.PerRankStateError, match=r"rank 4 .*'rng'.*'loader.pos'"):
            ucp_zarr.load(sd, root / "ck_per_rank")
        assert sd["rng"].tolist() == [100 + rank] * 3 and sd["step"] == 0  # nothing was read
    ucp_zarr.load(sd, root / "ck_per_rank", allow_new_ranks=True)
    assert_bits_equal(sd["shared"], ref_tensor("shared", (4, 4), seed=9), "shared")
    assert sd["step"] == 9
    if rank < 4:  # the rank existed at save time: its own saved values
        assert sd["rng"].tolist() == [rank] * 3, sd["rng"]
        assert sd["loader"] == {"pos": rank * 10}, sd["loader"]
    else:  # a new rank keeps its own
        assert sd["rng"].tolist() == [100 + rank] * 3, sd["rng"]
        assert sd["loader"] == {"pos": -1}, sd["loader"]


def _expect_failure(fn: Callable[[], Any], *needles: str, error: type = Exception) -> str:
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _failures(root: Path, rank: int, world: int) -> None:
    """Case 10: one rank's failure fails the save on every rank, and leaves nothing committed;
    an invalid global layout (a DTensor's local shards other than its placements give
    included) is refused on every rank before anything is written."""
    import torch.distributed as dist

    # (a) a value only rank 2 cannot store
    path = root / "fail_json"
    sd = {"w": torch.ones(3), "x": object() if rank == 2 else [1, 2]}
    msg = _expect_failure(lambda: ucp_zarr.save(sd, path), "rank 2", error=ucp_zarr.CheckpointError)
    assert "rank 0:" not in msg and "rank 1:" not in msg and "rank 3:" not in msg, msg
    dist.barrier()
    with pytest.raises((ucp_zarr.IncompleteCheckpointError, FileNotFoundError)):
        ucp_zarr.open(path)

    # (b) rank 2's writes fail after the others have written theirs
    path = root / "fail_write"
    import ucp_zarr.protocol.saver as saver

    original = saver.write_shard
    if rank == 2:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError("injected write failure")

        saver.write_shard = broken
    try:
        sd = {"w": shard_of(ref_tensor("w", (160, 128), seed=10), 0, world, rank)}  # 80 KB: 4 objects
        msg = _expect_failure(lambda: ucp_zarr.save(sd, path), "rank 2", "injected write failure",
                              error=ucp_zarr.CheckpointError)
        assert "rank 0:" not in msg and "rank 1:" not in msg and "rank 3:" not in msg, msg
    finally:
        saver.write_shard = original
    dist.barrier()
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(path)
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.load({"w": torch.zeros(160, 128)}, path)

    # (c) partial overlap: rank 0 (and its replicas 2, 3) hold rows 0:6, rank 1 rows 4:10
    path = root / "fail_overlap"
    ov = ref_tensor("ov", (10, 4), seed=10)
    sd = {"ok": torch.ones(2), "ov": ucp_zarr.Shard(ov[4:10].clone(), (10, 4), (4, 0)) if rank == 1
          else ucp_zarr.Shard(ov[0:6].clone(), (10, 4), (0, 0), replica_id=rank)}
    _expect_failure(lambda: ucp_zarr.save(sd, path), "'ov'", "overlap")
    dist.barrier()
    assert not path.exists() or not any(path.iterdir()), sorted(path.rglob("*"))

    # (d) a hole: rank r holds rows 3r:3r+2 of 12
    path = root / "fail_hole"
    hole = ref_tensor("hole", (12, 3), seed=10)
    sd = {"hole": ucp_zarr.Shard(hole[3 * rank : 3 * rank + 2].clone(), (12, 3), (3 * rank, 0))}
    _expect_failure(lambda: ucp_zarr.save(sd, path), "'hole'", "24 of its 36")
    dist.barrier()
    assert not path.exists() or not any(path.iterdir()), sorted(path.rglob("*"))

    # (e) ranks disagree on the dtype
    path = root / "fail_dtype"
    sd = {"mix": torch.ones(3, dtype=torch.float64 if rank == 3 else torch.float32)}
    _expect_failure(lambda: ucp_zarr.save(sd, path), "'mix'", "rank 3")
    dist.barrier()
    assert not path.exists() or not any(path.iterdir())

    # (f) a DTensor whose local shards are not those of its placements (from_local with shape=:
    # rank 0 holds 5 rows of 13, rank 3 none; Shard(0) gives 4, 4, 4, 1): its 5th row was dropped
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    path = root / "fail_local_shape"
    rows = {0: (0, 5), 1: (5, 9), 2: (9, 13), 3: (13, 13)}[rank]
    local = ref_tensor("uneven", (13, 2), seed=10)[rows[0] : rows[1]].clone()
    dt = DTensor.from_local(local, init_device_mesh("cpu", (world,)), [Shard(0)], shape=torch.Size([13, 2]), stride=(2, 1))
    _expect_failure(lambda: ucp_zarr.save({"uneven": dt}, path), "'uneven'", "(5, 2)", "(4, 2)")
    dist.barrier()
    assert not path.exists() or not any(path.iterdir())


def _job_save4(rank: int, world: int, root_s: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root = Path(root_s)
    mesh1d = init_device_mesh("cpu", (4,))
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _case(root_s, "save.fsdp4", rank, _save_fsdp4, root, rank)
    _case(root_s, "save.tp2dp2", rank, _save_tp2dp2, root, rank, mesh2d)
    _case(root_s, "save.fsdp_tp", rank, _save_fsdp_tp, root, rank, mesh2d)
    _case(root_s, "save.uneven", rank, _save_uneven, root, rank, mesh1d, mesh2d)
    _case(root_s, "save.zero", rank, _save_zero, root, rank, world)
    _case(root_s, "save.manual_tp", rank, _save_manual_tp, root, rank, world, "ck_manual_tp")
    _case(root_s, "save.one_writer", rank, _save_one_writer, root, rank, world)
    _case(root_s, "save.per_rank", rank, _save_per_rank, root, rank, world)
    _case(root_s, "failures", rank, _failures, root, rank, world)
    _case(root_s, "save.manual_tp_mixed", rank, _save_manual_tp, root, rank, world, "ck_manual_tp_mixed")


# === the load jobs ===============================================================================


def _load_fsdp_tp_into_flat(root: Path, rank: int, world: int) -> None:
    """Case 7 target: ZeRO-style flat partitions over 3 ranks of params and moments."""
    ref = torch.load(root / "ref_fsdp_tp.pt", weights_only=True)
    shapes = {n: tuple(t.shape) for n, t in ref["model"].items()}
    kinds = ("param", "exp_avg", "exp_avg_sq")
    _, lo, hi = flat_partition(shapes, world, rank)
    buffers = {k: torch.full((hi - lo,), SENTINEL) for k in kinds}
    frags = {k: flat_fragments(b, shapes, world, rank) for k, b in buffers.items()}
    sd = {
        "model": frags["param"],
        "optim": {
            "state": {
                n: {"exp_avg": frags["exp_avg"][n], "exp_avg_sq": frags["exp_avg_sq"][n], "step": torch.tensor(0.0)}
                for n in shapes
            },
            "param_groups": [dict(g, lr=0.0) for g in ref["optim"]["param_groups"]],
        },
    }
    ucp_zarr.load(sd, root / "ck_fsdp_tp")
    expected = {
        "param": ref["model"],
        "exp_avg": {n: ref["optim"]["state"][n]["exp_avg"] for n in shapes},
        "exp_avg_sq": {n: ref["optim"]["state"][n]["exp_avg_sq"] for n in shapes},
    }
    for k in kinds:
        assert_bits_equal(buffers[k], flat_buffer(expected[k], world, rank, torch.float32), f"flat {k} buffer")
    for n in shapes:
        assert_bits_equal(sd["optim"]["state"][n]["step"], ref["optim"]["state"][n]["step"], f"{n}.step")
    assert sd["optim"]["param_groups"][0]["lr"] == ref["optim"]["param_groups"][0]["lr"]


def _job_load3(rank: int, world: int, root_s: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root = Path(root_s)
    mesh = init_device_mesh("cpu", (3,))
    _case(root_s, "load3.fsdp4", rank, _load_trained_into_fsdp, root / "ck_fsdp4", root / "ref_fsdp4.pt", Net, mesh,
          "FSDP2(4) -> FSDP2(3)")
    _case(root_s, "load3.tp2dp2", rank, _load_trained_into_fsdp, root / "ck_tp2dp2", root / "ref_tp2dp2.pt", MLP,
          mesh, "TP2xDP2 -> FSDP2(3)")
    _case(root_s, "load3.fsdp_tp", rank, _load_fsdp_tp_into_flat, root, rank, world)
    _case(root_s, "load3.uneven", rank, _load_uneven, root, rank, world)
    _case(root_s, "load3.per_rank", rank, _load_per_rank, root, rank, world)


def _async_save(root: Path, rank: int, world: int) -> None:
    """Case 11: the future returns after staging; mutations afterwards are not saved."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    refs = {"w": ref_tensor("w", (9, 5), seed=11), "b": ref_tensor("b", (6,), seed=11),
            "m": ref_tensor("m", (7, 3), seed=11)}
    sd = {
        "w": dtensor_of(refs["w"], mesh, [Shard(0)]),
        "b": refs["b"].clone(),
        "m": shard_of(refs["m"], 1, world, rank),
        "step": 3,
    }
    fut = ucp_zarr.async_save(sd, root / "ck_async")
    assert isinstance(fut, concurrent.futures.Future)
    # mutate right away, in place, while the background thread writes
    sd["w"].to_local().fill_(-1.0)
    sd["b"].fill_(-1.0)
    sd["m"].local.fill_(-1.0)
    sd["step"] = 4
    # a second async save of the mutated state waits for the first
    fut2 = ucp_zarr.async_save(sd, root / "ck_async2")
    result = fut.result(timeout=300)
    assert isinstance(result, ucp_zarr.protocol.saver.SaveResult) and result.rank == rank and result.objects
    assert isinstance(fut2.result(timeout=300), ucp_zarr.protocol.saver.SaveResult)
    dist.barrier()
    ck = ucp_zarr.open(root / "ck_async")
    for k, t in refs.items():
        assert_bits_equal(ck[k][...], t, f"async {k}")
    assert ck.metadata["values"]["step"] == 3
    ck2 = ucp_zarr.open(root / "ck_async2")
    for k, t in refs.items():
        assert_bits_equal(ck2[k][...], torch.full_like(t, -1.0), f"async (second save) {k}")
    assert ck2.metadata["values"]["step"] == 4


def _mixed_dtype_exchange(root: Path, rank: int, world: int) -> None:
    """Boundary pieces of several dtypes travel to one writer in one message: a bf16 piece of
    one element (2 bytes) then an fp32 one (regression: it used to sit misaligned)."""
    refs = {"a": torch.arange(4, dtype=torch.bfloat16), "b": torch.arange(4, dtype=torch.float32) + 0.5}
    lo, hi = (0, 3) if rank == 0 else (3, 4)
    sd = {k: ucp_zarr.FlatShard(t[lo:hi].clone(), (4,), lo) for k, t in refs.items()}
    ucp_zarr.save(sd, root / "ck_exchange")
    import torch.distributed as dist

    dist.barrier()
    ck = ucp_zarr.open(root / "ck_exchange")
    for k, t in refs.items():
        assert_bits_equal(ck[k][...], t, k)


def _job_load2(rank: int, world: int, root_s: str) -> None:
    root = Path(root_s)
    _case(root_s, "exchange", rank, _mixed_dtype_exchange, root, rank, world)
    _case(root_s, "async", rank, _async_save, root, rank, world)
    _case(root_s, "load2.zero", rank, _load_zero_tp2, root, rank, world)


def _job_load5(rank: int, world: int, root_s: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root = Path(root_s)
    mesh = init_device_mesh("cpu", (5,))
    _case(root_s, "load5.single", rank, _load_trained_into_fsdp, root / "ck_single", root / "ref_single.pt", Net,
          mesh, "1 process -> FSDP2(5)")
    _case(root_s, "load5.uneven", rank, _load_uneven, root, rank, world)
    _case(root_s, "load5.per_rank", rank, _load_per_rank, root, rank, world)


# === fixtures: one job per world size ==============================================================


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def saved4(root: Path) -> str | None:
    return _job(root, 4, _job_save4)


@pytest.fixture(scope="module")
def saved1(root: Path) -> None:
    """Case 5 source: a single process (no process group) saves a trained Net with Adam."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, _net_inputs)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    ucp_zarr.save(sd, root / "ck_single")
    torch.save(full_copy(sd), root / "ref_single.pt")


@pytest.fixture(scope="module")
def loaded3(root: Path, saved4: str | None) -> str | None:
    return _job(root, 3, _job_load3)


@pytest.fixture(scope="module")
def loaded2(root: Path, saved4: str | None) -> str | None:
    return _job(root, 2, _job_load2)


@pytest.fixture(scope="module")
def loaded5(root: Path, saved4: str | None, saved1: None) -> str | None:
    return _job(root, 5, _job_load5)


# === the matrix ================================================================================


def test_fsdp2_4_to_fsdp2_3(root, saved4, loaded3):
    _expect_ok(root, saved4, "save.fsdp4", 4)
    _expect_ok(root, loaded3, "load3.fsdp4", 3)


def test_tp2_dp2_to_fsdp2_3(root, saved4, loaded3):
    _expect_ok(root, saved4, "save.tp2dp2", 4)
    _expect_ok(root, loaded3, "load3.tp2dp2", 3)


def test_zero_flat_4_to_tp2(root, saved4, loaded2):
    """ZeRO(4) flat partitions (bf16 params, fp32 master and moments, boundaries cutting rows)
    -> TP(2) column and row splits."""
    _expect_ok(root, saved4, "save.zero", 4)
    _expect_ok(root, loaded2, "load2.zero", 2)
    meta = ucp_zarr.open(root / "ck_zero").array_meta("optim.state.big.weight.master")
    assert meta.grid.shard_counts[0] > 1  # shards about one partition each, cut by the partitions


def test_manual_tp4_to_one_process(root, saved4):
    _expect_ok(root, saved4, "save.manual_tp", 4)
    _load_manual_tp_in_one_process(root, "ck_manual_tp")


def test_manual_tp4_mixed_dtypes_to_one_process(root, saved4):
    _expect_ok(root, saved4, "save.manual_tp_mixed", 4)
    _load_manual_tp_in_one_process(root, "ck_manual_tp_mixed")


def test_one_process_to_fsdp2_5(root, saved1, loaded5):
    _expect_ok(root, loaded5, "load5.single", 5)


def test_uneven_dtensor_shards(root, saved4, loaded3, loaded5):
    _expect_ok(root, saved4, "save.uneven", 4)
    _expect_ok(root, loaded3, "load3.uneven", 3)
    _expect_ok(root, loaded5, "load5.uneven", 5)
    ck = ucp_zarr.open(root / "ck_uneven")
    for name, (shape, dtype, _, _) in UNEVEN.items():
        assert_bits_equal(ck[f"uneven.{name}"][...], ref_tensor(name, shape, dtype, seed=6), name)


def test_fsdp2_tp_2x2_to_flat_3(root, saved4, loaded3):
    _expect_ok(root, saved4, "save.fsdp_tp", 4)
    _expect_ok(root, loaded3, "load3.fsdp_tp", 3)


def _objects(root: Path) -> list[set[str]]:
    return [set(json.loads((root / f"objects.{r}.json").read_text())) for r in range(4)]


def _files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def test_each_object_is_written_by_exactly_one_rank(root, saved4):
    _expect_ok(root, saved4, "save.one_writer", 4)
    path = root / "ck_one_writer"
    objects = _objects(root)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not objects[a] & objects[b], (a, b, sorted(objects[a] & objects[b]))
    union = set().union(*objects)
    files = _files(path)
    # every stored file, except the commit record, was reported by exactly one rank
    assert files - {"zarr.json"} <= union, sorted(files - union)
    assert len(files) > 12

    ck = ucp_zarr.open(path)
    # the flat partitions cut the chunk grid: some shards hold elements of two ranks, and
    # were written by one of them after the boundary pieces were exchanged
    grid = ck.array_meta("zero").grid
    cuts = [bounds(203 * 97, 4, r)[1] for r in range(3)]
    straddling = []
    for index in grid.all_shards():
        box = grid.shard_box(index)
        first = box.offset[0] * 97 + box.offset[1]
        last = (box.stop[0] - 1) * 97 + box.stop[1] - 1
        straddling += [(index, c) for c in cuts if first < c <= last]
    assert len(straddling) >= 3, (grid, cuts, straddling)
    assert_bits_equal(ck["zero"][...], ref_tensor("zero", (203, 97), seed=8), "zero")
    # the replicated tensor's shards are spread over the replicas
    rep = ck.array_path("rep")
    writers = {r for r in range(4) if any(o.startswith(f"{rep}/c") for o in objects[r])}
    assert len(writers) > 1, writers
    assert_bits_equal(ck["rep"][...], ref_tensor("rep", (128, 80), seed=8), "rep")


def test_save_result_objects_are_exactly_the_stored_files(root, saved4):
    """The union of the ranks' SaveResult.objects is the checkpoint's files, commit record
    (reported by rank 0) included."""
    _expect_ok(root, saved4, "save.one_writer", 4)
    objects = _objects(root)
    assert "zarr.json" in objects[0]
    assert set().union(*objects) == _files(root / "ck_one_writer")


def test_per_rank_state_follows_the_rank(root, saved4, loaded3, loaded5):
    _expect_ok(root, saved4, "save.per_rank", 4)
    _expect_ok(root, loaded3, "load3.per_rank", 3)
    _expect_ok(root, loaded5, "load5.per_rank", 5)
    meta = ucp_zarr.open(root / "ck_per_rank").metadata
    assert meta["rank_values"] == {"loader.pos": {0: 0, 1: 10, 2: 20, 3: 30}}
    assert meta["per_rank_tensors"] == ["rng"]
    assert meta["values"]["step"] == 9 and meta["world_size"] == 4


def test_failures_agree_and_commit_nothing(root, saved4):
    _expect_ok(root, saved4, "failures", 4)


def test_boundary_pieces_of_mixed_dtypes(root, loaded2):
    _expect_ok(root, loaded2, "exchange", 2)


def test_async_save_on_two_ranks(root, loaded2):
    _expect_ok(root, loaded2, "async", 2)
