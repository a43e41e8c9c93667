"""ucp_zarr's own Zarr codec path against the libraries, and optional compression.

    python benchmarks/bench_codecs.py [--mib 1024] [--repeat 3] [--dir DIR] [--json OUT] [--skip-libraries] [--skip-compression]

**Libraries.** The same fp32 arrays (``--mib`` MiB in 4 arrays of ``[n, n]``) are written
and read with the same shard and inner-chunk shapes and the same codecs (``bytes`` +
``crc32c`` in ``sharding_indexed``, crc32c index at the end) by:

* ``ucp_zarr``: ``ucp_zarr.save`` (durable on return) and ``ucp_zarr.load`` into
  preallocated tensors; the shapes it chose are read from its ``zarr.json`` documents;
* ``zarr-python`` with its default codec pipeline, and with the ``zarrs`` (Rust) pipeline
  (``zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})``), if installed;
* TensorStore (``zarr3`` driver).

A library's write is timed until its files are durable: it is followed by an fsync of every
file it wrote and of their directories (4 threads), which ucp_zarr does itself. Reads are
cold (page cache dropped, ``fincore``-checked in the first repeat); the libraries return
new arrays (``z[...]``, ``read().result()``), ucp_zarr fills the given tensors. Every read
is checked bit for bit in the first repeat. The order of the methods rotates per repeat.

**Compression** (measured only): numcodecs ``Zstd`` (levels 1, 3) and ``Blosc`` (zstd and
lz4, byte shuffle) on 4 MiB chunks of a trained model's bf16 weights and fp32 Adam moments
(a transformer trained for a few steps on random tokens; its embedding is left out: after a
few steps most of its rows have zero moments, which would flatter compression), one thread: the size ratio and
compression / decompression MiB/s per core, compared with what the disk writes and reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch
from pagecache import cached_bytes, evict, files_under

if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20


# --- the arrays and their layout ----------------------------------------------------------------


def arrays(mib: float) -> dict[str, np.ndarray]:
    n = int((mib * MiB / 4 / 4) ** 0.5) // 64 * 64
    g = np.random.default_rng(0)
    return {f"a{i}": g.standard_normal((n, n), dtype=np.float32) for i in range(4)}


def layout(ck: str, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard shape, inner chunk shape) ucp_zarr chose for array ``name`` of checkpoint ``ck``."""
    for f in files_under(ck):
        if f.endswith("zarr.json") and f"/{name}/" in f:
            doc = json.load(open(f))
            if doc.get("node_type") == "array":
                shard = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
                codec = doc["codecs"][0]
                assert codec["name"] == "sharding_indexed", codec
                return shard, tuple(codec["configuration"]["chunk_shape"])
    raise SystemExit(f"no array document for {name} under {ck}")


def fsync_tree(path: str, threads: int = 4) -> None:
    """fsync every file under ``path``, then every directory (what ucp_zarr's save does)."""
    files = files_under(path)
    dirs = sorted({os.path.dirname(f) for f in files} | {path}, key=len, reverse=True)

    def sync(p: str) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(sync, files))
    for d in dirs:
        sync(d)


# --- the methods -----------------------------------------------------------------------------


def ucp_write(data: dict[str, np.ndarray], path: str, shapes: Any) -> None:
    import ucp_zarr

    ucp_zarr.save({k: torch.from_numpy(v) for k, v in data.items()}, path)


def ucp_read(data: dict[str, np.ndarray], path: str, dest: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    import ucp_zarr

    ucp_zarr.load(dest, path)
    return {k: v.numpy() for k, v in dest.items()}


def zarr_write(data: dict[str, np.ndarray], path: str, shapes: Any, pipeline: str | None = None) -> None:
    import zarr
    from zarr.codecs import Crc32cCodec

    with zarr.config.set({"codec_pipeline.path": pipeline} if pipeline else {}):
        root = zarr.open_group(path, mode="w")
        for k, v in data.items():
            shard, chunk = shapes[k]
            z = root.create_array(k, shape=v.shape, dtype=v.dtype, shards=shard, chunks=chunk, compressors=[Crc32cCodec()],
                                  fill_value=0)
            z[...] = v
    fsync_tree(path)


def zarr_read(data: dict[str, np.ndarray], path: str, dest: Any, pipeline: str | None = None) -> dict[str, np.ndarray]:
    import zarr

    with zarr.config.set({"codec_pipeline.path": pipeline} if pipeline else {}):
        root = zarr.open_group(path, mode="r")
        return {k: root[k][...] for k in data}


ZARRS = "zarrs.ZarrsCodecPipeline"


def ts_spec(path: str, k: str, v: np.ndarray, shapes: Any) -> dict[str, Any]:
    shard, chunk = shapes[k]
    bytes_crc = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.path.join(path, k)},
        "metadata": {
            "shape": list(v.shape),
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": 0,
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunk), "codecs": bytes_crc, "index_codecs": bytes_crc, "index_location": "end"}}],
        },
    }


