"""The local read path: a shard read whole is read in one request (its chunks straight into the
destination, its index and trailer from its end), and only when the object is exactly what
this library writes; anything else is read by its index, or refused as before."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr.browse.checkpoint import open_store_checkpoint
from ucp_zarr.format.codec import CRC_BYTES, decode_index, encode_index, index_nbytes
from ucp_zarr.errors import CorruptChunkError
from ucp_zarr.io.local import LocalStore


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(64, 48, generator=g),  # 4 KiB chunks: 12 chunks in one shard
        "model.b": torch.randn(48, generator=g).to(torch.bfloat16),
        "model.s": torch.tensor(3.0),
    }


def _shard_file(path: str, key: str) -> str:
    ck = ucp_zarr.open(path)
    return os.path.join(path, ck.meta.tensors[key].path, *["c"] + ["0"] * len(ck.meta.tensors[key].shape))


def test_a_whole_shard_is_read_in_one_request(tmp_path) -> None:
    sd = _state()
    path = str(tmp_path / "ck")
    ucp_zarr.save(sd, path, chunk_bytes=4096)
    store = LocalStore(path)
    ck = open_store_checkpoint(store, None)
    before = (store.stats.read_calls, store.stats.bytes_read)
    for key, t in sd.items():
        out = torch.zeros_like(t)
        ck.read(key, out=out)
        assert torch.equal(out, t)
    sizes = sum(os.path.getsize(_shard_file(path, k)) for k in sd)
    # one preadv per shard, each reading its whole object: chunks, trailer and index
    assert (store.stats.read_calls - before[0], store.stats.bytes_read - before[1]) == (len(sd), sizes)


def test_a_shard_in_another_chunk_order_is_read_by_its_index(tmp_path) -> None:
    """A valid shard whose chunks lie in another order than this library writes them (as
    another Zarr writer may lay them out) reads bit-exact."""
    sd = _state()
    path = str(tmp_path / "ck")
    ucp_zarr.save(sd, path, chunk_bytes=4096)
    meta = ucp_zarr.open(path).array_meta("model.w")
    f = _shard_file(path, "model.w")
    raw = open(f, "rb").read()
    cps = meta.grid.chunks_per_shard
    n_index = index_nbytes(cps)
    index = decode_index(raw[-n_index:], cps, f).copy()
    size = int(index[0, 1])
    chunks = [raw[int(o) : int(o) + size] for o, _ in index]
    body = b"".join(reversed(chunks))  # the last chunk first
    index[:, 0] = [(len(chunks) - 1 - i) * size for i in range(len(chunks))]
    tail = raw[len(chunks) * size : -n_index]  # the trailer: crc32c per row, unchanged
    with open(f, "wb") as fh:
        fh.write(body + tail + encode_index(index))
    out = torch.zeros_like(sd["model.w"])
    ucp_zarr.load({"model.w": out, "model.b": torch.zeros_like(sd["model.b"]), "model.s": torch.tensor(0.0)}, path)
    assert torch.equal(out, sd["model.w"])
    assert size == meta.grid.chunk_shape[0] * meta.grid.chunk_shape[1] * 4 + CRC_BYTES


@pytest.mark.parametrize("change", ["appended", "truncated"])
def test_a_shard_of_another_size_is_refused(tmp_path, change: str) -> None:
    """One request reads a shard only when its object has exactly the size this library
    writes; bytes appended after the index (which moves the index) or cut off are refused
    by the index check, as a two-request read refuses them."""
    sd = _state()
    path = str(tmp_path / "ck")
    ucp_zarr.save(sd, path, chunk_bytes=4096)
    f = _shard_file(path, "model.w")
    raw = open(f, "rb").read()
    with open(f, "wb") as fh:
        fh.write(raw + b"\0" * 8 if change == "appended" else raw[:-8])
    out = {k: torch.zeros_like(t) for k, t in sd.items()}
    with pytest.raises(CorruptChunkError, match="model.w"):
        ucp_zarr.load(out, path)


def test_staged_chunks_land_where_they_belong(tmp_path) -> None:
    """Chunks aligned on dim 1 (strided blocks of the destination) go through the staging
    buffer in the one-request read too; into a transposed destination as well."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    path = str(tmp_path / "ck")
    ucp_zarr.save({"w": w}, path, chunk_bytes=1024)
    out = torch.zeros(64, 96).t()  # a non-contiguous view
    ucp_zarr.load({"w": out}, path)
    assert torch.equal(out, w)
    assert np.array_equal(ucp_zarr.open(path).read_numpy("w"), w.numpy())


def test_a_loads_reads_raise_the_first_failure_in_their_order_and_stop() -> None:
    """The load's pool (:func:`~ucp_zarr.protocol.filling.run_all`): of two failing reads the
    earlier one's error is raised, even when the later one fails first, and reads not yet
    started when one fails are not started."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ucp_zarr.protocol.filling import run_all

    ran: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        if i == 0:
            time.sleep(0.2)
            raise CorruptChunkError("read 0")
        if i == 1:
            raise CorruptChunkError("read 1")
        time.sleep(0.05)
        with lock:
            ran.append(i)

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(CorruptChunkError, match="read 0"):
            run_all(pool, [lambda i=i: job(i) for i in range(40)])
    assert len(ran) <= 2, ran  # (the worker freed by read 1 may take one more before the cancel)
