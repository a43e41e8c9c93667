"""torch.distributed.checkpoint interop: ZarrStorageWriter / ZarrStorageReader.

Real multi-process gloo jobs (FSDP2 over 2 and 3 CPU ranks) save with DCP or ucp_zarr and
load with the other on another world size, bit-exact against the full tensors gathered at
save time; single-process checks cover DCP's no-process-group mode and the file layout
(Zarr only, no pickle).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import ucp_zarr
from ucp_zarr.format.statedict import from_json, iter_leaves

CHUNKS = dict(chunk_bytes=4096, shard_bytes=16384)
"""Small chunks and shards, so the larger tensors span many of them."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 64)  # 76.8 KB: several shards, FSDP boundaries inside
        self.fc1 = nn.Linear(64, 30)
        self.fc2 = nn.Linear(30, 7)  # 7 rows: uneven over 2 and 3 ranks
        self.tiny = nn.Parameter(torch.randn(2, 3))  # FSDP2(3) leaves one rank an empty shard
        self.register_buffer("counter", torch.arange(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(x)))) * self.tiny.sum()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        x = torch.randint(0, 300, (8, 5), generator=torch.Generator().manual_seed(seed + i))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _fsdp(world: int, seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our forward returns a view
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.fc1, model.fc2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _flat(sd: dict) -> dict:
    return {leaf.key: leaf.value for leaf in iter_leaves(sd)}


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The full (gathered) state, flattened as DCP flattens it: on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _flat({"model": msd, "optim": osd})


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor) and _bits_equal(got[k], v), k
        else:
            assert got[k] == v, (k, got[k], v)


def _assert_zarr_only(root: Path) -> None:
    """Every file is a zarr.json (JSON) or a chunk/shard object of an indexed array."""
    ck = ucp_zarr.open(root)
    arrays = set()
    for e in ck.meta.tensors.values():
        arrays.add(e.path)
        arrays.update((e.ranks or {}).values())
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    assert "zarr.json" in files
    for f in files:
        assert not f.endswith((".metadata", ".distcp", ".pt", ".pkl")), f
        if f.endswith("zarr.json"):
            json.loads((root / f).read_text())
            continue
        m = re.fullmatch(r"(.+)/c(/\d+)*", f)
        assert m is not None and m.group(1) in arrays, f
        assert not (root / f).read_bytes()[:4] == b"PK\x03\x04", f  # not a torch.save zip


# --- multi-process jobs ------------------------------------------------------------------------
#
# Three spawned jobs cover the matrix (spawning is the slow part on 2 cores):
#   2 ranks: train FSDP2(2); dcp.save(ZarrStorageWriter) -> ck_dcp2 (a); ucp_zarr.save -> ck_ucp2 (b)
#   3 ranks: dcp.load(ZarrStorageReader) of ck_ucp2 onto FSDP2(3) (b); train on; dcp.save -> ck_dcp3 (c)
#   2 ranks: dcp.load(ZarrStorageReader) of ck_dcp3 onto FSDP2(2) (c)
# Each job's rank 0 writes the gathered full state (test artifacts ref*.pt) to compare against.
# Worker functions are module-level: spawned processes import them from this module.


