"""Object stores against their limit: single-process ``ucp_zarr.save``/``load`` of Llama-like
states (``bench_limits.model_state``) on loopback S3 (SeaweedFS, started here), through
obstore (the default for ``s3://``) and through fsspec (s3fs, ``backend="fsspec"``),
against **raw concurrent PUT/GET of the same objects with obstore**: as many objects of the
same sizes as the ucp_zarr save wrote, random bytes, put by as many threads as ucp_zarr
writes with by default (the store's request concurrency, ``REQUEST_CONCURRENCY``:
``obstore.put``, the same part size and upload concurrency), then those a load reads (the
shards and the root document: a load takes the array documents from the root's consolidated
copy) got back whole by as many threads as ucp_zarr loads with. ucp_zarr through fsspec runs
at its own default (4 threads: fsspec stores declare no request concurrency). ucp_zarr loads
into preallocated, resident tensors (training resume, as in ``bench_limits``), zeroed before
each load outside its time; raw GET lands nothing, and a second raw GET ("landed", a
reference) copies each body into a preallocated buffer, the least a load must add.

Each repeat runs every method once, alternating, in an order that rotates per repeat; each
ratio is taken per repeat (ucp_zarr's MiB/s over raw's, a few seconds apart); loaded data is
checked bit for bit. SeaweedFS keeps what it serves in its own memory and the page cache,
for raw and ucp_zarr alike. Requests per save and per load are counted in a separate,
untimed pass through a counting proxy (``tests/s3server.FaultProxy``): every HTTP request
each method sends.

A second measurement puts a distant store's round trip on every request: the same proxy holds
each request ``--latency-ms`` before forwarding it (concurrent requests wait concurrently), and
a small state (``--latency-mib``) is saved, loaded and saved again over itself
(``overwrite=True``, as the Lightning plug-in saves) by
ucp_zarr, and put, got and put again over the same objects by raw PUT/GET through it, at each
thread count of ``--latency-workers`` (``max_workers`` for ucp_zarr, as many threads for raw):
what a latency-bound save or load costs beyond its requests' own round trips (the serial ones:
the transaction's records before the first shard and after the last, the commit record before
the first read; an overwrite also moves its staged objects into place and deletes the replaced
ones).

Run: ``python benchmarks/bench_object_store.py [--sizes 256,1024] [--repeat 3] [--latency-ms 10]
[--latency-mib 16] [--latency-workers 4,16] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

import obstore  # noqa: E402
from bench_limits import MiB, bit_equal, model_state, nbytes  # noqa: E402
from s3server import FaultProxy, SeaweedServer  # noqa: E402

import ucp_zarr  # noqa: E402
import ucp_zarr.io.obstore as O  # noqa: E402

BUCKET = "bench"
METHODS = ("obstore", "fsspec", "raw")


def options(server: SeaweedServer, backend: str, endpoint: str | None = None) -> dict[str, Any]:
    return {**server.storage_options(endpoint), "backend": backend}


def raw_client(endpoint: str) -> Any:
    """An obstore client as ucp_zarr makes one (same defaults), for the raw limit."""
    return O._client("s3", BUCKET, {"key": "k", "secret": "s", "endpoint_url": endpoint})


def raw_put(client: Any, prefix: str, sizes: list[int], src: memoryview, workers: int = O.REQUEST_CONCURRENCY) -> None:
    """PUT ``len(sizes)`` objects of these sizes, ``workers`` at a time."""
    def put(i: int) -> None:
        obstore.put(client, f"{prefix}/{i}", src[: sizes[i]], chunk_size=O.PART_BYTES, max_concurrency=O.UPLOAD_CONCURRENCY)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(put, range(len(sizes))))


def raw_get(client: Any, prefix: str, sizes: list[int], read: list[int], workers: int = O.REQUEST_CONCURRENCY) -> int:
    """GET the objects ``read`` (indices into ``sizes``) back whole, ``workers`` at a time;
    return the bytes."""
    def get(i: int) -> int:
        return len(obstore.get(client, f"{prefix}/{i}").bytes())

    with ThreadPoolExecutor(workers) as pool:
        got = sum(pool.map(get, read))
    assert got == sum(sizes[i] for i in read)
    return got


def raw_get_landed(client: Any, prefix: str, sizes: list[int], read: list[int], dst: memoryview) -> int:
    """:func:`raw_get`, each body then copied into its range of ``dst`` (preallocated and
    resident: what any load must at least do with what it got)."""
    offsets = dict(zip(read, itertools.accumulate([0, *(sizes[i] for i in read)])))

    def get(i: int) -> int:
        body = obstore.get(client, f"{prefix}/{i}").bytes()
        n = len(body)
        np.copyto(np.frombuffer(dst[offsets[i] : offsets[i] + n], dtype=np.uint8), np.frombuffer(body, dtype=np.uint8))
        return n

    with ThreadPoolExecutor(O.REQUEST_CONCURRENCY) as pool:
        got = sum(pool.map(get, read))
    assert got == sum(sizes[i] for i in read)
    return got


def objects(server: SeaweedServer, url: str) -> tuple[list[int], list[int]]:
    """The sizes of every object under ``url``, largest first, and which of them a load
    reads (all but the array and group documents, which the root holds a copy of)."""
    client = raw_client(server.endpoint)
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    metas = sorted(obstore.list(client, prefix).collect(), key=lambda m: -m["size"])
    root = f"{prefix}/zarr.json"
    return [m["size"] for m in metas], [i for i, m in enumerate(metas) if m["path"] == root or
                                        not m["path"].endswith("/zarr.json")]


def zeroed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_repeat(server: SeaweedServer, sd: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], order: list[str],
               sizes: list[int], read: list[int], src: memoryview, landing: memoryview) -> dict[str, dict[str, float]]:
    """Every method's save and load (into ``dest``, resident) once, in ``order``: seconds."""
    out: dict[str, dict[str, float]] = {}
    for m in order:
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/ck"
        if m == "raw":
            client = raw_client(server.endpoint)
            prefix = url.removeprefix(f"s3://{BUCKET}/")
            out[m] = {"save": timed(lambda: raw_put(client, prefix, sizes, src)),
                      "load": timed(lambda: raw_get(client, prefix, sizes, read)),
                      "load_landed": timed(lambda: raw_get_landed(client, prefix, sizes, read, landing))}
            continue
        opts = options(server, m)
        save = timed(lambda: ucp_zarr.save(sd, url, storage_options=opts))
        for t in dest.values():
            t.zero_()
        load = timed(lambda: ucp_zarr.load(dest, url, storage_options=opts))
        assert all(bit_equal(dest[k], v) for k, v in sd.items()), f"{m}: the load differs"
        out[m] = {"save": save, "load": load}
    return out


