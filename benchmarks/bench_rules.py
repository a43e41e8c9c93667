"""Rules against DTensors: saving and loading a placed Megatron-style state costs what the same bytes cost as DTensors.

One command, one run, both forms side by side::

    python benchmarks/bench_rules.py [--mib 1024] [--repeat 5] [--dir DIR]

Two gloo processes (TP=2) hold the local tensors of Llama-shaped layers (hidden 2048): a fused
QKV with grouped-query attention ``[q_r; k_r; v_r]``, a fused SwiGLU ``[gate_r; up_r]``,
row-parallel projections, a padded vocabulary, replicated norms, with fp32 Adam moments.
The same local tensors are saved

* **placed**: ``ucp_zarr.place(state, rules, tp_rank=r, tp_size=2)`` (sub-parameter
  pieces, padding clipped);
* **dtensor**: as ``DTensor``s on a 2-rank mesh, ``Shard(0)`` or ``Shard(1)`` (the bytes
  are the same; the layout is the plain one DTensors can describe, so fused tensors are
  stored unfused -- what matters here is the cost of the same bytes).

Each save is timed up to its commit (max over ranks), then its files are dropped from the
page cache, and the load into preallocated tensors is timed cold. The forms alternate and
their order rotates per repeat; the medians are printed with the ratio placed / dtensor and
the range of the per-repeat ratios
(target: >= 0.9x for save and load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_distributed import run, settle  # noqa: E402

H, KV_HEADS, HEADS, FFN, VOCAB = 2048, 4, 16, 5632, 32003


def rules() -> Any:
    import ucp_zarr

    hd = H // HEADS
    return ucp_zarr.Rules.from_dict({
        "params": [
            {"kind": "fused", "patterns": [r"layers\.\d+\.qkv\.weight"], "sizes": [H, KV_HEADS * hd, KV_HEADS * hd]},
            {"kind": "fused", "patterns": [r"layers\.\d+\.fc1\.weight"], "sizes": [-1, -1]},
            {"kind": "split", "dim": 1, "patterns": [r"layers\.\d+\.(proj|fc2)\.weight"]},
            {"kind": "replicated", "patterns": [r"layers\.\d+\.norm\.weight"]},
        ],
        "vocab": {"patterns": [r"embedding\.weight"], "size": VOCAB},
    })


def local_params(mib: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Local tensors of enough layers for ``mib`` MiB of parameters + moments per rank."""
    hd = H // HEADS
    qkv = (H + 2 * KV_HEADS * hd) // tp
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    per_layer = (qkv * H + 2 * FFN // tp * H + H * H // tp + H * FFN // tp + H) * 4 * 3
    embedding = padded // tp * H * 4 * 3
    layers = max(1, round(((mib << 20) - embedding) / per_layer))
    g = torch.Generator().manual_seed(rank)
    out = {"embedding.weight": torch.randn(padded // tp, H, generator=g)}
    for i in range(layers):
        out |= {f"layers.{i}.qkv.weight": torch.randn(qkv, H, generator=g),
                f"layers.{i}.fc1.weight": torch.randn(2 * FFN // tp, H, generator=g),
                f"layers.{i}.proj.weight": torch.randn(H, H // tp, generator=g),
                f"layers.{i}.fc2.weight": torch.randn(H, FFN // tp, generator=g),
                f"layers.{i}.norm.weight": torch.ones(H)}
    return out


def state(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Parameters and Adam moments (those of replicated norms equal on every rank)."""
    moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in params.items()}
    for k, v in params.items():
        if ".norm." in k:
            moments[k] = {"exp_avg": torch.full_like(v, 0.25), "exp_avg_sq": torch.full_like(v, 0.5)}
    return {"model": params, "optim": {"state": moments}}


def as_dtensors(sd: dict[str, Any], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def conv(name: str, t: torch.Tensor) -> Any:
        dim = 1 if any(p in name for p in (".proj.", ".fc2.")) else 0
        placement = Replicate() if ".norm." in name else Shard(dim)
        return DTensor.from_local(t, mesh, [placement], run_check=False)

    return {"model": {k: conv(k, v) for k, v in sd["model"].items()},
            "optim": {"state": {k: {m: conv(k, t) for m, t in ms.items()} for k, ms in sd["optim"]["state"].items()}}}


def job(rank: int, world: int, mib: int, work: str, order: list[str], out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import ucp_zarr

    mesh = init_device_mesh("cpu", (world,))
    sd = state(local_params(mib, world, rank))
    forms = {"placed": lambda s: ucp_zarr.place(s, rules(), tp_rank=rank, tp_size=world),
             "dtensor": lambda s: as_dtensors(s, mesh)}
    nbytes = sum(t.numel() * t.element_size() for t in [*sd["model"].values(),
                 *(m for ms in sd["optim"]["state"].values() for m in ms.values())])
    times: dict[str, dict[str, float]] = {}
    for name in order:
        path = os.path.join(work, name)
        described = forms[name](sd)
        dist.barrier()
        t0 = time.perf_counter()
        ucp_zarr.save(described, path)
        save_s = time.perf_counter() - t0
        settle(rank, [path], delete=False)
        target = forms[name]({"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
                              "optim": {"state": {k: {m: torch.zeros_like(t) for m, t in ms.items()}
                                                  for k, ms in sd["optim"]["state"].items()}}})
        dist.barrier()
        t0 = time.perf_counter()
        ucp_zarr.load(target, path)
        load_s = time.perf_counter() - t0
        times[name] = {"save": save_s, "load": load_s}
        settle(rank, [path], delete=True)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (nbytes, times))
    if rank == 0:
        total = sum(n for n, _ in gathered)
        worst = {f: {op: max(t[f][op] for _, t in gathered) for op in ("save", "load")} for f in order}
        with open(out, "w") as f:
            json.dump({"bytes": total, "times": worst}, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="parameters + moments per rank, MiB (about)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_rules_", dir=args.dir)
    runs = []
    try:
        for i in range(args.repeat):
            order = ["placed", "dtensor"] if i % 2 == 0 else ["dtensor", "placed"]
            out = os.path.join(work, f"run{i}.json")
            run(2, job, args.mib, work, order, out)
            with open(out) as f:
                runs.append(json.load(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = runs[0]["bytes"]
    print(f"\nTP=2, {nbytes / 2**20:.0f} MiB in all, {args.repeat} repeats (medians; cold loads)\n")
    print("| op | placed MiB/s | dtensor MiB/s | placed / dtensor | per-repeat ratios | target |")
    print("|---|---|---|---|---|---|")
    for op in ("save", "load"):
        med = {f: statistics.median(r["times"][f][op] for r in runs) for f in ("placed", "dtensor")}
        rate = {f: nbytes / 2**20 / med[f] for f in med}
        ratio = rate["placed"] / rate["dtensor"]
        paired = sorted(r["times"]["dtensor"][op] / r["times"]["placed"][op] for r in runs)
        spread = f"{paired[0]:.2f}-{paired[-1]:.2f}"
        verdict = "PASS" if ratio >= 0.9 else "FAIL"
        print(f"| {op} | {rate['placed']:.0f} | {rate['dtensor']:.0f} | {ratio:.2f}x | {spread} | >= 0.9x {verdict} |")


if __name__ == "__main__":
    main()
