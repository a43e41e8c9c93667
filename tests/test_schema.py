"""The JSON Schemas in ``schema/`` against what ucp_zarr really writes, and against broken documents.

Every ``zarr.json`` a save writes is validated (root -> checkpoint schema, first level ->
group schema, second level -> array schema), together with the cross-field rules the schemas
cannot express (FORMAT.md section 3). Negative tests mutate valid documents and check that
the schemas reject them, so these tests can fail.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import jsonschema
import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr.format.dtypes import _BITS, _NATIVE, stored_dtype, supported_dtypes
from ucp_zarr.format.documents import ArrayMeta, Region
from ucp_zarr.layout import choose_grid

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"
SCHEMAS = ("checkpoint", "group", "array")
CHUNK_BYTES = 4096
SHARD_BYTES = 32768

FLOAT8 = [getattr(torch, n) for n in _BITS if n.startswith("float8") and hasattr(torch, n)]


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft202012Validator]:
    out = {}
    for name in SCHEMAS:
        schema = _schema(name)
        jsonschema.Draft202012Validator.check_schema(schema)
        out[name] = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
    return out


def _errors(validator: jsonschema.Draft202012Validator, doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _fp8(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (every encoding, NaNs included) viewed as an fp8 dtype."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)


def _state_dict() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 64)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)  # optimizer state keyed by parameter FQN
    tensors: dict[str, torch.Tensor] = {
        "bf16": torch.randn(96, 40).bfloat16(),
        "bf16_scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "empty_1d": torch.empty(0, dtype=torch.int64),
        "big": torch.randn(256, 96),  # 96 KiB: several shards of several chunks
        "fp16": torch.randn(33, 17).half(),
        "f64": torch.randn(5, dtype=torch.float64),
        "ints": torch.arange(-50, 50, dtype=torch.int32).reshape(10, 10),
        "mask": torch.rand(3, 4, 5) > 0.5,
        "bytes": torch.randint(0, 256, (31,), dtype=torch.uint8),
    }
    for i, dt in enumerate(FLOAT8):
        tensors[str(dt).removeprefix("torch.")] = _fp8(dt, (17, 9), i)
    return {
        "model": msd,
        "optim": osd,
        "step": 1,
        "extra": {
            "best_loss": float("inf"),
            "worst": float("-inf"),
            "undefined": float("nan"),
            "history": [1.0, float("nan"), 2],
            "betas": (0.9, 0.999),
            "name": "run-7",
            "flag": True,
            "nothing": None,
            "nested": {"a": {"b": [1, 2, 3]}},
        },
        "tensors": tensors,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("schema") / "ckpt"
    sd = _state_dict()
    ucp_zarr.save(sd, path, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES)
    return path, sd


def _strict_json(raw: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"bare {name} in JSON")

    return json.loads(raw, parse_constant=no_constant)


def _documents(root: Path) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Every zarr.json under ``root`` by the schema that applies: by depth in the hierarchy."""
    docs: dict[str, list[tuple[str, dict[str, Any]]]] = {name: [] for name in SCHEMAS}
    kind = {0: "checkpoint", 1: "group", 2: "array"}
    for dirpath, _, files in os.walk(root):
        if "zarr.json" not in files:
            continue
        rel = Path(dirpath).relative_to(root)
        depth = len(rel.parts)
        assert depth in kind, f"unexpected zarr.json at depth {depth}: {rel}"
        docs[kind[depth]].append((rel.as_posix(), _strict_json((Path(dirpath) / "zarr.json").read_text())))
    return docs


# --- the schemas themselves ---------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = _schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_dtype_enums_match_dtypes_py() -> None:
    every = set(_NATIVE) | set(_BITS)
    array_enum = _schema("array")["$defs"]["ucpAttributes"]["properties"]["torch_dtype"]["enum"]
    index_enum = _schema("checkpoint")["$defs"]["tensorEntry"]["properties"]["dtype"]["enum"]
    assert set(array_enum) == every
    assert set(index_enum) == every
    assert {str(d).removeprefix("torch.") for d in supported_dtypes()} <= every
    assert set(_schema("array")["properties"]["data_type"]["enum"]) == set(_NATIVE.values())


