"""The GPU path with bounded host memory: device tensors of a synchronous save are staged
shard by shard through a bounded (pinned) pool, fingerprints of large device tensors are
computed blockwise, and reads into device tensors (or other dtypes) go through bounded host
blocks. Every test taking ``device`` runs on CPU everywhere (with the device checks forced where
the path differs, so that its assertions are known to hold) and again on CUDA where a GPU is
present (``benchmarks/gpu_check.sh`` runs them there)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ucp_zarr
from ucp_zarr.protocol import reader, staging
from ucp_zarr.layout import Box
from ucp_zarr.protocol.replicas import device_fingerprint

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this machine; the same test ran on CPU (its [cpu] case)",
)
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host as integers of its width: bit-exact comparisons (NaN, -0.0, bf16)."""
    t = t.detach().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _state(device: str, seed: int) -> dict[str, torch.Tensor]:
    """fp32, bf16, a transposed (non-contiguous) tensor and int64, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(2048, 1024, generator=g).to(device),
        "b": torch.randn(4096, generator=g).bfloat16().to(device),
        "t": torch.randn(300, 200, generator=g).to(device).t(),
        "i": torch.randint(-(2**62), 2**62, (5000,), generator=g).to(device),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_device_fingerprint_is_the_same_in_any_block_size(device: str) -> None:
    cpu = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    v = cpu.to(torch.int64)
    pos = torch.arange(1, v.numel() + 1) % 65521
    want = hash((int(v.sum()), int((v * pos).sum())))  # the whole-tensor formula, on the host
    raw = cpu.to(device)
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
    blocks = reader.row_blocks(box, 4, limit)
    assert sum(b.numel for b in blocks) == box.numel
    for i, b in enumerate(blocks):
        assert box.contains(b)
        assert b.numel * 4 <= max(limit, 4) or box.ndim == 0
        for c in blocks[i + 1 :]:
            inter = b.intersect(c)
            assert inter is None or inter.is_empty()


@pytest.mark.parametrize("device", DEVICES)
def test_reads_into_another_dtype_stage_bounded_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    w = torch.randn(1000, 300).half()
    ucp_zarr.save({"w": w}, tmp_path / "ck")
    sizes: list[int] = []
    original = reader.CheckpointReader._read_into

    def recording(self, key, box, dest, rank):  # type: ignore[no-untyped-def]
        sizes.append(dest.nbytes)
        return original(self, key, box, dest, rank)

    monkeypatch.setattr(reader.CheckpointReader, "_read_into", recording)
    monkeypatch.setattr(reader, "STAGE_BYTES", 16 << 10)
    out = {"w": torch.full((1000, 300), -1.0, device=device)}  # float32: converted through host blocks
    ucp_zarr.load(out, tmp_path / "ck")
    assert out["w"].device.type == device and torch.equal(out["w"].cpu(), w.float())
    assert len(sizes) > 30 and max(sizes) <= 16 << 10


@pytest.mark.parametrize("device", DEVICES)
def test_device_tensors_are_staged_through_a_bounded_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """A synchronous save of device tensors (on CPU: pretend ones) copies each shard as it
    is written, never more than the pool's capacity at once, into pinned memory on CUDA."""
    pools: list[staging.HostPool] = []
    original_init = staging.HostPool.__init__

    def tracked(self, capacity, pin):  # type: ignore[no-untyped-def]
        original_init(self, capacity, pin)
        pools.append(self)

    monkeypatch.setattr(staging.HostPool, "__init__", tracked)
    if device == "cpu":
        monkeypatch.setattr(staging.Staging, "_lazy", lambda self, akey: not self.copy)
    monkeypatch.setattr(staging, "POOL_BYTES", 256 << 10)
    state = {f"w{i}": torch.randn(512, 256, device=device) for i in range(6)}  # 6 x 512 KiB
    ucp_zarr.save(state, tmp_path / "ck", shard_bytes=128 << 10, chunk_bytes=64 << 10, max_workers=4)
    (pool,) = pools
    assert pool.capacity == 256 << 10 and 0 < pool.peak <= pool.capacity and pool.in_use == 0
    assert pool.pin == (device == "cuda")
    ck = ucp_zarr.open(tmp_path / "ck")
    for k, t in state.items():
        assert torch.equal(ck[k][...], t.cpu())
    # an asynchronous save copies everything in its blocking stage instead (no pool)
    pools.clear()
    ucp_zarr.async_save(state, tmp_path / "ck2", shard_bytes=128 << 10).result()
    assert not pools


