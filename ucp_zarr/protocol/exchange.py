"""The boundary exchange: pieces of shards held by ranks other than the shard's writer.

Where fragments cut chunks (ZeRO's flat ranges cutting rows), the planner gives each such
shard one writer, and the other holders send it their pieces (each under one chunk). The
pieces for one peer travel as one byte buffer, each at a 64-byte aligned offset so that it
can be viewed in its dtype. Building the buffers is fallible per rank (it copies), so it
happens inside an agreed phase, in which every rank also checks that what it built to send
and expects to receive is exactly what its part of the plan implies, before any
point-to-point transfer starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .distributed import Comm
from .fragments import flat_bytes
from ..errors import LayoutError
from ..format.documents import ArrayMeta
from ..layout import Box
from .planner import SavePlan
from .staging import Staging, aligned

Ident = tuple[int, int]
"""(task number, source number) of a piece in the plan."""


@dataclass
class Exchange:
    """This rank's side of the exchange."""

    sends: dict[int, torch.Tensor] = field(default_factory=dict)
    """Destination rank -> the bytes of every piece this rank sends it."""
    expect: dict[int, list[tuple[Ident, Box, ArrayMeta]]] = field(default_factory=dict)
    """Source rank -> the pieces this rank receives from it, in order."""

    def send_sizes(self) -> dict[int, int]:
        return {dst: int(t.numel()) for dst, t in self.sends.items()}

    def recv_sizes(self) -> dict[int, int]:
        return {src: sum(aligned(b.numel * m.dtype.itemsize) for _, b, m in items) for src, items in self.expect.items()}

    def run(self, comm: Comm) -> dict[Ident, torch.Tensor]:
        """Transfer the pieces; return ``{(task, source): piece}`` of those received."""
        got = comm.exchange(self.sends, self.recv_sizes())
        out: dict[Ident, torch.Tensor] = {}
        for src, items in self.expect.items():
            pos = 0
            for ident, box, meta in items:
                nbytes = box.numel * meta.dtype.itemsize
                out[ident] = got[src][pos : pos + nbytes].view(meta.dtype.storage_torch_dtype).reshape(box.shape)
                pos += aligned(nbytes)
        return out


def planned_sizes(plan: SavePlan) -> dict[tuple[int, int], int]:
    """Bytes each rank sends each other rank, by ``(source, destination)``, as the plan (or
    a rank's part of it) implies."""
    sizes: dict[tuple[int, int], int] = {}
    for task in plan.shards:
        meta = plan.arrays[task.key][1]
        for src, box in task.sources:
            if src != task.writer:
                pair = (src, task.writer)
                sizes[pair] = sizes.get(pair, 0) + aligned(box.numel * meta.dtype.itemsize)
    return sizes


def check_sizes(plan: SavePlan, rank: int, exchange: "Exchange") -> None:
    """What this rank built to send and expects to receive must be exactly what its part of
    the plan implies, or the transfers would block or corrupt. (Every rank's part comes from
    one coordinator, so what a rank sends is what its peer expects.)"""
    planned = planned_sizes(plan)
    want_send = {dst: n for (src, dst), n in planned.items() if src == rank and n}
    want_recv = {src: n for (src, dst), n in planned.items() if dst == rank and n}
    got_send = {d: n for d, n in exchange.send_sizes().items() if n}
    got_recv = {s: n for s, n in exchange.recv_sizes().items() if n}
    if (got_send, got_recv) != (want_send, want_recv):
        raise LayoutError(
            f"boundary exchange mismatch on rank {rank}: built sends {got_send} and receives {got_recv}, "
            f"planned sends {want_send} and receives {want_recv}"
        )


def build_exchange(plan: SavePlan, rank: int, staging: Staging) -> Exchange:
    """The pieces this rank sends (copied into one buffer per destination) and receives."""
    parts: dict[int, list[torch.Tensor]] = {}
    ex = Exchange()
    for n, task in plan.numbered():
        meta = plan.arrays[task.key][1]
        for i, (src, box) in enumerate(task.sources):
            if src == task.writer:
                continue
            if src == rank:
                raw = flat_bytes(staging.data(task.key, box))
                pad = aligned(raw.numel()) - raw.numel()
                parts.setdefault(task.writer, []).extend([raw, torch.zeros(pad, dtype=torch.uint8)])
            elif task.writer == rank:
                ex.expect.setdefault(src, []).append(((n, i), box, meta))
    ex.sends = {dst: torch.cat(p) for dst, p in parts.items()}
    return ex