def _meta_doc(dtype: torch.dtype, shape: tuple[int, ...] = (64, 48)) -> dict[str, Any]:
    sd = stored_dtype(dtype)
    grid = choose_grid(shape, sd.itemsize, chunk_bytes=CHUNK_BYTES)
    return ArrayMeta("w", sd, grid, (Region((0,) * len(shape), shape),)).to_zarr_json()


@pytest.mark.parametrize(
    "dtype",
    supported_dtypes(),
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_every_supported_dtype_validates(validators, dtype: torch.dtype) -> None:
    for shape in [(64, 48), (), (0, 3), (1000,)]:
        assert _errors(validators["array"], _meta_doc(dtype, shape)) == []


def test_complex_array_is_plain_zarr(validators, tmp_path: Path) -> None:
    import zarr

    ucp_zarr.save({"c": torch.randn(3, dtype=torch.complex64)}, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "c" / "c" / "zarr.json").read_text())
    assert _errors(validators["array"], doc) == []
    zarr.open_array(tmp_path / "c" / "c" / "c", mode="r")


# --- every document of a real save -------------------------------------------------------


def _failures(validators, docs) -> dict[str, list]:
    """Schema errors of every document, by ``kind:path``; empty when all validate."""
    return {
        f"{kind}:{path}": errs
        for kind, items in docs.items()
        for path, doc in items
        if (errs := _errors(validators[kind], doc))
    }


def test_every_written_document_validates(validators, saved) -> None:
    root, _ = saved
    docs = _documents(root)
    assert [p for p, _ in docs["checkpoint"]] == ["."]
    assert docs["group"] and docs["array"]
    assert _failures(validators, docs) == {}


def test_documents_agree_with_each_other(saved) -> None:
    """The cross-field rules of FORMAT.md that JSON Schema cannot express."""
    root, sd = saved
    docs = _documents(root)
    index = docs["checkpoint"][0][1]["attributes"]["ucp_zarr"]
    arrays = dict(docs["array"])
    assert set(arrays) == {e["path"] for e in index["tensors"].values()}
    assert {p.split("/")[0] for p in arrays} == {p for p, _ in docs["group"]}
    for key, entry in index["tensors"].items():
        doc = arrays[entry["path"]]
        attrs = doc["attributes"]["ucp_zarr"]
        rank = len(doc["shape"])
        assert attrs["key"] == key
        assert attrs["torch_dtype"] == entry["dtype"]
        assert doc["shape"] == entry["shape"] == attrs["global_shape"]
        shard = doc["chunk_grid"]["configuration"]["chunk_shape"]
        assert [c["name"] for c in doc["codecs"]] == ["sharding_indexed"]  # every array is sharded
        chunk = doc["codecs"][0]["configuration"]["chunk_shape"]
        assert len(shard) == len(chunk) == rank
        assert all(s % c == 0 for s, c in zip(shard, chunk))
        _check_regions(doc)
    # the commit record holds the SHA-256 of exactly every other document
    written = {p.relative_to(root).as_posix() for p in root.rglob("zarr.json") if p != root / "zarr.json"}
    assert set(index["documents"]) == written
    for path, digest in index["documents"].items():
        assert digest == "sha256:" + hashlib.sha256((root / path).read_bytes()).hexdigest(), path


def _check_regions(doc: dict[str, Any]) -> None:
    """Regions lie inside the array, do not overlap and cover it (FORMAT.md section 10)."""
    shape = doc["shape"]
    count = np.zeros(math.prod(shape), dtype=np.int64)
    for r in doc["attributes"]["ucp_zarr"]["regions"]:
        if "offset" in r:
            assert len(r["offset"]) == len(r["shape"]) == len(shape)
            assert all(o + n <= m for o, n, m in zip(r["offset"], r["shape"], shape))
            count.reshape(shape)[tuple(slice(o, o + n) for o, n in zip(r["offset"], r["shape"]))] += 1
        else:
            assert r["flat_offset"] + r["numel"] <= count.size
            count[r["flat_offset"] : r["flat_offset"] + r["numel"]] += 1
    assert (count == 1).all(), "regions must cover the array exactly once"


