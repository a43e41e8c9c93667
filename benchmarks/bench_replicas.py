"""What showing replicas equal costs: a DDP-like state (every tensor plain, identical on every
rank) saved by 4 gloo processes, with the replica digests (the default) and with them
switched off (a monkeypatch, for this measurement only), alternating, in one run.

    python benchmarks/bench_replicas.py [--mib 128] [--ranks 4] [--repeat 3] [--json out.json]

Reports the save time both ways (median and range over repeats), their ratio, and the time
one rank spends digesting its copy (crc32c of every replicated box) with its throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(mib: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    n = max(1, mib // 2)  # tensors of 2 MiB (float32 512 x 1024)
    return {"model": {f"layer{i}.weight": torch.randn(512, 1024, generator=gen) for i in range(n)}}


def _rank(rank: int, world: int, port: int, mib: int, repeat: int, base: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import ucp_zarr
    import ucp_zarr.protocol.saver as saver
    from ucp_zarr.protocol.replicas import fingerprint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = _state(mib)
    real_digests, real_check = saver.replica_digests, saver.check_replicas
    times: dict[str, list[float]] = {"digests": [], "no digests": []}
    for r in range(repeat):
        for mode in ("digests", "no digests") if r % 2 == 0 else ("no digests", "digests"):
            on = mode == "digests"
            saver.replica_digests = real_digests if on else (lambda plan, fragments: {})
            saver.check_replicas = real_check if on else (lambda plan, digests: None)
            dist.barrier()
            t0 = time.perf_counter()
            ucp_zarr.save(state, os.path.join(base, f"{mode.replace(' ', '_')}-{r}"))
            dist.barrier()
            times[mode].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for t in state["model"].values():
        fingerprint(t)
    digest_s = time.perf_counter() - t0
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mib_per_rank": mib, "ranks": world, "times": times, "digest_s": digest_s}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        out = os.path.join(base, "result.json")
        mp.start_processes(
            _rank, args=(args.ranks, port, args.mib, args.repeat, base, out), nprocs=args.ranks, start_method="spawn"
        )
        with open(out) as f:
            res = json.load(f)
    on, off = res["times"]["digests"], res["times"]["no digests"]
    ratios = [a / b for a, b in zip(on, off)]
    res.update(
        save_s=statistics.median(on), save_without_s=statistics.median(off), ratio=statistics.median(ratios),
        ratio_range=[min(ratios), max(ratios)], digest_gib_s=res["mib_per_rank"] / 1024 / res["digest_s"],
    )
    print(
        f"DDP-like state, {res['ranks']} ranks x {res['mib_per_rank']} MiB (every tensor replicated): save "
        f"{res['save_s']:.2f} s with replica digests, {res['save_without_s']:.2f} s without: "
        f"{res['ratio']:.3f}x ({res['ratio_range'][0]:.3f}-{res['ratio_range'][1]:.3f}); digesting one rank's "
        f"copy {res['digest_s'] * 1000:.0f} ms ({res['digest_gib_s']:.1f} GiB/s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