def count_requests(
    server: SeaweedServer, sd: dict[str, torch.Tensor], sizes: list[int], read: list[int], src: memoryview
) -> dict[str, Any]:
    """HTTP requests of one save and one load of each method, through a counting proxy."""
    out: dict[str, Any] = {}
    with FaultProxy(server.s3_port) as proxy:
        for m in METHODS:
            url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/ck"
            before = proxy.counts.requests
            if m == "raw":
                client = raw_client(proxy.endpoint)
                prefix = url.removeprefix(f"s3://{BUCKET}/")
                raw_put(client, prefix, sizes, src)
                mid = proxy.counts.requests
                raw_get(client, prefix, sizes, read)
            else:
                opts = options(server, m, proxy.endpoint)
                ucp_zarr.save(sd, url, storage_options=opts)
                mid = proxy.counts.requests
                ucp_zarr.load(zeroed(sd), url, storage_options=opts)
            out[m] = {"save": mid - before, "load": proxy.counts.requests - mid}
    return out


def measure(server: SeaweedServer, mib: float, repeat: int, log: Any = print) -> dict[str, Any]:
    sd = model_state(mib)
    total = nbytes(sd)
    probe = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/probe"
    ucp_zarr.save(sd, probe, storage_options=options(server, "obstore"))
    sizes, read = objects(server, probe)
    src = memoryview(torch.randint(0, 256, (max(sizes),), dtype=torch.uint8).numpy()).cast("B")
    dest = {k: torch.ones_like(v) for k, v in sd.items()}  # (resident: every page written)
    landing = memoryview(np.ones(sum(sizes[i] for i in read), dtype=np.uint8))  # (raw GET's bodies land here)
    runs = []
    for i in range(repeat):
        order = [METHODS[(i + j) % len(METHODS)] for j in range(len(METHODS))]
        runs.append(one_repeat(server, sd, dest, order, sizes, read, src, landing))
        log(json.dumps({"mib": round(total / MiB), "repeat": i, "order": order,
                        **{f"{m}:{op}": round(runs[-1][m][op], 3) for m in METHODS for op in ("save", "load")}}))
    return {"mib": total / MiB, "objects": len(sizes), "object_mib": sum(sizes) / MiB, "read_objects": len(read),
            "runs": runs, "requests": count_requests(server, sd, sizes, read, src)}


