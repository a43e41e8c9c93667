"""Loading a checkpoint into a state dict: what :func:`ucp_zarr.load` checks, plans and reads.

A load is planned whole before anything is read: every key is matched, every target
checked (dtype, shape, rules, and that its memory can hold the saved values), so that a
refused load changes nothing. Then each target is filled in place. Targets that share
memory (tied weights, a tensor given under two keys, overlapping views) are filled one
after the other and checked afterwards: each must show exactly what the checkpoint holds
for its key, or the load raises naming both keys.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, MutableMapping, NamedTuple

import torch

from .checkpoint import Checkpoint, check_destination, open_store_checkpoint
from .distributed import Comm
from .dtypes import is_lossless_cast, stored_dtype_by_name
from .errors import DtypeMismatchError, KeyMismatchError, LayoutError, PerRankStateError, ShapeMismatchError
from .fragments import Fragment, PerRank, Placed, is_fragment_value, to_fragment
from .rules import same_meaning
from .statedict import from_json, iter_leaves, set_leaf
from .storage import open_store

LOAD_WORKERS = 4
"""Threads a load reads with."""


@dataclass
class _Read:
    """One target tensor to fill: ``frag`` (on this rank) from the stored tensor ``key``."""

    key: str
    leaf: str
    """The target's own key (differs from ``key`` for a placed tensor)."""
    frag: Fragment
    per_rank: bool


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_new_ranks: bool = False,
    allow_lossy_cast: bool = False,
    allow_other_rules: bool = False,
    hmac_key: bytes | None = None,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    max_workers: int = LOAD_WORKERS,
    return_incompatible_keys: bool = False,
) -> MutableMapping[str, Any] | tuple[MutableMapping[str, Any], IncompatibleKeys]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it (with
    ``return_incompatible_keys``: ``(state_dict, IncompatibleKeys(missing_keys,
    unexpected_keys))``).

    Every rank reads only the chunks that overlap what its own tensors hold (DTensor,
    :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard` or whole tensors), whatever the
    saving layout was. Tensors keep their dtype and device (a lossy conversion, such as
    ``float32`` into ``bfloat16``, needs ``allow_lossy_cast``); other values are replaced.
    Per-rank state (:class:`~ucp_zarr.PerRank`) is restored from the copy of the saving
    rank of the same number.

    Each tensor is filled in place, whatever view it is (strided or transposed, a
    conjugate or negative view, on another device, an inference tensor, a parameter that
    requires grad), and then shows exactly the saved values; a target no load can fill (on
    the meta device, an expanded or otherwise self-overlapping view) raises
    :class:`~ucp_zarr.LayoutError` naming its key. Targets that share memory (tied
    weights) are filled and then checked: when the checkpoint holds different values for
    them, :class:`~ucp_zarr.LayoutError` names both keys.

    With ``strict``: keys missing from the checkpoint or unexpected in it raise one
    :class:`~ucp_zarr.KeyMismatchError` listing them all, and a rank that did not exist at
    save time raises :class:`~ucp_zarr.PerRankStateError` for per-rank state it cannot
    restore, unless ``allow_new_ranks`` (then it keeps its current values, as it always
    does without ``strict``). Everything is checked before anything is read.
    ``hmac_key`` refuses a checkpoint that is unsigned or was changed after signing.

    Without ``strict``, whatever the two sides share is loaded and the rest is reported,
    as :meth:`torch.nn.Module.load_state_dict` reports it: ``missing_keys``, the keys of
    ``state_dict`` left as they were (the checkpoint holds nothing for them, on this rank);
    ``unexpected_keys``, the checkpoint's keys that were not loaded. When either is not
    empty an :class:`IncompatibleKeysWarning` (a ``UserWarning`` carrying both lists) names
    them, unless ``return_incompatible_keys`` hands them to the caller instead. On several
    ranks, each rank reports its own.

    A state dict placed by rules (:func:`ucp_zarr.place`) is filled in place from the
    consolidated tensors, whatever layout saved them; padding rows get zeros. Loading with
    rules that give a tensor another consolidated form (other fused sub-parameter sizes,
    another vocabulary size) raises :class:`~ucp_zarr.LayoutError` unless
    ``allow_other_rules``. With ``strict``, a placed load on several ranks checks the keys
    against the union of every rank's (a collective: every rank of ``process_group`` calls
    ``load``).
    """
    comm = Comm(process_group)
    rank = comm.rank
    ck = open_store_checkpoint(open_store(path, storage_options), hmac_key)
    leaves = {leaf.key: leaf for leaf in iter_leaves(state_dict)}
    # a tensor placed by rules is read from its consolidated key
    stored_key = {k: leaf.value.key if isinstance(leaf.value, Placed) else k for k, leaf in leaves.items()}
    meta = ck.meta
    saved_values = set(meta.values) | set(meta.rank_values)
    saved = list(meta.tensors) + list(meta.values) + list(meta.rank_values)
    missing = [k for k, s in stored_key.items() if s not in meta.tensors and s not in saved_values]
    held = set(stored_key.values())
    if strict and comm.active and any(isinstance(leaf.value, Placed) for leaf in leaves.values()):
        # placed state dicts hold different keys on different ranks (pipeline stages, experts)
        held = set().union(*comm.all_gather(held))
    unexpected = [k for k in saved if k not in held]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)

    reads: list[_Read] = []
    unrestorable: list[str] = []
    for leaf_key, leaf in leaves.items():
        key = stored_key[leaf_key]
        value = leaf.value.value if isinstance(leaf.value, PerRank) else leaf.value
        if key in meta.tensors:
            entry = meta.tensors[key]
            if not is_fragment_value(value):
                raise DtypeMismatchError(f"key {key!r}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
            frag = to_fragment(key, value)
            if not allow_other_rules and not same_meaning(entry.rule, frag.meaning):
                raise LayoutError(
                    f"tensor {key!r} was saved as {entry.rule} and the rules loading it ({frag.rule!r}) make it "
                    f"{frag.meaning}: another consolidated form (pass allow_other_rules=True to load it anyway)"
                )
            if frag.shape != entry.shape:
                raise ShapeMismatchError(
                    f"tensor {key!r}: checkpoint shape {list(entry.shape)}, state dict shape {list(frag.shape)}"
                )
            saved_dtype = stored_dtype_by_name(entry.dtype).torch_dtype
            if not allow_lossy_cast and not is_lossless_cast(saved_dtype, frag.dtype):
                raise DtypeMismatchError(
                    f"tensor {key!r}: the checkpoint holds {saved_dtype}, the state dict {frag.dtype}; "
                    "converting loses information (pass allow_lossy_cast=True to convert anyway)"
                )
            for _, view in frag.pieces:
                check_destination(leaf_key, view)
            per_rank = entry.ranks is not None
            if per_rank and rank not in entry.ranks:
                unrestorable.append(key)
                continue
            reads.append(_Read(key, leaf_key, frag, per_rank))
        elif key in saved_values:
            if is_fragment_value(value):
                raise DtypeMismatchError(f"key {key!r}: the state dict holds a tensor, the checkpoint a JSON value")
            if key in meta.rank_values and rank not in meta.rank_values[key]:
                unrestorable.append(key)
    if strict and unrestorable and not allow_new_ranks:
        raise PerRankStateError(
            f"rank {rank} has no saved copy of the per-rank state {unrestorable} (the checkpoint was saved by "
            f"{meta.world_size} rank(s)), so it cannot be restored; pass allow_new_ranks=True to keep the current values"
        )

    fill(ck, reads, rank, allow_lossy_cast, max_workers)
    for key, leaf in leaves.items():
        if key in meta.values:
            value = from_json(meta.values[key], key)
        elif key in meta.rank_values and rank in meta.rank_values[key]:
            value = from_json(meta.rank_values[key][rank], key)
        else:
            continue
        set_leaf(state_dict, leaf.path, PerRank(value) if isinstance(leaf.value, PerRank) else value)
    skipped = IncompatibleKeys(missing + unrestorable, unexpected)
    if return_incompatible_keys:
        return state_dict, skipped
    if not strict and (skipped.missing_keys or skipped.unexpected_keys):
        warnings.warn(IncompatibleKeysWarning(skipped, ck.store.url), stacklevel=2)
    return state_dict


class IncompatibleKeys(NamedTuple):
    """What a non-strict :func:`load` did not load (the fields of
    :meth:`torch.nn.Module.load_state_dict`'s result)."""

    missing_keys: list[str]
    """Keys of the state dict left as they were: the checkpoint holds nothing for them."""
    unexpected_keys: list[str]
    """Keys of the checkpoint that were not loaded: the state dict has no place for them."""


class IncompatibleKeysWarning(UserWarning):
    """A non-strict :func:`load` left keys unloaded; ``missing_keys`` and
    ``unexpected_keys`` list them all (the message names the first few)."""

    SHOWN = 20

    def __init__(self, keys: IncompatibleKeys, url: str) -> None:
        self.missing_keys = keys.missing_keys
        self.unexpected_keys = keys.unexpected_keys
        parts = []
        if keys.missing_keys:
            parts.append(f"left {_names(keys.missing_keys, self.SHOWN)} of the state dict as they were (not in the checkpoint)")
        if keys.unexpected_keys:
            parts.append(f"did not load {_names(keys.unexpected_keys, self.SHOWN)} of the checkpoint (not in the state dict)")
        super().__init__(f"ucp_zarr.load(strict=False) from {url} " + "; and ".join(parts))


def _names(keys: list[str], shown: int) -> str:
    listed = ", ".join(repr(k) for k in keys[:shown])
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} key(s): {listed}{more}"


# --- filling the targets ---------------------------------------------------------------------


def fill(ck: Checkpoint, reads: list[_Read], rank: int, lossy: bool, max_workers: int) -> None:
    """Fill every target of ``reads``, ``max_workers`` at a time; targets that share memory
    one after the other, then checked (see :func:`_fill_shared`)."""
    shared = shared_memory(reads)
    alone = [r for i, r in enumerate(reads) if not any(i in group for group in shared)]
    jobs: list[Any] = [lambda r=r: _read_fragment(ck, r, rank, lossy) for r in alone]
    jobs += [lambda g=group: _fill_shared(ck, [reads[i] for i in g], rank, lossy) for group in shared]
    with ThreadPoolExecutor(max_workers) as pool:
        list(pool.map(lambda job: job(), jobs))


def _read_fragment(ck: Checkpoint, r: _Read, rank: int, lossy: bool) -> None:
    with torch.no_grad():
        for box, view in r.frag.pieces:
            ck.read(r.key, box, out=view, rank=rank if r.per_rank else None, allow_lossy_cast=lossy)
        for pad in r.frag.pad:  # padding (of a padded vocabulary) has no saved counterpart
            pad.zero_()


def _fill_shared(ck: Checkpoint, reads: list[_Read], rank: int, lossy: bool) -> None:
    """Fill targets that share memory in turn; then every one but the last (whose values
    were written last) must still show what the checkpoint holds for its key."""
    for r in reads:
        _read_fragment(ck, r, rank, lossy)
    for r in reads[:-1]:
        for box, view in r.frag.pieces:
            want = ck.read(r.key, box, rank=rank if r.per_rank else None).to(view.dtype)
            if not same_bits(view, want):
                others = ", ".join(repr(o.leaf) for o in reads if o is not r)
                raise LayoutError(
                    f"tensor {r.leaf!r} shares memory with {others}, and the checkpoint holds other values for "
                    f"them: one cannot show both; pass tensors that do not share memory (or load them separately)"
                )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` show the same values, bit for bit (NaN payloads, signed zeros)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = (t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1) for t in (a, b))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


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
