"""Distributed save / reshard load: ucp_zarr against torch.distributed.checkpoint (DCP).

One command, one run, both methods side by side on the same training state::

    python benchmarks/bench_distributed.py [--gib 1.0] [--repeat 2] [--dir DIR] [--profile]

The state (>= ``--gib`` GiB): a Llama-7B-shaped model (hidden 4096, FFN 11008 at 1 GiB),
bf16 parameters with fp32 Adam moments (``exp_avg``, ``exp_avg_sq``), an embedding and a
bias whose dim 0 (``vocab % 4 == 3``) gives uneven shards over 4 and over 3 ranks, a
replicated 0-d ``step`` tensor and a float learning rate. Every tensor is an FSDP2-style
``DTensor`` sharded on dim 0 (``Shard(0)``, torch.chunk sizes).

Per repeat (fresh processes each time; the methods interleaved, their order rotating):

* **save on 4 processes** (gloo): ``ucp_zarr.save(sd, path)`` and ``dcp.save(sd,
  storage_writer=FileSystemWriter(path, sync_files=True))``; both fsync before returning.
  Each method saves twice: the first save in the process (what the first checkpoint of a
  job costs, including the allocator's first-touch page faults) and a second one to another
  path (the steady state of a job that checkpoints periodically). The first is kept.
* **reshard load on 3 processes**: the same keys as ``Shard(0)`` DTensors over a 3-rank mesh,
  preallocated and zero-filled (resident), filled in place by ``ucp_zarr.load(sd, path)``
  and ``dcp.load(sd, storage_reader=FileSystemReader(path))``. Before every load, every
  file of both checkpoints is fsynced and dropped from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``), so loads are cold.

Every rank generates only its own shard: element ``i`` (row-major global index) of tensor
``k`` is ``(i + salt_k) mod 16777213`` (fp32, exact) or ``mod 251`` (bf16, exact), so any
rank can compute the expected values of any box. After the first repeat's loads every rank
checks its local shards bit for bit against them (and the step and lr).

Timing: a barrier, then each rank times the whole call (planning collectives included);
the time of an operation is the maximum over ranks, and throughput is the state's bytes
divided by it. Memory: a thread samples ``VmRSS`` (``/proc/self/status``) every 10 ms;
"extra" is the peak minus the RSS right before the call. Untimed, before the timed calls,
every process does one save (or load) of a tiny state with each method (imports, first
calls) and writes (or cold-reads) a scratch file the size of its shard: the first large
write/read of a fresh process was measured ~2x slower whichever method came first. After
every save, its files are dropped from the page cache (the second copies are deleted)
before the next save starts: on this VM a save that had to find memory for its page cache
without that was up to 3x slower whichever method it was (see :func:`settle`).

``--profile`` adds, in the last repeat, one untimed ucp_zarr save and load on rank 0 under
cProfile with ucp_zarr's thread pools run inline (so the profile sees all the work; its
time is not representative), and prints the top functions.

Prints a markdown table of medians, ratios ucp_zarr / DCP and the project's targets:
save >= 1.0x DCP, reshard load >= 1.0x DCP, extra host memory per rank during a sync save
<= 256 MiB beyond its own shard.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pagecache import cached_bytes, evict, files_under
from rawio import counted_load as ucp_load
from rawio import raw_write, read_files

if importlib.util.find_spec("ucp_zarr") is None:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
GiB = 1 << 30
METHODS = ("ucp_zarr", "dcp", "dcp_t4")
"""Saved by each repeat; ``dcp`` is DCP's default ``thread_count=1``, ``dcp_t4`` uses as many
writer threads as ucp_zarr (4); the better of the two is the DCP figure."""
LOAD_METHODS = ("ucp_zarr", "dcp")
"""Loaded (DCP's ``FileSystemReader`` has no thread count: it reads the ``dcp`` copy)."""
LOAD_ORDER = (*LOAD_METHODS, "raw")
"""What the load job times, rotating: ``raw`` is the load's limit, the raw aggregate read
(every file of the ucp_zarr checkpoint read whole, once, by one of the load ranks, files
dealt out largest first, ``RAW_THREADS`` threads of ``preadv`` per rank)."""
RAW_THREADS = 4
SAVE_WORLD = 4
LOAD_WORLD = 3
FP32_MOD = 16777213  # < 2**24: every value exact in fp32
BF16_MOD = 251  # < 2**8: every value exact in bf16
FILL_BLOCK = 1 << 22  # elements generated at a time (bounded temporaries)


# --- the state ------------------------------------------------------------------------------

Spec = list[tuple[str, tuple[int, ...], torch.dtype, int]]
"""(key, global shape, dtype, salt) of every tensor."""


def state_spec(gib: float) -> Spec:
    """A Llama-like model's parameters (bf16) with fp32 Adam moments, at least ``gib`` GiB.

    First an embedding ``[vocab, h]`` and ``lm_head.bias [vocab]`` with ``vocab % 4 == 3``
    (uneven Shard(0) over 4 and over 3 ranks), then layers of qkv ``[3h, h]``, o ``[h, h]``,
    up ``[f, h]``, down ``[h, f]`` and two norms ``[h]``, parameter by parameter until the
    total reaches ``gib`` GiB; ``h`` = 4096 and ``f`` = 11008 at 1 GiB (1.35 GiB in all).
    """
    h = 1024 * max(1, round(4 * math.sqrt(gib)))
    f = int(h * 2.6875)
    vocab = 4 * max(1, round(gib * 2000)) + 3
    target = int(gib * GiB)

    def params():
        yield "tok_embeddings.weight", (vocab, h)
        yield "lm_head.bias", (vocab,)
        layer = 0
        while True:
            p = f"layers.{layer}."
            yield p + "attention.wqkv.weight", (3 * h, h)
            yield p + "attention.wo.weight", (h, h)
            yield p + "feed_forward.w1.weight", (f, h)
            yield p + "feed_forward.w2.weight", (h, f)
            yield p + "attention_norm.weight", (h,)
            yield p + "ffn_norm.weight", (h,)
            layer += 1

    spec: Spec = []
    total = 0
    for name, shape in params():
        for key, dtype in (
            (f"model.{name}", torch.bfloat16),
            (f"optim.state.{name}.exp_avg", torch.float32),
            (f"optim.state.{name}.exp_avg_sq", torch.float32),
        ):
            spec.append((key, shape, dtype, 7919 * len(spec)))
            total += math.prod(shape) * dtype.itemsize
        if total >= target:
            break
    return spec


def spec_bytes(spec: Spec) -> int:
    return sum(math.prod(s) * d.itemsize for _, s, d, _ in spec) + 4  # + the 0-d step


STEP = 1000.0
LR = 3e-4


def expected(start: int, stop: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Elements ``[start, stop)`` (row-major global indices) of a tensor with ``salt``."""
    idx = torch.arange(start + salt, stop + salt, dtype=torch.int64)
    return idx.remainder_(BF16_MOD if dtype == torch.bfloat16 else FP32_MOD).to(dtype)


def row_split(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of ``rank``'s Shard(0) part of ``n`` rows (torch.chunk sizes, as DTensor)."""
    size = -(-n // world) if n else 0
    off = min(rank * size, n)
    return off, max(0, min(size, n - off))


def build_state(spec: Spec, mesh: Any, fill: bool) -> tuple[dict[str, Any], int]:
    """This rank's DTensors (Shard(0) over ``mesh``) of every tensor of ``spec``, filled with
    the expected values (``fill``) or zeros; plus the step and lr. Returns (state, own bytes)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    world, rank = mesh.size(), mesh.get_local_rank()
    sd: dict[str, Any] = {}
    own = 0
    for key, shape, dtype, salt in spec:
        off, rows = row_split(shape[0], world, rank)
        lshape, goff = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        assert tuple(lshape) == (rows, *shape[1:]) and (rows == 0 or goff[0] == off), (key, lshape, goff, off, rows)
        local = torch.zeros((rows, *shape[1:]), dtype=dtype)
        if fill:
            row = math.prod(shape[1:])
            flat = local.view(-1)
            for a in range(0, flat.numel(), FILL_BLOCK):
                b = min(a + FILL_BLOCK, flat.numel())
                flat[a:b] = expected(off * row + a, off * row + b, dtype, salt)
        own += local.numel() * dtype.itemsize
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        sd[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    sd["optim.state.step"] = torch.tensor(STEP if fill else 0.0)
    sd["optim.param_groups.0.lr"] = LR if fill else 0.0
    return sd, own


def check_state(spec: Spec, sd: dict[str, Any], mesh: Any) -> list[str]:
    """Keys whose local data differs from the expected values (bit for bit)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    bad = []
    for key, shape, dtype, salt in spec:
        off, rows = row_split(shape[0], world, rank)
        local = sd[key].to_local()
        if tuple(local.shape) != (rows, *shape[1:]) or local.dtype != dtype:
            bad.append(key)
            continue
        row = math.prod(shape[1:])
        flat = local.reshape(-1)
        for a in range(0, flat.numel(), FILL_BLOCK):
            b = min(a + FILL_BLOCK, flat.numel())
            want = expected(off * row + a, off * row + b, dtype, salt)
            if not torch.equal(flat[a:b].view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                               want.view(torch.int16 if dtype.itemsize == 2 else torch.int32)):
                bad.append(key)
                break
    if float(sd["optim.state.step"]) != STEP:
        bad.append("optim.state.step")
    if sd["optim.param_groups.0.lr"] != LR:
        bad.append("optim.param_groups.0.lr")
    return bad


def zero_state(sd: dict[str, Any]) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            (v.to_local() if hasattr(v, "to_local") else v).zero_()
    sd["optim.param_groups.0.lr"] = 0.0


# --- the methods ----------------------------------------------------------------------------


def ucp_save(sd: dict[str, Any], path: str) -> Any:
    import ucp_zarr

    return ucp_zarr.save(sd, path)


def dcp_save(sd: dict[str, Any], path: str, thread_count: int = 1) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True, thread_count=thread_count))


def dcp_save_t4(sd: dict[str, Any], path: str) -> None:
    dcp_save(sd, path, thread_count=4)


def dcp_load(sd: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))


