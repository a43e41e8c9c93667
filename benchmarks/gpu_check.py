"""Everything to check on a machine with a GPU, in one go: the CUDA tests, then a small benchmark.

    .venv/bin/python benchmarks/gpu_check.py [--mib 1024] [--repeat 3] [--dir DIR] [--json OUT]

1. **Tests**: ``tests/test_gpu_path.py`` (every test taking ``device`` runs on CPU and on CUDA;
   two more need two GPUs), the CUDA targets of ``tests/test_load_targets.py`` and
   ``read_state_dict(..., device=)``. With a GPU, a CUDA case that skips is a failure of this script.
2. **Benchmark** (GPU only), a state of fp32 and bf16 tensors of ``--mib`` MiB on ``cuda``:

   * ``save``: ``ucp_zarr.save`` from the device until durable, MiB/s (shards staged through
     the pinned pool); ``pinned pool``: the pool's capacity and peak bytes in use;
   * ``load``: ``ucp_zarr.load`` into device tensors, cold (files dropped from the page
     cache) and warm, MiB/s, checked bit for bit;
   * ``async stall``: ``async_save(...)`` until it returns (the blocking stage: the
     copy into pinned host memory), against ``t.to("cpu")`` of every tensor and a copy into
     preallocated pinned buffers (the limit: PCIe / NVLink-C2C device-to-host); ``async
     total``: until its future is done; the pinned host buffer it held;
   * ``device memory``: what the save added to the device's peak allocation.

Without a GPU it runs the tests (their CPU cases), says so, and skips the benchmark (exit 0);
``--device cpu`` runs the benchmark's code on the CPU (a dry run of this script: no pinned
memory, no pool).
Exit status: 0 when every test passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20
# the CUDA cases: the GPU path, loading into CUDA targets (conjugate, strided), read_state_dict(device=)
TESTS = ["tests/test_gpu_path.py", "tests/test_load_targets.py",
         "tests/test_resume_fresh.py::test_read_state_dict_keys_and_device"]


def run_tests(gpu: bool) -> bool:
    """The CUDA tests (and their CPU twins), verbosely; with a GPU no CUDA case may skip."""
    cmd = [sys.executable, "-m", "pytest", *TESTS, "-v", "-rs", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=300"]
    print("$ " + " ".join(cmd), flush=True)
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(run.stdout[-20000:] + run.stderr[-5000:], flush=True)
    cuda_skips = [line for line in run.stdout.splitlines() if "[cuda]" in line and "SKIPPED" in line]
    if gpu and cuda_skips:
        print(f"FAIL: {len(cuda_skips)} CUDA test(s) skipped on a machine with a GPU:\n" + "\n".join(cuda_skips))
        return False
    return run.returncode == 0


def make_state(mib: int, device: str) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB: 64 MiB fp32 matrices, a bf16 one and a bias per layer."""
    g = torch.Generator(device=device).manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    layer = 0
    while sum(t.nbytes for t in state.values()) < mib * MiB:
        state[f"layers.{layer}.w"] = torch.randn(4096, 4096, device=device, generator=g)
        state[f"layers.{layer}.w_bf16"] = torch.randn(2048, 4096, device=device, generator=g).bfloat16()
        state[f"layers.{layer}.b"] = torch.randn(4096, device=device, generator=g)
        layer += 1
    return state


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def benchmark(mib: int, repeat: int, workdir: str, device: str) -> dict[str, Any]:
    import ucp_zarr
    from pagecache import evict
    from ucp_zarr.protocol import staging

    pools: list[staging.HostPool] = []
    original_init = staging.HostPool.__init__

    def tracked(self: staging.HostPool, capacity: int, pin: bool) -> None:
        original_init(self, capacity, pin)
        pools.append(self)

    staging.HostPool.__init__ = tracked  # type: ignore[method-assign]
    buffers: list[int] = []
    original_staging = staging.Staging.__init__

    def staged(self: staging.Staging, *args: Any, **kwargs: Any) -> None:
        original_staging(self, *args, **kwargs)
        buffers.append(self.nbytes)

    staging.Staging.__init__ = staged  # type: ignore[method-assign]

    cuda = device == "cuda"
    state = make_state(mib, device)
    nbytes = sum(t.nbytes for t in state.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for k, t in state.items()}
    rows: dict[str, list[float]] = {k: [] for k in (
        "save", "load_cold", "load_warm", "to_cpu", "to_pinned", "async_stall", "async_total", "device_extra")}
    pool_capacity = pool_peak = async_buffer = 0
    for r in range(repeat):
        path = os.path.join(workdir, f"ck{r}")
        pools.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        seconds, _ = timed(lambda: ucp_zarr.save(state, path), device)
        rows["save"].append(seconds)
        rows["device_extra"].append(torch.cuda.max_memory_allocated() - base if cuda else 0)
        for pool in pools:  # (one, for device tensors)
            pool_capacity, pool_peak = pool.capacity, max(pool_peak, pool.peak)

        out = {k: torch.empty_like(t) for k, t in state.items()}
        evict(path)
        rows["load_cold"].append(timed(lambda: ucp_zarr.load(out, path), device)[0])
        rows["load_warm"].append(timed(lambda: ucp_zarr.load(out, path), device)[0])
        bad = [k for k in state if not torch.equal(bits(out[k]), bits(state[k]))]
        if bad:
            raise SystemExit(f"FAIL: loaded tensors differ from the saved ones: {bad[:5]}")
        out.clear()  # (the device memory back before the next measurement)

        rows["to_cpu"].append(timed(lambda: {k: t.to("cpu", copy=True) for k, t in state.items()}, device)[0])
        rows["to_pinned"].append(timed(lambda: [pinned[k].copy_(t, non_blocking=cuda) for k, t in state.items()], device)[0])
        buffers.clear()
        t0 = time.perf_counter()
        fut = ucp_zarr.async_save(state, path + "_async")
        rows["async_stall"].append(time.perf_counter() - t0)
        fut.result()
        rows["async_total"].append(time.perf_counter() - t0)
        async_buffer = max(buffers)
        shutil.rmtree(path)
        shutil.rmtree(path + "_async")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "mib": nbytes / MiB, "tensors": len(state), "repeat": repeat,
        "seconds": {k: v for k, v in rows.items() if k != "device_extra"},
        "save_mib_s": nbytes / MiB / med["save"], "load_cold_mib_s": nbytes / MiB / med["load_cold"],
        "load_warm_mib_s": nbytes / MiB / med["load_warm"],
        "async_stall_s": med["async_stall"], "async_total_s": med["async_total"],
        "to_cpu_s": med["to_cpu"], "to_pinned_s": med["to_pinned"],
        "pinned_pool_bytes": pool_capacity, "pinned_pool_peak_bytes": pool_peak,
        "async_pinned_buffer_bytes": async_buffer, "device_extra_bytes": int(med["device_extra"]),
    }


