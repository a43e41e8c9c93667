"""Single-process save and load against the disk's real limits, from 16 MiB to GiB states.

    python benchmarks/bench_limits.py [--sizes 16,64,256,1024] [--repeat 3] [--threads 4] [--dir DIR] [--json OUT]

For each state size (MiB), a Llama-like model state (bf16 weights of layers of q, k, v, o
``[h, h]``, up ``[4h, h]``, down ``[h, 4h]`` and two norms, with fp32 Adam moments; ``h``
grows with the size) is saved and loaded with ``ucp_zarr`` and with the raw limits:

* **raw write**: the same number of files with the same sizes as every object ucp_zarr
  wrote for that state (shards, ``zarr.json`` documents, commit record), written by as many
  threads as ucp_zarr uses (``--threads``, default 4 = ``max_workers``) from one source
  buffer, each file ``write`` + ``fsync`` (then the directory fsynced): what this disk does
  when nothing but the bytes is written durably; again with ``O_DIRECT`` (around the
  page cache, each file from a page-aligned range, padded, cut and fsynced), as ucp_zarr
  writes shards larger than 8 MiB; and again into the same directory tree as ucp_zarr's
  (every file under its own path, directories made as needed and fsynced): a reference
  that tells the layout's directories (a Zarr array is a directory, a shard ``c/<i>/<j>``)
  from the rest of a save's cost;
* **raw read**: the same files read cold by as many threads with ``os.preadv`` into one
  preallocated, resident buffer (no allocation, no copy); and again cold with ``O_DIRECT``
  (around the page cache, each file's range page-aligned): the device's own limit, which
  ucp_zarr's local loads also use for large cold spans (``ucp_zarr/io/direct.py``);
* **ucp_zarr save** (``ucp_zarr.save``, durable on return) and **load** (``ucp_zarr.load``
  into preallocated, resident tensors: training resume), with the bytes its store read.

Loads are cold: every file is fsynced and dropped from the page cache
(``posix_fadvise(DONTNEED)``) before; the first repeat checks with ``fincore`` and the
loaded state bit for bit. Per repeat the order of ucp_zarr and raw alternates; the result
is the median of the per-repeat times and of the per-repeat ratios (each ratio taken
between two runs a few seconds apart: the machine may be shared). A host cache below the
guest (the VM's disk image in the host's page cache) may still serve "cold" reads: the
raw read limit is measured the same way, so the ratio stays fair.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch
from pagecache import cached_bytes, evict, files_under
from rawio import (counted_load, direct_buffer, load_counts, opened_stores, raw_read, raw_read_direct, raw_write,
                   raw_write_direct, raw_write_tree, tree_directories)

if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20


# --- the state ------------------------------------------------------------------------------


def hidden_for(mib: float, layers: int = 4) -> int:
    """A hidden size (multiple of 64) that makes ``layers`` layers about ``mib`` MiB."""
    params = mib * MiB / 10  # bf16 weight + two fp32 moments = 10 bytes per parameter
    return 64 * max(2, round(math.sqrt(params / (12 * layers)) / 64))


def model_state(mib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat DCP-style state of ``mib`` MiB or a little more: ``model.<p>`` (bf16, N(0, 0.02))
    and ``optim.state.<p>.exp_avg`` / ``.exp_avg_sq`` (fp32, Adam-like scales)."""
    h = hidden_for(mib)
    shapes = [("q", (h, h)), ("k", (h, h)), ("v", (h, h)), ("o", (h, h)),
              ("up", (4 * h, h)), ("down", (h, 4 * h)), ("norm1", (h,)), ("norm2", (h,))]
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < mib * MiB:
        for name, shape in shapes:
            p = f"layers.{layer}.{name}"
            sd[f"model.{p}"] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            sd[f"optim.state.{p}.exp_avg"] = torch.randn(shape, generator=g) * 1e-4
            sd[f"optim.state.{p}.exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-6
            total += math.prod(shape) * 10
        layer += 1
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(ints[a.element_size()]), b.reshape(-1).view(ints[b.element_size()])
    )


# --- the raw limits -------------------------------------------------------------------------




# --- ucp_zarr ---------------------------------------------------------------------------------


def ucp_save(sd: dict[str, torch.Tensor], path: str, threads: int) -> int:
    """``ucp_zarr.save``; return the bytes its store wrote around the page cache."""
    import ucp_zarr
    import ucp_zarr.protocol.saving as saving

    with opened_stores(saving) as stores:
        ucp_zarr.save(sd, path, max_workers=threads)
    return sum(s.stats.bytes_written_direct for s in stores)


def object_files(path: str) -> list[tuple[str, int]]:
    """Every file under ``path``: its path relative to ``path`` and its size, largest first."""
    return sorted(((os.path.relpath(f, path), os.path.getsize(f)) for f in files_under(path)), key=lambda f: -f[1])


# --- one size -----------------------------------------------------------------------------------