SAVE: dict[str, Callable[[dict[str, Any], str], Any]] = {"ucp_zarr": ucp_save, "dcp": dcp_save, "dcp_t4": dcp_save_t4}
LOAD: dict[str, Callable[[dict[str, Any], str], Any]] = {"ucp_zarr": ucp_load, "dcp": dcp_load}


# --- measuring ------------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Meter:
    """Wall time, process CPU time and peak RSS growth (sampled every 10 ms) of a block."""

    def __init__(self, interval: float = 0.010) -> None:
        self.interval = interval
        self._stop = threading.Event()

    def __enter__(self) -> "Meter":
        self.base = self.peak = rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        t = os.times()
        self._cpu = t.user + t.system
        self._t = time.perf_counter()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._t
        t = os.times()
        self.cpu = t.user + t.system - self._cpu
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    def record(self) -> dict[str, float]:
        return {"wall": self.wall, "cpu": self.cpu, "extra": self.peak - self.base, "base": self.base}


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


# --- the jobs (run in spawned processes) ----------------------------------------------------


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes with a gloo group."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn", join=True)


def _timed(op: Callable[[], Any], keep: list[Any] | None = None) -> dict[str, float]:
    dist.barrier()
    with Meter() as m:
        got = op()
    if keep is not None:
        keep.append(got)
    return m.record()


