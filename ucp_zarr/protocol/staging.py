"""Staging: the host copies a save writes from, owned by that save.

* An asynchronous save copies every box this rank writes or sends into one host buffer
  during its blocking stage, so that training may change its tensors as soon as it returns.
* A synchronous save writes CPU tensors straight from their memory. Tensors on a device
  (GPU) are copied to the host shard by shard, as each is written, through a
  :class:`HostPool` of bounded size (pinned memory when CUDA is available); only the pieces
  sent to other ranks' shards (small) are copied up front.

Nothing is shared between saves: each :class:`Staging` owns its buffer and its pool.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..io.arrayio import as_storage
from ..io.writer_process import SharedMemory
from .fragments import Fragment
from ..layout import Box
from .planner import SavePlan

ALIGN = 64
"""Every staged box starts at a multiple of this many bytes (it can be viewed in its dtype)."""
POOL_BYTES = 256 << 20
"""The host memory a synchronous save of device tensors stages at once (or one shard, if larger)."""
PARALLEL_FILL_BYTES = 16 << 20
"""An asynchronous save's host copy is made by all its workers from this size on (when torch
copies on one thread: see :func:`fill_workers`)."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostPool:
    """Host buffers of at most ``capacity`` bytes in use at once: :meth:`take` waits until
    enough is given back. Pinned when ``pin`` (torch's caching host allocator reuses them)."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.pin = pin
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.capacity:
            raise ValueError(f"a buffer of {nbytes} bytes exceeds the pool's {self.capacity}")
        with self._cond:
            self._cond.wait_for(lambda: self.in_use + nbytes <= self.capacity)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self.in_use -= buf.numel()
            self._cond.notify_all()


class Staging:
    """Host copies of the boxes this rank writes or sends: array key -> [(box, copy)]."""

    def __init__(
        self, plan: SavePlan, fragments: dict[str, Fragment], rank: int, copy: bool, pool_bytes: int | None = None,
        workers: int = 1, shared: bool = False,
    ) -> None:
        self.plan = plan
        self.fragments = fragments
        self.copy = copy
        self.boxes: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self.leased: dict[tuple[str, Box], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.memory: SharedMemory | None = None
        """The shared memory of the copies (with ``shared``, where they need no pinning):
        a writer process reads them there."""
        written, sent = self._wanted(rank)
        self.pool: HostPool | None = None
        lazy = [(a, b) for a, b in written if self._lazy(a)]
        if lazy:
            largest = max(b.numel * self._fragment(a).dtype.itemsize for a, b in lazy)
            self.pool = HostPool(max(pool_bytes or POOL_BYTES, largest), _pin([self._fragment(a) for a, _ in lazy]))
        todo = [(a, b) for a, b in written + sent if copy or (self._fragment(a).device.type != "cpu" and (a, b) not in lazy)]
        if not todo:
            return
        pin = _pin([self._fragment(a) for a, _ in todo])
        sizes = [aligned(box.numel * self._fragment(akey).dtype.itemsize) for akey, box in todo]
        self.nbytes = sum(sizes)
        if shared and not pin:
            self.memory = SharedMemory(self.nbytes)
            buf = torch.frombuffer(self.memory.map, dtype=torch.uint8)[: self.nbytes]
        else:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        pos = 0
        fills: list[tuple[torch.Tensor, str, Box]] = []
        for (akey, box), size in zip(todo, sizes):
            dst = self._view(buf[pos : pos + box.numel * self._fragment(akey).dtype.itemsize], akey, box)
            fills.append((dst, akey, box))
            self.boxes.setdefault(akey, []).append((box, dst))
            pos += size
        workers = fill_workers(workers)
        if pin or workers <= 1 or self.nbytes < PARALLEL_FILL_BYTES:
            for dst, akey, box in fills:
                self._fill(dst, akey, box, pin)
        else:  # host copies (and the first touch of the fresh buffer) on every worker: copy_ frees the GIL
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda f: self._fill(*f, False), _balanced(fills, workers)))
        if pin:  # every device the copies came from (the caller's current device may be another)
            for device in {self._fragment(akey).device for akey, _ in todo if self._fragment(akey).device.type == "cuda"}:
                torch.cuda.synchronize(device)

    def _lazy(self, akey: str) -> bool:
        """Whether shards of ``akey`` are staged one by one as they are written."""
        return not self.copy and self._fragment(akey).device.type != "cpu"

    def _fragment(self, akey: str) -> Fragment:
        return self.fragments[self.plan.arrays[akey][1].key]

    def _view(self, raw: torch.Tensor, akey: str, box: Box) -> torch.Tensor:
        return raw.view(self.plan.arrays[akey][1].dtype.storage_torch_dtype).view(box.shape)

    def _fill(self, dst: torch.Tensor, akey: str, box: Box, non_blocking: bool) -> None:
        pbox, t = self._fragment(akey).holding(box)
        dst.copy_(as_storage(t, self.plan.arrays[akey][1])[box.relative_to(pbox).slices()], non_blocking=non_blocking)

    def _wanted(self, rank: int) -> tuple[list[tuple[str, Box]], list[tuple[str, Box]]]:
        """The shards this rank writes whole, and the boxes it writes into or sends to a
        shard assembled from pieces."""
        written: list[tuple[str, Box]] = []
        pieces: list[tuple[str, Box]] = []
        for task in self.plan.shards:
            if task.writer == rank and not task.sources:
                written.append((task.key, self.plan.arrays[task.key][1].grid.shard_box(task.shard)))
            pieces += [(task.key, box) for src, box in task.sources if src == rank]
        return written, pieces

    def holding(self, akey: str, box: Box) -> tuple[torch.Tensor, Box]:
        """A tensor holding ``box`` of array ``akey`` whole (in the storage dtype), and the
        box it holds: a staged copy if there is one, a copy leased from the pool for a
        device tensor (give it back with :meth:`release`), else the fragment's own memory."""
        for sbox, t in self.boxes.get(akey, ()):
            if sbox.contains(box):
                return t, sbox
        if self.pool is not None and self._lazy(akey):
            raw = self.pool.take(box.numel * self._fragment(akey).dtype.itemsize)
            dst = self._view(raw, akey, box)
            self._fill(dst, akey, box, self.pool.pin)
            if self.pool.pin:  # the stream of the tensor's device (a writer thread's current device is cuda:0)
                torch.cuda.current_stream(self._fragment(akey).device).synchronize()
            with self._lock:
                self.leased[(akey, box)] = raw
            return dst, box
        meta = self.plan.arrays[akey][1]
        pbox, t = self._fragment(akey).holding(box)
        return as_storage(t, meta), pbox

    def release(self, akey: str, box: Box) -> None:
        """``box`` of array ``akey`` is written: give its leased copy back to the pool."""
        with self._lock:
            raw = self.leased.pop((akey, box), None)
        if raw is not None and self.pool is not None:
            self.pool.give(raw)

    def data(self, akey: str, box: Box) -> torch.Tensor:
        """This rank's data of ``box`` of array ``akey``, in the storage dtype (a view)."""
        t, held = self.holding(akey, box)
        return t[box.relative_to(held).slices()]