def measure(mib: float, repeat: int, threads: int, work: str, log: Any = print) -> dict[str, Any]:
    """Every measurement of one state size; times in seconds, per repeat."""
    sd = model_state(mib)
    size = nbytes(sd)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    probe = os.path.join(work, "probe")
    ucp_save(sd, probe, threads)  # untimed: first calls, and the object sizes raw writes
    files = object_files(probe)
    sizes = [size for _, size in files]
    evict(probe)
    counted_load(dest, probe, max_workers=threads)
    shutil.rmtree(probe)
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    dst = torch.zeros(sum(sizes), dtype=torch.uint8)
    direct = direct_buffer(sizes) if hasattr(os, "O_DIRECT") else None
    out: dict[str, Any] = {
        "mib": mib, "bytes": size, "tensors": len(sd), "objects": len(sizes), "object_bytes": sum(sizes),
        "directories": len(tree_directories(files)), "threads": threads, "save": [], "raw_write": [],
        "raw_write_direct": [], "raw_write_tree": [], "load": [], "raw_read": [], "raw_read_direct": [], "bytes_read": [],
        "bytes_read_direct": [], "bytes_written_direct": [], "cached": {},
        "cpu": {"save": [], "raw_write": [], "raw_write_direct": [], "raw_write_tree": [], "load": [], "raw_read": [],
                "raw_read_direct": []},
    }

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    for rep in range(repeat):
        order = ["ucp_zarr", "raw"] if rep % 2 == 0 else ["raw", "ucp_zarr"]
        for m in order:
            path = os.path.join(work, f"{m}.{rep}")
            gc.collect()
            op = "save" if m == "ucp_zarr" else "raw_write"
            c0, t0 = cpu(), time.perf_counter()
            if m == "ucp_zarr":
                out["bytes_written_direct"].append(ucp_save(sd, path, threads))
            else:
                raw_write(path, sizes, src, threads)
            out[op].append(time.perf_counter() - t0)
            out["cpu"][op].append(cpu() - c0)
            if m == "raw":  # the same files again: around the page cache, and in ucp_zarr's directory tree
                again: list[tuple[str, Any]] = [("raw_write_tree", lambda p: raw_write_tree(p, files, src, threads))]
                if direct is not None:
                    again.insert(0, ("raw_write_direct", lambda p: raw_write_direct(p, sizes, direct, threads)))
                for name, write in again:
                    gc.collect()
                    c0, t0 = cpu(), time.perf_counter()
                    write(f"{path}.{name}")
                    out[name].append(time.perf_counter() - t0)
                    out["cpu"][name].append(cpu() - c0)
                    shutil.rmtree(f"{path}.{name}")
            evict(path)
            if rep == 0:
                out["cached"][m] = cached_bytes(path)
            if m == "ucp_zarr":
                for t in dest.values():
                    t.zero_()
                c0, t0 = cpu(), time.perf_counter()
                read, read_direct = load_counts(dest, path, max_workers=threads)
                out["load"].append(time.perf_counter() - t0)
                out["cpu"]["load"].append(cpu() - c0)
                out["bytes_read"].append(read)
                out["bytes_read_direct"].append(read_direct)
                if rep == 0:
                    bad = [k for k in sd if not bit_equal(sd[k], dest[k])]
                    if bad:
                        raise SystemExit(f"ucp_zarr loaded {bad[:3]} wrong at {mib} MiB")
            else:
                dst.zero_()
                c0, t0 = cpu(), time.perf_counter()
                raw_read(path, sizes, dst, threads)
                out["raw_read"].append(time.perf_counter() - t0)
                out["cpu"]["raw_read"].append(cpu() - c0)
                if direct is not None:  # the same files again, cold, around the page cache
                    evict(path)
                    c0, t0 = cpu(), time.perf_counter()
                    raw_read_direct(path, sizes, direct, threads)
                    out["raw_read_direct"].append(time.perf_counter() - t0)
                    out["cpu"]["raw_read_direct"].append(cpu() - c0)
            shutil.rmtree(path)
        log(
            f"  {mib:g} MiB repeat {rep + 1}/{repeat}: save {size / MiB / out['save'][-1]:.0f} MiB/s vs raw "
            f"{size / MiB / out['raw_write'][-1]:.0f}; load {size / MiB / out['load'][-1]:.0f} vs raw "
            f"{size / MiB / out['raw_read'][-1]:.0f}"
        )
    return out