TINY: Spec = [("model.tiny.weight", (7, 4), torch.bfloat16, 1), ("optim.state.tiny.weight.exp_avg", (7, 4), torch.float32, 2)]


def scratch_io(path: str, nbytes: int, read: bool) -> None:
    """Write (and fsync) ``nbytes`` to ``path``; with ``read``, evict it and read it back
    cold. Then delete it. Untimed: the first large write/read of a fresh process is slow."""
    buf = torch.ones(min(nbytes, 64 * MiB) or 1, dtype=torch.uint8).numpy()
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // buf.nbytes)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    if read:
        evict(path)
        with open(path, "rb") as f:
            while f.readinto(buf):
                pass
    os.remove(path)


def settle(rank: int, paths: list[str], delete: bool) -> None:
    """Drop ``paths`` from the page cache (or delete them) on rank 0, between barriers.

    On this kind of VM (Firecracker with free page reporting) writing into memory the guest
    has not used recently costs host page faults: a save that follows another without
    freeing its page cache was measured up to 3x slower whichever method it was. Freeing
    the previous save's pages right before the next one gives every save the same start."""
    dist.barrier()
    if rank == 0:
        for p in paths:
            shutil.rmtree(p) if delete else evict(p)
    dist.barrier()


class _Inline:
    """A ThreadPoolExecutor stand-in that runs everything in the calling thread (--profile)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def map(self, fn: Callable[..., Any], *its: Any) -> list[Any]:
        return [fn(*xs) for xs in zip(*its)]

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:
            fut.set_exception(e)
        return fut


def profiled(op: Callable[[], None], out: str, rank: int) -> None:
    """Run ``op`` on every rank; on rank 0 under cProfile with ucp_zarr's pools inline."""
    import cProfile
    import io
    import pstats

    import ucp_zarr.protocol.saving
    import ucp_zarr.protocol.saver

    dist.barrier()
    if rank != 0:
        op()
        return
    saved = ucp_zarr.protocol.saving.ThreadPoolExecutor, ucp_zarr.protocol.saver.ThreadPoolExecutor
    ucp_zarr.protocol.saving.ThreadPoolExecutor = ucp_zarr.protocol.saver.ThreadPoolExecutor = _Inline
    prof = cProfile.Profile()
    try:
        prof.enable()
        op()
        prof.disable()
    finally:
        ucp_zarr.protocol.saving.ThreadPoolExecutor, ucp_zarr.protocol.saver.ThreadPoolExecutor = saved
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    with open(out, "w") as f:
        f.write(text.getvalue())


