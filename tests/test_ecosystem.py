"""The Zarr ecosystem opens checkpoints out of the box: xarray (``open_datatree``,
``open_zarr``), dask and TensorStore, in a process that cannot import ucp_zarr; optimizer
moments sit beside their parameter; the root's consolidated metadata lists a checkpoint on
S3 in a handful of requests and lets ucp_zarr read one metadata object per load.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dist import run
from hypothesis import given
from hypothesis import strategies as st
from test_other_readers import BLOCK_UCP_ZARR

import ucp_zarr
from ucp_zarr.format.documents import dimension_names
from ucp_zarr.io.local import LocalStore

pytest.importorskip("xarray")
pytest.importorskip("dask")
pytest.importorskip("tensorstore")


# --- dimension names (pure) ------------------------------------------------------------------

names = st.sampled_from(["model", "optim.exp_avg", "optim.exp_avg_sq", "optim.step", "optim.row", "optim.col", "x~rank1"])
shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@given(st.dictionaries(names, shapes, min_size=1))
def test_dimension_names_are_consistent_within_a_group(group: dict[str, tuple[int, ...]]) -> None:
    """xarray's rule: one dimension name, one size, within a group; every array has one name
    per dimension, distinct within the array."""
    items = list(group.items())
    dims = dimension_names(items)
    sizes: dict[str, int] = {}
    for (name, shape), d in zip(items, dims):
        assert len(d) == len(shape) and len(set(d)) == len(d)
        for dim, n in zip(d, shape):
            assert sizes.setdefault(dim, n) == n, (dim, items, dims)


def test_dimension_names_of_a_parameter_and_its_moments() -> None:
    group = [("model", (4, 8)), ("optim.exp_avg", (4, 8)), ("optim.row", (4,)), ("optim.col", (8,)), ("optim.step", ())]
    assert dimension_names(group) == [
        ("dim_0", "dim_1"), ("dim_0", "dim_1"), ("optim.row_dim_0",), ("optim.col_dim_0",), (),
    ]
    # ties go to the parameter (a name without a dot), whatever the order
    tie = [("optim.row", (4,)), ("model", (4, 8)), ("optim.col", (8,))]
    assert dimension_names(tie) == [("optim.row_dim_0",), ("dim_0", "dim_1"), ("optim.col_dim_0",)]


# --- moments beside their parameter ----------------------------------------------------------


def _trained(named: bool, optimizer: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    params = model.named_parameters() if named else model.parameters()
    opt = torch.optim.Adafactor(params, lr=1e-2) if optimizer == "adafactor" else torch.optim.AdamW(params, lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _groups(path: Path) -> dict[str, str]:
    ck = ucp_zarr.open(path)
    return {k: ck.array_path(k) for k in ck.keys()}


@pytest.mark.parametrize("how", ["param_names", "model"])
def test_moments_sit_beside_their_parameter(tmp_path: Path, how: str) -> None:
    model, opt = _trained(named=how == "param_names")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ucp_zarr.save(sd, tmp_path / "ck", model=model if how == "model" else None)
    paths = _groups(tmp_path / "ck")
    assert paths["model.0.weight"] == "0.weight/model"
    assert paths["optim.state.0.exp_avg"] == "0.weight/optim.exp_avg"  # the key keeps its number
    assert paths["optim.state.3.exp_avg_sq"] == "1.bias/optim.exp_avg_sq"
    assert paths["optim.state.5.step"] == "2.bias/optim.step"
    model2, opt2 = _trained(named=how == "param_names")
    for p in model2.parameters():
        p.data.zero_()
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    for s in state["optim"]["state"].values():
        for v in s.values():
            v.zero_()
    ucp_zarr.load(state, tmp_path / "ck")
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    for n, s in opt.state_dict()["state"].items():
        for m, v in s.items():
            assert torch.equal(state["optim"]["state"][n][m], v)


def test_unknowable_names_keep_numbered_groups(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(named=False)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ucp_zarr.save(sd, tmp_path / "plain")
    assert _groups(tmp_path / "plain")["optim.state.0.exp_avg"] == "0/optim.exp_avg"
    # a model whose parameters do not match the optimizer's (another model) is not used
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    with caplog.at_level(logging.WARNING, logger="ucp_zarr.format.optimizer_names"):
        ucp_zarr.save(sd, tmp_path / "other", model=other)
    assert _groups(tmp_path / "other")["optim.state.0.exp_avg"] == "0/optim.exp_avg"
    assert "does not have the shape" in caplog.text


# --- other tools, without ucp_zarr -----------------------------------------------------------

READER = BLOCK_UCP_ZARR + textwrap.dedent(
    r'''
    import json, sys
    from pathlib import Path

    import dask.array as da
    import numpy as np
    import tensorstore as ts
    import xarray as xr
    import zarr

    base, root = Path(sys.argv[1]), sys.argv[2]
    manifest = json.loads((base / "manifest.json").read_text())

    def same(got, want, what):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
        assert np.array_equal(got.view(f"u{got.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}")), what

    tree = xr.open_datatree(root, engine="zarr", chunks={})  # lazy: dask-backed
    groups = {node.path.strip("/") for node in tree.subtree if node.path != "/"}
    for key, m in manifest.items():
        group, name = m["path"].split("/")
        want = np.load(base / m["npy"])
        assert group in groups, (key, group, sorted(groups))
        var = tree[group].to_dataset()[name]
        assert list(var.dims) == m["dims"], (key, var.dims, m["dims"])
        same(var.values, want, f"open_datatree {key}")
        ds = xr.open_zarr(root, group=group)  # one parameter with its moments
        same(ds[name].values, want, f"open_zarr {key}")
        if m["torch_dtype"] == "bfloat16":
            assert ds[name].attrs["bit_dtype"]["dtype"] == "bfloat16"
            f32 = (ds[name].values.astype(np.uint32) << 16).view(np.float32)
            assert np.array_equal(f32, np.load(base / m["f32"]), equal_nan=True), key
        z = zarr.open_array(f"{root}/{m['path']}", mode="r")
        same(da.from_zarr(z, chunks=z.shards).compute(), want, f"dask {key}")
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{m['path']}"}}, read=True).result()
        same(t.read().result(), want, f"tensorstore {key}")
    # moments beside their parameter: a parameter's group holds its optimizer state
    for group, names in json.loads((base / "beside.json").read_text()).items():
        assert set(names) <= set(tree[group].to_dataset().data_vars), (group, names)
    assert "ucp_zarr" not in sys.modules
    print("OK", len(manifest))
    '''
)


def _expect_and_read(tmp_path: Path, root: Path, beside: dict[str, list[str]]) -> None:
    """Write what the reader must find (from ucp_zarr's own bit-exact reads), run it."""
    ck = ucp_zarr.open(root)
    manifest = {}
    for i, key in enumerate(ck.keys()):
        t = ck[key].read()
        raw = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
        np.save(tmp_path / f"{i}.npy", raw.numpy())
        entry = {"npy": f"{i}.npy", "path": ck.array_path(key), "torch_dtype": str(t.dtype)[6:],
                 "dims": list(ck.array_meta(key).dims)}
        if t.dtype == torch.bfloat16:
            np.save(tmp_path / f"{i}.f32.npy", t.float().numpy())
            entry["f32"] = f"{i}.f32.npy"
        manifest[key] = entry
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "beside.json").write_text(json.dumps(beside))
    (tmp_path / "reader.py").write_text(READER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "reader.py", str(tmp_path), str(root)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr[-4000:]


@pytest.mark.parametrize("case", ["plain-optimizer-bf16", "named-optimizer", "adafactor"])
def test_other_tools_open_single_process_checkpoints(tmp_path: Path, case: str) -> None:
    model, opt = _trained(named=case != "plain-optimizer-bf16", optimizer="adafactor" if case == "adafactor" else "adamw")
    if case == "plain-optimizer-bf16":
        model = model.to(torch.bfloat16)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
    ucp_zarr.save(sd, tmp_path / "ck", model=model if case == "plain-optimizer-bf16" else None)
    moments = ["optim.row_var", "optim.col_var"] if case == "adafactor" else ["optim.exp_avg", "optim.exp_avg_sq"]
    _expect_and_read(tmp_path, tmp_path / "ck", {"0.weight": ["model", *moments], "2.weight": ["model", *moments]})


def _fsdp_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    ucp_zarr.save({"model": msd, "optim": osd}, path)


def test_other_tools_open_an_fsdp2_checkpoint(tmp_path: Path) -> None:
    run(2, _fsdp_save, str(tmp_path / "ck"))
    paths = _groups(tmp_path / "ck")
    assert paths["optim.state.0.weight.exp_avg"] == "0.weight/optim.exp_avg"
    _expect_and_read(tmp_path, tmp_path / "ck", {"0.weight": ["model", "optim.exp_avg", "optim.exp_avg_sq", "optim.step"]})


# --- consolidated metadata -------------------------------------------------------------------


def _big_state(layers: int = 12) -> dict[str, Any]:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.named_parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_a_load_reads_one_metadata_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _big_state()
    ucp_zarr.save(sd, tmp_path / "ck")
    reads: list[str] = []
    original = LocalStore.read

    def counting(self: LocalStore, key: str) -> bytes:
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(LocalStore, "read", counting)
    ucp_zarr.load(_big_state(), tmp_path / "ck")
    assert [k for k in reads if k.endswith("zarr.json")] == ["zarr.json"], reads
    reads.clear()
    assert ucp_zarr.open(tmp_path / "ck").verify() > 0  # verify reads every stored document
    assert len([k for k in reads if k.endswith("zarr.json")]) == 1 + len(sd["model"]) * 5


LISTER = BLOCK_UCP_ZARR + textwrap.dedent(
    r'''
    import json, sys
    import s3fs, zarr
    from zarr.storage import FsspecStore

    url, options, consolidated = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    calls = []
    original = s3fs.S3FileSystem._call_s3
    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await original(self, method, *args, **kwargs)
    s3fs.S3FileSystem._call_s3 = counting
    store = FsspecStore.from_url(url, storage_options=options, read_only=True)
    group = zarr.open_group(store, mode="r", use_consolidated=consolidated)
    tree = {path: (list(node.shape), str(node.dtype)) for path, node in group.members(max_depth=None)
            if isinstance(node, zarr.Array)}
    print(json.dumps({"requests": len(calls), "arrays": len(tree)}))
    '''
)


def test_listing_on_s3_takes_a_handful_of_requests(seaweed: Any, tmp_path: Path) -> None:
    url = f"s3://objstore/{uuid.uuid4().hex[:8]}/ck"
    options = seaweed.storage_options()
    sd = _big_state()
    ucp_zarr.save(sd, url, storage_options=options)
    script = tmp_path / "lister.py"
    script.write_text(LISTER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    counts = {}
    for consolidated in (True, False):
        proc = subprocess.run([sys.executable, str(script), url, json.dumps(options), str(int(consolidated))],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts[consolidated] = json.loads(proc.stdout)
    n_arrays = len(sd["model"]) * 4  # weight/bias, each with step and two moments
    assert counts[True]["arrays"] == counts[False]["arrays"] == n_arrays
    print("requests to list:", counts)
    # zarr-python's opening probes (the root document, v2 names) plus nothing per node
    assert counts[True]["requests"] <= 10
    assert counts[False]["requests"] >= 2 * n_arrays
