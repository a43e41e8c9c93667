"""Staging: the host copies a save writes from, in one buffer owned by that save.

A synchronous save of CPU tensors writes straight from their memory and stages nothing
but what lives off the CPU. An asynchronous save copies every box this rank writes or
sends, so that training may change its tensors as soon as the blocking stage returns.
The buffer belongs to one :class:`Staging` (one save); nothing is shared between saves.
"""

from __future__ import annotations

import torch

from .arrayio import as_storage
from .fragments import Fragment
from .layout import Box
from .planner import SavePlan

ALIGN = 64
"""Every staged box starts at a multiple of this many bytes (it can be viewed in its dtype)."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Host copies of the boxes this rank writes or sends: array key -> [(box, copy)]."""

    def __init__(self, plan: SavePlan, fragments: dict[str, Fragment], rank: int, copy: bool) -> None:
        self.plan = plan
        self.fragments = fragments
        self.boxes: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        self.nbytes = 0
        todo = [(akey, box) for akey, box in self._wanted(rank) if copy or self._fragment(akey).device.type != "cpu"]
        if not todo:
            return
        pin = torch.cuda.is_available() and any(self._fragment(a).device.type == "cuda" for a, _ in todo)
        sizes = [aligned(box.numel * self._fragment(akey).dtype.itemsize) for akey, box in todo]
        self.nbytes = sum(sizes)
        buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        pos = 0
        for (akey, box), size in zip(todo, sizes):
            meta = plan.arrays[akey][1]
            frag = self._fragment(akey)
            dst = buf[pos : pos + box.numel * frag.dtype.itemsize].view(meta.dtype.storage_torch_dtype).view(box.shape)
            pbox, t = frag.holding(box)
            dst.copy_(as_storage(t, meta)[box.relative_to(pbox).slices()], non_blocking=pin)
            self.boxes.setdefault(akey, []).append((box, dst))
            pos += size
        if pin:
            torch.cuda.synchronize()

    def _fragment(self, akey: str) -> Fragment:
        return self.fragments[self.plan.arrays[akey][1].key]

    def _wanted(self, rank: int) -> list[tuple[str, Box]]:
        """The boxes this rank writes whole or sends to another writer."""
        wanted: list[tuple[str, Box]] = []
        for task in self.plan.shards:
            if task.writer == rank and not task.sources:
                wanted.append((task.key, self.plan.arrays[task.key][1].grid.shard_box(task.shard)))
            wanted += [(task.key, box) for src, box in task.sources if src == rank]
        return wanted

    def holding(self, akey: str, box: Box) -> tuple[torch.Tensor, Box]:
        """A tensor holding ``box`` of array ``akey`` whole (in the storage dtype), and the
        box it holds: a staged copy if there is one, else the fragment's own memory."""
        for sbox, t in self.boxes.get(akey, ()):
            if sbox.contains(box):
                return t, sbox
        meta = self.plan.arrays[akey][1]
        pbox, t = self._fragment(akey).holding(box)
        return as_storage(t, meta), pbox

    def release(self, akey: str, box: Box) -> None:
        """Called once ``box`` (a shard) of array ``akey`` is written: nothing to free here
        (the staging buffer lives as long as the save)."""

    def data(self, akey: str, box: Box) -> torch.Tensor:
        """This rank's data of ``box`` of array ``akey``, in the storage dtype (a view)."""
        t, held = self.holding(akey, box)
        return t[box.relative_to(held).slices()]