def ts_write(data: dict[str, np.ndarray], path: str, shapes: Any) -> None:
    import tensorstore as ts

    futures = []
    for k, v in data.items():
        arr = ts.open(ts_spec(path, k, v, shapes), create=True, delete_existing=True).result()
        futures.append(arr.write(v))
    for f in futures:
        f.result()
    fsync_tree(path)


def ts_read(data: dict[str, np.ndarray], path: str, dest: Any) -> dict[str, np.ndarray]:
    import tensorstore as ts

    opened = {k: ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, k)}}).result()
              for k in data}
    futures = {k: a.read() for k, a in opened.items()}
    return {k: f.result() for k, f in futures.items()}


def methods(skip_zarrs: bool) -> dict[str, tuple[Callable, Callable]]:
    out: dict[str, tuple[Callable, Callable]] = {
        "ucp_zarr": (ucp_write, ucp_read),
        "zarr-python": (zarr_write, zarr_read),
        "tensorstore": (ts_write, ts_read),
    }
    if not skip_zarrs:
        out["zarr-python + zarrs"] = (
            lambda d, p, s: zarr_write(d, p, s, ZARRS),
            lambda d, p, dest: zarr_read(d, p, dest, ZARRS),
        )
    return out


def libraries(mib: float, repeat: int, work: str) -> dict[str, Any]:
    data = arrays(mib)
    size = sum(v.nbytes for v in data.values())
    probe = os.path.join(work, "probe")
    ucp_write(data, probe, None)
    shapes = {k: layout(probe, k) for k in data}
    shutil.rmtree(probe)
    skip_zarrs = importlib.util.find_spec("zarrs") is None
    if skip_zarrs:
        print("  zarrs is not installed (pip install zarrs): its pipeline is skipped")
    ms = methods(skip_zarrs)
    dest = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in data.items()}
    res: dict[str, Any] = {"bytes": size, "shapes": {k: [list(a), list(b)] for k, (a, b) in shapes.items()},
                           "write": {m: [] for m in ms}, "read": {m: [] for m in ms}, "cached": {}}
    names = list(ms)
    for rep in range(repeat + 1):  # repeat 0 warms every method up (imports, thread pools), untimed
        order = names[rep % len(names):] + names[: rep % len(names)]
        for m in order:
            write, read = ms[m]
            path = os.path.join(work, f"{m.replace(' ', '')}.{rep}")
            t0 = time.perf_counter()
            write(data, path, shapes)
            tw = time.perf_counter() - t0
            evict(path)
            if rep == 1:
                res["cached"][m] = cached_bytes(path)
            for t in dest.values():
                t.zero_()
            t0 = time.perf_counter()
            got = read(data, path, dest)
            tr = time.perf_counter() - t0
            if rep <= 1:
                bad = [k for k in data if not np.array_equal(got[k].view(np.uint32), data[k].view(np.uint32))]
                if bad:
                    raise SystemExit(f"{m} read {bad} wrong")
            del got
            shutil.rmtree(path)
            if rep:
                res["write"][m].append(tw)
                res["read"][m].append(tr)
        if rep:
            print("  repeat %d/%d: " % (rep, repeat) + "; ".join(
                f"{m} write {size / MiB / res['write'][m][-1]:.0f} read {size / MiB / res['read'][m][-1]:.0f}" for m in order
            ) + " MiB/s", flush=True)
    return res


