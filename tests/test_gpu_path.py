"""The GPU path with bounded host memory: device tensors of a synchronous save are staged
shard by shard through a bounded (pinned) pool, fingerprints of large device tensors are
computed blockwise, and reads into device tensors (or other dtypes) go through bounded host
blocks. The mechanics are exercised on CPU here (the device checks are forced); the CUDA
tests at the end run where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ucp_zarr
from ucp_zarr import checkpoint, staging
from ucp_zarr.layout import Box
from ucp_zarr.saver import device_fingerprint

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this machine; the bounded staging, blockwise fingerprints and blockwise "
    "device reads are exercised on CPU by the other tests of this file",
)


def test_device_fingerprint_is_the_same_in_any_block_size() -> None:
    raw = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    v = raw.to(torch.int64)
    pos = torch.arange(1, v.numel() + 1) % 65521
    want = hash((int(v.sum()), int((v * pos).sum())))  # the whole-tensor formula
    assert device_fingerprint(raw, block=4096) == device_fingerprint(raw, block=1 << 30) == want
    changed = raw.clone()
    changed[500_000] ^= 1
    assert device_fingerprint(changed, block=4096) != want


@given(
    st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
    st.lists(st.integers(0, 9), min_size=3, max_size=3).map(tuple),
    st.integers(1, 300),
)
def test_row_blocks_tile_the_box(offset: tuple[int, ...], shape: tuple[int, ...], limit: int) -> None:
    shape = shape[: len(offset)]
    box = Box(offset, shape)
    blocks = checkpoint.row_blocks(box, 4, limit)
    assert sum(b.numel for b in blocks) == box.numel
    for i, b in enumerate(blocks):
        assert box.contains(b)
        assert b.numel * 4 <= max(limit, 4) or box.ndim == 0
        for c in blocks[i + 1 :]:
            inter = b.intersect(c)
            assert inter is None or inter.is_empty()


def test_reads_into_another_dtype_stage_bounded_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(1000, 300).half()
    ucp_zarr.save({"w": w}, tmp_path / "ck")
    sizes: list[int] = []
    original = checkpoint.Checkpoint._read_into

    def recording(self, key, box, dest, rank):  # type: ignore[no-untyped-def]
        sizes.append(dest.nbytes)
        return original(self, key, box, dest, rank)

    monkeypatch.setattr(checkpoint.Checkpoint, "_read_into", recording)
    monkeypatch.setattr(checkpoint, "STAGE_BYTES", 16 << 10)
    out = {"w": torch.full((1000, 300), -1.0)}  # float32: converted through host blocks
    ucp_zarr.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], w.float())
    assert len(sizes) > 30 and max(sizes) <= 16 << 10


def test_device_tensors_are_staged_through_a_bounded_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous save of (here: pretend) device tensors copies each shard as it is
    written, never more than the pool's capacity at once."""
    pools: list[staging.HostPool] = []
    original_init = staging.HostPool.__init__

    def tracked(self, capacity, pin):  # type: ignore[no-untyped-def]
        original_init(self, capacity, pin)
        pools.append(self)

    monkeypatch.setattr(staging.HostPool, "__init__", tracked)
    monkeypatch.setattr(staging.Staging, "_lazy", lambda self, akey: not self.copy)
    monkeypatch.setattr(staging, "POOL_BYTES", 256 << 10)
    state = {f"w{i}": torch.randn(512, 256) for i in range(6)}  # 6 x 512 KiB
    ucp_zarr.save(state, tmp_path / "ck", shard_bytes=128 << 10, chunk_bytes=64 << 10, max_workers=4)
    (pool,) = pools
    assert pool.capacity == 256 << 10 and 0 < pool.peak <= pool.capacity and pool.in_use == 0
    ck = ucp_zarr.open(tmp_path / "ck")
    for k, t in state.items():
        assert torch.equal(ck[k][...], t)
    # an asynchronous save copies everything in its blocking stage instead (no pool)
    pools.clear()
    ucp_zarr.save(state, tmp_path / "ck2", async_save=True, shard_bytes=128 << 10).result()
    assert not pools


@CUDA
def test_cuda_save_and_load_bit_exact(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    state = {"w": torch.randn(2048, 1024, device=dev), "b": torch.randn(4096, device=dev).bfloat16()}
    ucp_zarr.save(state, tmp_path / "ck", shard_bytes=1 << 20)
    out = {"w": torch.zeros(2048, 1024, device=dev), "b": torch.zeros(4096, device=dev, dtype=torch.bfloat16)}
    ucp_zarr.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["w"].device.type == "cuda"


@CUDA
def test_cuda_async_save(tmp_path: Path) -> None:
    w = torch.randn(1024, 1024, device="cuda")
    fut = ucp_zarr.save({"w": w}, tmp_path / "ck", async_save=True)
    w.add_(1)  # training goes on: the save holds its own host copy
    fut.result()
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][...].cuda(), w - 1)