def test_a_failing_store_fails_a_save_of_device_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard write fails (a full disk) while the pool is full: the save raises instead
    of waiting forever for the pooled copies its failed writers did not give back."""
    from ucp_zarr.io.local import LocalStore

    real = LocalStore.write

    def write(self, key, buffers, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "/c/" in key:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, key, buffers, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "write", write)
    monkeypatch.setattr(staging.Staging, "_lazy", lambda self, akey: not self.copy)
    monkeypatch.setattr(staging, "POOL_BYTES", 256 << 10)
    state = {f"w{i}": torch.randn(512, 256) for i in range(6)}
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            ucp_zarr.save(state, tmp_path / "ck", shard_bytes=128 << 10, chunk_bytes=64 << 10, max_workers=4)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the save hangs: a failed writer kept its pooled copy"
    assert len(outcome) == 1 and "No space left" in str(outcome[0])


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_on_the_device_bit_exact(tmp_path: Path, device: str) -> None:
    state = _state(device, 0)
    ucp_zarr.save(state, tmp_path / "ck", shard_bytes=1 << 20)
    out = {k: torch.zeros_like(v) for k, v in state.items()}  # (the transposed one keeps its strides)
    ucp_zarr.load(out, tmp_path / "ck")
    for k, v in state.items():
        assert out[k].device.type == device and out[k].stride() == v.stride(), k
        assert torch.equal(_bits(out[k]), _bits(v)), k


@pytest.mark.parametrize("device", DEVICES)
def test_async_save_holds_the_state_of_its_blocking_stage(tmp_path: Path, device: str) -> None:
    """What an asynchronous save writes is, bit for bit, the state when ``save`` returned,
    while training changes every tensor at once (on CUDA from another stream, which only
    the blocking stage's synchronisation orders after the copies)."""
    state = _state(device, 1)
    want = {k: v.clone() for k, v in state.items()}
    fut = ucp_zarr.async_save(state, tmp_path / "ck", shard_bytes=256 << 10)
    stream = torch.cuda.Stream() if device == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for _ in range(3):  # training goes on while the background writes
            for v in state.values():
                v.mul_(-3).add_(1)
    if stream is not None:
        stream.synchronize()
    fut.result()
    ck = ucp_zarr.open(tmp_path / "ck")
    for k, v in want.items():
        saved = _bits(ck[k][...])
        assert torch.equal(saved, _bits(v)), k
        assert not torch.equal(saved, _bits(state[k])), k  # training did change it after the save returned


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("async_save", [False, True])
def test_tensors_on_a_device_other_than_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Tensors on cuda:1 while the current device is cuda:0 (a job that never called
    ``set_device``; writer threads always start on cuda:0): the copies into pinned memory
    are waited for on cuda:1's stream before a byte is written."""
    monkeypatch.setattr(staging, "POOL_BYTES", 1 << 20)
    torch.cuda.set_device(0)
    state = _state("cuda:1", 2)
    state["big"] = torch.randn(8192, 4096, device="cuda:1")  # 128 MiB: copies long enough to race
    want = {k: _bits(v) for k, v in state.items()}
    result = ucp_zarr.save(state, tmp_path / "ck", async_save=async_save, shard_bytes=1 << 20)
    if async_save:
        result.result()
    ck = ucp_zarr.open(tmp_path / "ck")
    for k, v in want.items():
        assert torch.equal(_bits(ck[k][...]), v), k
