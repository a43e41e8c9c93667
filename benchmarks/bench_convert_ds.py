"""Converting DeepSpeed pipeline and MoE checkpoints: ``ucp_zarr.convert`` against DeepSpeed's own
``ds_to_universal``, in one run.

    python benchmarks/bench_convert_ds.py [--mib 512] [--workers 2] [--repeat 2] [--dir DIR]

1. DeepSpeed itself trains, one step on 2 gloo processes (CPU), and saves (ZeRO-1, fp32):
   * ``pipeline``: a ``PipelineModule`` of 2 stages, a stack of square linear layers;
   * ``moe``: a ``deepspeed.moe.layer.MoE`` of 8 experts at ``ep_size=2`` between two linear
     layers (the experts' optimizer state is partitioned over expert-data-parallel groups);
   each with about ``--mib`` MiB of optimizer state (fp32 masters + Adam moments).
2. Each converter runs in its own process tree from a cold page cache, ``--workers`` workers
   (ours: I/O threads; DeepSpeed's: extract and merge processes), in alternating order;
   ``bench_convert.measure`` samples the peak RSS summed over the process tree and the peak
   disk used under the output folder (DeepSpeed's temporary folder lives there). DeepSpeed's
   converter fails on the MoE checkpoint (expert parallelism): its time to the failure is shown.
3. Where both finish, every master and moment of DeepSpeed's output is checked equal to ours.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from bench_convert import OURS, check, du, measure  # noqa: E402
from pagecache import evict  # noqa: E402

TRAIN = textwrap.dedent('''
    import collections, sys, torch, torch.nn as nn
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)  # no shm_comm JIT build
    out, kind, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if kind == "pipeline":
        from deepspeed.pipe import LayerSpec, PipelineModule
        model = PipelineModule([LayerSpec(nn.Linear, width, width) for _ in range(layers)], num_stages=2,
                               loss_fn=lambda y, t: (y - t).pow(2).mean(), partition_method="uniform")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        engine.train_batch(iter([(torch.randn(2, width), torch.randn(2, width))]))
    else:
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
                expert = nn.Sequential(nn.Linear(width, width * layers // 8), nn.ReLU(),
                                       nn.Linear(width * layers // 8, width))
                self.moe = MoE(width, expert=expert, num_experts=8, ep_size=2, k=1, min_capacity=1)

            def forward(self, x):
                h, aux, _ = self.moe(self.inp(x))
                return self.out(h).pow(2).mean() + aux

        model = Model()
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(groups, lr=1e-3), config=cfg)
        loss = engine(torch.randn(2, width))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
''')


def build(folder: Path, kind: str, mib: int) -> None:
    width = 1024
    layers = max(2, round(mib * 2**20 / 12 / (width * width + width)))  # masters + 2 moments: 12 bytes/param
    if kind == "moe":  # 8 experts of 2 * width * (width * layers / 8) parameters: about `layers` linear layers
        layers = max(8, layers // 8 * 8)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    script = folder.parent / f"train_{kind}.py"
    script.write_text(TRAIN)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    str(script), str(folder), kind, str(layers), str(width)],
                   check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)


CONVERTERS = ("ours", "ds_to_universal")


def command(name: str, ds: Path, out: Path, workers: int) -> list[str]:
    """The command line converting DeepSpeed folder ``ds`` into ``out`` with converter ``name``."""
    if name == "ours":
        return [sys.executable, "-c", OURS, str(ds), str(out / "ck"), str(workers)]
    step = ds / (ds / "latest").read_text().strip()
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step), "--output_folder",
            str(out / "universal"), "--num_extract_workers", str(workers), "--num_merge_workers", str(workers),
            "--inject_missing_state"]


def run(kind: str, ds: Path, work: Path, workers: int, repeat: int) -> dict[str, Any]:
    """Both converters on ``ds``, ``repeat`` times in alternating order, from a cold page cache."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONVERTERS}
    failure = None
    compared = 0
    for i in range(repeat):
        for name in CONVERTERS[:: 1 if i % 2 == 0 else -1]:
            (work / f"{kind}-{name}{i}").mkdir()
            evict(str(ds))
            t0 = time.perf_counter()
            try:
                runs[name].append(measure(command(name, ds, work / f"{kind}-{name}{i}", workers), work / f"{kind}-{name}{i}"))
            except RuntimeError as e:  # DeepSpeed's converter on expert parallelism
                failure = {"after_s": time.perf_counter() - t0, "error": str(e).strip().splitlines()[-1]}
        if (work / f"{kind}-ds_to_universal{i}" / "universal" / "zero").is_dir():
            compared = check(work / f"{kind}-ours{i}" / "ck", work / f"{kind}-ds_to_universal{i}" / "universal")
        for name in CONVERTERS:
            shutil.rmtree(work / f"{kind}-{name}{i}", ignore_errors=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items() if rs}
    return {"medians": med, "ds_to_universal_failure": failure, "compared": compared, "input_mib": du(ds) / 2**20}


def table(results: dict[str, Any]) -> str:
    """A Markdown table: per checkpoint, each converter's time, peak RSS and disk, and the ratios."""
    lines = ["| checkpoint | converter | seconds | to durable output | peak RSS (all processes) | peak disk under output |",
             "|---|---|---|---|---|---|"]
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    for kind, r in results.items():
        label = f"{kind} ({r['input_mib']:.0f} MiB)"
        for name in ("ours", "ds_to_universal"):
            m = r["medians"].get(name)
            cells = ([f"{m['s']:.1f}", f"{m['durable_s']:.1f}", mib(m["rss"]), mib(m["disk"])] if m else
                     [f"fails after {r['ds_to_universal_failure']['after_s']:.1f} s", "", "", ""])
            lines.append("| " + " | ".join([label, name] + cells) + " |")
        if len(r["medians"]) == 2:
            o, d = r["medians"]["ours"], r["medians"]["ds_to_universal"]
            lines.append(f"| {label} | ours / DeepSpeed | {o['s'] / d['s']:.2f}x | {o['durable_s'] / d['durable_s']:.2f}x "
                         f"| {o['rss'] / d['rss']:.2f}x | ({r['compared']} tensors checked equal) |")
        elif r["ds_to_universal_failure"]:
            lines.append(f"| {label} | DeepSpeed's error | {r['ds_to_universal_failure']['error'][:120]} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="optimizer state (fp32 masters + moments) per checkpoint, MiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_ds_", dir=args.dir))
    results = {}
    try:
        for kind in ("pipeline", "moe"):
            ds = work / kind
            t0 = time.perf_counter()
            build(ds, kind, args.mib)
            print(f"{kind}: DeepSpeed checkpoint of {du(ds) / 2**20:.0f} MiB on disk, built in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            results[kind] = run(kind, ds, work, args.workers, args.repeat)
            shutil.rmtree(ds)
        print(f"\n{args.workers} workers each, {args.repeat} repeats (medians, cold page cache)\n")
        print(table(results))
        print(json.dumps(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
