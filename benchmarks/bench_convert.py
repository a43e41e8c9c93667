"""Converting a DeepSpeed ZeRO checkpoint: ``ucp_zarr.convert`` against DeepSpeed's own
``ds_to_universal``, in one run.

    python benchmarks/bench_convert.py [--mib 1536] [--stage 2] [--dtype fp32] [--world 2]
                                       [--workers 4] [--repeat 2] [--dir DIR]

1. DeepSpeed itself trains a stack of linear layers one step on ``--world`` gloo processes
   (CPU) and saves a ZeRO checkpoint whose optimizer state (fp32 masters + Adam moments)
   is about ``--mib`` MiB.
2. Each converter runs in its own process tree from a cold page cache, ``--workers``
   workers each (ours: I/O threads; DeepSpeed's: extract and merge processes), in rotating
   order. A sampler records the peak RSS summed over the whole process tree and the peak
   extra disk used under the output folder (DeepSpeed's temporary folder lives there).
   Time is taken to the converter's exit and, after an ``os.sync()``, to a durable output
   (ours fsyncs every object before it commits; ``torch.save`` leaves DeepSpeed's output in
   the page cache).
3. Both outputs are checked against each other (every master and moment, bit for bit).

Targets (issue 8): ours >= 3x faster, <= 0.5x peak memory, no temporary disk beyond the output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(__file__))
from pagecache import evict  # noqa: E402

TRAIN = textwrap.dedent('''
    import collections, os, sys, torch, torch.nn as nn
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)  # no shm_comm JIT build
    out, layers, width, stage, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, width, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)
''')

OURS = textwrap.dedent('''
    import sys, ucp_zarr
    ucp_zarr.convert(sys.argv[1], sys.argv[2], max_workers=int(sys.argv[3]))
''')


def build(folder: Path, mib: int, stage: int, dtype: str, world: int) -> None:
    width = 2048
    layers = max(1, round(mib * 2**20 / 12 / (width * width + width)))  # masters + 2 moments: 12 bytes/param
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    script = folder.parent / "train.py"
    script.write_text(TRAIN)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
                    str(script), str(folder), str(layers), str(width), str(stage), dtype],
                   check=True, env=env, timeout=1800, stdout=subprocess.DEVNULL)


def measure(cmd: list[str], out: Path) -> dict[str, float]:
    """Run ``cmd``; peak RSS summed over its process tree and peak bytes under ``out``."""
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    peak = {"rss": 0, "disk": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                procs = [proc] + proc.children(recursive=True)
                rss = 0
                for p in procs:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak["rss"] = max(peak["rss"], rss)
                peak["disk"] = max(peak["disk"], du(out))
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    _, err = proc.communicate(timeout=3600)
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} failed:\n{err.decode()[-3000:]}")
    os.sync()  # what is still only in the page cache (ours fsyncs as it goes; torch.save does not)
    durable = time.perf_counter() - t0
    return {"s": seconds, "durable_s": durable, "rss": peak["rss"], "disk": peak["disk"], "final_disk": du(out)}


def du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def check(ours: Path, theirs: Path) -> int:
    """Every master and moment of DeepSpeed's output equals ours; returns how many were compared."""
    import torch

    import ucp_zarr

    ck = ucp_zarr.open(ours)
    n = 0
    for folder in (theirs / "zero").iterdir():
        for f in folder.glob("*.pt"):
            if f.stem == "step":
                continue
            v = torch.load(f, weights_only=False)
            want = v["param"] if isinstance(v, dict) else v
            key = f"optim.state.{folder.name}.{f.stem}"
            if f.stem == "fp32":
                key = key if key in ck else f"model.{folder.name}"
            if not torch.equal(ck.read(key).reshape(-1), want.reshape(-1)):
                raise AssertionError(f"{key} differs from DeepSpeed's {f}")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1536, help="optimizer state (fp32 masters + moments), MiB")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.dir))
    try:
        ds = work / "ds"
        t0 = time.perf_counter()
        build(ds, args.mib, args.stage, args.dtype, args.world)
        step = ds / (ds / "latest").read_text().strip()
        print(f"DeepSpeed checkpoint: {du(ds) / 2**20:.0f} MiB on disk, built in {time.perf_counter() - t0:.0f} s")
        runs: dict[str, list[dict[str, float]]] = {"ours": [], "ds_to_universal": []}
        for i in range(args.repeat):
            order = ["ours", "ds_to_universal"] if i % 2 == 0 else ["ds_to_universal", "ours"]
            for name in order:
                out = work / f"{name}{i}"
                out.mkdir()
                evict(str(ds))
                if name == "ours":
                    cmd = [sys.executable, "-c", OURS, str(ds), str(out / "ck"), str(args.workers)]
                else:
                    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step),
                           "--output_folder", str(out / "universal"), "--num_extract_workers", str(args.workers),
                           "--num_merge_workers", str(args.workers), "--inject_missing_state"]
                runs[name].append(measure(cmd, out))
            compared = check(work / f"ours{i}" / "ck", work / f"ds_to_universal{i}" / "universal")
            for name in runs:
                shutil.rmtree(work / f"{name}{i}")
        med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
        o, d = med["ours"], med["ds_to_universal"]
        print(f"\nZeRO-{args.stage} {args.dtype}, {args.world} ranks, {args.workers} workers each, "
              f"{args.repeat} repeats (medians, cold page cache); {compared} tensors checked equal\n")
        print("| converter | seconds | seconds to durable output | peak RSS (all processes) | peak disk under output "
              "| final output |")
        print("|---|---|---|---|---|---|")
        for n, m in med.items():
            print(f"| {n} | {m['s']:.1f} | {m['durable_s']:.1f} | {m['rss'] / 2**20:.0f} MiB | {m['disk'] / 2**20:.0f} MiB | "
                  f"{m['final_disk'] / 2**20:.0f} MiB |")
        print(f"\nspeed: ours {d['s'] / o['s']:.1f}x faster, {d['durable_s'] / o['durable_s']:.1f}x to a durable output "
              f"(target >= 3x); memory: ours {o['rss'] / d['rss']:.2f}x "
              f"(target <= 0.5x); temporary disk: ours {(o['disk'] - o['final_disk']) / 2**20:.0f} MiB, "
              f"DeepSpeed {(d['disk'] - d['final_disk']) / 2**20:.0f} MiB beyond its output")
        print(json.dumps(med))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
