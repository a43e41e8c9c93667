"""Every benchmark of issue 9's measurement half, one command, one table, plots.

    python benchmarks/run_all.py [--quick] [--dir DIR] [--out benchmarks/results]

Runs, each in its own process (fresh memory), with bounded sizes and repeats:

1. ``bench_limits.py``: single-process save/load of 16 MiB ... 1 GiB states against the
   parallel raw write+fsync and in-place ``preadv`` limits;
2. ``bench_distributed.py``: 4-process save against the raw 4-process aggregate and DCP
   (``thread_count`` 1 and 4, the better one compared), reshard load 4 -> 3 against DCP, bytes
   read per rank;
3. ``bench_async.py``: the blocking stage of an async save against a host copy, and the
   training-step slowdown during the background write;
4. ``bench_codecs.py``: ucp_zarr's codec path against zarr-python (default and zarrs
   pipelines) and TensorStore; zstd/blosc compression of weights and moments;
5. ``bench_planning.py``: planning the simulated 405B-like layout for 64 ... 32768 ranks
   (no data) in two levels: the coordinator's critical path, what rank 0 receives and its
   peak memory, bytes each rank sends and receives, objects, metadata (its plot:
   ``planning.png``);
6. ``bench_object_store.py``: single-process save/load of 256 MiB and 1 GiB on loopback S3
   (SeaweedFS) through obstore and through fsspec, against raw concurrent obstore PUT/GET of
   the same objects; requests per save and per load.

Then it prints one markdown table (figure, ours, the peer or limit, the ratio with its
per-repeat range, the target) and writes ``results.json``, ``table.md`` and the plots
(``throughput_vs_size.png``, ``peers.png``) into ``--out``. 11-20 minutes on a 2-core VM, planning included
(``--quick``: about 10); each step is killed after ``--step-timeout`` seconds (default 1200).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
GiB = 1 << 30


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_step(name: str, args: list[str], out: str, timeout: float) -> Any:
    """Run ``benchmarks/<name>.py args --json out`` and return its JSON (None if it failed);
    the load averages at its start and end go to ``out`` + ``.loadavg``."""
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), *args, "--json", out]
    start, start_utc = loadavg(), time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(f"\n== {' '.join(cmd[1:])} (load average {start})", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=HERE, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"!! {name} did not finish in {timeout:.0f} s", flush=True)
        return None
    finally:
        with open(out + ".loadavg", "w") as f:
            json.dump({"start": start, "end": loadavg(), "utc": start_utc}, f)
    print(f"== {name}: {time.perf_counter() - t0:.0f} s, exit {proc.returncode}, load average {loadavg()}", flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        return None
    with open(out) as f:
        return json.load(f)


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, ours, peer or limit, ratio (range), target, verdict) for every measured target."""
    sys.path.insert(0, HERE)
    out: list[tuple[str, str, str, str, str, str]] = []

    def verdict(ok: bool) -> str:
        return "meets" if ok else "**short**"

    def rng(lo: float, hi: float) -> str:
        return f"({lo:.2f}-{hi:.2f})"

    if res.get("limits"):
        from bench_limits import summary

        for r in res["limits"]:
            s = summary(r)
            size = f"{r['bytes'] / MiB:.0f} MiB"
            target = 0.8 if r["bytes"] < 512 * MiB else 0.9  # issue 21: 0.8x at 16-256 MiB, 0.9x at 1 GiB and above
            out.append((f"save {size}, 1 process", f"{s['save']:.0f} MiB/s", f"raw write+fsync, {r['threads']} threads: "
                        f"{s['raw_write']:.0f} MiB/s", f"{s['save_ratio']:.2f}x {rng(s['save_ratio_min'], s['save_ratio_max'])}",
                        f">= {target}x", verdict(s["save_ratio"] >= target)))
            out.append((f"load {size}, 1 process, cold", f"{s['load']:.0f} MiB/s", f"raw preadv, {r['threads']} threads: "
                        f"{s['raw_read']:.0f} MiB/s", f"{s['load_ratio']:.2f}x {rng(s['load_ratio_min'], s['load_ratio_max'])}",
                        ">= 0.9x", verdict(s["load_ratio"] >= 0.9)))
            if "cpu_load_ratio" in s:
                out.append((f"load {size}: CPU seconds", f"{s['cpu_load']:.2f} s", f"raw preadv: {s['cpu_raw_read']:.2f} s",
                            f"{s['cpu_load_ratio']:.2f}x {rng(s['cpu_load_ratio_min'], s['cpu_load_ratio_max'])}",
                            "<= 1.3x", verdict(s["cpu_load_ratio"] <= 1.3)))
            for op, share, raw, done in (("save", "write_direct_share", "write", "written"),
                                         ("load", "direct_share", "read", "read")):
                if f"{op}_direct_ratio" in s:  # (reference rows: the device's limit around the page cache)
                    out.append((f"{op} {size}, against {raw}s around the page cache",
                                f"{s[op]:.0f} MiB/s ({100 * s[share]:.0f}% of its bytes {done} with O_DIRECT)",
                                f"raw O_DIRECT {raw}, {r['threads']} threads: {s[f'raw_{raw}_direct']:.0f} MiB/s "
                                f"(CPU {s[f'cpu_raw_{raw}_direct']:.2f} s; through the cache {s[f'cpu_raw_{raw}']:.2f} s)",
                                f"{s[f'{op}_direct_ratio']:.2f}x {rng(s[f'{op}_direct_ratio_min'], s[f'{op}_direct_ratio_max'])}",
                                "(reference)", ""))
            if "save_tree_ratio" in s:  # (reference: the layout's directories written raw too)
                out.append((f"save {size}, against raw writes of the same tree",
                            f"{s['save']:.0f} MiB/s",
                            f"raw write+fsync of the same files in the same {s['directories']} directories, "
                            f"{r['threads']} threads: {s['raw_write_tree']:.0f} MiB/s (CPU {s['cpu_raw_write_tree']:.2f} s)",
                            f"{s['save_tree_ratio']:.2f}x {rng(s['save_tree_ratio_min'], s['save_tree_ratio_max'])}",
                            "(reference)", ""))
    if res.get("distributed"):
        from bench_distributed import summarize

        d = res["distributed"]
        s = summarize(d["bytes"], d["runs"], d["own"])
        g = s["gibs"]
        size = f"{d['bytes'] / GiB:.2f} GiB"
        best = "DCP thread_count=4" if s["best_dcp"] == "dcp_t4" else "DCP thread_count=1"
        out.append((f"save {size}, 4 processes", f"{g['save:ucp_zarr']:.2f} GiB/s", f"raw 4-process aggregate: "
                    f"{g['save:raw']:.2f} GiB/s", f"{s['save_vs_raw'][0]:.2f}x {rng(*s['save_vs_raw'][1:])}", ">= 0.9x",
                    verdict(s["save_vs_raw"][0] >= 0.9)))
        out.append((f"save {size}, 4 processes", f"{g['save:ucp_zarr']:.2f} GiB/s", f"{best} (best of 1, 4): "
                    f"{g['save:' + s['best_dcp']]:.2f} GiB/s", f"{s['save_vs_dcp'][0]:.2f}x {rng(*s['save_vs_dcp'][1:])}",
                    ">= 1.0x", verdict(s["save_vs_dcp"][0] >= 1.0)))
        out.append((f"reshard load 4 -> 3, {size}, cold", f"{g['load:ucp_zarr']:.2f} GiB/s", f"DCP: {g['load:dcp']:.2f} GiB/s",
                    f"{s['load_vs_dcp'][0]:.2f}x {rng(*s['load_vs_dcp'][1:])}", ">= 1.0x", verdict(s["load_vs_dcp"][0] >= 1.0)))
        if "load_vs_raw" in s:
            out.append((f"reshard load 4 -> 3, {size}, cold", f"{g['load:ucp_zarr']:.2f} GiB/s",
                        f"raw 3-process aggregate read: {g['load:raw']:.2f} GiB/s",
                        f"{s['load_vs_raw'][0]:.2f}x {rng(*s['load_vs_raw'][1:])}", ">= 0.9x", verdict(s["load_vs_raw"][0] >= 0.9)))
        out.append(("reshard load: bytes read per rank / its slice", f"{s['read_per_need']:.3f}x (worst rank)", "", "",
                    "<= 1.1x", verdict(s["read_per_need"] <= 1.1)))
    plan = res.get("planning")
    if plan:
        big = max(plan, key=lambda r: (r.get("world", 0) <= 16384, r.get("world", 0)))  # (the target's size)
        w = int(big.get("world", 0))
        for r in sorted(plan, key=lambda r: r["world"]):
            if r["world"] >= 4096 and "coord_s" in r:
                out.append((f"plan a save, {r['world']} ranks (405B-like)", f"{r['coord_s']:.1f} s critical path "
                            f"(rank 0 {r['root_s']:.1f} s, peak {r['root_peak_mib']:.0f} MiB)",
                            f"rank 0 receives {r['root_in_mib']:.0f} MiB (one level: {r['rank0_recv_mib']:.0f}); each rank "
                            f"sends <= {r['send_kib_max']:.0f} KiB, receives <= {r['recv_kib_max']:.0f} KiB", "",
                            "< 10 s" if r["world"] <= 16384 else "(curve)", verdict(r["coord_s"] < 10) if r["world"] <= 16384 else ""))
        if "per_pair_max" in big:
            out.append((f"objects, {w} ranks", f"{big.get('objects', 0):.0f}, <= {big['per_pair_max']:.0f} per (rank, array)",
                        "", "", "<= ~2 per pair", verdict(big["per_pair_max"] <= 2)))
        if "meta_mib" in big:
            out.append((f"all metadata, {w} ranks", f"{big['meta_mib']:.1f} MiB", "", "", "< 64 MiB", verdict(big["meta_mib"] < 64)))
        if "load_s" in big:
            out.append((f"reshard load plan, {w} -> {big.get('load_world', 0):.0f} ranks", f"{big['load_s']:.1f} s per rank",
                        f"reads {big.get('read_x', float('nan')):.3f}x its slice", "", "< 10 s", verdict(big["load_s"] < 10)))
    for r in res.get("objstore") or []:
        from bench_object_store import O, latency_summary
        from bench_object_store import summary as objstore_summary

        if "latency_ms" in r:
            for key, v in latency_summary(r).items():
                op, w = key.split(":")
                ratio = v["ratio"]
                default = " (the default)" if int(w) == O.REQUEST_CONCURRENCY else ""
                out.append((f"{op} {r['mib']:.0f} MiB, loopback S3 + {r['latency_ms']:.0f} ms per request, obstore, "
                            f"{w} threads{default}",
                            f"{v['ucp_zarr_s'] * 1e3:.0f} ms, {v['requests'][0]} requests",
                            f"raw obstore {'GET' if op == 'load' else 'PUT'}, {w} threads: {v['raw_s'] * 1e3:.0f} ms, "
                            f"{v['requests'][1]} requests", f"{ratio[0]:.2f}x {rng(*ratio[1:])}", "(latency-bound)", ""))
            continue
        s = objstore_summary(r)
        for op in ("save", "load"):
            q = r["requests"]
            for m in ("obstore", "fsspec"):
                ratio = s[f"{op}:{m}_vs_raw"]
                out.append((f"{op} {r['mib']:.0f} MiB, loopback S3, {'obstore' if m == 'obstore' else 'fsspec (s3fs)'}",
                            f"{s[f'{op}:{m}']:.0f} MiB/s, {q[m][op]} requests",
                            f"raw obstore {'PUT' if op == 'save' else 'GET'}: {s[f'{op}:raw']:.0f} MiB/s, {q['raw'][op]} requests",
                            f"{ratio[0]:.2f}x {rng(*ratio[1:])}", ">= 0.8x" if m == "obstore" else "(peer)",
                            verdict(ratio[0] >= 0.8) if m == "obstore" else ""))
            if op == "load" and "load:obstore_vs_raw_landed" in s:
                ratio = s["load:obstore_vs_raw_landed"]
                out.append((f"load {r['mib']:.0f} MiB, loopback S3, obstore, against GETs landed", f"{s['load:obstore']:.0f} MiB/s",
                            f"raw obstore GET + one copy of each body into memory: {s['load:raw_landed']:.0f} MiB/s",
                            f"{ratio[0]:.2f}x {rng(*ratio[1:])}", "(reference)", ""))
            if f"{op}:obstore_vs_fsspec" in s:
                ratio = s[f"{op}:obstore_vs_fsspec"]
                out.append((f"{op} {r['mib']:.0f} MiB, loopback S3, obstore against fsspec", f"{s[f'{op}:obstore']:.0f} MiB/s",
                            f"ucp_zarr on fsspec (s3fs): {s[f'{op}:fsspec']:.0f} MiB/s", f"{ratio[0]:.2f}x {rng(*ratio[1:])}",
                            "(today's path)", ""))
    if res.get("async"):
        from bench_async import summary

        s = summary(res["async"])
        out.append((f"async save, blocking stage ({res['async']['bytes'] / MiB:.0f} MiB)", f"{s['blocking_ms']:.0f} ms",
                    f"clone of the state: {s['clone_ms']:.0f} ms", f"{s['blocking_vs_clone']:.2f}x", "<= 1.2x",
                    verdict(s["blocking_vs_clone"] <= 1.2)))
        out.append(("training step during the background write (median per repeat)", f"{s['slowdown']:.2f}x the step before",
                    f"step {s['step_ms']:.0f} ms, write {s['background_ms']:.0f} ms",
                    f"{s['slowdown']:.2f}x {rng(s['slowdown_min'], s['slowdown_max'])}", "<= 1.05x",
                    verdict(s["slowdown"] <= 1.05)))
        if "thread_slowdown" in s:
            out.append(("training step during the write, written by a thread (writer=\"thread\")",
                        f"{s['thread_slowdown']:.2f}x the step before", f"write {s['thread_background_ms']:.0f} ms",
                        f"{s['thread_slowdown']:.2f}x {rng(s['thread_slowdown_min'], s['thread_slowdown_max'])}",
                        "(reference)", ""))
        if "paced_slowdown" in s:
            rate = res["async"].get("paced_rate") or 0
            out.append((f"training step during the write, paced (write_bytes_per_s={rate / 1e6:.0f} MB/s)",
                        f"{s['paced_slowdown']:.2f}x the step before", f"write {s['paced_background_ms']:.0f} ms",
                        f"{s['paced_slowdown']:.2f}x {rng(s['paced_slowdown_min'], s['paced_slowdown_max'])}", "<= 1.05x",
                        verdict(s["paced_slowdown"] <= 1.05)))
        if "during_median_ms" in s:
            for q in ("median", "p90", "max"):
                out.append((f"training step {q}, during / before the write", f"{s[f'during_{q}_ms']:.0f} ms "
                            f"({s['during_n']} steps)", f"before: {s[f'before_{q}_ms']:.0f} ms ({s['before_n']} steps); "
                            f"after: {s[f'after_{q}_ms']:.0f} ms", f"{s[f'during_{q}_ms'] / s[f'before_{q}_ms']:.2f}x",
                            "<= 1.05x" if q == "median" else "(distribution)",
                            verdict(s[f"during_{q}_ms"] <= 1.05 * s[f"before_{q}_ms"]) if q == "median" else ""))
    lib = (res.get("codecs") or {}).get("libraries")
    if lib:
        import statistics

        size = lib["bytes"] / MiB
        for m in lib["write"]:
            if m == "ucp_zarr":
                continue
            for op in ("write", "read"):
                rs = [b / a for a, b in zip(lib[op]["ucp_zarr"], lib[op][m])]
                med = statistics.median(rs)
                out.append((f"codec path, {op} {size:.0f} MiB", f"{size / statistics.median(lib[op]['ucp_zarr']):.0f} MiB/s",
                            f"{m}: {size / statistics.median(lib[op][m]):.0f} MiB/s", f"{med:.2f}x {rng(min(rs), max(rs))}",
                            "library within 10% -> use it", "ours stays" if med > 1.1 else "**use the library**"))
    return out


