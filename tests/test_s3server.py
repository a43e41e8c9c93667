"""Tests of the test helpers in ``s3server``: a real SeaweedFS S3 server and the FaultProxy."""

from __future__ import annotations

import http.client
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import FaultProxy, SeaweedServer, seaweed_or_skip

s3fs = pytest.importorskip("s3fs")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

BUCKET = "bucket1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS server for the module, with bucket ``bucket1``."""
    with seaweed_or_skip(tmp_path_factory.mktemp("seaweed")) as srv:
        srv.make_bucket(BUCKET)
        yield srv


@pytest.fixture
def proxy(server: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(server.s3_port) as p:
        yield p


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "FaultProxy"]


def test_roundtrip_direct(server: SeaweedServer, request: pytest.FixtureRequest) -> None:
    fs = server.filesystem()
    key = f"{BUCKET}/{request.node.name}/obj"
    fs.pipe_file(key, b"hello")
    assert fs.cat_file(key) == b"hello"
    assert fs.ls(f"{BUCKET}/{request.node.name}") == [key]
    assert "region_name" not in server.storage_options()["client_kwargs"]
    # no auth is configured: any key/secret is accepted
    opts = server.storage_options() | {"key": "someone-else", "secret": "anything"}
    assert s3fs.S3FileSystem(**opts).cat_file(key) == b"hello"


def test_listens_on_loopback_only(server: SeaweedServer) -> None:
    psutil = pytest.importorskip("psutil")
    assert server.pid is not None
    sockets = psutil.Process(server.pid).net_connections("inet")  # TCP and UDP, v4 and v6
    assert {c.laddr.ip for c in sockets} == {"127.0.0.1"}  # also: no connection leaves loopback
    listening = {c.laddr.port for c in sockets if c.status == psutil.CONN_LISTEN}
    assert listening == set(server.ports.values())


def test_bucket_names(server: SeaweedServer) -> None:
    server.make_bucket(BUCKET)  # exist_ok
    with pytest.raises(OSError):
        server.make_bucket("bk")  # too short for S3


def test_conditional_create(server: SeaweedServer, request: pytest.FixtureRequest) -> None:
    fs = server.filesystem()
    key = f"{BUCKET}/{request.node.name}/obj"
    fs.pipe_file(key, b"first", mode="create")
    with pytest.raises(OSError) as info:
        fs.pipe_file(key, b"second", mode="create")
    err = info.value
    assert type(err) is OSError and err.errno == 22  # s3fs's translate_boto_error: EINVAL
    cause = err.__cause__
    assert isinstance(cause, botocore_exceptions.ClientError)
    assert cause.response["Error"]["Code"] == "PreconditionFailed"
    assert cause.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert fs.cat_file(key) == b"first"


def test_roundtrip_through_proxy(server: SeaweedServer, proxy: FaultProxy, request: pytest.FixtureRequest) -> None:
    fs = server.filesystem(proxy.endpoint)
    key = f"{BUCKET}/{request.node.name}/obj"
    data = bytes(range(256)) * 4096  # 1 MiB
    fs.pipe_file(key, data)
    assert fs.cat_file(key) == data
    counts = proxy.counts
    assert counts.forwarded_requests >= 2 and counts.requests == counts.forwarded_requests
    assert counts.failed_connections == counts.http_503 == 0