def fill_workers(workers: int) -> int:
    """Threads an asynchronous save's host copy is made by: one when torch copies with
    several intra-op threads (each ``copy_`` is parallel already, as ``clone()`` is), else
    ``workers``."""
    return 1 if torch.get_num_threads() > 1 else workers


def _balanced(fills: list[tuple[torch.Tensor, str, Box]], workers: int) -> list[tuple[torch.Tensor, str, Box]]:
    """The copies to make, largest first, a large one cut along dim 0 into about
    ``workers`` parts, so that the workers finish together."""
    total = sum(d.nbytes for d, _, _ in fills)
    out: list[tuple[torch.Tensor, str, Box]] = []
    for dst, akey, box in fills:
        parts = min(workers, box.shape[0] if box.ndim else 1, max(1, dst.nbytes * workers // max(total, 1)))
        rows = -(-box.shape[0] // parts) if parts > 1 else 0
        if parts <= 1:
            out.append((dst, akey, box))
            continue
        for r in range(0, box.shape[0], rows):
            n = min(rows, box.shape[0] - r)
            out.append((dst[r : r + n], akey, Box((box.offset[0] + r,) + box.offset[1:], (n,) + box.shape[1:])))
    return sorted(out, key=lambda f: -f[0].nbytes)


def _pin(fragments: list[Fragment]) -> bool:
    return torch.cuda.is_available() and any(f.device.type == "cuda" for f in fragments)