def summary(r: dict[str, Any]) -> dict[str, float]:
    """Medians (MiB/s) and the median of per-repeat ratios, with their spread."""
    size = r["bytes"] / MiB
    save_ratios = [w / s for s, w in zip(r["save"], r["raw_write"])]
    load_ratios = [w / s for s, w in zip(r["load"], r["raw_read"])]
    cpu = r.get("cpu", {})
    cpu_ratios = [a / b for a, b in zip(cpu.get("load", []), cpu.get("raw_read", [])) if b > 0]
    return {
        "save": size / statistics.median(r["save"]),
        "raw_write": size / statistics.median(r["raw_write"]),
        "load": size / statistics.median(r["load"]),
        "raw_read": size / statistics.median(r["raw_read"]),
        "save_ratio": statistics.median(save_ratios), "save_ratio_min": min(save_ratios), "save_ratio_max": max(save_ratios),
        "load_ratio": statistics.median(load_ratios), "load_ratio_min": min(load_ratios), "load_ratio_max": max(load_ratios),
        "read_amplification": statistics.median(r["bytes_read"]) / r["bytes"],
        "save_ms": 1000 * statistics.median(r["save"]), "raw_write_ms": 1000 * statistics.median(r["raw_write"]),
        **{f"cpu_{k}": statistics.median(v) for k, v in cpu.items() if v},
        **({"cpu_load_ratio": statistics.median(cpu_ratios), "cpu_load_ratio_min": min(cpu_ratios),
            "cpu_load_ratio_max": max(cpu_ratios)} if cpu_ratios else {}),
        **(_direct_summary(r) if r.get("raw_read_direct") else {}),
        **(_tree_summary(r) if r.get("raw_write_tree") else {}),
    }


def _tree_summary(r: dict[str, Any]) -> dict[str, float]:
    """The save against raw writes of the same files into the same directory tree."""
    ratios = [w / s for s, w in zip(r["save"], r["raw_write_tree"])]
    return {
        "raw_write_tree": r["bytes"] / MiB / statistics.median(r["raw_write_tree"]),
        "save_tree_ratio": statistics.median(ratios), "save_tree_ratio_min": min(ratios), "save_tree_ratio_max": max(ratios),
        "directories": r.get("directories", 0),
    }


def _direct_summary(r: dict[str, Any]) -> dict[str, float]:
    """The load against the device's limit around the page cache (raw ``O_DIRECT``), and the
    share of the load's bytes it read that way."""
    ratios = [w / s for s, w in zip(r["load"], r["raw_read_direct"])]
    out = {
        "raw_read_direct": r["bytes"] / MiB / statistics.median(r["raw_read_direct"]),
        "load_direct_ratio": statistics.median(ratios), "load_direct_ratio_min": min(ratios),
        "load_direct_ratio_max": max(ratios),
        "direct_share": statistics.median(d / b for d, b in zip(r["bytes_read_direct"], r["bytes_read"]) if b),
    }
    if r.get("raw_write_direct"):  # (results before 2026-12-06 03:00 UTC lack it)
        ratios = [w / s for s, w in zip(r["save"], r["raw_write_direct"])]
        out |= {
            "raw_write_direct": r["bytes"] / MiB / statistics.median(r["raw_write_direct"]),
            "save_direct_ratio": statistics.median(ratios), "save_direct_ratio_min": min(ratios),
            "save_direct_ratio_max": max(ratios),
            "write_direct_share": statistics.median(r["bytes_written_direct"]) / r["object_bytes"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64,256,1024", help="state sizes, MiB (default 16,64,256,1024)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats per size (default 3)")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads for ucp_zarr and the raw limits (default 4)")
    ap.add_argument("--dir", default="/work/bench_tmp", help="scratch directory (default /work/bench_tmp)")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args(argv)
    import ucp_zarr

    sizes = [float(s) for s in args.sizes.split(",")]
    work = os.path.join(args.dir, f"bench_limits.{os.getpid()}")
    os.makedirs(work)
    print(f"ucp_zarr {ucp_zarr.__version__} from {os.path.dirname(ucp_zarr.__file__)}; {os.cpu_count()} CPUs; dir {work}")
    results = []
    try:
        for mib in sizes:
            results.append(measure(mib, args.repeat, args.threads, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return {"single": results}


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| state | tensors / objects | save MiB/s | raw write MiB/s | save / raw (min-max) | load MiB/s | raw read MiB/s "
        "| load / raw (min-max) | raw O_DIRECT read MiB/s | load / raw O_DIRECT | bytes read / state (O_DIRECT share) "
        "| CPU s: save / raw write / load / raw read / raw O_DIRECT |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = summary(r)
        rows.append(
            f"| {r['bytes'] / MiB:.0f} MiB | {r['tensors']} / {r['objects']} | {s['save']:.0f} | {s['raw_write']:.0f} "
            f"| {s['save_ratio']:.2f}x ({s['save_ratio_min']:.2f}-{s['save_ratio_max']:.2f}) | {s['load']:.0f} "
            f"| {s['raw_read']:.0f} | {s['load_ratio']:.2f}x ({s['load_ratio_min']:.2f}-{s['load_ratio_max']:.2f}) "
            f"| {s.get('raw_read_direct', 0):.0f} | {s.get('load_direct_ratio', 0):.2f}x "
            f"| {s['read_amplification']:.3f} ({s.get('direct_share', 0):.2f}) | {s.get('cpu_save', 0):.2f} / "
            f"{s.get('cpu_raw_write', 0):.2f} / {s.get('cpu_load', 0):.2f} / {s.get('cpu_raw_read', 0):.2f} / "
            f"{s.get('cpu_raw_read_direct', 0):.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
