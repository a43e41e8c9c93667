"""Asynchronous save: what it blocks, and what its background write costs a training loop.

    python benchmarks/bench_async.py [--d-model 512] [--layers 6] [--repeat 3] [--device cpu] [--dir DIR] [--json OUT]

A small transformer (``nn.TransformerEncoder``, AdamW, fp32) trains on random tokens on the
CPU (or ``--device cuda``), one process. Per repeat:

* **blocking stage**: ``ucp_zarr.async_save(state, path)`` until it returns,
  against a plain copy of the same state to host memory (``t.to("cpu", copy=True)`` of every
  tensor, the least an asynchronous save must do before training may change the tensors), and
  a copy into preallocated (on CUDA: pinned) host buffers (``dst.copy_(t)``), alternating in order;
* **training slowdown**: the training step time while the background write runs (from the
  return of the save until its future is done), against the step time of the steps right
  before the save, on the same warmed-up loop; the same save written by a thread of the
  training process (``writer="thread"``) alongside, as the reference; every step is kept, so the summary gives
  the distribution (median, p90, max over all repeats) of the steps before, during and
  after the write (the steps after show the loop's own spread with nothing in the background).

The machine may have 2 cores: the background writer (its copies, checksums, system calls)
competes with the training step's threads for them, which is what this measures.
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
from torch import nn

if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20


class Model(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 8000) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def clone(state: Any) -> Any:
    """A host copy of every tensor (on the CPU: ``clone()``)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def pinned(state: Any) -> Any:
    """``state`` with every tensor in pinned host memory."""
    if isinstance(state, torch.Tensor):
        return state.pin_memory()
    if isinstance(state, dict):
        return {k: pinned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(pinned(v) for v in state)
    return state


def copy_into(dst: Any, src: Any) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif isinstance(src, dict):
        for k, v in src.items():
            copy_into(dst[k], v)
    elif isinstance(src, (list, tuple)):
        for a, b in zip(dst, src):
            copy_into(a, b)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of the training step (default 1: on a shared 2-core machine, 2 OpenMP threads "
        "spin against other processes and a step's time swings 10x)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    ap.add_argument("--dir", default="/work/bench_tmp")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--paced", type=float, default=None, metavar="BYTES_PER_S",
                    help="also run the save paced (write_bytes_per_s) in every repeat")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up, as a training script may: the full collections a save "
                         "brings on then skip the ~285,000 objects of torch and the model (profiles.md)")
    args = ap.parse_args(argv)
    import ucp_zarr

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = Model(args.d_model, args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8000, (args.batch, args.seq), device=device)
    y = torch.randint(0, 8000, (args.batch, args.seq), device=device)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - t0

    for _ in range(5):  # warm up, and create the optimizer state
        step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    size = state_bytes(state())
    work = os.path.join(args.dir, f"bench_async.{os.getpid()}")
    os.makedirs(work)
    print(
        f"ucp_zarr {ucp_zarr.__version__}; transformer d={args.d_model} x {args.layers} layers, state {size / MiB:.0f} MiB; "
        f"on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs",
        flush=True,
    )
    ucp_zarr.async_save(state(), os.path.join(work, "warm")).result()  # first calls, untimed
    if args.gc_freeze:
        gc.freeze()
    pre = pinned(clone(state())) if device.type == "cuda" else clone(state())
    res: dict[str, Any] = {"bytes": size, "gc_freeze": args.gc_freeze, "blocking": [], "clone": [], "copy_into": [], "background": [],
                           "thread_background": [], "thread_steps_during": [], "paced_background": [],
                           "paced_steps_during": [], "paced_rate": args.paced,
                           "steps_before": [], "steps_during": [], "all_before": [], "all_during": [], "all_after": []}
    try:
        for rep in range(args.repeat):
            before = [step() for _ in range(8)]
            order = ["clone", "copy_into", "save", "thread"] + (["paced"] if args.paced else [])
            order = order if rep % 2 == 0 else order[::-1]
            during: list[float] = []
            for what in order:
                if what == "clone":
                    t0 = time.perf_counter()
                    kept = clone(state())
                    res["clone"].append(time.perf_counter() - t0)
                    kept.clear()  # (freed after the timing)
                elif what == "copy_into":
                    t0 = time.perf_counter()
                    copy_into(pre, state())
                    sync()
                    res["copy_into"].append(time.perf_counter() - t0)
                elif what in ("thread", "paced"):  # the same save written by a thread of this process, or paced
                    kw = {"writer": "thread"} if what == "thread" else {"write_bytes_per_s": args.paced}
                    fut = ucp_zarr.async_save(state(), os.path.join(work, f"{what}{rep}"), **kw)
                    t1 = time.perf_counter()
                    other: list[float] = []
                    while not fut.done():
                        other.append(step())
                    fut.result()
                    res[f"{what}_background"].append(time.perf_counter() - t1)
                    res[f"{what}_steps_during"].append(statistics.median(other) if other else float("nan"))
                else:
                    t0 = time.perf_counter()
                    fut = ucp_zarr.async_save(state(), os.path.join(work, f"ck{rep}"))
                    t1 = time.perf_counter()
                    while not fut.done():
                        during.append(step())
                    fut.result()
                    res["blocking"].append(t1 - t0)
                    res["background"].append(time.perf_counter() - t1)
            after = [step() for _ in range(8)]  # the loop's own spread, with nothing in the background
            res["all_before"].append(before)
            res["all_during"].append(during)
            res["all_after"].append(after)
            res["steps_before"].append(statistics.median(before))
            # a step that started during the write counts as during it (the last may end after)
            res["steps_during"].append(statistics.median(during) if during else float("nan"))
            print(
                f"  repeat {rep + 1}/{args.repeat}: blocking {1000 * res['blocking'][-1]:.0f} ms, clone "
                f"{1000 * res['clone'][-1]:.0f} ms, copy into {1000 * res['copy_into'][-1]:.0f} ms; background write "
                f"{1000 * res['background'][-1]:.0f} ms with {len(during)} steps of {1000 * res['steps_during'][-1]:.0f} ms "
                f"(before: {1000 * res['steps_before'][-1]:.0f} ms)",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = summary(res)
    print(
        f"\nblocking stage / clone = {s['blocking_vs_clone']:.2f}x (target <= 1.2), / copy into preallocated = "
        f"{s['blocking_vs_copy']:.2f}x; training step during the background write = {s['slowdown']:.2f}x the step "
        f"before it (target <= 1.05)" + (f"; written by a thread instead: {s['thread_slowdown']:.2f}x" if "thread_slowdown" in s else "")
        + (f"; paced: {s['paced_slowdown']:.2f}x, write {s['paced_background_ms']:.0f} ms" if "paced_slowdown" in s else "")
    )
    for k in ("before", "during", "after"):
        print(f"steps {k:6s} the write (ms, {s[k + '_n']} steps): median {s[k + '_median_ms']:.0f}, "
              f"p90 {s[k + '_p90_ms']:.0f}, max {s[k + '_max_ms']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def summary(res: dict[str, Any]) -> dict[str, float]:
    """Medians of the per-repeat ratios; the distribution (median, p90, max) of every step
    before, during and after the background writes, pooled over repeats."""
    def med(xs: list[float]) -> float:
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")

    dist: dict[str, float] = {}
    for k in ("before", "during", "after"):
        steps = [x for rep in res.get(f"all_{k}", []) for x in rep]
        if steps:
            dist[f"{k}_n"] = len(steps)
            for name, q in (("median", 0.5), ("p90", 0.9), ("max", 1.0)):
                dist[f"{k}_{name}_ms"] = 1000 * quantile(steps, q)
    return {
        **dist,
        "blocking_ms": 1000 * med(res["blocking"]),
        "clone_ms": 1000 * med(res["clone"]),
        "blocking_vs_clone": med([b / c for b, c in zip(res["blocking"], res["clone"])]),
        "blocking_vs_copy": med([b / c for b, c in zip(res["blocking"], res["copy_into"])]),
        "slowdown": med([d / b for d, b in zip(res["steps_during"], res["steps_before"])]),
        "slowdown_min": min(d / b for d, b in zip(res["steps_during"], res["steps_before"])),
        "slowdown_max": max(d / b for d, b in zip(res["steps_during"], res["steps_before"])),
        "step_ms": 1000 * med(res["steps_before"]),
        "background_ms": 1000 * med(res["background"]),
        **_variant_summary(res, "thread"),
        **_variant_summary(res, "paced"),
    }


def _variant_summary(res: dict[str, Any], what: str) -> dict[str, float]:
    """The step during the same save written by a thread of the training process
    (``what="thread"``: ``writer="thread"``) or paced (``"paced"``: ``write_bytes_per_s``)."""
    pairs = [(d / b) for d, b in zip(res.get(f"{what}_steps_during", []), res["steps_before"]) if d == d]
    if not pairs:
        return {}
    return {
        f"{what}_slowdown": statistics.median(pairs), f"{what}_slowdown_min": min(pairs),
        f"{what}_slowdown_max": max(pairs), f"{what}_background_ms": 1000 * statistics.median(res[f"{what}_background"]),
    }


if __name__ == "__main__":
    main()
