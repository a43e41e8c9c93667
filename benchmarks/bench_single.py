"""Single-process save/load throughput: ucp_zarr against raw disk and the common formats.

One command, one run, all methods side by side on the same training-like state::

    python benchmarks/bench_single.py [--gib 1.0] [--repeat 3] [--dir DIR]

Methods (each saves the same state dict and loads it back):

  ucp_zarr     ucp_zarr.save / ucp_zarr.load into preallocated tensors (training resume)
  raw          the disk's limit: one file per tensor written by 4 threads (write + fsync each) /
               read back by 4 threads with ``os.preadv`` into the preallocated tensors
  torch        torch.save + fsync / torch.load(weights_only=True)
  safetensors  safetensors.torch.save_file + fsync / safetensors.torch.load_file
  dcp          torch.distributed.checkpoint, one process, no process group:
               dcp.save(FileSystemWriter, sync_files=True) / dcp.load into preallocated tensors

Fairness rules, identical for every method:

* a save is timed up to and including the fsync of its files (and of its directory);
* after a save, every file the method wrote is fsynced and evicted from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``), so every load is cold;
* a load is timed until every page of every loaded tensor is resident (one byte per 4 KiB
  page is touched; this matters for safetensors, whose default ``mmap`` backend is lazy);
* methods are interleaved within each repeat (the order rotates between repeats) and each
  method's output is deleted before the next method runs, so disk use stays ~1x the state;
* each method's loaded tensors are compared bit for bit with the source once (first repeat).

Prints a markdown table of median MiB/s and the project's target ratios.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from pagecache import cached_bytes, evict
from rawio import pread_exact, write_durably

if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the state ------------------------------------------------------------------------------


def training_state(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat, DCP-style state dict of a Llama-like model: bf16 weights plus fp32 Adam moments.

    Blocks of (attn.o [4096,4096], mlp.up [11008,4096], mlp.up bias [11008], norm [4096]) are
    added parameter by parameter, each as ``model.<p>`` (bf16) + ``optim.state.<p>.exp_avg``
    + ``.exp_avg_sq`` (fp32), until the total reaches ``gib`` GiB; a 0-d fp32 ``step`` ends it.
    """
    target = int(gib * (1 << 30))
    params = [
        ("self_attn.o_proj.weight", (4096, 4096)),
        ("mlp.up_proj.weight", (11008, 4096)),
        ("mlp.up_proj.bias", (11008,)),
        ("input_layernorm.weight", (4096,)),
    ]
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    total = 0
    layer = 0
    while total < target:
        for name, shape in params:
            if total >= target:
                break
            p = f"layers.{layer}.{name}"
            w = torch.randn(shape, generator=g)
            sd[f"model.{p}"] = w.to(torch.bfloat16)
            sd[f"optim.state.{p}.exp_avg"] = w.mul_(1e-3)  # reuse the buffer: fp32, distinct values
            sd[f"optim.state.{p}.exp_avg_sq"] = torch.rand(shape, generator=g)
            total += sum(_nbytes(sd[k]) for k in list(sd)[-3:])
        layer += 1
    sd["optim.state.step"] = torch.tensor(1000.0)
    return sd


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def empty_like_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated, already faulted-in destination tensors (as a resuming trainer has)."""
    return {k: torch.zeros_like(v) for k, v in sd.items()}


# --- file system helpers --------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def touch_pages(tensors: dict[str, torch.Tensor]) -> None:
    """Read one byte of every page of every tensor, so lazily mapped results become resident."""
    for t in tensors.values():
        s = t.untyped_storage()
        if s.nbytes():
            torch.empty(0, dtype=torch.uint8).set_(s)[::PAGE].sum()


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def wait_idle(max_wait: float, idle_needed: float = 0.85, window: float = 0.5) -> float:
    """Wait (up to ``max_wait`` s) for a ``window`` in which the machine is mostly idle; return the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        b0, t_0 = _cpu_jiffies()
        time.sleep(window)
        b1, t_1 = _cpu_jiffies()
        if t_1 > t_0 and 1 - (b1 - b0) / (t_1 - t_0) >= idle_needed:
            break
    return time.perf_counter() - t0