def measure_latency(server: SeaweedServer, mib: float, latency_s: float, workers: list[int], repeat: int,
                    log: Any = print) -> dict[str, Any]:
    """ucp_zarr (obstore) and raw PUT/GET of a ``mib`` MiB state through a proxy that holds
    every request ``latency_s``, at each thread count of ``workers``, alternating per repeat:
    seconds, and requests per save and load."""
    sd = model_state(mib)
    probe = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/probe"
    ucp_zarr.save(sd, probe, storage_options=options(server, "obstore"))
    sizes, read = objects(server, probe)
    src = memoryview(torch.randint(0, 256, (max(sizes),), dtype=torch.uint8).numpy()).cast("B")
    dest = {k: torch.ones_like(v) for k, v in sd.items()}
    out: dict[str, Any] = {"mib": nbytes(sd) / MiB, "objects": len(sizes), "latency_ms": latency_s * 1e3, "workers": {}}
    with FaultProxy(server.s3_port) as proxy:
        proxy.delay(latency_s)
        client = raw_client(proxy.endpoint)
        opts = options(server, "obstore", proxy.endpoint)
        for w in workers:
            runs, requests = [], {}
            for i in range(repeat):
                run: dict[str, dict[str, float]] = {}
                for m in (("ucp_zarr", "raw") if i % 2 == 0 else ("raw", "ucp_zarr")):
                    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/ck"
                    prefix = url.removeprefix(f"s3://{BUCKET}/")
                    proxy.reset_counts()
                    if m == "raw":
                        save = timed(lambda: raw_put(client, prefix, sizes, src, w))
                        mid = proxy.counts.requests
                        load = timed(lambda: raw_get(client, prefix, sizes, read, w))
                        end = proxy.counts.requests
                        again = timed(lambda: raw_put(client, prefix, sizes, src, w))
                    else:
                        save = timed(lambda: ucp_zarr.save(sd, url, storage_options=opts, max_workers=w))
                        mid = proxy.counts.requests
                        for t in dest.values():
                            t.zero_()
                        load = timed(lambda: ucp_zarr.load(dest, url, storage_options=opts, max_workers=w))
                        assert all(bit_equal(dest[k], v) for k, v in sd.items()), "the load differs"
                        end = proxy.counts.requests
                        again = timed(lambda: ucp_zarr.save(sd, url, storage_options=opts, max_workers=w, overwrite=True))
                    run[m] = {"save": save, "load": load, "overwrite": again}
                    requests[m] = {"save": mid, "load": end - mid, "overwrite": proxy.counts.requests - end}
                runs.append(run)
                log(json.dumps({"latency_ms": latency_s * 1e3, "mib": round(out["mib"]), "workers": w, "repeat": i,
                                **{f"{m}:{op}": round(t, 3) for m in run for op, t in run[m].items()}}))
            out["workers"][str(w)] = {"runs": runs, "requests": requests}
    return out