def save_job(rank: int, world: int, spec: Spec, work: str, order: list[str], out: str, profile: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for m in order:  # untimed warm-up of both methods on a tiny state
        tiny, _ = build_state(TINY, mesh, fill=True)
        SAVE[m](tiny, os.path.join(work, f"warm.{m}"))
    sd, own = build_state(spec, mesh, fill=True)
    scratch_io(os.path.join(work, f"scratch.{rank}"), own, read=False)
    res: dict[str, Any] = {"own": own}
    # After each save its files leave the page cache (the .2 copies are deleted), so that every
    # save finds the same amount of free memory for its page cache (see settle()).
    for m in order:  # the first save in the process, kept for the load job
        kept: list[Any] = []
        res[m] = _timed(lambda: SAVE[m](sd, os.path.join(work, m)), kept)
        settle(rank, [os.path.join(work, m)], delete=False)
        if m == "ucp_zarr":  # the raw limit: the same files this rank wrote, right after
            sizes = [os.path.getsize(os.path.join(work, m, k)) for k in kept[0].objects]
            src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
            res["raw"] = _timed(lambda: raw_write(os.path.join(work, "raw", str(rank)), sizes, src, RAW_THREADS))
            res["raw"]["objects"] = len(sizes)
            del src
            settle(rank, [os.path.join(work, "raw")], delete=True)
    for m in order:  # a second save: the steady state of a job that checkpoints periodically
        res[m + ".2"] = _timed(lambda: SAVE[m](sd, os.path.join(work, m + ".2")))
        settle(rank, [os.path.join(work, m + ".2")], delete=True)
    if profile:
        profiled(lambda: ucp_save(sd, os.path.join(work, "ucp_zarr.prof")), os.path.join(work, "save.prof.txt"), rank)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(work, "ucp_zarr.prof"))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def load_job(
    rank: int, world: int, spec: Spec, work: str, order: list[str], out: str, verify: bool, profile: bool
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for m in LOAD_METHODS:  # untimed warm-up of both methods on a tiny state
        tiny, _ = build_state(TINY, mesh, fill=False)
        LOAD[m](tiny, os.path.join(work, f"warm.{m}"))
        if check_state(TINY, tiny, mesh):
            raise SystemExit(f"rank {rank}: {m}: the tiny warm-up state loaded wrong")
    sd, own = build_state(spec, mesh, fill=False)
    scratch_io(os.path.join(work, f"scratch.{rank}"), own, read=True)
    checkpoints = [os.path.join(work, x) for x in LOAD_METHODS]
    res: dict[str, Any] = {"own": own, "warm": {}}
    files = sorted(files_under(checkpoints[0]), key=lambda f: (-os.path.getsize(f), f))[rank::world]
    raw_buf = torch.empty(sum(os.path.getsize(f) for f in files), dtype=torch.uint8)
    raw_buf[:: 4096] = 0  # resident before the timed read, as the loaded tensors are
    for m in order:
        zero_state(sd)
        dist.barrier()
        if rank == 0:
            evict(*checkpoints)
            if m != "raw":
                res["warm"][m] = cached_bytes(os.path.join(work, m))
        kept: list[Any] = []
        if m == "raw":
            res[m] = _timed(lambda: read_files(files, raw_buf, RAW_THREADS))
            res[m]["bytes_read"] = raw_buf.numel()
            continue
        res[m] = _timed(lambda: LOAD[m](sd, os.path.join(work, m)), kept)
        if m == "ucp_zarr":
            res[m]["bytes_read"] = kept[0]
        if verify:
            bad = check_state(spec, sd, mesh)
            res[m]["bad"] = bad[:5]
    if profile:
        zero_state(sd)
        dist.barrier()
        if rank == 0:
            evict(*checkpoints)
        profiled(lambda: ucp_load(sd, os.path.join(work, "ucp_zarr")), os.path.join(work, "load.prof.txt"), rank)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


# --- driver ---------------------------------------------------------------------------------


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the training state, GiB (default 1.0)")
    ap.add_argument("--repeat", type=int, default=2, help="repeats (default 2)")
    ap.add_argument("--dir", default="/work/bench_tmp", help="scratch directory (default /work/bench_tmp)")
    ap.add_argument("--profile", action="store_true", help="profile one extra ucp_zarr save and load on rank 0 (last repeat)")
    ap.add_argument("--json", help="write the per-rank records here")
    args = ap.parse_args(argv)

    spec = state_spec(args.gib)
    nbytes = spec_bytes(spec)
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 4 * nbytes:
        raise SystemExit(f"{args.dir}: {free / MiB:.0f} MiB free, need ~{4 * nbytes / MiB:.0f} MiB")
    root = os.path.join(args.dir, f"bench_distributed.{os.getpid()}")
    os.makedirs(root)

    import ucp_zarr

    uneven = [k for k, s, _, _ in spec if s[0] % SAVE_WORLD and k.startswith("model.")]
    print(
        f"ucp_zarr {ucp_zarr.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {loadavg()}\n"
        f"state: {len(spec)} Shard(0) DTensors (bf16 params + fp32 exp_avg/exp_avg_sq; uneven dim 0: "
        f"{', '.join(f'{k} {list(s)}' for k, s, _, _ in spec if k in uneven)}) + step + lr, "
        f"{nbytes / MiB:.0f} MiB; save on {SAVE_WORLD} processes, load on {LOAD_WORLD}; dir {root}",
        flush=True,
    )
    t_start = time.perf_counter()
    runs: dict[str, list[list[dict]]] = {}  # "save:<m>", "save2:<m>", "load:<m>" -> repeat -> per-rank record
    own: dict[str, list[int]] = {}
    disk: dict[str, int] = {}
    warm: dict[str, int] = {}
    loadavgs = [loadavg()]
    try:
        for rep in range(args.repeat):
            order = list(METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)])
            load_order = list(LOAD_ORDER[rep % 3 :] + LOAD_ORDER[: rep % 3])
            work = os.path.join(root, f"rep{rep}")
            os.makedirs(work)
            profile = args.profile and rep == args.repeat - 1
            out = os.path.join(work, "save.json")
            run(SAVE_WORLD, save_job, spec, work, order, out, profile)
            with open(out) as f:
                got = json.load(f)
            own["save"] = [g["own"] for g in got]
            runs.setdefault("save:raw", []).append([g["raw"] for g in got])
            for m in METHODS:
                runs.setdefault(f"save:{m}", []).append([g[m] for g in got])
                runs.setdefault(f"save2:{m}", []).append([g[m + ".2"] for g in got])
                disk[m] = disk_bytes(os.path.join(work, m))
            evict(*(os.path.join(work, m) for m in METHODS))
            out = os.path.join(work, "load.json")
            run(LOAD_WORLD, load_job, spec, work, load_order, out, rep == 0, profile)
            with open(out) as f:
                got = json.load(f)
            own["load"] = [g["own"] for g in got]
            runs.setdefault("load:raw", []).append([g["raw"] for g in got])
            for m in LOAD_METHODS:
                runs.setdefault(f"load:{m}", []).append([g[m] for g in got])
                if got[0]["warm"].get(m) is not None:
                    warm[m] = max(warm.get(m, 0), got[0]["warm"][m])
                if rep == 0:
                    bad = sorted({k for g in got for k in g[m]["bad"]})
                    if bad:
                        raise SystemExit(f"{m}: loaded state differs from the expected values: {bad[:5]}")
            loadavgs.append(loadavg())
            line = []
            for m in order:
                s1, s2 = (max(r["wall"] for r in runs[f"{op}:{m}"][-1]) for op in ("save", "save2"))
                load = runs.get(f"load:{m}")
                tail = f", load {nbytes / GiB / max(r['wall'] for r in load[-1]):.2f}" if load else ""
                line.append(f"{m} save {nbytes / GiB / s1:.2f} / {nbytes / GiB / s2:.2f}{tail}")
            raw = max(r["wall"] for r in runs["save:raw"][-1])
            print(
                f"  repeat {rep + 1}/{args.repeat} (GiB/s): " + "; ".join(line) + f"; raw write {nbytes / GiB / raw:.2f}"
                f"  (load average {loadavgs[-1]})",
                flush=True,
            )
            if profile:
                for op in ("save", "load"):
                    prof = os.path.join(work, f"{op}.prof.txt")
                    if os.path.exists(prof):
                        with open(prof) as f:
                            print(f"\ncProfile of one ucp_zarr {op} on rank 0 (pools inline):\n" + f.read())
            shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, nbytes, runs, own, disk, warm, loadavgs, time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "runs": runs, "own": own, "disk": disk, "warm": warm}, f)


