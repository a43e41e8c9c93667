"""DCP folders in and out: real ``dcp.save`` output of FSDP2 (with Adam state), TP
(column/row-wise), FSDP2 x TP on a 2x2 mesh (``_StridedShard``) and DDP, written by gloo jobs,
converted bit-exact against the full tensors gathered at save time; exported back and read by
``dcp.load`` in one process without a process group; loaded with ``ucp_zarr.load`` onto
another layout. Bad input (missing or truncated data files, a ``.metadata`` that pickles a
foreign class, a path out of the folder, pickled values) is refused naming the file, and
leaves no checkpoint behind.
"""

from __future__ import annotations

import argparse
import io
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run
from _states import full_copy
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ucp_zarr
from ucp_zarr.converters import dcp as dcp_convert
from ucp_zarr.converters import read_source
from ucp_zarr.errors import ConversionError, UntrustedInputError
from ucp_zarr.layout import Box
from ucp_zarr.format.statedict import iter_leaves

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save/load in one process


class MLP(nn.Module):
    """``up`` column-parallel, ``down`` row-parallel under TP; 51 embedding rows are 26/25
    under FSDP2(2)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(51, 16)
        self.up = nn.Linear(16, 36)
        self.down = nn.Linear(36, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(self.emb(x)))))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for i in range(steps):
        out = model(torch.randint(0, 51, (4, 5), generator=torch.Generator().manual_seed(i)))
        loss = (out.full_tensor() if hasattr(out, "full_tensor") else out).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


EXTRA = {"step": 7, "tag": "run-a", "blob": b"\x00\x01\xff"}


def _flat(sd: dict) -> dict:
    return {leaf.key: leaf.value for leaf in iter_leaves(sd)}


def _save(rank: int, model: nn.Module, opt: torch.optim.Optimizer, d: Path, name: str) -> dict:
    """``dcp.save`` of ``get_state_dict`` (+ extra values, one an ``io.BytesIO``) to ``d/name``;
    rank 0 saves the gathered full state (flattened) as ``d/ref_<name>.pt``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    full = full_copy(sd)  # a collective, before the save
    extra = {"step": EXTRA["step"], "tag": EXTRA["tag"], "blob": io.BytesIO(EXTRA["blob"])}
    dcp.save({**sd, "extra": extra}, checkpoint_id=d / name)
    if rank == 0:
        torch.save(_flat(full), d / f"ref_{name}.pt")
    return sd


def _job_2(rank: int, world: int, d: str) -> None:
    """FSDP2(2), TP(2) and DDP(2), each trained two Adam steps and saved with dcp.save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our forward returns a view
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP()
    for m in (model.emb, model.up, model.down):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt)
    _save(rank, model, opt, Path(d), "fsdp")

    torch.manual_seed(1)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    _train(model, opt)
    _save(rank, model, opt, Path(d), "tp")

    torch.manual_seed(2)
    model = nn.parallel.DistributedDataParallel(MLP())
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    _train(model, opt)
    _save(rank, model, opt, Path(d), "ddp")


def _fsdp_tp(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = parallelize_module(MLP(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _job_4(rank: int, world: int, d: str) -> None:
    """FSDP2(2) x TP(2): save with dcp.save; then load the converted FSDP2(2) checkpoint
    into two other such models, with ucp_zarr.load (``fsdp.zarr``) and with dcp.load (its
    export, ``fsdp.export``), and keep what they hold."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor.placement_types import _StridedShard

    model, opt = _fsdp_tp(seed=3, lr=4e-2)
    _train(model, opt)
    sd = _save(rank, model, opt, Path(d), "fsdp_tp")
    assert isinstance(sd["model"]["up.weight"].placements[0], _StridedShard), sd["model"]["up.weight"].placements

    for seed, name in ((4, "loaded_fsdp_tp"), (5, "dcp_loaded_fsdp_tp")):
        model, opt = _fsdp_tp(seed=seed, lr=0.5)
        _train(model, opt, steps=1)  # other weights, and Adam state to fill
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd, "extra": {"step": -1, "tag": "", "blob": b""}}
        if name == "loaded_fsdp_tp":
            ucp_zarr.load(target, Path(d) / "fsdp.zarr")
        else:
            dcp.load(target, checkpoint_id=Path(d) / "fsdp.export")
        full = full_copy(target)
        if rank == 0:
            torch.save(_flat(full), Path(d) / f"{name}.pt")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    """The DCP folders ``fsdp``, ``tp``, ``ddp``, ``fsdp_tp`` and their references; and
    ``fsdp`` converted and exported, then loaded onto FSDP2 x TP (``*loaded_fsdp_tp.pt``)."""
    d = tmp_path_factory.mktemp("dcp_convert")
    run(2, _job_2, str(d), timeout_s=120)
    ucp_zarr.convert(d / "fsdp", d / "fsdp.zarr")
    ucp_zarr.export(d / "fsdp.zarr", d / "fsdp.export", to="dcp", block_bytes=300)
    run(4, _job_4, str(d), timeout_s=120)
    return d


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor) and _bits_equal(got[k], v), k
        else:
            assert got[k] == v and type(got[k]) is type(v), (k, got[k], v)