def table(res: dict[str, Any]) -> str:
    lines = ["| figure | ucp_zarr | peer or limit | ratio (per-repeat range) | target | |", "|---|---:|---|---:|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(res)]
    comp = (res.get("codecs") or {}).get("compression")
    if comp:
        sys.path.insert(0, HERE)
        from bench_codecs import compression_table

        lines += ["", "Compression (one core, 4 MiB chunks):", "", compression_table(comp)]
    return "\n".join(lines)


def plots(res: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, HERE)
    made = []
    if res.get("limits"):
        from bench_limits import summary

        sizes = [r["bytes"] / MiB for r in res["limits"]]
        ss = [summary(r) for r in res["limits"]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, label, style in (("save", "ucp_zarr save", "o-"), ("raw_write", "raw write+fsync (limit)", "o--"),
                                  ("load", "ucp_zarr load (cold)", "s-"), ("raw_read", "raw preadv (limit)", "s--")):
            ax.plot(sizes, [s[key] for s in ss], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state size, MiB")
        ax.set_ylabel("MiB/s (median)")
        ax.set_title("Single process, 4 I/O threads: ucp_zarr against the disk's limits")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(out, "throughput_vs_size.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    bars: list[tuple[str, float]] = []
    if res.get("distributed"):
        from bench_distributed import summarize

        d = res["distributed"]
        g = summarize(d["bytes"], d["runs"], d["own"])["gibs"]
        bars += [("save ucp_zarr", g["save:ucp_zarr"]), ("save raw", g["save:raw"]), ("save DCP t=1", g["save:dcp"]),
                 ("save DCP t=4", g["save:dcp_t4"]), ("load ucp_zarr", g["load:ucp_zarr"]), ("load DCP", g["load:dcp"])]
    if bars:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C7", "C1", "C1", "C0", "C1"][: len(bars)])
        ax.set_ylabel("GiB/s (median, max over ranks)")
        ax.set_title(f"4-process save, 4 -> 3 reshard load, {res['distributed']['bytes'] / GiB:.2f} GiB")
        plt.setp(ax.get_xticklabels(), rotation=20)
        path = os.path.join(out, "peers.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (about 10 minutes)")
    ap.add_argument("--dir", default="/tmp/ucp_zarr_bench", help="scratch directory (default /tmp/ucp_zarr_bench)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where results and plots go")
    ap.add_argument("--only", default="limits,distributed,async,codecs,planning,objstore", help="comma-separated subset")
    ap.add_argument("--step-timeout", type=float, default=1200)
    ap.add_argument("--table-only", action="store_true", help="run nothing: the table and plots from --out's JSON files")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    q = args.quick
    steps = {
        "limits": ("bench_limits", ["--sizes", "16,64,256" if q else "16,64,256,1024", "--repeat", "3" if q else "5"]),
        "distributed": ("bench_distributed", ["--gib", "0.5" if q else "1.0", "--repeat", "2" if q else "3"]),
        "async": ("bench_async", ["--repeat", "3" if q else "6", "--paced", "3e8"]),
        "codecs": ("bench_codecs", ["--mib", "256" if q else "1024", "--repeat", "2" if q else "3"]),
        "planning": ("bench_planning", ["--plot", os.path.join(args.out, "planning.png"),
                                        "--worlds", *(["64", "256", "1024"] if q else ["4096", "8192", "16384", "32768"])]),
        "objstore": ("bench_object_store", ["--sizes", "64,256" if q else "256,1024", "--repeat", "2" if q else "3"]),
    }
    res: dict[str, Any] = {}
    for key in [k.strip() for k in args.only.split(",") if k.strip()]:
        name, extra = steps[key]
        scratch = [] if key in ("planning", "objstore") else ["--dir", args.dir]
        out = os.path.join(args.out, f"{key}.json")
        if args.table_only:
            got = json.load(open(out)) if os.path.exists(out) else None
        else:
            got = run_step(name, [*extra, *scratch], out, args.step_timeout)
        res[key] = got["single"] if key == "limits" and isinstance(got, dict) and "single" in got else got
    text = table(res)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = []
    for key in res:
        path = os.path.join(args.out, f"{key}.json.loadavg")
        if os.path.exists(path):
            la = json.load(open(path))
            loads.append(f"{key} (from {la['utc']} UTC) {la['start']} -> {la['end']}")
    header = (f"Table {stamp}, {os.cpu_count()} CPUs; load average at the start and end of each step: "
              + ("; ".join(loads) or loadavg()) + ".")
    print("\n" + header + "\n\n" + text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(header + "\n\n" + text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f)
    for p in plots(res, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