def _wall(rep: list[dict]) -> float:
    return max(r["wall"] for r in rep)


def summarize(nbytes: int, runs: dict[str, list[list[dict]]], own: dict[str, list[int]]) -> dict[str, Any]:
    """GiB/s medians, the best DCP, and per-repeat ratios (median, min, max) of the targets."""

    def gibs(key: str) -> float:
        return nbytes / GiB / statistics.median(_wall(rep) for rep in runs[key])

    def ratios(ours: str, theirs: str) -> tuple[float, float, float]:
        rs = [_wall(b) / _wall(a) for a, b in zip(runs[ours], runs[theirs])]
        return statistics.median(rs), min(rs), max(rs)

    best = max(("dcp", "dcp_t4"), key=lambda m: gibs(f"save:{m}"))
    read = [[r["bytes_read"] / max(o, 1) for r, o in zip(rep, own["load"])] for rep in runs["load:ucp_zarr"]]
    return {
        "gibs": {k: gibs(k) for k in runs},
        "best_dcp": best,
        "save_vs_raw": ratios("save:ucp_zarr", "save:raw"),
        "save_vs_dcp": ratios("save:ucp_zarr", f"save:{best}"),
        "save2_vs_dcp": ratios("save2:ucp_zarr", f"save2:{best}"),
        "load_vs_dcp": ratios("load:ucp_zarr", "load:dcp"),
        "load_vs_raw": ratios("load:ucp_zarr", "load:raw"),
        "read_per_need": max(max(x) for x in read),
        "bytes_read": [max(r["bytes_read"] for r in rank) for rank in zip(*runs["load:ucp_zarr"])],
    }


