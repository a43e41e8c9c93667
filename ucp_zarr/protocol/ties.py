"""Tied tensors: one tensor under several keys, stored once.

A model whose modules share a parameter (a language model's output layer and its
embedding) gives it under each name in ``model.state_dict()``: two keys, one memory. A save
stores such a tensor once, under its first key (the *canonical* one), and records every
other key as an *alias* of it in the commit record (``ties``, ``schema/FORMAT.md``), so
that reading or loading any name reads the one array.

:func:`find_ties` finds them in what one rank holds: two keys are tied when their values
show the same memory as the same tensor (each piece of the same global box is the same
view: storage, offset, shape, strides, dtype, conjugate and negative bits), or are the same
object. Views of one storage that differ in any of these (a row, a transposed view, another
dtype) are different tensors and stay separate. A DTensor, ``Shard`` or ``FlatShard`` is
compared by what this rank holds of it, so a rank holding nothing of a tensor cannot tell
whether it is tied; :func:`agree_ties` takes each rank's ties on the coordinator and refuses
ranks that disagree on a tensor they hold part of.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..errors import LayoutError
from .fragments import Fragment
from .planner import FragmentInfo


def find_ties(held: Iterable[tuple[str, Any, Fragment]]) -> dict[str, str]:
    """Alias -> canonical key among ``(key, value, fragment)`` in state-dict order: a key
    whose value is the same object as, or shows the same memory as the same tensor as, an
    earlier key's is an alias of the first such key. Scalars (0-d) are no ties: a group's
    optimizer step, shared by its parameters, stays under each of their names."""
    first_by_object: dict[int, str] = {}
    first_by_memory: dict[tuple[Any, ...], str] = {}
    ties: dict[str, str] = {}
    for key, value, frag in held:
        if not frag.shape:
            continue
        canonical = first_by_object.setdefault(id(value), key)
        signature = _signature(frag)
        if signature is not None:
            canonical = first_by_memory.setdefault(signature, canonical)
        if canonical != key:
            ties[key] = canonical
    return ties


def _signature(frag: Fragment) -> tuple[Any, ...] | None:
    """What makes two fragments one tensor: the same global geometry and, for every piece,
    the same view of the same memory (None when the rank holds nothing of it)."""
    if not frag.pieces:
        return None
    views = []
    for box, t in frag.pieces:
        memory = memory_of(t)
        if memory is None:
            return None
        views.append((box.offset, box.shape, memory))
    return (frag.shape, frag.dtype, frag.flat, frag.plain, tuple(views))


def memory_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The memory a view shows, exactly (None for a tensor without storage of its own)."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (a subclass without plain storage)
        return None
    return (str(t.device), storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.is_conj(),
            t.is_neg())


def agree_ties(per_rank: list[tuple[dict[str, str], list[FragmentInfo]]]) -> dict[str, str]:
    """The ties of a save from each rank's ``(ties, fragment infos)``: the union, after
    checking that no two ranks tie a key to different keys and that every rank holding
    elements of an alias found the tie (a rank holding nothing of it cannot tell)."""
    ties: dict[str, str] = {}
    for rank, (found, _) in enumerate(per_rank):
        for alias, canonical in found.items():
            if ties.setdefault(alias, canonical) != canonical:
                raise LayoutError(f"tensor {alias!r} shares memory with {ties[alias]!r} on one rank and with "
                                  f"{canonical!r} on rank {rank}")
    chained = sorted(set(ties) & set(ties.values()))
    if chained:
        raise LayoutError(f"tensors {chained[:5]} are tied to a tensor on one rank and hold a tied tensor on another")
    for rank, (found, infos) in enumerate(per_rank):
        for info in infos:
            if info.key in ties and info.key not in found and any(b.numel for b in info.boxes):
                raise LayoutError(
                    f"tensors {info.key!r} and {ties[info.key]!r} share memory (tied weights) on some ranks but not on "
                    f"rank {rank}: give them the same tensor on every rank, or separate tensors (clone one)"
                )
    return ties


def check_ties(ties: Mapping[str, str], tensors: Iterable[str], values: Iterable[str]) -> None:
    """Refuse ties that do not name a tensor, or whose alias is a key of its own."""
    tensors, taken = set(tensors), set(tensors) | set(values)
    bad = [(a, c) for a, c in ties.items() if c not in tensors or a in taken]
    if bad:
        raise LayoutError(f"ties {bad[:5]}: each alias must be a key of no tensor or value, and tie to a tensor")
