"""save/open/load through fsspec stores: ``memory://`` and a real S3 server (moto) on loopback."""

from __future__ import annotations

import copy
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest
import torch

import ucp_zarr

BUCKET = "ucp-zarr-tests"
CHUNK_BYTES = 16384
BIG_KEY = "extra.big"


# --- the state dict -------------------------------------------------------------------------


def _state_dict() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 12)).square().mean().backward()
        opt.step()
    g = torch.Generator().manual_seed(1)
    bf16 = torch.randn(40, 9, generator=g).to(torch.bfloat16)
    bf16[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    extra = {
        "big": torch.randn(301, 70, generator=g),  # several chunks of CHUNK_BYTES, an edge chunk
        "bf16": bf16,
        "f16": torch.randn(7, 5, generator=g).half(),
        "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-(2**40), 2**40, (6, 4), generator=g),
        "mask": torch.rand(19, generator=g) > 0.3,
        "scalar": torch.tensor(2.5),
    }
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": extra,
        "step": 2,
        "note": "fsspec",
        "loss": float("nan"),
    }


def _tensors(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            out.update(_tensors(v, key + "."))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so that equality is bit equality (nan, -0.0)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(_bits(got), _bits(want)), what


def _zeroed(sd: Any) -> Any:
    """A copy of ``sd`` with every tensor zeroed and every other value scrambled (a tuple
    stays a tuple: ``load`` keeps the container type of the leaf it replaces)."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeroed(v) for k, v in sd.items()}
    if isinstance(sd, list) and any(isinstance(v, (dict, torch.Tensor)) for v in sd):
        return [_zeroed(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(None for _ in sd)
    return None


# --- backends -------------------------------------------------------------------------------


class Backend:
    """Where checkpoints go: a fresh URL per call, the options to reach it, its filesystem."""

    def __init__(self, name: str, base: str, storage_options: dict[str, Any] | None, fs: Any) -> None:
        self.name = name
        self.base = base
        self.storage_options = storage_options
        self.fs = fs

    def url(self, name: str = "ckpt") -> str:
        return f"{self.base}/{name}-{uuid.uuid4().hex[:8]}"

    def fs_path(self, url: str) -> str:
        return fsspec.core.url_to_fs(url, **(self.storage_options or {}))[1]


def _clear_memory_fs() -> None:
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    fs.invalidate_cache()


@pytest.fixture
def memory_backend() -> Iterator[Backend]:
    _clear_memory_fs()
    yield Backend("memory", "memory://ucp", None, fsspec.filesystem("memory"))
    _clear_memory_fs()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1, for the whole session, with one bucket."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        found = shutil.which("moto_server")
        if found is None:
            pytest.skip("moto_server executable not found")
        exe = Path(found)
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # it answers: it is up
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not come up on {endpoint}:\n{log.read_text()}")
                time.sleep(0.2)

        import boto3

        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing"
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture
def s3_backend(moto_endpoint: str) -> Backend:
    import s3fs

    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint}}
    fs = s3fs.S3FileSystem(**opts)
    return Backend("s3", f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", opts, fs)


@pytest.fixture(params=["memory", "s3"])
def backend(request) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


# --- tests ----------------------------------------------------------------------------------


def test_round_trip_bit_exact(backend: Backend):
    sd = _state_dict()
    url = backend.url()
    ucp_zarr.save(sd, url, storage_options=backend.storage_options, chunk_bytes=CHUNK_BYTES)

    # the objects really are in the store, with the commit record at the root
    path = backend.fs_path(url)
    assert backend.fs.exists(f"{path}/zarr.json")
    assert not backend.fs.exists(f"{path}/.ucp_zarr_pending")

    want = _tensors(sd)
    ck = ucp_zarr.open(url, storage_options=backend.storage_options)
    assert set(ck.keys()) == set(want)
    grid = ck.array_meta(BIG_KEY).grid
    assert grid.sharded and math.prod(grid.chunks_per_shard) > 1, grid
    for key, t in want.items():
        assert backend.fs.exists(f"{path}/{ck.array_path(key)}/zarr.json"), key
        _assert_bit_equal(ck[key][...], t, key)
        _assert_bit_equal(ck.read(key), t, key)
    assert ck.metadata["step"] == 2

    target = _zeroed(sd)
    out = ucp_zarr.load(target, url, storage_options=backend.storage_options)
    assert out is target
    for key, t in _tensors(target).items():
        _assert_bit_equal(t, want[key], key)
    assert target["step"] == 2 and target["note"] == "fsspec" and math.isnan(target["loss"])
    assert target["optim"]["param_groups"] == sd["optim"]["param_groups"]

    # the loaded optimizer state drives a fresh Adam like the original
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    model.load_state_dict(target["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(copy.deepcopy(target["optim"]))
    for i, st in sd["optim"]["state"].items():
        for name, v in st.items():
            _assert_bit_equal(opt.state_dict()["state"][i][name], v, f"state {i} {name}")


def test_partial_read(backend: Backend):
    sd = _state_dict()
    url = backend.url()
    ucp_zarr.save(sd, url, storage_options=backend.storage_options, chunk_bytes=CHUNK_BYTES)
    ck = ucp_zarr.open(url, storage_options=backend.storage_options)
    big = sd["extra"]["big"]
    grid = ck.array_meta(BIG_KEY).grid
    rows = grid.chunk_shape[0]
    full_bytes = big.numel() * big.element_size()

    for a, b in [(0, 1), (3, 17), (rows - 2, rows + 3), (100, 250), (big.shape[0] - 5, big.shape[0])]:
        ck.store.stats = type(ck.store.stats)()
        _assert_bit_equal(ck[BIG_KEY][a:b], big[a:b], f"[{a}:{b}]")
        # only the overlapping chunks (and at most the shard's tail: trailer and index) come over the wire
        nchunks = -(-b // rows) - a // rows
        row_bytes = math.prod(grid.chunk_shape) * big.element_size() + 4
        n = math.prod(grid.chunks_per_shard)
        tail_bytes = n * 16 + 4 + (80 + 4 * n)
        assert ck.store.stats.bytes_read <= nchunks * row_bytes + tail_bytes, (a, b, ck.store.stats)
        assert ck.store.stats.bytes_read < full_bytes

    _assert_bit_equal(ck[BIG_KEY][40:90, 7:33], big[40:90, 7:33], "2-D")
    _assert_bit_equal(ck[BIG_KEY][-3], big[-3], "int")
    bf16 = sd["extra"]["bf16"]
    _assert_bit_equal(ck["extra.bf16"][2:31], bf16[2:31], "bf16")
    f8 = sd["extra"]["f8"]
    _assert_bit_equal(ck["extra.f8"][5:9], f8[5:9], "f8")


def test_incomplete_checkpoint(backend: Backend):
    sd = _state_dict()
    url = backend.url()
    ucp_zarr.save(sd, url, storage_options=backend.storage_options, chunk_bytes=CHUNK_BYTES)
    path = backend.fs_path(url)
    backend.fs.rm_file(f"{path}/zarr.json")
    assert not backend.fs.exists(f"{path}/zarr.json")

    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(url, storage_options=backend.storage_options)
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.load(_zeroed(sd), url, storage_options=backend.storage_options)


def test_missing_checkpoint_is_not_incomplete(backend: Backend):
    url = backend.url("never-written")
    with pytest.raises(FileNotFoundError) as info:
        ucp_zarr.open(url, storage_options=backend.storage_options)
    assert not isinstance(info.value, ucp_zarr.IncompleteCheckpointError)


def test_save_onto_committed_checkpoint_raises(backend: Backend):
    sd = _state_dict()
    url = backend.url()
    ucp_zarr.save(sd, url, storage_options=backend.storage_options, chunk_bytes=CHUNK_BYTES)
    other = {"model": {"w": torch.ones(3)}}
    with pytest.raises(ucp_zarr.CheckpointExistsError):
        ucp_zarr.save(other, url, storage_options=backend.storage_options)
    with pytest.raises(ucp_zarr.CheckpointExistsError):
        ucp_zarr.save(sd, url, storage_options=backend.storage_options, chunk_bytes=CHUNK_BYTES)

    # the committed checkpoint is untouched by the refused saves
    ck = ucp_zarr.open(url, storage_options=backend.storage_options)
    want = _tensors(sd)
    assert set(ck.keys()) == set(want)
    for key, t in want.items():
        _assert_bit_equal(ck[key][...], t, key)


def test_memory_fs_is_cleared_between_tests(memory_backend: Backend):
    assert memory_backend.fs.find("/") == []
    ucp_zarr.save({"w": torch.arange(4)}, memory_backend.url())
    assert memory_backend.fs.find("/") != []


def test_a_small_shard_is_fetched_in_one_request(memory_backend: Backend):
    """On an object store a request costs a round trip: a load fetches a small shard it
    reads whole (index, trailer and chunks) in one request, not two (loopback S3, a 96-tensor
    17 MiB state: 1.41 -> 0.97 s); a partial read of it still fetches only the tail and the
    chunks it needs."""
    sd = {f"t{i}": torch.arange(i * 1000, i * 1000 + 640, dtype=torch.float32).reshape(64, 10) for i in range(6)}
    url = memory_backend.url()
    ucp_zarr.save(sd, url, storage_options=memory_backend.storage_options)
    ck = ucp_zarr.open(url, storage_options=memory_backend.storage_options)
    ck.store.stats = type(ck.store.stats)()
    out = {k: torch.zeros(64, 10) for k in sd}
    for k in sd:
        ck.read(k, out=out[k])
        assert torch.equal(out[k], sd[k]), k
    assert ck.store.stats.read_calls == len(sd), ck.store.stats  # one per array: its one shard
    assert ck.store.stats.bytes_read < 1.1 * sum(t.nbytes for t in sd.values()) + 2000
    ck2 = ucp_zarr.open(url, storage_options=memory_backend.storage_options)
    _assert_bit_equal(ck2["t3"][5:7], sd["t3"][5:7], "partial")


def test_an_overwrite_at_the_root_of_a_store_is_refused_naming_the_fix() -> None:
    """A checkpoint at the top of a store has no folder to stage an overwrite in: the save
    says so as a ucp_zarr error (before: a bare ValueError), and the checkpoint is intact."""
    import uuid

    url = f"memory://{uuid.uuid4().hex}"
    ucp_zarr.save({"w": torch.ones(2)}, url)
    with pytest.raises(ucp_zarr.OptionError, match="keep checkpoints in a folder"):
        ucp_zarr.save({"w": torch.zeros(2)}, url, overwrite=True)
    assert torch.equal(ucp_zarr.read_state_dict(url)["w"], torch.ones(2))
    below = f"{url}-runs/ck"  # (in a folder: the overwrite is staged beside it)
    ucp_zarr.save({"w": torch.ones(2)}, below)
    ucp_zarr.save({"w": torch.zeros(2)}, below, overwrite=True)
    assert torch.equal(ucp_zarr.read_state_dict(below)["w"], torch.zeros(2))