class Meter:
    """Wall time, this process's CPU time, other processes' CPU load and peak RSS growth of a block.

    The machine may be shared: ``other_load`` is the CPU time the rest of the machine used during
    the block, as a fraction of all CPUs, so that a contended measurement can be recognised.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def __enter__(self) -> "Meter":
        self.base = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._jif = _cpu_jiffies()
        t = os.times()
        self._cpu = t.user + t.system
        self._t = time.perf_counter()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t
        t = os.times()
        self.cpu = t.user + t.system - self._cpu
        busy, total = _cpu_jiffies()
        tick = os.sysconf("SC_CLK_TCK")
        machine_busy = (busy - self._jif[0]) / tick
        ncpu = os.cpu_count() or 1
        self.other_load = max(0.0, machine_busy - self.cpu) / max(self.wall * ncpu, 1e-9)
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


# --- the methods ----------------------------------------------------------------------------
#
# Each method is (save(sd, path), load(sd_like, dest, path) -> loaded dict). ``dest`` holds
# preallocated tensors for methods that load in place; the others allocate their own.


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


RAW_THREADS = 4  # as many as ucp_zarr's max_workers


def raw_save(sd: dict[str, torch.Tensor], path: str) -> None:
    """One file per tensor, ``RAW_THREADS`` at a time, each write + fsync; then the directory."""
    os.makedirs(path)

    def one(it: tuple[int, torch.Tensor]) -> None:
        i, t = it
        write_durably(os.path.join(path, f"{i}.bin"), memoryview(_np_bytes(t)))

    with ThreadPoolExecutor(RAW_THREADS) as pool:
        list(pool.map(one, enumerate(sd.values())))
    fsync_dir(path)


def raw_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    """``os.preadv`` of every file into its preallocated tensor, ``RAW_THREADS`` at a time."""

    def one(it: tuple[int, str]) -> None:
        i, k = it
        pread_exact(os.path.join(path, f"{i}.bin"), memoryview(_np_bytes(dest[k])))

    with ThreadPoolExecutor(RAW_THREADS) as pool:
        list(pool.map(one, enumerate(sd_like)))
    return dest


def ucp_save(sd, path: str) -> None:
    import ucp_zarr

    ucp_zarr.save(sd, path)


def ucp_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    import ucp_zarr

    ucp_zarr.load(dest, path)
    return dest


def ucp_fresh_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    """``ucp_zarr.read_state_dict``: new tensors, nothing preallocated (as ``torch.load``)."""
    import ucp_zarr

    return ucp_zarr.read_state_dict(path)


def torch_save(sd, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def torch_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def st_save(sd, path: str) -> None:
    import safetensors.torch

    safetensors.torch.save_file(sd, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def st_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(path)


def dcp_save(sd, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)


def dcp_load(sd_like, dest, path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return dest


METHODS: dict[str, tuple[str, Callable, Callable, str]] = {
    # name: (label, save, load, output suffix)
    "ucp_zarr": ("ucp_zarr", ucp_save, ucp_load, ".zarr"),
    "ucp_fresh": ("ucp_zarr save / read_state_dict (fresh tensors)", ucp_save, ucp_fresh_load, ".zarr"),
    "raw": ("raw limit: 4 threads write+fsync / preadv", raw_save, raw_load, ".raw"),
    "torch": ("torch.save+fsync / torch.load", torch_save, torch_load, ".pt"),
    "safetensors": ("safetensors save_file+fsync / load_file", st_save, st_load, ".safetensors"),
    "dcp": ("torch DCP, 1 process", dcp_save, dcp_load, ".dcp"),
}
IN_PLACE = {"ucp_zarr", "dcp", "raw"}


# --- checking -------------------------------------------------------------------------------

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ia = a.contiguous().reshape(-1).view(_INT_OF[a.element_size()])
    ib = b.contiguous().reshape(-1).view(_INT_OF[b.element_size()])
    return torch.equal(ia, ib)


def check(name: str, src: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    bad = [k for k in src if k not in got or not bit_equal(src[k], got[k])]
    extra = [k for k in got if k not in src]
    if bad or extra:
        raise SystemExit(f"{name}: loaded state differs from the source: bad={bad[:5]} extra={extra[:5]}")


# --- driver ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the state, GiB (default 1.0)")
    ap.add_argument("--repeat", type=int, default=3, help="repeats per method (default 3)")
    ap.add_argument("--dir", default="/work/bench_tmp", help="scratch directory (default /work/bench_tmp)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument(
        "--wait-idle", type=float, default=0.0, metavar="S",
        help="before each timed step, wait up to S seconds for the machine to be >= 85%% idle (default 0: off)",
    )
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in names:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}")

    src = training_state(args.gib)
    nbytes = sum(_nbytes(t) for t in src.values())
    dest = empty_like_state(src)
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 3 * nbytes:
        raise SystemExit(f"{args.dir}: {free / MiB:.0f} MiB free, need ~{3 * nbytes / MiB:.0f} MiB")
    work = os.path.join(args.dir, f"bench_single.{os.getpid()}")
    os.makedirs(work)
    if "ucp_zarr" in names:
        import ucp_zarr

        print(f"ucp_zarr {ucp_zarr.__version__} from {os.path.dirname(ucp_zarr.__file__)}")
    print(
        f"state: {len(src)} tensors, {nbytes / MiB:.0f} MiB "
        f"(bf16 weights + fp32 Adam moments); dir {work}; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )

    runs: dict[tuple[str, str], list[Meter]] = {(m, op): [] for m in names for op in ("save", "load")}
    warm: dict[str, int] = {}
    waited = 0.0
    try:
        for rep in range(args.repeat):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for m in order:
                _, save, load, suffix = METHODS[m]
                path = os.path.join(work, m + suffix)
                gc.collect()
                waited += wait_idle(args.wait_idle) if args.wait_idle else 0.0
                with Meter() as ms:
                    save(src, path)
                evict(path)
                if rep == 0:
                    c = cached_bytes(path)
                    if c is not None:
                        warm[m] = c
                for t in dest.values():  # the in-place loaders must really write
                    t.zero_()
                gc.collect()
                waited += wait_idle(args.wait_idle) if args.wait_idle else 0.0
                with Meter() as ml:
                    got = load(src, dest, path)
                    touch_pages(got)
                if rep == 0:
                    check(m, src, got)
                del got
                remove(path)
                runs[m, "save"].append(ms)
                runs[m, "load"].append(ml)
                print(
                    f"  repeat {rep + 1}/{args.repeat} {m:<12} save {nbytes / MiB / ms.wall:6.0f} MiB/s"
                    f" (cpu {ms.cpu:4.2f}s, other load {ms.other_load:4.0%})"
                    f"  load {nbytes / MiB / ml.wall:6.0f} MiB/s (cpu {ml.cpu:4.2f}s, other load {ml.other_load:4.0%})",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if any(v > 0.01 * nbytes for v in warm.values()):
        print(f"WARNING: page cache not fully evicted before load: { {k: v // MiB for k, v in warm.items()} } MiB")

    def mibs(m: str, op: str) -> float:
        return nbytes / MiB / statistics.median(r.wall for r in runs[m, op])

    def span(m: str, op: str) -> str:
        walls = [r.wall for r in runs[m, op]]
        return f"{nbytes / MiB / max(walls):.0f}-{nbytes / MiB / min(walls):.0f}"

    def med(m: str, op: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs[m, op])

    other = statistics.mean(r.other_load for rs in runs.values() for r in rs)
    print()
    print(
        f"Median of {args.repeat} interleaved repeats; {nbytes / MiB:.0f} MiB state, {len(src)} tensors "
        f"(bf16 + fp32); save includes fsync; loads are cold (page cache evicted) and end with every page "
        f"resident; bit-exact check passed. {os.cpu_count()} CPUs; other processes used {other:.0%} of them "
        f"on average during the measurements{f' (waited {waited:.0f}s for idle)' if waited else ''}."
    )
    print()
    print(
        "| method | save MiB/s | load MiB/s | save min-max | load min-max "
        "| CPU s save / load | peak RSS growth MiB save / load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in names:
        how = " (in place)" if m in IN_PLACE else ""
        print(
            f"| {METHODS[m][0]}{how} | {mibs(m, 'save'):.0f} | {mibs(m, 'load'):.0f} | {span(m, 'save')} "
            f"| {span(m, 'load')} | {med(m, 'save', 'cpu'):.2f} / {med(m, 'load', 'cpu'):.2f} "
            f"| {max(r.growth for r in runs[m, 'save']) / MiB:.0f} / {max(r.growth for r in runs[m, 'load']) / MiB:.0f} |"
        )
    print()
    if "ucp_zarr" in names and "raw" in names:
        r = mibs("ucp_zarr", "save") / mibs("raw", "save")
        print(f"ucp_zarr save / raw write+fsync = {r:.2f}x  (target >= 0.90: {'PASS' if r >= 0.9 else 'FAIL'})")
        r = mibs("ucp_zarr", "load") / mibs("raw", "load")
        print(f"ucp_zarr load / raw preadv      = {r:.2f}x  (target >= 0.90: {'PASS' if r >= 0.9 else 'FAIL'})")
    if "ucp_zarr" in names and "torch" in names:
        r = mibs("ucp_zarr", "load") / mibs("torch", "load")
        print(f"ucp_zarr load / torch.load      = {r:.2f}x  (target >= 0.80: {'PASS' if r >= 0.8 else 'FAIL'})")
    for peer in ("torch", "safetensors"):
        if "ucp_fresh" in names and peer in names:
            r = mibs("ucp_fresh", "load") / mibs(peer, "load")
            print(f"ucp_zarr read_state_dict / {METHODS[peer][0].split(' / ')[-1]} (both into fresh tensors) = {r:.2f}x")


if __name__ == "__main__":
    main()
