"""Paced background saves (``async_save(..., write_bytes_per_s=...)``): the writes of one
save, from every thread (and from the writer process), keep to the rate; the checkpoint is
the same."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from _states import assert_bits_equal

import ucp_zarr
from ucp_zarr.io.pace import Pace


def test_the_threads_of_one_save_share_the_rate() -> None:
    pace = Pace(2e6)
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda: [pace.take(100_000) for _ in range(5)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 >= 9 * 100_000 / 2e6 * 0.95  # (the first slot starts at once)


def test_no_rate_never_waits() -> None:
    pace = Pace(None)
    t0 = time.monotonic()
    for _ in range(1000):
        pace.take(1 << 30)
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("rate", [0, -1.0, math.nan, math.inf, "fast", True])
def test_a_rate_must_be_a_positive_number(tmp_path, rate) -> None:
    with pytest.raises(ValueError, match="write_bytes_per_s"):
        ucp_zarr.async_save({"w": torch.ones(3)}, tmp_path / "ck", write_bytes_per_s=rate)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_paced_save_keeps_to_its_rate_and_loads_back(tmp_path, writer) -> None:
    sd = {f"w{i}": torch.randn(128, 256) for i in range(8)}  # 1 MiB
    nbytes = sum(t.nbytes for t in sd.values())
    ucp_zarr.async_save(sd, tmp_path / "warm", writer=writer).result()  # (the writer process started)
    t0 = time.monotonic()
    ucp_zarr.async_save(sd, tmp_path / "ck", writer=writer, write_bytes_per_s=4e6).result()
    assert time.monotonic() - t0 >= 0.9 * (nbytes - 128 * 256 * 4) / 4e6
    out = ucp_zarr.load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "ck")
    for k, v in sd.items():
        assert_bits_equal(out[k], v, k)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_one_large_shard_is_spread_over_its_time(tmp_path, writer) -> None:
    """A save of one shard keeps to the rate too: each piece of it waits for its slot (before,
    the shard waited once, for a slot that starts at once, and was written at full speed)."""
    sd = {"w": torch.randn(1536, 1024)}  # 6 MiB, one shard
    nbytes = sd["w"].nbytes
    ucp_zarr.async_save(sd, tmp_path / "warm", writer=writer).result()
    t0 = time.monotonic()
    ucp_zarr.async_save(sd, tmp_path / "ck", writer=writer, write_bytes_per_s=4e6).result()
    assert time.monotonic() - t0 >= 0.9 * (nbytes - (1 << 20)) / 4e6
    assert_bits_equal(ucp_zarr.load({"w": torch.empty_like(sd["w"])}, tmp_path / "ck")["w"], sd["w"], "w")