def library_table(res: dict[str, Any]) -> str:
    size = res["bytes"] / MiB
    rows = ["| method | write MiB/s (to durable) | read MiB/s (cold) | ucp_zarr / it, write (min-max) | ucp_zarr / it, read (min-max) |",
            "|---|---:|---:|---:|---:|"]
    for m in res["write"]:
        w, r = res["write"][m], res["read"][m]
        rw = [b / a for a, b in zip(res["write"]["ucp_zarr"], w)]
        rr = [b / a for a, b in zip(res["read"]["ucp_zarr"], r)]
        rows.append(
            f"| {m} | {size / statistics.median(w):.0f} | {size / statistics.median(r):.0f} "
            f"| {statistics.median(rw):.2f}x ({min(rw):.2f}-{max(rw):.2f}) | {statistics.median(rr):.2f}x ({min(rr):.2f}-{max(rr):.2f}) |"
        )
    return "\n".join(rows)


# --- compression ----------------------------------------------------------------------------


def trained_state(steps: int = 5) -> dict[str, torch.Tensor]:
    """bf16 weights and fp32 Adam moments of a small transformer after a few steps."""
    from bench_async import Model

    torch.manual_seed(0)
    model = Model(512, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 8000, (2, 32))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("emb."):  # rows of tokens never seen in a few steps have zero moments
            continue
        out[f"weights bf16/{name}"] = p.detach().to(torch.bfloat16)
        st = opt.state[p]
        out[f"exp_avg fp32/{name}"] = st["exp_avg"]
        out[f"exp_avg_sq fp32/{name}"] = st["exp_avg_sq"]
    return out


def codecs() -> dict[str, Any]:
    from numcodecs import Blosc, Zstd

    return {
        "zstd-1": Zstd(level=1),
        "zstd-3": Zstd(level=3),
        "blosc-zstd-1-shuffle": Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE),
        "blosc-lz4-5-shuffle": Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE),
    }


def compression(chunk_bytes: int = 4 * MiB) -> dict[str, Any]:
    from numcodecs import blosc

    blosc.set_nthreads(1)
    state = trained_state()
    kinds: dict[str, list[np.ndarray]] = {}
    for key, t in state.items():
        kind = key.split("/")[0]
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        item = t.element_size()
        for a in range(0, raw.nbytes, chunk_bytes):
            kinds.setdefault(kind, []).append(raw[a : a + chunk_bytes].view(np.uint16 if item == 2 else np.uint32))
    res: dict[str, Any] = {}
    for kind, chunks in kinds.items():
        total = sum(c.nbytes for c in chunks)
        for name, codec in codecs().items():
            t0 = time.perf_counter()
            enc = [codec.encode(c) for c in chunks]
            tc = time.perf_counter() - t0
            t0 = time.perf_counter()
            for e, c in zip(enc, chunks):
                out = np.empty_like(c)
                codec.decode(e, out=out)
            td = time.perf_counter() - t0
            res[f"{kind}|{name}"] = {
                "bytes": total, "ratio": sum(len(e) for e in enc) / total,
                "compress_mibs": total / MiB / tc, "decompress_mibs": total / MiB / td,
            }
    return res


def compression_table(res: dict[str, Any]) -> str:
    rows = ["| data | codec | size after / before | compress MiB/s per core | decompress MiB/s per core |",
            "|---|---|---:|---:|---:|"]
    for key, r in res.items():
        kind, name = key.split("|")
        rows.append(f"| {kind} ({r['bytes'] / MiB:.0f} MiB) | {name} | {r['ratio']:.3f} | {r['compress_mibs']:.0f} "
                    f"| {r['decompress_mibs']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=1024, help="size of the arrays, MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/work/bench_tmp")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--skip-libraries", action="store_true")
    ap.add_argument("--skip-compression", action="store_true")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.skip_libraries:
        work = os.path.join(args.dir, f"bench_codecs.{os.getpid()}")
        os.makedirs(work)
        try:
            out["libraries"] = libraries(args.mib, args.repeat, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        shapes = out["libraries"]["shapes"]
        first = next(iter(shapes.values()))
        print(f"\n{out['libraries']['bytes'] / MiB:.0f} MiB in {len(shapes)} fp32 arrays, shards {first[0]}, chunks {first[1]}, "
              f"bytes + crc32c; median of {args.repeat} repeats (order rotating)\n")
        print(library_table(out["libraries"]))
    if not args.skip_compression:
        out["compression"] = compression()
        print()
        print(compression_table(out["compression"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