def table(res: dict[str, Any]) -> str:
    size = res["mib"]
    rows = [
        ("save (device -> durable)", f"{res['save_mib_s']:,.0f} MiB/s", f"{size / res['save_mib_s']:.2f} s"),
        ("load cold (-> device)", f"{res['load_cold_mib_s']:,.0f} MiB/s", f"{size / res['load_cold_mib_s']:.2f} s"),
        ("load warm (-> device)", f"{res['load_warm_mib_s']:,.0f} MiB/s", f"{size / res['load_warm_mib_s']:.2f} s"),
        ("async stall (blocking stage)", f"{res['async_stall_s']:.3f} s",
         f"{res['async_stall_s'] / res['to_pinned_s']:.2f}x copy into pinned, "
         f"{res['async_stall_s'] / res['to_cpu_s']:.2f}x .to('cpu')"),
        ("  copy into pinned buffers", f"{res['to_pinned_s']:.3f} s", f"{size / res['to_pinned_s']:,.0f} MiB/s"),
        ("  .to('cpu') of every tensor", f"{res['to_cpu_s']:.3f} s", f"{size / res['to_cpu_s']:,.0f} MiB/s"),
        ("async total (until durable)", f"{res['async_total_s']:.2f} s", ""),
        ("pinned pool (sync save)", f"{res['pinned_pool_bytes'] / MiB:,.0f} MiB",
         f"peak in use {res['pinned_pool_peak_bytes'] / MiB:,.0f} MiB"),
        ("pinned buffer (async save)", f"{res['async_pinned_buffer_bytes'] / MiB:,.0f} MiB", "the whole state"),
        ("device memory added by save", f"{res['device_extra_bytes'] / MiB:,.1f} MiB", ""),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    head = f"{res['device']}: {size:,.0f} MiB in {res['tensors']} tensors, median of {res['repeat']}"
    return "\n".join([head] + [f"{a:<{w[0]}}  {b:>{w[1]}}  {c}".rstrip() for a, b, c in rows])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the benchmarked state (default 1024)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of each measurement (default 3)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON here")
    p.add_argument("--no-tests", action="store_true", help="the benchmark only")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the benchmarked state lives (cpu: a dry run of this script's code)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no GPU: torch.cuda.is_available() is False here; the tests run their CPU cases (the CUDA ones "
              "skip)" + (" and the GPU benchmark is not run" if args.device == "cuda" else ""), flush=True)
    ok = args.no_tests or run_tests(gpu)
    if args.device == "cuda" and not gpu:
        return 0 if ok else 1
    workdir = tempfile.mkdtemp(prefix="gpu_check-", dir=args.dir)
    try:
        res = benchmark(args.mib, args.repeat, workdir, args.device)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