def test_save_covers_the_cases(saved) -> None:
    """The fixture really exercises bf16, fp8, 0-d, empty and multi-chunk shards."""
    root, _ = saved
    arrays = dict(_documents(root)["array"])
    index = _strict_json((root / "zarr.json").read_text())["attributes"]["ucp_zarr"]
    dtypes = {e["dtype"] for e in index["tensors"].values()}
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "float64", "int32", "bool", "uint8"} <= dtypes
    shapes = [e["shape"] for e in index["tensors"].values()]
    assert [] in shapes and any(0 in s for s in shapes)
    big = arrays[index["tensors"]["tensors.big"]["path"]]
    assert big["codecs"][0]["name"] == "sharding_indexed"
    shard = big["chunk_grid"]["configuration"]["chunk_shape"]
    chunk = big["codecs"][0]["configuration"]["chunk_shape"]
    assert math.prod(s // c for s, c in zip(shard, chunk)) > 1
    assert len(list((root / index["tensors"]["tensors.big"]["path"] / "c").rglob("*"))) > 1
    # a parameter and its Adam moments share the parameter's group
    keys = ["model.0.weight", "optim.state.0.weight.exp_avg", "optim.state.0.weight.exp_avg_sq", "optim.state.0.weight.step"]
    paths = [index["tensors"][k]["path"] for k in keys]
    assert paths == ["0.weight/model", "0.weight/optim.exp_avg", "0.weight/optim.exp_avg_sq", "0.weight/optim.step"]
    # no marker or temporary file is left after the commit
    assert not (root / ".ucp_zarr_pending").exists()
    assert not [p for p in root.iterdir() if p.name.startswith("zarr.json.")]


def test_non_finite_values_are_tagged_and_round_trip(saved) -> None:
    root, _ = saved
    values = _strict_json((root / "zarr.json").read_text())["attributes"]["ucp_zarr"]["values"]
    assert values["extra.best_loss"] == {"$float": "inf"}
    assert values["extra.worst"] == {"$float": "-inf"}
    assert values["extra.undefined"] == {"$float": "nan"}
    assert values["extra.history"] == [1.0, {"$float": "nan"}, 2]
    back = ucp_zarr.open(root).metadata["values"]
    assert back["extra.best_loss"] == math.inf and math.isnan(back["extra.undefined"])


def test_format_md_plain_reader_snippet(saved) -> None:
    """FORMAT.md section 12, verbatim in spirit: zarr-python and TensorStore, no ucp_zarr."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ts = pytest.importorskip("tensorstore")
    import zarr

    root, sd = saved
    index = json.loads((root / "zarr.json").read_text())["attributes"]["ucp_zarr"]

    def as_dtype(a, torch_dtype):
        return a.view(getattr(ml_dtypes, torch_dtype)) if torch_dtype.startswith(("bfloat", "float8")) else a

    for key, ref in [("tensors.bf16", sd["tensors"]["bf16"]), ("tensors.float8_e4m3fn", sd["tensors"]["float8_e4m3fn"]),
                     ("tensors.big", sd["tensors"]["big"]), ("model.0.weight", sd["model"]["0.weight"])]:
        entry = index["tensors"][key]
        path = str(root / entry["path"])
        x = as_dtype(zarr.open_array(path, mode="r")[0:16, :], entry["dtype"])
        y = as_dtype(ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, read=True)
                     .result()[0:16, :].read().result(), entry["dtype"])
        t = torch.from_numpy(zarr.open_array(path, mode="r")[...]).view(getattr(torch, entry["dtype"]))
        bits = ref.view(torch.uint8 if ref.element_size() == 1 else torch.uint16) if entry["dtype"] != "float32" else ref
        assert x.tobytes() == y.tobytes() == bits[0:16].numpy().tobytes()
        assert torch.equal(t.view(bits.dtype), bits)


def test_missing_commit_record_means_incomplete(saved, tmp_path: Path) -> None:
    root, _ = saved
    copy_ = tmp_path / "copy"
    shutil.copytree(root, copy_)
    (copy_ / "zarr.json").unlink()
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(copy_)


# --- a real distributed save ---------------------------------------------------------------

DIST_WORLD = 3


def _dist_worker(rank: int, world: int, port: int, path: str) -> None:
    """One rank of a gloo job saving ZeRO flat fragments, replicated row shards, a per-rank
    tensor and value, and the other single-process cases."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        full = torch.randn(160, 96, generator=g)  # 60 KiB
        big = torch.randn(256, 128, generator=g)  # 128 KiB: sharded
        cuts = [0, 4999, 9000, full.numel()]  # flat ranges cutting rows anywhere
        bf = torch.randn(64, 40, generator=g).bfloat16().reshape(-1)
        bcuts = [0, 1000, 1001, bf.numel()]
        sd = {
            "model": {
                "w": ucp_zarr.FlatShard(full.reshape(-1)[cuts[rank] : cuts[rank + 1]].clone(), (160, 96), cuts[rank]),
                "bf": ucp_zarr.FlatShard(bf[bcuts[rank] : bcuts[rank + 1]].clone(), (64, 40), bcuts[rank]),
                # ranks 0 and 2 hold rows 0:128 (replicas), rank 1 rows 128:256
                "big": ucp_zarr.Shard(big[128:].clone(), (256, 128), (128, 0))
                if rank == 1
                else ucp_zarr.Shard(big[:128].clone(), (256, 128), (0, 0), replica_id=rank // 2),
                "scale": torch.tensor(2.0),
                "empty": torch.empty(0, 3),
                "fp8": _fp8(torch.float8_e4m3fn, (8, 8), 1),
            },
            "rng": ucp_zarr.PerRank(torch.tensor([rank, 7])),  # per-rank state
            "seed": rank,
            "step": 11,
            "loss": float("nan"),
        }
        ucp_zarr.save(sd, path, chunk_bytes=CHUNK_BYTES)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dist_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path_factory.mktemp("dist") / "ckpt"
    mp.start_processes(_dist_worker, args=(DIST_WORLD, port, str(path)), nprocs=DIST_WORLD, start_method="spawn", join=True)
    return path


def test_distributed_documents_validate(validators, dist_saved) -> None:
    docs = _documents(dist_saved)
    assert _failures(validators, docs) == {}
    index = docs["checkpoint"][0][1]["attributes"]["ucp_zarr"]
    arrays = dict(docs["array"])
    assert index["world_size"] == DIST_WORLD
    assert set(arrays) == {p for e in index["tensors"].values() for p in [e["path"], *(a["path"] for a in e.get("ranks", {}).values())]}
    for key, entry in index["tensors"].items():
        copies = entry.get("ranks") or {None: {"path": entry["path"], "digest": entry["digest"]}}
        for rank, path in {r: a["path"] for r, a in copies.items()}.items():
            doc = arrays[path]
            attrs = doc["attributes"]["ucp_zarr"]
            assert attrs["key"] == key and doc["shape"] == entry["shape"] == attrs["global_shape"]
            assert attrs.get("rank") == (None if rank is None else int(rank))
            _check_regions(doc)
        if "ranks" in entry:
            assert entry["path"] == entry["ranks"][min(entry["ranks"], key=int)]["path"]
    assert not set(index["values"]) & set(index["rank_values"])


def test_distributed_save_covers_the_cases(dist_saved) -> None:
    index = json.loads((dist_saved / "zarr.json").read_text())["attributes"]["ucp_zarr"]
    arrays = {k: json.loads((dist_saved / e["path"] / "zarr.json").read_text()) for k, e in index["tensors"].items()}
    regions = {k: a["attributes"]["ucp_zarr"]["regions"] for k, a in arrays.items()}
    # ZeRO flat fragments are recorded in the flat form, one per rank
    assert [(r["flat_offset"], r["numel"], r["replicas"]) for r in regions["model.w"]] == [
        (0, 4999, [0]), (4999, 4001, [1]), (9000, 6360, [2])
    ]
    assert all("flat_offset" in r for r in regions["model.bf"])
    # replicated rows: one region held by ranks 0 and 2, written by one of them
    rows = {tuple(r["offset"]): r for r in regions["model.big"]}
    assert rows[(0, 0)]["replicas"] == [0, 2] and rows[(128, 0)]["replicas"] == [1]
    assert arrays["model.big"]["codecs"][0]["name"] == "sharding_indexed"
    # per-rank state
    assert sorted(index["tensors"]["rng"]["ranks"]) == ["0", "1", "2"]
    assert index["rank_values"]["seed"] == {"0": 0, "1": 1, "2": 2}
    assert index["values"]["loss"] == {"$float": "nan"} and index["values"]["step"] == 11
    assert regions["model.empty"] == []


# --- flat (ZeRO) regions ------------------------------------------------------------------


def _some_array(saved) -> dict[str, Any]:
    root, _ = saved
    index = json.loads((root / "zarr.json").read_text())["attributes"]["ucp_zarr"]
    return json.loads((root / index["tensors"]["model.0.weight"]["path"] / "zarr.json").read_text())


def test_flat_regions_validate(validators, saved) -> None:
    doc = copy.deepcopy(_some_array(saved))
    n = math.prod(doc["shape"])
    doc["attributes"]["ucp_zarr"]["regions"] = [
        {"flat_offset": 0, "numel": 3000, "replicas": [0, 2], "writers": [0]},
        {"flat_offset": 3000, "numel": n - 3000, "replicas": [1, 3], "writers": [0, 3]},
    ]
    assert _errors(validators["array"], doc) == []
    _check_regions(doc)


# --- broken documents are rejected ---------------------------------------------------------


def _del(*path: str) -> Callable[[dict], None]:
    def f(doc: dict) -> None:
        for p in path[:-1]:
            doc = doc[p]
        del doc[path[-1]]

    return f


def _set(value: Any, *path: Any) -> Callable[[dict], None]:
    def f(doc: dict) -> None:
        for p in path[:-1]:
            doc = doc[p]
        doc[path[-1]] = value

    return f


U = ("attributes", "ucp_zarr")
LEAF = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]

ARRAY_BREAKS: dict[str, Callable[[dict], None]] = {
    "missing torch_dtype": _del(*U, "torch_dtype"),
    "missing key": _del(*U, "key"),
    "missing regions": _del(*U, "regions"),
    "missing ucp_zarr attributes": _set({}, "attributes"),
    "format_version 3": _set(3, *U, "format_version"),
    "format_version as string": _set("2", *U, "format_version"),
    "unknown torch_dtype": _set("float4_e2m1fn_x2", *U, "torch_dtype"),
    "torch. prefix": _set("torch.float32", *U, "torch_dtype"),
    "dtype mismatch": _set("bfloat16", *U, "torch_dtype"),
    "unknown data_type": _set("float8_e4m3", "data_type"),
    "zarr_format 2": _set(2, "zarr_format"),
    "node_type group": _set("group", "node_type"),
    "negative dim": _set([-1, 64], "shape"),
    "zero chunk dim": _set([0, 64], "chunk_grid", "configuration", "chunk_shape"),
    "irregular grid": _set("rectilinear", "chunk_grid", "name"),
    "v2 key encoding": _set({"name": "v2", "configuration": {"separator": "."}}, "chunk_key_encoding"),
    "dot separator": _set(".", "chunk_key_encoding", "configuration", "separator"),
    "nonzero fill": _set(1.5, "fill_value"),
    "no crc": _set([LEAF[0]], "codecs"),
    "big endian": _set([{"name": "bytes", "configuration": {"endian": "big"}}, LEAF[1]], "codecs"),
    "compressed": _set([LEAF[0], {"name": "gzip", "configuration": {"level": 5}}, LEAF[1]], "codecs"),
    "index at start": _set(
        [{"name": "sharding_indexed", "configuration": {"chunk_shape": [16, 64], "codecs": LEAF, "index_codecs": LEAF, "index_location": "start"}}],
        "codecs",
    ),
    "index without crc": _set(
        [{"name": "sharding_indexed", "configuration": {"chunk_shape": [16, 64], "codecs": LEAF, "index_codecs": LEAF[:1], "index_location": "end"}}],
        "codecs",
    ),
    "storage transformer": _set([], "storage_transformers"),
    "regions not a list": _set({"offset": [0, 0], "shape": [128, 64], "replicas": [0], "writers": [0]}, *U, "regions"),
    "region without writers": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [0]}], *U, "regions"),
    "region with singular writer": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [0], "writer": 0}], *U, "regions"),
    "region with no writers": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [0], "writers": []}], *U, "regions"),
    "region with no replicas": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [], "writers": [0]}], *U, "regions"),
    "region repeated replica": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [1, 1], "writers": [1]}], *U, "regions"),
    "region negative writer": _set([{"offset": [0, 0], "shape": [128, 64], "replicas": [0], "writers": [-1]}], *U, "regions"),
    "region mixing box and flat": _set(
        [{"offset": [0, 0], "shape": [128, 64], "flat_offset": 0, "numel": 8192, "replicas": [0], "writers": [0]}], *U, "regions"
    ),
    "flat region without numel": _set([{"flat_offset": 0, "replicas": [0], "writers": [0]}], *U, "regions"),
    "negative rank": _set(-1, *U, "rank"),
}


