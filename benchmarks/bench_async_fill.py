"""The blocking stage of ``ucp_zarr.async_save`` by how its host copy is made, against ``clone()``.

    python benchmarks/bench_async_fill.py [--repeat 5] [--dir /tmp/bench_async_fill]

The 310 MiB state of ``bench_async.py``'s transformer (d 512, 6 layers, AdamW), for torch
intra-op threads 1 and 8: ``clone()`` of every tensor; the blocking stage as the library makes
its copy (``staging.fill_workers``: one parallel ``copy_`` per tensor when torch has several
threads, else the save's workers); and with the copy always cut among the save's 4 workers.
Alternating, median (min-max) of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import Model, clone  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench_async_fill")
    args = ap.parse_args()
    import ucp_zarr
    from ucp_zarr.protocol import staging

    library = staging.fill_workers
    try:
        for threads in (1, 8):
            torch.set_num_threads(threads)
            model = Model(512, 6)
            opt = torch.optim.AdamW(model.parameters())
            model(torch.randint(0, 8000, (2, 32))).sum().backward()
            opt.step()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            ucp_zarr.async_save(state, os.path.join(args.dir, "warm")).result()
            res: dict[str, list[float]] = {"clone": [], "library": [], "4 workers": []}
            for r in range(args.repeat):
                for what in res:
                    t0 = time.perf_counter()
                    if what == "clone":
                        kept = clone(state)
                        res[what].append(time.perf_counter() - t0)
                        kept.clear()  # (freed after the timing, as a save's copy is)
                        continue
                    staging.fill_workers = library if what == "library" else (lambda workers: workers)
                    path = os.path.join(args.dir, f"{r}-{what}")
                    fut = ucp_zarr.async_save(state, path)
                    res[what].append(time.perf_counter() - t0)
                    fut.result()
                    shutil.rmtree(path)
            staging.fill_workers = library
            print(f"torch threads {threads}: " + ", ".join(
                f"{k} {1000 * statistics.median(v):.0f} ms ({1000 * min(v):.0f}-{1000 * max(v):.0f})" for k, v in res.items()
            ), flush=True)
    finally:
        staging.fill_workers = library
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