def latency_summary(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per thread count and operation: ucp_zarr's and raw's median seconds, the ratio (raw's
    time over ucp_zarr's: median, min, max) and the requests of each."""
    out: dict[str, dict[str, Any]] = {}
    for w, got in r["workers"].items():
        for op in ("save", "load", "overwrite"):
            if not all(op in run["raw"] for run in got["runs"]):  # (results before 2026-12-06 lack overwrites)
                continue
            ratios = [run["raw"][op] / run["ucp_zarr"][op] for run in got["runs"]]
            out[f"{op}:{w}"] = {
                "ucp_zarr_s": statistics.median(run["ucp_zarr"][op] for run in got["runs"]),
                "raw_s": statistics.median(run["raw"][op] for run in got["runs"]),
                "ratio": (statistics.median(ratios), min(ratios), max(ratios)),
                "requests": (got["requests"]["ucp_zarr"][op], got["requests"]["raw"][op]),
            }
    return out


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """MiB/s of each method (median over repeats) and each ratio to raw: (median, min, max)."""
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        for m in METHODS:
            out[f"{op}:{m}"] = statistics.median(r["mib"] / run[m][op] for run in r["runs"])
        for m, peer in (("obstore", "raw"), ("fsspec", "raw"), ("obstore", "fsspec")):
            ratios = [run[peer][op] / run[m][op] for run in r["runs"]]
            out[f"{op}:{m}_vs_{peer}"] = (statistics.median(ratios), min(ratios), max(ratios))
    if all("load_landed" in run["raw"] for run in r["runs"]):  # (results before 2026-12-06 lack it)
        out["load:raw_landed"] = statistics.median(r["mib"] / run["raw"]["load_landed"] for run in r["runs"])
        ratios = [run["raw"]["load_landed"] / run["obstore"]["load"] for run in r["runs"]]
        out["load:obstore_vs_raw_landed"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| state | op | ucp_zarr obstore MiB/s | ucp_zarr fsspec MiB/s | raw obstore MiB/s | obstore / raw | "
            "fsspec / raw | obstore / fsspec | requests obstore / fsspec / raw |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def ratio(x: tuple[float, float, float]) -> str:
        return f"{x[0]:.2f}x ({x[1]:.2f}-{x[2]:.2f})"

    for r in (r for r in results if "latency_ms" not in r):
        s = summary(r)
        for op in ("save", "load"):
            q = r["requests"]
            rows.append(
                f"| {r['mib']:.0f} MiB, {r['objects']} objects | {op} | {s[f'{op}:obstore']:.0f} | {s[f'{op}:fsspec']:.0f} | "
                f"{s[f'{op}:raw']:.0f} | {ratio(s[f'{op}:obstore_vs_raw'])} | {ratio(s[f'{op}:fsspec_vs_raw'])} | "
                f"{ratio(s[f'{op}:obstore_vs_fsspec'])} | {q['obstore'][op]} / {q['fsspec'][op]} / {q['raw'][op]} |"
            )
    return "\n".join(rows)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1024", help="state sizes in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=10.0, help="held on every request of the latency runs (0: none)")
    ap.add_argument("--latency-mib", type=float, default=16.0, help="state size of the latency runs")
    ap.add_argument("--latency-workers", default="4,16", help="thread counts of the latency runs")
    ap.add_argument("--dir", default=None, help="where SeaweedFS keeps its data (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    print(f"load average at the start {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as work, SeaweedServer(Path(work)) as server:
        server.make_bucket(BUCKET)
        for mib in (float(x) for x in args.sizes.split(",")):
            results.append(measure(server, mib, args.repeat, log=lambda line: print(line, flush=True)))
        if args.latency_ms > 0:
            results.append(measure_latency(server, args.latency_mib, args.latency_ms / 1e3,
                                           [int(w) for w in args.latency_workers.split(",")], args.repeat,
                                           log=lambda line: print(line, flush=True)))
    print(f"load average at the end {loadavg()}")
    print(table(results))
    for r in (r for r in results if "latency_ms" in r):
        for key, v in latency_summary(r).items():
            print(f"{r['mib']:.0f} MiB at {r['latency_ms']:.0f} ms per request, {key}: ucp_zarr {v['ucp_zarr_s'] * 1e3:.0f} ms, "
                  f"raw {v['raw_s'] * 1e3:.0f} ms, {v['ratio'][0]:.2f}x ({v['ratio'][1]:.2f}-{v['ratio'][2]:.2f}), "
                  f"requests {v['requests'][0]} / {v['requests'][1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