@pytest.mark.parametrize("name", list(ARRAY_BREAKS))
def test_array_schema_rejects(validators, saved, name: str) -> None:
    doc = copy.deepcopy(_some_array(saved))
    assert doc["data_type"] == "float32" and doc["shape"] == [128, 64]
    assert _errors(validators["array"], doc) == []
    ARRAY_BREAKS[name](doc)
    assert _errors(validators["array"], doc), f"the array schema accepted a document with {name}"


def _tensor0(doc: dict) -> dict:
    return doc["attributes"]["ucp_zarr"]["tensors"]["model.0.weight"]


ROOT_BREAKS: dict[str, Callable[[dict], None]] = {
    "format_version 3": _set(3, *U, "format_version"),
    "missing format_version": _del(*U, "format_version"),
    "missing tensors": _del(*U, "tensors"),
    "missing values": _del(*U, "values"),
    "missing rank_values": _del(*U, "rank_values"),
    "rank_values with a non-rank key": _set({"seed": {"rank0": 1}}, *U, "rank_values"),
    "rank_values with no ranks": _set({"seed": {}}, *U, "rank_values"),
    "tensor entry with empty ranks": lambda d: _tensor0(d).__setitem__("ranks", {}),
    "tensor entry ranks with bad path": lambda d: _tensor0(d).__setitem__("ranks", {"0": {"path": "../x", "digest": "sha256:" + "0" * 64}}),
    "missing created": _del(*U, "created"),
    "created not a date-time": _set("yesterday", *U, "created"),
    "created without zone": _set("2025-01-31T12:00:00", *U, "created"),
    "world_size 0": _set(0, *U, "world_size"),
    "layout not an object": _set([], *U, "layout"),
    "node_type array": _set("array", "node_type"),
    "not a ucp_zarr root": _set({}, "attributes"),
    "bad float tag": _set({"$float": "NaN"}, *U, "values", "extra.undefined"),
    "float tag with extra member": _set({"$float": "nan", "x": 1}, *U, "values", "extra.undefined"),
    "tensor entry unknown dtype": lambda d: _tensor0(d).__setitem__("dtype", "float4"),
    "tensor entry without path": lambda d: _tensor0(d).pop("path"),
    "tensor entry extra member": lambda d: _tensor0(d).__setitem__("chunks", [16, 64]),
    "path escaping the root": lambda d: _tensor0(d).__setitem__("path", "../0.weight/model"),
    "path with three parts": lambda d: _tensor0(d).__setitem__("path", "0/weight/model"),
    "path in reserved group": lambda d: _tensor0(d).__setitem__("path", "zarr.json/model"),
    "path with unescaped space": lambda d: _tensor0(d).__setitem__("path", "0 weight/model"),
    "path starting with __": lambda d: _tensor0(d).__setitem__("path", "__w/model"),
    "negative tensor dim": lambda d: _tensor0(d).__setitem__("shape", [-3]),
}


