"""Filling a load's targets: each target tensor read from its stored tensor, tensors that share
memory (tied weights, views) read once and checked equal."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .reader import CheckpointReader
from ..errors import CheckpointError, LayoutError
from ..io.store import Store, wait_all
from .fragments import Fragment, flat_bytes
from .ties import memory_of


LOAD_WORKERS = 4
"""Threads a load reads with, where the store declares no request concurrency of its own."""


def read_workers(store: Store, max_workers: int | None = None) -> int:
    """Threads a load reads ``store`` with: ``max_workers``, else the store's request
    concurrency (:attr:`~..io.store.Store.request_concurrency`), else :data:`LOAD_WORKERS`."""
    return max_workers or store.request_concurrency or LOAD_WORKERS


@dataclass
class _Read:
    """One target tensor to fill: ``frag`` (on this rank) from the stored tensor ``key``."""

    key: str
    leaf: str
    """The target's own key (differs from ``key`` for a placed tensor)."""
    frag: Fragment
    per_rank: bool


# --- filling the targets ---------------------------------------------------------------------


def fill(ck: CheckpointReader, reads: list[_Read], rank: int, lossy: bool, max_workers: int | None) -> None:
    """Fill every target of ``reads``, :func:`read_workers` at a time; targets that share memory
    one after the other, then checked (see :func:`_fill_shared`). Each read is prepared
    here, in the calling thread (checks, views, padding zeroed), so that the pool runs
    only the reading (see :meth:`CheckpointReader.prepare_read`)."""
    shared = shared_memory(reads)
    alone = [r for i, r in enumerate(reads) if not any(i in group for group in shared)]
    jobs = [job for r in alone for job in _prepare(ck, r, rank, lossy)]
    jobs += [lambda g=group: _fill_shared(ck, [reads[i] for i in g], rank, lossy) for group in shared]
    with ThreadPoolExecutor(read_workers(ck.store, max_workers)) as pool:
        try:
            run_all(pool, jobs)
        except CheckpointError as e:  # (a corrupt chunk is found where it is read: into its target)
            say_partly_filled(e)
            raise


PARTLY_FILLED = (" (the load had filled part of the state dict before: its tensors now hold neither their values "
                 "from before nor the checkpoint's; do not train on them)")


def say_partly_filled(e: CheckpointError) -> None:
    """Add :data:`PARTLY_FILLED` to the message of ``e``, raised while targets were filled."""
    if e.parts:
        e.parts = (*e.parts, PARTLY_FILLED)
    e.args = (f"{e.args[0] if e.args else ''}{PARTLY_FILLED}", *e.args[1:])


def run_all(pool: ThreadPoolExecutor, jobs: list[Callable[[], None]]) -> None:
    """Run every job on ``pool``, the caller asleep until all are done: not woken per job as
    by ``pool.map``, which costs a GIL hand-off each (~2 ms of a cold 16 MiB load of 96
    tensors, 5%). A failure is raised as :func:`~..io.store.wait_all` raises it."""
    wait_all([pool.submit(job) for job in jobs])


def _rank(r: _Read, rank: int) -> int | None:
    """The copy of per-rank state ``r`` reads: this rank's."""
    return rank if r.per_rank else None


def _prepare(ck: CheckpointReader, r: _Read, rank: int, lossy: bool) -> list[Callable[[], None]]:
    """The reads that fill ``r``'s pieces, prepared (see :meth:`CheckpointReader.prepare_read`);
    its padding zeroed."""
    with torch.no_grad():
        jobs = [
            ck.prepare_read(r.key, box, view, _rank(r, rank), allow_lossy_cast=lossy)[1] for box, view in r.frag.pieces
        ]
        for pad in r.frag.pad:  # padding (of a padded vocabulary) has no saved counterpart
            pad.zero_()
    return jobs


def _read_fragment(ck: CheckpointReader, r: _Read, rank: int, lossy: bool) -> None:
    for job in _prepare(ck, r, rank, lossy):
        job()


def _fill_shared(ck: CheckpointReader, reads: list[_Read], rank: int, lossy: bool) -> None:
    """Fill targets that share memory in turn (the same tensor under several keys, such as
    tied weights, once); then every one but the last (whose values were written last) must
    still show what the checkpoint holds for its key."""
    reads = _once(reads)
    for r in reads:
        _read_fragment(ck, r, rank, lossy)
    for r in reads[:-1]:
        for box, view in r.frag.pieces:
            want = ck.read(r.key, box, rank=_rank(r, rank)).to(view.dtype)
            if not same_bits(view, want):
                others = ", ".join(repr(o.leaf) for o in reads if o is not r)
                raise LayoutError(
                    f"tensor {r.leaf!r} shares memory with {others}, and the checkpoint holds other values for "
                    f"them: one cannot show both; pass tensors that do not share memory (or load them separately)"
                )


def _once(reads: list[_Read]) -> list[_Read]:
    """``reads`` without those filling exactly what an earlier one fills: the same stored
    tensor into the same views of the same memory."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for r in reads:
        views = tuple((box.offset, box.shape, memory_of(view)) for box, view in r.frag.pieces)
        if any(m is None for *_, m in views) or (r.key, r.per_rank, views) not in seen:
            out.append(r)
        seen.add((r.key, r.per_rank, views))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` show the same values, bit for bit (NaN payloads, signed zeros)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(*(flat_bytes(t.detach().resolve_conj().resolve_neg().cpu()) for t in (a, b)))


def shared_memory(reads: list[_Read]) -> list[list[int]]:
    """Groups of ``reads`` (by index, in order) whose targets may share memory: their byte
    spans overlap in one storage (a superset of sharing for strided views, so that a group
    may only cost a check)."""
    spans: list[tuple[tuple[str, int], int, int, int]] = []
    for i, r in enumerate(reads):
        for _, view in r.frag.pieces:
            span = _byte_span(view)
            if span is not None:
                spans.append((span[0], span[1], span[2], i))
    spans.sort()
    groups: list[set[int]] = []
    current: set[int] = set()
    where, end = None, -1
    for storage, start, stop, i in spans:
        if storage != where or start >= end:
            if len(current) > 1:
                groups.append(current)
            current, where, end = set(), storage, stop
        current.add(i)
        end = max(end, stop)
    if len(current) > 1:
        groups.append(current)
    return [sorted(g) for g in _merge_groups(groups)]


def _merge_groups(groups: list[set[int]]) -> list[set[int]]:
    """Unite groups that share a member (a read whose pieces lie in several storages)."""
    out: list[set[int]] = []
    for g in groups:
        touching = [o for o in out if o & g]
        for o in touching:
            out.remove(o)
            g = g | o
        out.append(g)
    return out


def _byte_span(t: torch.Tensor) -> tuple[tuple[str, int], int, int] | None:
    """``(storage, first byte, end byte)`` of the memory a view may touch; None when empty."""
    if not t.numel():
        return None
    try:
        storage = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without plain storage
        return None
    start = t.storage_offset() * t.element_size()
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    return (str(t.device), storage), start, start + extent * t.element_size()