def _state(model: nn.Module, opt: torch.optim.Optimizer, extra: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": extra}


def _dcp_save(rank: int, world: int, sd: dict, path: Path) -> None:
    writer = ucp_zarr.ZarrStorageWriter(path, **CHUNKS)
    dcp.save(sd, storage_writer=writer)
    # every object was written by exactly one rank, and every rank wrote shards
    objects = [set(o) for o in _all_gather(list(writer.result.objects))]
    assert all(not (objects[a] & objects[b]) for a in range(world) for b in range(a)), objects
    assert all(any("/c/" in o for o in objs) for objs in objects), objects


def _dcp_load_and_check(rank: int, world: int, model, opt, path: Path, ref: Path, per_rank: bool) -> None:
    """dcp.load(ZarrStorageReader) into (model, opt) + set_state_dict; the gathered state
    must equal ``ref`` bit for bit. All collectives run before any check, so a failed check
    on one rank cannot leave the others waiting."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    extra = {"step": -1, "lr": 0.0, "tag": ""}
    if per_rank:
        extra.update(rng=torch.full((2,), -1, dtype=torch.int64), pos=-1)
    sd = _state(model, opt, extra)
    dcp.load(sd, storage_reader=ucp_zarr.ZarrStorageReader(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = _full_state(model, opt)

    assert (extra["step"], extra["lr"], extra["tag"]) == (2, 0.125, "run-a")
    if per_rank:  # saved by ranks 0 and 1: theirs come back, rank 2 keeps its own
        if rank < 2:
            assert extra["rng"].tolist() == [rank, 10 + rank] and extra["pos"] == 100 * rank
        else:
            assert extra["rng"].tolist() == [-1, -1] and extra["pos"] == -1
    if rank == 0:
        _assert_same_state(full, torch.load(ref, weights_only=True))
        assert full["optim.param_groups.0.lr"] == 1e-2  # not the 0.5 the optimizer was built with


def _job_save_2(rank: int, world: int, d: str) -> None:
    d_ = Path(d)
    model, opt = _fsdp(world, seed=0, lr=1e-2)
    _train(model, opt, steps=2, seed=0)
    extra = {"step": 2, "lr": 0.125, "tag": "run-a"}
    _dcp_save(rank, world, _state(model, opt, extra), d_ / "ck_dcp2")
    # per-rank state as ucp_zarr.save stores it: a PerRank tensor and a value that differs
    extra = {**extra, "rng": ucp_zarr.PerRank(torch.tensor([rank, 10 + rank], dtype=torch.int64)), "pos": 100 * rank}
    ucp_zarr.save(_state(model, opt, extra), d_ / "ck_ucp2", **CHUNKS)
    # a value only rank 1 holds cannot be stored as JSON: every rank fails the same way
    bad = {"w": torch.ones(2), **({"obj": object()} if rank == 1 else {})}
    try:
        dcp.save(bad, storage_writer=ucp_zarr.ZarrStorageWriter(d_ / "ck_bad"))
        err = ""
    except CheckpointException as e:
        err = str(e)
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, d_ / "ref2.pt")
    assert "failed on 1 of 2 ranks: rank 1: NotJSONableError" in err, err


def _job_3(rank: int, world: int, d: str) -> None:
    import traceback

    d_ = Path(d)
    model, opt = _fsdp(world, seed=1, lr=0.5)
    _train(model, opt, steps=1, seed=50)  # other weights and moments; optimizer state exists
    try:
        _dcp_load_and_check(rank, world, model, opt, d_ / "ck_ucp2", d_ / "ref2.pt", per_rank=True)
        status = "ok"
    except Exception:
        status = traceback.format_exc()
    (d_ / f"b_rank{rank}.txt").write_text(status)
    # train on from the loaded state, then save from 3 ranks for (c)
    _train(model, opt, steps=1, seed=7)
    _dcp_save(rank, world, _state(model, opt, {"step": 2, "lr": 0.125, "tag": "run-a"}), d_ / "ck_dcp3")
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, d_ / "ref3.pt")


def _job_load_2(rank: int, world: int, d: str) -> None:
    d_ = Path(d)
    model, opt = _fsdp(world, seed=2, lr=0.5)
    _train(model, opt, steps=1, seed=60)
    _dcp_load_and_check(rank, world, model, opt, d_ / "ck_dcp3", d_ / "ref3.pt", per_rank=False)


def _all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dcp_jobs")
    run(2, _job_save_2, str(d))
    return d


@pytest.fixture(scope="module")
def three_rank_dir(jobs_dir) -> Path:
    run(3, _job_3, str(jobs_dir))
    return jobs_dir


# --- tests -------------------------------------------------------------------------------------


def test_fsdp2_dcp_save_writes_the_universal_format(jobs_dir):
    """(a) FSDP2(2) + Adam -> get_state_dict -> dcp.save(ZarrStorageWriter) -> ucp_zarr.open."""
    path = jobs_dir / "ck_dcp2"
    want = torch.load(jobs_dir / "ref2.pt", weights_only=True)
    ck = ucp_zarr.open(path)
    assert ck.meta.world_size == 2
    assert "model.emb.weight" in ck and "model.fc2.weight" in ck and "model.counter" in ck
    assert "optim.state.fc1.weight.exp_avg" in ck and "optim.state.fc1.weight.exp_avg_sq" in ck
    assert ck.array_path("optim.state.fc1.weight.exp_avg") == "fc1.weight/optim.exp_avg"
    regions = ck.array_meta("model.emb.weight").regions  # the FSDP2(2) halves, one writer each
    assert [(r.offset, r.shape, r.writers) for r in regions] == [((0, 0), (150, 64), (0,)), ((150, 0), (150, 64), (1,))]
    assert set(ck.keys()) == {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert _bits_equal(ck[key][...], value), key
        else:
            saved = from_json(ck.meta.values[key])
            assert saved == value and type(saved) is type(value), key  # tuples stay tuples
    assert ck.metadata["values"]["extra.tag"] == "run-a"
    _assert_zarr_only(path)
    assert not (jobs_dir / "ck_bad" / "zarr.json").exists()  # the failed save committed nothing
    # ucp_zarr.load reads it like any other checkpoint
    out = {k: torch.zeros_like(v) for k, v in want.items() if isinstance(v, torch.Tensor)}
    ucp_zarr.load(out, path, strict=False)
    assert all(_bits_equal(out[k], want[k]) for k in out)


def test_ucp_zarr_save_2_ranks_dcp_load_fsdp2_3_ranks(three_rank_dir):
    """(b) ucp_zarr.save on FSDP2(2) -> dcp.load(ZarrStorageReader) on FSDP2(3) -> set_state_dict,
    bit-exact, with per-rank state restored on the ranks that saved it."""
    assert ucp_zarr.open(three_rank_dir / "ck_ucp2").metadata["per_rank_tensors"] == ["extra.rng"]
    for rank in range(3):
        status = (three_rank_dir / f"b_rank{rank}.txt").read_text()
        assert status == "ok", f"rank {rank}:\n{status}"


def test_dcp_save_3_ranks_dcp_load_2_ranks(three_rank_dir):
    """(c) dcp.save(ZarrStorageWriter) on FSDP2(3) -> dcp.load(ZarrStorageReader) on FSDP2(2)."""
    path = three_rank_dir / "ck_dcp3"
    _assert_zarr_only(path)
    assert ucp_zarr.open(path).meta.world_size == 3
    run(2, _job_load_2, str(three_rank_dir))


# --- single process, no process group ----------------------------------------------------------


def _plain_state(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.9))
    _train(model, opt, steps=2, seed=seed)
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd}


EXTRA = {
    "step": 7,
    "lr": 3e-4,
    "betas": (0.9, 0.95),
    "name": "run-1",
    "none": None,
    "flags": [True, False],
    "nan": math.nan,
    "blob": b"\x00\x80\xffopaque",
    "sched": {"last_epoch": 3, "milestones": [1, 2]},
    "bf16": torch.randn(6, 3).to(torch.bfloat16),
    "ints": torch.arange(12, dtype=torch.int32).reshape(3, 4),
}


def _blank_extra() -> dict:
    return {
        "step": 0, "lr": 0.0, "betas": (0.0, 0.0), "name": "", "none": 1, "flags": [], "nan": 0.0, "blob": b"",
        "sched": {"last_epoch": 0, "milestones": []},
        "bf16": torch.zeros(6, 3, dtype=torch.bfloat16), "ints": torch.zeros(3, 4, dtype=torch.int32),
    }  # fmt: skip


def _check_extra(got: dict) -> None:
    for k, v in EXTRA.items():
        if isinstance(v, torch.Tensor):
            assert _bits_equal(got[k], v), k
        elif k == "nan":
            assert math.isnan(got[k])
        else:
            assert got[k] == v and type(got[k]) is type(v), (k, got[k])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_single_process_no_process_group_round_trip(tmp_path):
    """(d) dcp.save / dcp.load with the adapters and no process group, non-tensor values included."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    assert not dist.is_initialized()
    model, opt, sd = _plain_state(0, 1e-2)
    dcp.save({**sd, "extra": EXTRA}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck", **CHUNKS))
    _assert_zarr_only(tmp_path / "ck")

    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.meta.world_size == 1
    assert ck.metadata["values"]["extra.step"] == 7 and ck.metadata["values"]["extra.blob"] == EXTRA["blob"]
    assert ck.metadata["values"]["optim.param_groups.0.betas"] == (0.8, 0.9)
    assert _bits_equal(ck["extra.bf16"][...], EXTRA["bf16"])

    model2, opt2, sd2 = _plain_state(5, 0.5)
    extra2 = _blank_extra()
    dcp.load({**sd2, "extra": extra2}, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    _check_extra(extra2)
    set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    got = _flat({"m": model2.state_dict(), "o": opt2.state_dict()})
    _assert_same_state(got, _flat({"m": model.state_dict(), "o": opt.state_dict()}))
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9) and opt2.param_groups[0]["lr"] == 1e-2

    # ucp_zarr.load reads the DCP-written checkpoint too
    extra3 = _blank_extra()
    ucp_zarr.load({"extra": extra3}, tmp_path / "ck", strict=False)
    _check_extra(extra3)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_of_a_ucp_zarr_save_single_process(tmp_path):
    model, opt, sd = _plain_state(0, 1e-2)
    ucp_zarr.save({**sd, "extra": EXTRA}, tmp_path / "ck", **CHUNKS)
    _, _, sd2 = _plain_state(5, 0.5)
    extra2 = _blank_extra()
    reader = ucp_zarr.ZarrStorageReader("elsewhere")  # checkpoint_id wins, as with DCP's readers
    dcp.load({**sd2, "extra": extra2}, checkpoint_id=tmp_path / "ck", storage_reader=reader)
    _check_extra(extra2)
    _assert_same_state(_flat(sd2), _flat(sd))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_reader_metadata_describes_shards_and_values(tmp_path):
    big = torch.randn(300, 64)
    sd = {"big": big, "small": torch.ones(3), "scalar": torch.tensor(2.5), "v": {"a": 1}}
    ucp_zarr.save(sd, tmp_path / "ck", **CHUNKS)
    reader = ucp_zarr.ZarrStorageReader(tmp_path / "ck")
    md = reader.read_metadata()
    assert set(md.state_dict_metadata) == {"big", "small", "scalar", "v.a"}
    assert isinstance(md.state_dict_metadata["v.a"], BytesStorageMetadata)
    tmd = md.state_dict_metadata["big"]
    assert isinstance(tmd, TensorStorageMetadata)
    assert tmd.size == torch.Size([300, 64]) and tmd.properties.dtype == torch.float32
    grid = ucp_zarr.open(tmp_path / "ck").array_meta("big").grid
    boxes = [grid.shard_box(i) for i in grid.all_shards()]
    assert len(tmd.chunks) == len(boxes) > 2
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in tmd.chunks] == [(b.offset, b.shape) for b in boxes]
    assert sum(math.prod(c.sizes) for c in tmd.chunks) == big.numel()
    assert md.state_dict_metadata["scalar"].size == torch.Size([])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_reader_reads_only_what_is_asked(tmp_path):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    sd = {"a": torch.randn(256, 256), "b": torch.randn(4, 4)}
    ucp_zarr.save(sd, tmp_path / "ck", **CHUNKS)
    reader = ucp_zarr.ZarrStorageReader(tmp_path / "ck")
    out = {"b": torch.zeros(4, 4)}
    dcp.load(out, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["b"], sd["b"])
    assert reader._checkpoint().store.stats.bytes_read < 16 << 10  # "a" is 256 KiB


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_writer_overwrites_like_dcp_unless_told_not_to_and_refuses_pickle_only_values(tmp_path):
    sd = {"w": torch.ones(3)}
    dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][:], torch.full((3,), 2.0))  # DCP's default: overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging copy left beside it
    with pytest.raises(CheckpointException, match="already committed") as info:
        dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck", overwrite=False))
    assert isinstance(info.value.failures[0][0], ucp_zarr.CheckpointExistsError)
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][:], torch.full((3,), 2.0))
    with pytest.raises(CheckpointException, match="neither a tensor nor JSON-able") as info:
        dcp.save({"w": torch.ones(3), "obj": object()}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "bad"))
    assert isinstance(info.value.failures[0][0], ucp_zarr.NotJSONableError)
    with pytest.raises((FileNotFoundError, ucp_zarr.IncompleteCheckpointError)):
        ucp_zarr.open(tmp_path / "bad")  # refused before anything was written
    assert not any(p.name.endswith((".metadata", ".distcp")) for p in tmp_path.rglob("*"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_id_and_storage_meta(tmp_path):
    writer = ucp_zarr.ZarrStorageWriter("unused")
    assert ucp_zarr.ZarrStorageWriter.validate_checkpoint_id(tmp_path / "x")
    assert ucp_zarr.ZarrStorageReader.validate_checkpoint_id("memory://x")
    assert not ucp_zarr.ZarrStorageWriter.validate_checkpoint_id(3)  # type: ignore[arg-type]
    md = dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "ck", storage_writer=writer)
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == tmp_path / "ck"
    assert not os.path.exists("unused")
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][...], torch.arange(4.0))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsspec_url_and_reader_reuse():
    url = f"memory://dcp-adapter-{os.getpid()}/ck"
    sd = {"w": torch.randn(50, 40), "n": 3}
    dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(url, **CHUNKS))
    reader = ucp_zarr.ZarrStorageReader(url)
    for _ in range(2):  # the same reader serves two loads
        out = {"w": torch.zeros(50, 40), "n": 0}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], sd["w"]) and out["n"] == 3


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_async_save_single_process(tmp_path):
    _, _, sd = _plain_state(0, 1e-2)
    fut = dcp.async_save({**sd, "extra": {"step": 9}}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    fut.result()
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.metadata["values"]["extra.step"] == 9
    assert all(_bits_equal(ck[k][...], v) for k, v in _flat(sd).items() if isinstance(v, torch.Tensor))


def test_writer_obeys_a_planner_that_resolves_values_itself(tmp_path):
    """DCP's writer saves what the planner's ``resolve_data`` gives. ``ZarrStorageWriter`` took
    non-tensor values from the state dict, so a planner that redacts or migrates them (its
    ``resolve_data`` or ``transform_object`` overridden) was bypassed, and the secret it meant
    to leave out was stored. A planner that saves values as they are (Megatron's
    ``MCoreSavePlanner``: its values are ``torch.save`` streams already) loads back as
    ``dcp.load`` gives them: unpickled, not as the stream."""
    import io

    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class Redacting(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn == "cfg.token":
                data = io.BytesIO()
                torch.save("<redacted>", data)
            return data

    class Migrating(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return super().transform_object(write_item, object + 1000 if write_item.index.fqn == "cfg.step" else object)

    class AsIs(DefaultSavePlanner):  # as megatron.core's MCoreSavePlanner
        def transform_object(self, write_item, object):
            return object

    for planner in (Redacting, Migrating, AsIs):
        got = {}
        for name, writer, reader in (("fs", dcp.FileSystemWriter, dcp.FileSystemReader),
                                     ("z", ucp_zarr.ZarrStorageWriter, ucp_zarr.ZarrStorageReader)):
            blob = io.BytesIO()
            torch.save([{"layer": 3, "scale": 0.5}], blob)
            cfg = {"blob": blob} if planner is AsIs else {"step": 7, "token": "secret", "raw": io.BytesIO(b"\x00raw")}
            sd = {"w": torch.arange(3.0), "cfg": cfg}
            dcp.save(sd, storage_writer=writer(tmp_path / planner.__name__ / name), planner=planner())
            back = {"w": torch.zeros(3), "cfg": {k: (io.BytesIO() if k in ("blob", "raw") else 0) for k in sd["cfg"]}}
            dcp.load(back, storage_reader=reader(tmp_path / planner.__name__ / name))
            got[name] = {k: v.getvalue() if isinstance(v, io.BytesIO) else v for k, v in back["cfg"].items()}
        assert got["z"] == got["fs"], planner.__name__
    assert got["z"]["blob"] == [{"layer": 3, "scale": 0.5}]  # (dcp.load unpickles the stream it saved)
    for planner in (Redacting, Migrating):  # (a BytesIO value, pickled by DCP's default transform_object)
        assert ucp_zarr.read_state_dict(tmp_path / planner.__name__ / "z")["cfg"]["raw"].getvalue() == b"\x00raw"
    stored = ucp_zarr.open(tmp_path / "Redacting" / "z").metadata["values"]
    assert stored["cfg.token"] == "<redacted>" and "secret" not in repr(stored)


def test_dcp_rebuilds_the_nesting_of_a_ucp_zarr_save(tmp_path):
    """DCP's metadata-only loader (``_load_state_dict_from_keys``, what ``dcp_to_torch_save``
    runs) rebuilds the nested state dict from ``planner_data``: a ``ucp_zarr.save`` checkpoint gave
    none, so they returned flat keys (``'model.w'``) where DCP's own checkpoint of the same
    state dict gives ``{'model': {'w': ...}}``; ``_load_state_dict_from_keys(keys=...)`` failed."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    def state():
        return {"model": {"w": torch.arange(6.0).reshape(2, 3), "layers": [{"b": torch.ones(2)}, {"b": torch.zeros(2)}]},
                "meta": {"epoch": 3, "name": "run"}}

    dcp.save(state(), storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    ucp_zarr.save(state(), tmp_path / "ck")
    want = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(tmp_path / "dcp"))
    got = _load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    assert list(got) == list(want) == ["model", "meta"]
    assert got["meta"] == want["meta"] and list(got["model"]) == list(want["model"])
    assert all(torch.equal(a["b"], b["b"]) for a, b in zip(got["model"]["layers"], want["model"]["layers"]))
    part = _load_state_dict_from_keys(keys={"model.w"}, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    assert list(part) == ["model"] and torch.equal(part["model"]["w"], state()["model"]["w"])


def _subgroup_saves(rank: int, world: int, base: str) -> None:
    sub = dist.new_group([0])  # (every rank makes it; only rank 0 saves, as one replica group does)
    if rank != 0:
        return
    state = {"w": torch.arange(4.0)}
    with pytest.raises(CheckpointException, match=r"dcp.save runs over 1 ranks, ZarrStorageWriter's process group has "
                                                  r"2: pass dcp.save's process_group"):
        dcp.save(state, storage_writer=ucp_zarr.ZarrStorageWriter(f"{base}/default"), process_group=sub)
    dcp.save(state, storage_writer=ucp_zarr.ZarrStorageWriter(f"{base}/sub", process_group=sub), process_group=sub)
    assert torch.equal(ucp_zarr.read_state_dict(f"{base}/sub")["w"], state["w"])


def test_a_save_over_a_subgroup_with_the_writers_default_group_is_refused_at_once(tmp_path):
    """``dcp.save(process_group=<ranks [0]>)`` with a writer on the default group (2 ranks):
    the writer's collectives waited for rank 1, which does not save, until the group's
    timeout, ending in a bare gloo error (DCP's own writer saves). Refused at once, naming the
    fix; the writer given the same group saves. (Group timeout 60 s: a wait fails the job.)"""
    run(2, _subgroup_saves, str(tmp_path), timeout_s=60)