@pytest.mark.parametrize("name", list(ROOT_BREAKS))
def test_checkpoint_schema_rejects(validators, saved, name: str) -> None:
    root, _ = saved
    doc = json.loads((root / "zarr.json").read_text())
    assert _errors(validators["checkpoint"], doc) == []
    ROOT_BREAKS[name](doc)
    assert _errors(validators["checkpoint"], doc), f"the checkpoint schema accepted a document with {name}"


GROUP_BREAKS: dict[str, Callable[[dict], None]] = {
    "node_type array": _set("array", "node_type"),
    "zarr_format 2": _set(2, "zarr_format"),
    "missing node_type": _del("node_type"),
    "ucp_zarr attributes": _set({"ucp_zarr": {"format_version": 1}}, "attributes"),
    "unknown top-level member": _set(True, "must_understand"),
}


@pytest.mark.parametrize("name", list(GROUP_BREAKS))
def test_group_schema_rejects(validators, saved, name: str) -> None:
    root, _ = saved
    doc = json.loads((root / "0.weight" / "zarr.json").read_text())
    assert _errors(validators["group"], doc) == []
    GROUP_BREAKS[name](doc)
    assert _errors(validators["group"], doc), f"the group schema accepted a document with {name}"


def test_schemas_do_not_cross_validate(validators, saved) -> None:
    """Each kind of document is rejected by the other kinds' schemas."""
    root, _ = saved
    docs = {kind: items[0][1] for kind, items in _documents(root).items()}
    for kind, doc in docs.items():
        for other in SCHEMAS:
            if other != kind:
                assert _errors(validators[other], doc), f"the {other} schema accepted a {kind} document"


