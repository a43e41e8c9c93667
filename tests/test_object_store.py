"""Saves and loads on a real S3-compatible object store (SeaweedFS on loopback, started and
stopped here), with faults: a reshard across world sizes, the server dying mid-save, and
transient network errors. Each runs on obstore (the default for ``s3://``) and on fsspec
(``storage_options["backend"] = "fsspec"``).

(The transaction's interleavings on S3 are in ``test_concurrent_saves.py``.)
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run

import ucp_zarr

BUCKET = "objstore"


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/{name}"


@pytest.fixture(params=["obstore", "fsspec"])
def backend(request) -> str:
    return request.param


def _options(server: Any, backend: str, endpoint: str | None = None, **kwargs: Any) -> dict[str, Any]:
    return {**server.storage_options(endpoint, **kwargs), "backend": backend}


def _full(gen: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(gen)
    return {"w": torch.randn(60, 512, generator=g), "f": torch.randn(37, 29, generator=g)}


def _fragments(rank: int, world: int, gen: int) -> dict[str, Any]:
    """Rows of ``w`` split over ``world`` ranks (uneven), ``f`` as flat ranges cutting rows."""
    full = _full(gen)
    rows = [60 * r // world for r in range(world + 1)]
    n = full["f"].numel()
    lo, hi = n * rank // world, n * (rank + 1) // world
    return {
        "w": ucp_zarr.Shard(full["w"][rows[rank] : rows[rank + 1]].clone(), (60, 512), (rows[rank], 0)),
        "f": ucp_zarr.FlatShard(full["f"].reshape(-1)[lo:hi].clone(), (37, 29), lo),
        "rng": ucp_zarr.PerRank(torch.tensor([gen, rank])),
        "step": gen,
    }


def _save_job(rank: int, world: int, url: str, options: dict[str, Any], gen: int) -> None:
    ucp_zarr.save(_fragments(rank, world, gen), url, storage_options=options, chunk_bytes=8192, shard_bytes=32768)


def _load_job(rank: int, world: int, url: str, options: dict[str, Any], gen: int) -> None:
    out = _fragments(rank, world, gen + 1)  # other values, the load target's layout
    for v in (out["w"].local, out["f"].local):
        v.zero_()
    ucp_zarr.load(out, url, storage_options=options, allow_new_ranks=True)
    want = _fragments(rank, world, gen)
    assert torch.equal(out["w"].local, want["w"].local) and torch.equal(out["f"].local, want["f"].local)
    assert out["step"] == gen
    if rank < 4:
        assert out["rng"].value.tolist() == [gen, rank]


def test_save_on_4_ranks_reshard_load_on_3(seaweed, backend):
    url = _url("ck")
    options = _options(seaweed, backend)
    run(4, _save_job, url, options, 7)
    ck = ucp_zarr.open(url, storage_options=options)
    assert ck.meta.world_size == 4 and sorted(ck.meta.tensors["rng"].ranks) == [0, 1, 2, 3]
    assert ck.verify() > 0
    assert torch.equal(ck["w"][...], _full(7)["w"]) and torch.equal(ck["f"][...], _full(7)["f"])
    run(3, _load_job, url, options, 7)


# --- the server dies mid-save -----------------------------------------------------------------


def _save_pausing(rank: int, world: int, url: str, options: dict[str, Any], pause: str, result: str) -> None:
    """Save, pausing at the start of the write phase until the test says go; record what
    this rank raised and how long the failure took after going on."""
    import json

    import ucp_zarr.protocol.saver as saver

    original = saver.PreparedSave._write_data
    went: list[float] = []

    def paused(self: Any, *args: Any, **kwargs: Any) -> Any:
        Path(pause, f"paused.{rank}").write_text("")
        while not Path(pause, "go").exists():
            time.sleep(0.05)
        went.append(time.monotonic())
        return original(self, *args, **kwargs)

    saver.PreparedSave._write_data = paused
    try:
        ucp_zarr.save(_fragments(rank, world, 9), url, storage_options=options, chunk_bytes=8192, shard_bytes=32768)
        out: dict[str, Any] = {"ok": True}
    except Exception as e:
        out = {"ok": False, "types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    out["after_go"] = time.monotonic() - went[0] if went else None
    Path(result, f"{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize(
    "backend", ["obstore", pytest.param("fsspec", marks=pytest.mark.long)], indirect=True
)  # (the fsspec store's retries of a dead server take ~1 min: -m long; its retries are tested below)
def test_server_dying_mid_save_fails_every_rank_clearly_and_keeps_the_previous_checkpoint(tmp_path, backend):
    import json
    import threading

    from s3server import seaweed_or_skip

    server = seaweed_or_skip(tmp_path / "server")
    try:
        server.make_bucket(BUCKET)
        options = _options(server, backend, fast_fail=True)
        prev, url = _url("prev"), _url("new")
        run(4, _save_job, prev, options, 3)
        pause, result = tmp_path / "pause", tmp_path / "result"
        pause.mkdir()
        result.mkdir()

        def kill_server_then_go() -> None:
            while len(list(pause.glob("paused.*"))) < 4:
                time.sleep(0.05)
            server.stop(kill=True)  # the server crashes while every rank is about to write
            (pause / "go").write_text("")

        killer = threading.Thread(target=kill_server_then_go)
        killer.start()
        run(4, _save_pausing, url, options, str(pause), str(result), timeout_s=120)
        killer.join()
        records = [json.loads((result / f"{r}.json").read_text()) for r in range(4)]
        for rank, rec in enumerate(records):
            assert not rec["ok"], f"rank {rank} saved with the server down"
            assert "SaveError" in rec["types"] and "CheckpointError" in rec["types"], rec
            assert f"saving {url} failed on" in rec["message"], rec["message"]
            assert rec["after_go"] < 60, rec  # bounded retries, no hang

        server.restart()
        # after the recovery, clients with the usual timeouts (a server just restarted on a busy
        # machine may take longer than fast_fail's 2 s to answer its first writes)
        options = _options(server, backend)
        ck = ucp_zarr.open(prev, storage_options=options)  # the previous checkpoint is intact
        ck.verify()
        assert torch.equal(ck["w"][...], _full(3)["w"]) and torch.equal(ck["f"][...], _full(3)["f"])
        with pytest.raises((ucp_zarr.IncompleteCheckpointError, ucp_zarr.NotACheckpointError)):
            ucp_zarr.open(url, storage_options=options)
        run(4, _save_job, url, options, 4)  # the crashed job's claim is dead: the path is usable
        assert torch.equal(ucp_zarr.open(url, storage_options=options)["w"][...], _full(4)["w"])
    finally:
        server.stop()


# --- transient errors ------------------------------------------------------------------------


def test_transient_errors_are_retried_with_backoff(seaweed, caplog, backend):
    """Connection resets and HTTP 503 "SlowDown" answers on the way to the server are
    retried (botocore's own retries are turned off here, so on fsspec the library's bounded
    retry with backoff is what recovers; obstore retries each request itself, at least as
    often), and the save and load come out bit-exact."""
    from s3server import FaultProxy

    sd = {"w": torch.randn(128, 256), "step": 1}
    with FaultProxy(seaweed.s3_port) as proxy:
        options = _options(seaweed, backend, proxy.endpoint)
        options["config_kwargs"].update(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5)
        url = _url("flaky")
        caplog.set_level(logging.WARNING, logger="ucp_zarr.io.fsspec")
        proxy.http_503_next(2)  # three faults in a row: within the bound of 4 attempts
        proxy.fail_next(1)
        ucp_zarr.save(sd, url, storage_options=options, chunk_bytes=8192, shard_bytes=32768)
        assert proxy.counts.http_503 == 2
        proxy.http_503_next(2)
        out = {"w": torch.zeros(128, 256), "step": 0}
        ucp_zarr.load(out, url, storage_options=options)
        assert torch.equal(out["w"], sd["w"]) and out["step"] == 1
        assert proxy.counts.http_503 == 4
        if backend == "fsspec":  # (obstore's retries happen inside its client, unlogged)
            retries = [r for r in caplog.records if "retry" in r.getMessage()]
            assert len(retries) >= 4, [r.getMessage() for r in caplog.records]
        # more faults in a row than the bound allows: a clear error, not an endless retry
        proxy.http_503_next(40)
        start = time.monotonic()
        with pytest.raises(OSError, match="Service Unavailable"):
            ucp_zarr.open(url, storage_options=options)
        assert time.monotonic() - start < 60


def test_an_unreachable_store_fails_within_a_bound(seaweed, backend):
    from s3server import FaultProxy

    with FaultProxy(seaweed.s3_port) as proxy:
        options = _options(seaweed, backend, proxy.endpoint, fast_fail=True)
        proxy.down()
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            ucp_zarr.save({"w": torch.ones(4)}, _url("down"), storage_options=options)
        assert time.monotonic() - start < 60
        assert "127.0.0.1" in str(info.value) or "Connect" in type(info.value).__name__, info.value