def test_proxy_http_boundaries_on_keepalive(server: SeaweedServer, proxy: FaultProxy) -> None:
    """503s hit exactly the next request, also after bodies (Content-Length and chunked) on one connection."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("PUT", f"/{BUCKET}/raw/a", body=b"x" * 100_000)
        assert conn.getresponse().read() == b""
        conn.request("PUT", f"/{BUCKET}/raw/b", body=iter([b"abc", b"defg"]), encode_chunked=True)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        proxy.http_503_next(1)
        conn.request("PUT", f"/{BUCKET}/raw/c", body=b"never stored")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 503
        assert resp.getheader("Connection") == "close"
        assert b"<Code>SlowDown</Code>" in body
    finally:
        conn.close()
    assert proxy.counts.connections == 1
    assert (proxy.counts.requests, proxy.counts.forwarded_requests, proxy.counts.http_503) == (3, 2, 1)
    fs = server.filesystem()
    assert fs.cat_file(f"{BUCKET}/raw/b") == b"abcdefg"
    assert not fs.exists(f"{BUCKET}/raw/c")


def test_delay_holds_each_request_and_overlaps_concurrent_ones(server: SeaweedServer, proxy: FaultProxy) -> None:
    def get(conn: http.client.HTTPConnection, key: str) -> int:
        conn.request("GET", f"/{BUCKET}/delay/{key}")
        resp = conn.getresponse()
        resp.read()
        return resp.status

    conns = [http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10) for _ in range(4)]
    try:
        assert get(conns[0], "warm") == 404
        t0 = time.monotonic()
        get(conns[0], "a")
        fast = time.monotonic() - t0
        proxy.delay(0.5)
        t0 = time.monotonic()
        assert [get(conns[0], k) for k in "bc"] == [404, 404]  # one after the other: 2 delays
        serial = time.monotonic() - t0
        threads = [threading.Thread(target=get, args=(c, k)) for c, k in zip(conns, "defg")]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent = time.monotonic() - t0  # 4 at once: about 1 delay (4 if they queued)
        proxy.delay(0)
        t0 = time.monotonic()
        get(conns[0], "h")
        after = time.monotonic() - t0
    finally:
        for c in conns:
            c.close()
    assert serial >= 1.0 and 0.5 <= concurrent < 1.5, (serial, concurrent)
    assert fast < 0.5 and after < 0.5, (fast, after)
    assert proxy.counts.requests == 9 and proxy.counts.most_held == 4 and proxy.counts.held == 0


def test_fail_next_is_retried(server: SeaweedServer, proxy: FaultProxy, request: pytest.FixtureRequest) -> None:
    key = f"{BUCKET}/{request.node.name}/obj"
    server.filesystem().pipe_file(key, b"data")
    proxy.fail_next(2)
    fs = server.filesystem(proxy.endpoint, fast_fail=True)  # fresh client: new connections
    assert fs.cat_file(key) == b"data"
    assert proxy.counts.failed_connections == 2
    assert proxy.pending() == (0, 0)


def test_http_503_is_retried(server: SeaweedServer, proxy: FaultProxy, request: pytest.FixtureRequest) -> None:
    key = f"{BUCKET}/{request.node.name}/obj"
    fs = server.filesystem(proxy.endpoint, fast_fail=True)
    fs.pipe_file(key, b"v1")  # warm a keep-alive connection
    proxy.http_503_next(2)
    fs.pipe_file(key, b"v2" * 1000)
    proxy.http_503_next(1)
    assert fs.cat_file(key) == b"v2" * 1000
    assert proxy.counts.http_503 == 3
    assert proxy.pending() == (0, 0)


def test_down_fails_fast_and_up_recovers(
    server: SeaweedServer, proxy: FaultProxy, request: pytest.FixtureRequest
) -> None:
    key = f"{BUCKET}/{request.node.name}/obj"
    fs = server.filesystem(proxy.endpoint, fast_fail=True)
    fs.pipe_file(key, b"data")
    proxy.down()
    assert proxy.is_down
    t0 = time.monotonic()
    with pytest.raises((OSError, botocore_exceptions.BotoCoreError)):
        fs.cat_file(key)
    assert time.monotonic() - t0 < 15
    assert proxy.counts.refused_connections >= 1
    proxy.up()
    assert fs.cat_file(key) == b"data"


def test_proxy_close_joins_thread(server: SeaweedServer) -> None:
    before = len(_proxy_threads())
    p = FaultProxy(server.s3_port)
    fs = server.filesystem(p.endpoint)
    fs.ls(BUCKET)  # leaves a live keep-alive connection in the pool
    assert len(_proxy_threads()) == before + 1
    p.close()
    p.close()  # idempotent
    assert len(_proxy_threads()) == before


def test_multipart_upload_through_503s(
    server: SeaweedServer, proxy: FaultProxy, request: pytest.FixtureRequest
) -> None:
    key = f"{BUCKET}/{request.node.name}/big"
    data = bytes(range(251)) * (12 * 2**20 // 251)  # ~12 MiB: three 5 MiB parts
    fs = server.filesystem(proxy.endpoint, fast_fail=True)
    proxy.http_503_next(3)
    with fs.open(key, "wb", block_size=5 * 2**20) as f:
        for i in range(0, len(data), 2**20):
            f.write(data[i : i + 2**20])
    assert proxy.counts.http_503 == 3
    assert server.filesystem().cat_file(key) == data


def test_restart_keeps_data(server: SeaweedServer, tmp_path: Path) -> None:
    with SeaweedServer(tmp_path) as other, FaultProxy(other.s3_port) as proxy:
        assert other.endpoint != server.endpoint  # two servers side by side
        other.make_bucket("bucket2")
        fs = other.filesystem()
        fs.pipe_file("bucket2/k1", b"before graceful restart")
        via_proxy = other.filesystem(proxy.endpoint, fast_fail=True)
        assert via_proxy.cat_file("bucket2/k1") == b"before graceful restart"  # keep-alive via proxy
        endpoint = other.endpoint
        other.restart()
        assert other.endpoint == endpoint
        fs.pipe_file("bucket2/k2", b"before crash")
        other.restart(kill=True)
        fs = other.filesystem()
        assert fs.cat_file("bucket2/k1") == b"before graceful restart"
        assert fs.cat_file("bucket2/k2") == b"before crash"
        assert via_proxy.cat_file("bucket2/k2") == b"before crash"  # stale pooled connection recovers
    assert not other.running
    assert not server.filesystem().exists("bucket2")


def test_start_failure_reports_log(tmp_path: Path) -> None:
    fake = tmp_path / "fake-weed"
    fake.write_text("#!/bin/sh\necho 'fake weed: cannot start' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    srv = SeaweedServer(tmp_path / "work", weed=str(fake))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*fake weed: cannot start"):
        srv.start()
    assert not srv.running


def test_seaweed_or_skip_without_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import s3server

    monkeypatch.setattr(s3server, "find_weed", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="weed"):
        seaweed_or_skip(tmp_path)