def test_tags_and_dollar_keys_validate(validators, tmp_path: Path) -> None:
    ucp_zarr.save({"meta": {"d": {"$float": 1, "$": 2}, "b": b"\x00raw", "f": float("nan")}, "t": torch.ones(1)}, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "zarr.json").read_text())
    assert _errors(validators["checkpoint"], doc) == []
    bad = json.loads(json.dumps(doc))
    bad["attributes"]["ucp_zarr"]["values"]["meta.d"] = {"$float": "nan", "x": 1}
    assert _errors(validators["checkpoint"], bad)


def test_a_nan_with_another_payload_is_refused(tmp_path) -> None:
    """A NaN value is stored as the one ``nan`` this format version has (readers of version
    2 know no other, so its sign is not kept: numpy's and x86's 0/0 is ``-nan``); a NaN with
    another payload, which the format cannot keep either, is refused naming its key rather
    than stored as another NaN."""
    import struct

    import numpy as np

    with np.errstate(invalid="ignore"):
        neg = float(np.float64(0.0) / np.float64(0.0))
    ucp_zarr.save({"loss": neg, "plain": math.nan, "t": torch.ones(1)}, tmp_path / "ck")
    values = _strict_json((tmp_path / "ck" / "zarr.json").read_text())["attributes"]["ucp_zarr"]["values"]
    assert (values["loss"], values["plain"]) == ({"$float": "nan"}, {"$float": "nan"})
    payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]
    with pytest.raises(ucp_zarr.NotJSONableError, match="'odd'.*payload"):
        ucp_zarr.save({"odd": payload}, tmp_path / "ck2")
    assert not (tmp_path / "ck2").exists()