def _chunks(folder: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    md = dcp.FileSystemReader(folder).read_metadata()  # our own files: the plain unpickler is fine here
    return {
        k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def _round_trip(src: Path, want: dict, tmp_path: Path, block_bytes: int = 512) -> ucp_zarr.Checkpoint:
    """convert ``src``; every tensor and value as ``want``; export to DCP in blocks of
    ``block_bytes``; ``dcp.load`` (one process, no process group) gives ``want`` again."""
    ucp_zarr.convert(src, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.meta.layout["source"] == {"format": "dcp"}  # (and layout.dcp: the nesting, BytesIO values)
    assert sorted(ck) == sorted(_chunks(src))
    got = {k: ck.read(k) for k in ck} | ck.metadata["values"]
    _assert_same(got, want)

    done: list[int] = []
    out = ucp_zarr.export(tmp_path / "ck", tmp_path / "dcp2", to="dcp", block_bytes=block_bytes, progress=lambda n, t: done.append(n))
    assert done[-1] == ck.nbytes()
    for k, boxes in _chunks(out).items():  # streamed in blocks: each one a chunk
        assert all(torch.Size(s).numel() * getattr(torch, ck.meta.tensors[k].dtype).itemsize <= block_bytes for _, s in boxes), k
    target: dict[str, Any] = {k: _blank(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    dcp.load(target, checkpoint_id=out)
    blobs = [k for k in want if k.endswith("blob")]  # (saved as io.BytesIO: dcp.load gives them so, as of the source)
    assert blobs and all(isinstance(target[k], io.BytesIO) for k in blobs), {k: type(target[k]) for k in blobs}
    _assert_same({k: v.getvalue() if k in blobs else v for k, v in target.items()}, want)
    return ck


def _blank(like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=like.dtype)
    t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return t


def _want(jobs: Path, name: str) -> dict:
    return torch.load(jobs / f"ref_{name}.pt", weights_only=True) | {f"extra.{k}": v for k, v in EXTRA.items()}


# --- multi-process sources -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fsdp", "tp", "fsdp_tp", "ddp"])
def test_dcp_save_converts_and_exports_bit_exact(jobs: Path, name: str, tmp_path: Path) -> None:
    want = _want(jobs, name)
    ck = _round_trip(jobs / name, want, tmp_path)
    assert want["optim.param_groups.0.lr"] == {"fsdp": 1e-2, "tp": 2e-2, "ddp": 3e-2, "fsdp_tp": 4e-2}[name]
    assert ck.read("optim.state.up.weight.step") == 2
    # the saved layouts: each chunk of a tensor is what one rank held
    chunks = _chunks(jobs / name)
    if name == "fsdp":
        assert chunks["model.emb.weight"] == [((0, 0), (26, 16)), ((26, 0), (25, 16))]
    if name == "tp":
        assert sorted(chunks["model.up.weight"]) == [((0, 0), (18, 16)), ((18, 0), (18, 16))]
        assert sorted(chunks["model.down.weight"]) == [((0, 0), (16, 18)), ((0, 18), (16, 18))]
    if name == "fsdp_tp":  # TP halves, each split again by FSDP: four chunks of 9 rows
        assert sorted(chunks["optim.state.up.weight.exp_avg"]) == [((r, 0), (9, 16)) for r in (0, 9, 18, 27)]
    if name == "ddp":
        assert all(len(c) == 1 for c in chunks.values())


def test_converted_dcp_loads_onto_fsdp2_tp(jobs: Path) -> None:
    """The FSDP2(2) DCP checkpoint, converted, fills an FSDP2 x TP model and its Adam state
    (``_StridedShard`` placements) through ucp_zarr.load."""
    got = torch.load(jobs / "loaded_fsdp_tp.pt", weights_only=True)
    _assert_same(got, _want(jobs, "fsdp"))


def test_exported_dcp_loads_onto_fsdp2_tp(jobs: Path) -> None:
    """The same checkpoint exported to DCP in row blocks fills an FSDP2 x TP model through
    dcp.load on four ranks."""
    assert len(_chunks(jobs / "fsdp.export")["model.emb.weight"]) == 13  # 51 rows, 4 (256 bytes) per chunk
    with torch.serialization.safe_globals([io.BytesIO]):  # (a BytesIO value comes back as one, as DCP gives it)
        got = torch.load(jobs / "dcp_loaded_fsdp_tp.pt", weights_only=True)
    assert isinstance(got["extra.blob"], io.BytesIO)
    _assert_same(got | {"extra.blob": got["extra.blob"].getvalue()}, _want(jobs, "fsdp"))


def test_a_box_reads_only_the_chunks_it_overlaps(jobs: Path, tmp_path: Path) -> None:
    src = tmp_path / "fsdp"
    shutil.copytree(jobs / "fsdp", src)
    want = _want(jobs, "fsdp")["model.emb.weight"]
    emb = read_source(src).tensors["model.emb.weight"]
    (src / "__1_0.distcp").unlink()  # rank 1's rows 26..50
    box = Box((3, 2), (20, 9))
    t, held = emb.read(box)
    assert _bits_equal(t[box.relative_to(held).slices()], want[3:23, 2:11])
    with pytest.raises(ConversionError, match="__1_0.distcp"):
        emb.read(Box((20, 0), (10, 16)))


# --- one process: every dtype, odd shapes, values --------------------------------------------------


def _plain_state() -> dict:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 9, generator=g)
    return {
        "model": {
            "w": w,
            "wt": torch.randn(6, 11, generator=g).t(),  # saved with transposed strides
            "bf16": torch.randn(13, 3, generator=g).bfloat16(),
            "f16": torch.randn(5, generator=g).half(),
            "f64": torch.randn(2, 2, 2, generator=g).double(),
            "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
            "u8": torch.randint(0, 256, (3, 4), generator=g, dtype=torch.uint8),
            "mask": torch.rand(10, generator=g) > 0.5,
            "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"param_groups": [{"lr": 0.25, "betas": (0.9, 0.999), "params": ["w", "wt"], "fused": None}]},
        "tag": "hello",
        "blob": io.BytesIO(b"\x00raw"),
    }


def _plain_want() -> dict:
    sd = _plain_state()
    return {k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in _flat(sd).items()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dcp_plain") / "dcp"
    dcp.save(_plain_state(), checkpoint_id=d)
    return d


def test_single_process_state_dict_converts_and_exports(plain: Path, tmp_path: Path) -> None:
    ck = _round_trip(plain, _plain_want(), tmp_path, block_bytes=100)
    assert len(_chunks(tmp_path / "dcp2")["model.w"]) == 20  # 40 rows of 36 bytes, two per chunk
    # loads into a nested state dict like any checkpoint, with a prefix too
    target = _plain_state()
    target["model"] = {k: _blank(v) for k, v in target["model"].items()}
    target["tag"], target["blob"], target["optim"]["param_groups"][0]["lr"] = "", b"", 0.0
    ucp_zarr.load(target, tmp_path / "ck")
    _assert_same(_flat(target), _plain_want())
    ucp_zarr.convert(plain, tmp_path / "ck2", prefix="run.")
    assert sorted(ucp_zarr.open(tmp_path / "ck2")) == sorted("run." + k for k in ck)


def test_conjugate_and_negative_views_convert_as_dcp_loads_them(tmp_path: Path) -> None:
    """``torch.save`` keeps a conjugate view's storage unconjugated (and a negative view's
    unnegated) with a flag: the converter read the raw storage, so a conjugated tensor came
    out with its imaginary part's sign flipped. The truth is DCP's own load of the folder."""
    z = torch.tensor([[1 + 2j, 3 - 4j, -5 + 6j], [7 + 8j, -9 - 1j, 2 + 3j]], dtype=torch.complex64)
    sd = {"conj": z.conj(), "conj_t": z.t().conj(), "neg": z.conj().imag, "plain": z, "both": torch._neg_view(z).conj()}
    assert sd["conj"].is_conj() and sd["neg"].is_neg() and sd["both"].is_conj() and sd["both"].is_neg()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    want = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(want, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"))
    assert torch.equal(want["conj"].imag, -z.imag)
    ucp_zarr.convert(tmp_path / "dcp", tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    for k, t in want.items():
        assert torch.equal(ck.read(k), t), k
        assert torch.equal(ck[k][1:, 1:], t[1:, 1:]), k


def test_nonoverlapping_bytes_of_a_chunk_are_not_read(plain: Path, tmp_path: Path) -> None:
    """A box reads only the byte range of the chunk's storage it covers: garbage in the
    other rows goes unseen."""
    src = tmp_path / "dcp"
    shutil.copytree(plain, src)
    w = read_source(src).tensors["model.w"]
    (chunk,) = w.chunks
    with open(chunk.stored.file, "r+b") as f:
        f.seek(chunk.data)
        f.write(b"\xff" * 10 * 9 * 4)  # rows 0..9
    want = _plain_state()["model"]["w"]
    t, held = w.read(Box((10, 0), (30, 9)))
    assert held == Box((10, 0), (30, 9)) and _bits_equal(t, want[10:])
    t, _ = w.read(Box((5, 0), (10, 9)))
    assert not torch.equal(t, want[5:15]) and torch.equal(t[5:], want[10:15])


def test_export_refuses_per_rank_state(tmp_path: Path) -> None:
    ucp_zarr.save({"w": torch.ones(3), "rng": ucp_zarr.PerRank(torch.arange(2)), "v": 1}, tmp_path / "ck")
    with pytest.raises(ConversionError, match=r"\['rng'\] are per-rank state"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "out", to="dcp")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    out = ucp_zarr.export(tmp_path / "ck", tmp_path / "out", to="dcp", keys=["w", "v"])
    target = {"w": torch.zeros(3), "v": 0}
    dcp.load(target, checkpoint_id=out)
    assert torch.equal(target["w"], torch.ones(3)) and target["v"] == 1


# --- bad input ----------------------------------------------------------------------------------


def _copy(plain: Path, tmp_path: Path) -> Path:
    src = tmp_path / "dcp"
    shutil.copytree(plain, src)
    return src


def _refused(src: Path, tmp_path: Path, error: type, match: str, **kw: Any) -> None:
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        ucp_zarr.convert(src, out, **kw)
    assert not (out / "zarr.json").exists()


def test_missing_data_file(plain: Path, tmp_path: Path) -> None:
    src = _copy(plain, tmp_path)
    (src / "__0_0.distcp").unlink()
    _refused(src, tmp_path, ConversionError, r"__0_0\.distcp: missing")


def test_truncated_data_file(plain: Path, tmp_path: Path) -> None:
    src = _copy(plain, tmp_path)
    data = src / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    _refused(src, tmp_path, ConversionError, r"__0_0\.distcp: truncated")


def test_damaged_chunk(plain: Path, tmp_path: Path) -> None:
    src = _copy(plain, tmp_path)
    md = dcp.FileSystemReader(src).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.w")
    with open(src / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"garbage!")
    _refused(src, tmp_path, ConversionError, r"__0_0\.distcp: the chunk at offset \d+ .* not a torch.save archive")


def _rewrite_metadata(src: Path, change: Any) -> None:
    md = dcp.FileSystemReader(src).read_metadata()
    change(md)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_metadata_pickling_a_foreign_class_is_untrusted(plain: Path, tmp_path: Path) -> None:
    src = _copy(plain, tmp_path)
    _rewrite_metadata(src, lambda md: setattr(md, "planner_data", {"model.w": argparse.Namespace(x=1)}))
    _refused(src, tmp_path, UntrustedInputError, r"dcp/\.metadata: holds a pickled argparse\.Namespace")
    ucp_zarr.convert(src, tmp_path / "trusted", trust=True)  # it is only planner data
    assert _bits_equal(ucp_zarr.open(tmp_path / "trusted").read("model.w"), _plain_want()["model.w"])


def test_metadata_naming_a_file_outside_the_folder(plain: Path, tmp_path: Path) -> None:
    src = _copy(plain, tmp_path)
    (tmp_path / "outside.distcp").write_bytes((src / "__0_0.distcp").read_bytes())

    def escape(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp"

    _rewrite_metadata(src, escape)
    _refused(src, tmp_path, ConversionError,
             r"\.metadata: the entry of .* names the file '\.\./outside\.distcp' is refused as a file name: its part '\.\.'")


def test_metadata_chunk_out_of_bounds_or_missing(plain: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    src = _copy(plain, tmp_path)
    moved = ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([40, 9]))
    _rewrite_metadata(src, lambda md: setattr(md.state_dict_metadata["model.w"], "chunks", [moved]))
    _refused(src, tmp_path, ConversionError, r"\.metadata: a chunk of 'model.w' .* lies outside its shape \[40, 9\]")
    half = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([20, 9]))
    _rewrite_metadata(src, lambda md: setattr(md.state_dict_metadata["model.w"], "chunks", [half]))
    _refused(src, tmp_path, ConversionError, r"the chunks of 'model.w' do not tile its shape \[40, 9\]")


def test_pickled_values_need_trust(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1)}, checkpoint_id=tmp_path / "dcp")
    _refused(tmp_path / "dcp", tmp_path, UntrustedInputError, r"__0_0\.distcp: the value 'args' .* weights-only")
    _refused(tmp_path / "dcp", tmp_path, ConversionError, r"the value 'args' .* Namespace", trust=True)


def test_other_serialization_format_is_named(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    pytest.importorskip("safetensors")
    writer = FileSystemWriter(tmp_path / "dcp", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"w": torch.ones(2, 3)}, storage_writer=writer)
    _refused(tmp_path / "dcp", tmp_path, ConversionError, "not a torch.save archive .*SAFETENSORS")


def test_transformed_chunks_are_decoded_with_dcp_extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks written through a stream transform (DCP's ``_extensions``, e.g. zstd) are
    decoded by the registry DCP's reader uses; an unknown transform is named."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Xor(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test-xor"

        @staticmethod
        def from_descriptor(version: str) -> "Xor":
            return Xor()

        def get_descriptor(self) -> str:
            return "test-xor/1"

        def transform_to(self, output: Any) -> Any:
            class W(io.RawIOBase):
                def writable(self) -> bool:
                    return True

                def write(self, b: Any) -> int:
                    output.write(bytes(x ^ 0x5A for x in bytes(b)))
                    return len(b)

            return W()

        def transform_from(self, input: Any) -> Any:
            return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))

    sd = {"w": torch.randn(6, 5), "v": {"a": 1}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "dcp", _extensions=[Xor()]))
    _refused(tmp_path / "dcp", tmp_path, ConversionError, r"transforms \['test-xor/1'\]")

    def registry() -> ExtensionRegistry:
        r = ExtensionRegistry()
        r.register(Xor)
        return r

    monkeypatch.setattr(dcp_convert, "_registry", registry)
    ucp_zarr.convert(tmp_path / "dcp", tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert _bits_equal(ck.read("w"), sd["w"]) and ck.metadata["values"] == {"v.a": 1}


def _tree_equal(a: Any, b: Any, where: str = "") -> None:
    """Leaf for leaf, with the containers, keys and value types of ``b`` (BytesIO by content)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(b, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in b:
            _tree_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _tree_equal(x, y, f"{where}[{i}]")
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, io.BytesIO):
        assert a.getvalue() == b.getvalue(), where
    else:
        assert a == b, (where, a, b)


def test_the_nesting_and_bytes_io_of_a_dcp_folder_survive_convert_and_export(tmp_path: Path) -> None:
    """DCP -> ucp_zarr -> DCP: ``read_state_dict`` of the conversion and torch's own
    ``dcp_to_torch_save`` of the export give what ``dcp_to_torch_save`` gives of the original
    (before: flat keys, and ``io.BytesIO`` values as bytes); a checkpoint saved by
    ``ucp_zarr.save`` exports with the nesting ``dcp.save`` of the same state dict records."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = {"model": {"w": torch.arange(4.0), "b": torch.ones(2)},
          "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
          "lst": [torch.ones(1), {"a": 1}], "blob": io.BytesIO(b"abc"), "epoch": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=tmp_path / "orig")
        dcp_to_torch_save(tmp_path / "orig", tmp_path / "orig.pt")
        want = torch.load(tmp_path / "orig.pt", weights_only=False)
        ucp_zarr.convert(tmp_path / "orig", tmp_path / "ck")
        _tree_equal(ucp_zarr.read_state_dict(tmp_path / "ck"), want)
        ucp_zarr.export(tmp_path / "ck", tmp_path / "back", to="dcp")
        dcp_to_torch_save(tmp_path / "back", tmp_path / "back.pt")
        _tree_equal(torch.load(tmp_path / "back.pt", weights_only=False), want)
        ucp_zarr.save({k: v for k, v in sd.items() if k != "blob"}, tmp_path / "saved")
        ucp_zarr.export(tmp_path / "saved", tmp_path / "out", to="dcp")
        dcp_to_torch_save(tmp_path / "out", tmp_path / "out.pt")
        _tree_equal(torch.load(tmp_path / "out.pt", weights_only=False), {k: v for k, v in want.items() if k != "blob"})


def test_a_foreign_metadata_json_beside_a_dcp_folder_is_no_megatron_folder(plain: Path, tmp_path: Path) -> None:
    """Only Megatron's metadata.json (sharded_backend torch_dist) makes a DCP folder Megatron's:
    another tool's file, even unreadable, leaves it a plain DCP folder."""
    src = tmp_path / "dcp"
    shutil.copytree(plain, src)
    for text in ("", '{"sharded_backend": "zarr"}'):
        (src / "metadata.json").write_text(text)
        ucp_zarr.convert(src, tmp_path / "ck", overwrite=True)
        assert ucp_zarr.open(tmp_path / "ck").meta.layout["source"] == {"format": "dcp"}