def report(args, nbytes, runs, own, disk, warm, loadavgs, elapsed) -> None:
    def gibs(key: str) -> float:
        return nbytes / GiB / statistics.median(_wall(rep) for rep in runs[key])

    def span(key: str) -> str:
        walls = [_wall(rep) for rep in runs[key]]
        return f"{nbytes / GiB / max(walls):.2f}-{nbytes / GiB / min(walls):.2f}"

    def extra(key: str) -> list[int]:
        """Per rank: the largest extra RSS over the repeats."""
        return [max(rep[r]["extra"] for rep in runs[key]) for r in range(len(runs[key][0]))]

    def mib(xs: list[int]) -> str:
        return "/".join(f"{x / MiB:.0f}" for x in xs)

    if any(v > 0.01 * nbytes for v in warm.values()):
        print(f"WARNING: page cache not fully evicted before a load: { {k: v // MiB for k, v in warm.items()} } MiB")
    elif warm:
        print(f"Page cache right before the loads (fincore): at most {max(warm.values()) / MiB:.1f} MiB of each checkpoint.")
    print()
    print(
        f"{nbytes / MiB:.0f} MiB state ({nbytes / GiB:.2f} GiB, Shard(0) DTensors, bf16 + fp32); save on "
        f"{SAVE_WORLD} processes, reshard load on {LOAD_WORLD} (into preallocated DTensors, cold page cache), "
        f"gloo; median of {args.repeat} repeats (order rotating), time = max over ranks, loaded state checked bit "
        f"for bit. Load average {' -> '.join(loadavgs)} on {os.cpu_count()} CPUs; {elapsed:.0f} s in all."
    )
    print()
    print("| method | save GiB/s, 1st in process | save GiB/s, 2nd | reshard load GiB/s | extra RSS MiB per rank, save / load | on disk MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    labels = {"ucp_zarr": "ucp_zarr", "dcp": "DCP thread_count=1", "dcp_t4": "DCP thread_count=4"}
    for m in METHODS:
        load = f"{gibs(f'load:{m}'):.2f} ({span(f'load:{m}')})" if f"load:{m}" in runs else "(same files as t=1)"
        rss = mib(extra(f"save:{m}")) + (f" / {mib(extra(f'load:{m}'))}" if f"load:{m}" in runs else "")
        print(
            f"| {labels[m]} | {gibs(f'save:{m}'):.2f} ({span(f'save:{m}')}) | {gibs(f'save2:{m}'):.2f} ({span(f'save2:{m}')}) "
            f"| {load} | {rss} | {disk.get(m, 0) / MiB:.0f} |"
        )
    print(f"| raw write+fsync, {RAW_THREADS} threads per process, ucp_zarr's file sizes | {gibs('save:raw'):.2f} "
          f"({span('save:raw')}) | | {gibs('load:raw'):.2f} ({span('load:raw')}) | | |")
    s = summarize(nbytes, runs, own)
    ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
    fmt = lambda r: f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"  # noqa: E731
    print()
    print(f"(min-max over repeats in parentheses) Own shard per rank: save {mib(own['save'])} MiB, load {mib(own['load'])} MiB.")
    print(f"best DCP: {labels[s['best_dcp']]}")
    print(f"save vs raw {SAVE_WORLD}-process aggregate: {fmt(s['save_vs_raw'])} (target >= 0.9: {ok(s['save_vs_raw'][0] >= 0.9)})")
    print(f"save vs best DCP (1st in process): {fmt(s['save_vs_dcp'])} (target >= 1.0: {ok(s['save_vs_dcp'][0] >= 1.0)})")
    print(f"save vs best DCP (2nd in process): {fmt(s['save2_vs_dcp'])}")
    print(f"reshard load vs DCP: {fmt(s['load_vs_dcp'])} (target >= 1.0: {ok(s['load_vs_dcp'][0] >= 1.0)})")
    print(f"reshard load vs raw {LOAD_WORLD}-process aggregate read: {fmt(s['load_vs_raw'])} "
          f"(target >= 0.9: {ok(s['load_vs_raw'][0] >= 0.9)})")
    print(
        f"bytes read per rank / bytes its slice needs: <= {s['read_per_need']:.3f} (read {mib(s['bytes_read'])} MiB, "
        f"need {mib(own['load'])} MiB; target <= 1.1: {ok(s['read_per_need'] <= 1.1)})"
    )


if __name__ == "__main__":
    main()
