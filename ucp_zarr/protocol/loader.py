"""Loading a checkpoint into a state dict: what :func:`ucp_zarr.load` checks, plans and reads.

A load is planned whole before anything is read: every key is matched, every target
checked (dtype, shape, rules, and that its memory can hold the saved values), so that a
refused load changes nothing. Then each target is filled in place. Targets that share
memory (tied weights, a tensor given under two keys, overlapping views) are filled one
after the other and checked afterwards: each must show exactly what the checkpoint holds
for its key, or the load raises naming both keys.
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, NamedTuple

import torch

from .reader import CheckpointReader, check_destination, open_store_reader
from .distributed import Comm
from ..format.dtypes import is_lossless_cast, stored_dtype_by_name
from ..errors import (
    DtypeMismatchError, KeyMismatchError, LayoutError, OptionError, PerRankStateError, ShapeMismatchError,
)
from .fragments import FlatShard, PerRank, Placed, Shard, is_dtensor, is_fragment_value, is_sharded_tensor, to_fragment
from ..format.statedict import ListIndex, Path, from_json, hashable, iter_leaves, key_of, put_path, typed_path
from ..io.factory import open_store
from .filling import _Read, fill

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
    max_workers: int | None = None,
    return_incompatible_keys: bool = False,
) -> MutableMapping[str, Any] | tuple[MutableMapping[str, Any], IncompatibleKeys]:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it (with
    ``return_incompatible_keys``: ``(state_dict, IncompatibleKeys(missing_keys,
    unexpected_keys))``).

    Every rank reads only the chunks that overlap what its own tensors hold (DTensor,
    :class:`~ucp_zarr.Shard`, :class:`~ucp_zarr.FlatShard` or whole tensors), whatever the
    saving layout was. Tensors keep their dtype and device (a lossy conversion, such as
    ``float32`` into ``bfloat16``, needs ``allow_lossy_cast``); other values are replaced (an
    ``io.BytesIO`` by a ``BytesIO`` of the saved bytes, as ``dcp.load`` does).
    Per-rank state (:class:`~ucp_zarr.PerRank`) is restored from the copy of the saving
    rank of the same number.

    Each tensor is filled in place, whatever view it is (strided or transposed, a
    conjugate or negative view, on another device, an inference tensor, a parameter that
    requires grad), and then shows exactly the saved values; a target no load can fill (on
    the meta device, an expanded or otherwise self-overlapping view) raises
    :class:`~ucp_zarr.LayoutError` naming its key. Targets that share memory (tied
    weights) are filled and then checked: when the checkpoint holds different values for
    them, :class:`~ucp_zarr.LayoutError` names both keys.

    Entries the state dict lacks are made and filled where the state dict shows their
    place: the state of a fresh optimizer (``opt.state_dict()`` before any step holds
    ``"state": {}``), and any entry below a parameter's state or an empty mapping. They
    are keyed as the state dict keys its parameters (by number, or by name: the checkpoint
    may key them the other way). Parameters are matched by name where both sides name
    every one (state keyed by name, as ``get_state_dict`` keys it, or param groups with
    ``param_names``) and some names are on both sides, whatever their order and whichever
    of them each side holds (an optimizer of some of the saved parameters gets theirs; the
    others are missing or unexpected keys); else by position in the param groups, as
    ``Optimizer.load_state_dict`` matches them. They get the checkpoint's shapes and dtypes,
    on the device and in the layout of their parameter (a DTensor, ``Shard`` or
    ``FlatShard`` like it; scalars such as Adam's ``step`` whole), so that
    ``opt.load_state_dict(state["optim"])`` resumes exactly. They are neither missing nor
    unexpected keys. In a load on several ranks, optimizer state whose parameter cannot be
    told (no ``param_names`` and no parameter beside it in the checkpoint) raises
    :class:`~ucp_zarr.LayoutError` naming the key, as its layout is unknown.

    With ``strict``: keys missing from the checkpoint or unexpected in it raise one
    :class:`~ucp_zarr.KeyMismatchError` listing them all, and a rank that did not exist at
    save time raises :class:`~ucp_zarr.PerRankStateError` for per-rank state it cannot
    restore, unless ``allow_new_ranks`` (then it keeps its current values, as it always
    does without ``strict``). Everything is checked before anything is read; a corrupt
    chunk is found where it is read, into its target, and its error says that the state
    dict was partly filled (do not train on it).
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
    another vocabulary size), or whose ``model`` records another model than the saved rules'
    (rotary frequencies, norm, activation), raises :class:`~ucp_zarr.LayoutError` unless
    ``allow_other_rules``. With ``strict``, a placed load on several ranks checks the keys
    against the union of every rank's.

    A load of a sharded state dict (DTensors, :class:`Shard`, :class:`FlatShard`,
    :class:`Placed`) is a collective: every rank of ``process_group`` calls it, and an error
    on one rank is raised on every rank (the failing rank's own error there, a
    :class:`~ucp_zarr.SaveError` naming it on the others), so that no rank goes on with its
    state filled while another's load failed. A load of whole tensors is each rank's own, as
    ``torch.load`` is (one rank may load alone).

    ``max_workers`` objects are read at once: by default ``LOAD_WORKERS`` (4), or the
    store's own request concurrency where it declares one (an object store: 16, as each
    request waits a round trip).
    """
    comm = Comm(process_group)
    what = f"load of {os.fspath(path)!r}"
    # a sharded load agrees twice, whatever fails where: an error on one rank is raised on every
    # rank, so that no rank goes on (into the next collective, or resumed while another starts
    # fresh); a load of whole tensors is one rank's own, as torch.load is
    agreeing = comm if _sharded(state_dict) else Comm(local=True)
    agreeing.start("load", what)
    error: Exception | None = None
    try:
        ck = open_store_reader(open_store(path, storage_options), hmac_key, shared=comm.world > 1)
        planner = _Planner(ck, state_dict, comm)
        matched = planner.match(strict)
    except Exception as e:
        error = e
    opened = agreeing.agree(error, what, (ck.store.url, ck.meta.save_id, matched.placements) if error is None else None,
                            own=True)
    _check_same_checkpoint(opened, what)
    placements = [p for _, _, p in opened]
    try:
        plan = planner.plan(matched, placements, strict, allow_new_ranks, allow_lossy_cast, allow_other_rules)
        fill(ck, plan.reads, comm.rank, allow_lossy_cast, max_workers)
    except Exception as e:
        error = e
    agreeing.agree(error, what, own=True)
    for where, value in plan.values:
        put_path(state_dict, where, value, "the state dict")
    skipped = IncompatibleKeys(plan.missing, plan.unexpected)
    if return_incompatible_keys:
        return state_dict, skipped
    if not strict and (skipped.missing_keys or skipped.unexpected_keys):
        warnings.warn(IncompatibleKeysWarning(skipped, ck.store.url), stacklevel=2)
    return state_dict


def _check_same_checkpoint(opened: list[tuple[str, str, Any]], what: str) -> None:
    """Refuse, on every rank, a collective load whose ranks opened different checkpoints
    (each rank's ``(url, save id, placements)``): each would fill its part from its own."""
    if len({save_id for _, save_id, _ in opened}) > 1:
        seen = "; ".join(f"rank {r}: {url} (save {save_id})" for r, (url, save_id, _) in enumerate(opened))
        raise OptionError(f"{what}: the ranks opened different checkpoints ({seen}); a load of a sharded state dict is "
                          "a collective: pass the same path on every rank")


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
            parts.append(f"left {_names(keys.missing_keys, self.SHOWN)} of the state dict as they were (not in the "
                         "checkpoint, or per-rank state no rank of this number saved)")
        if keys.unexpected_keys:
            parts.append(f"did not load {_names(keys.unexpected_keys, self.SHOWN)} of the checkpoint (not in the state dict)")
        super().__init__(f"ucp_zarr.load(strict=False) from {url} " + "; and ".join(parts))


def _names(keys: list[str], shown: int) -> str:
    listed = ", ".join(repr(k) for k in keys[:shown])
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} key(s): {listed}{more}"


# --- planning --------------------------------------------------------------------------------


@dataclass
class _Plan:
    reads: list[_Read]
    values: list[tuple[Path, Any]]
    """What to set in the state dict after the reads: JSON values, and the entries made for
    what it lacks (their tensors filled by ``reads``)."""
    missing: list[str]
    unexpected: list[str]


@dataclass
class _Matched:
    """What :meth:`_Planner.match` found on this rank."""

    kept: set[str]
    """Leaves whose values stay as they are (see :meth:`_Planner._match_optimizer_state`)."""
    absent: list[tuple[Path, str]]
    missing: list[str]
    held: set[str]
    placed: list[Placed]
    placements: tuple[set[str], frozenset[Any]] | None
    """(the keys held, the rule patterns used) for the other ranks, where strict and placed."""


def _sharded(state_dict: Any) -> bool:
    """Whether ``state_dict`` holds a rank's part of a tensor (a DTensor, :class:`Shard`,
    :class:`FlatShard` or :class:`Placed`): then every rank of the group loads (told by the
    values alone, so that every rank tells the same before anything can fail)."""
    stack, seen = [state_dict], set()
    while stack:
        node = stack.pop()
        if isinstance(node, (Shard, FlatShard, Placed)) or is_dtensor(node) or is_sharded_tensor(node):
            return True
        if isinstance(node, (Mapping, list, tuple)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, Mapping) else node)
    return False


@dataclass
class _Optimizer:
    """An optimizer state dict in the target (``{"state": ..., "param_groups": [...]}``)."""

    path: Path
    prefix: str
    """Its flattened key and a dot (empty at the root)."""
    groups: list[list[Any]]
    """The parameter ids of each param group, as the target keys its state."""
    names: dict[Any, str]
    """Parameter id -> its name, from the groups' ``param_names`` (empty without them)."""


class _Planner:
    """Matches a target state dict against a checkpoint (see :func:`load`)."""

    def __init__(self, ck: CheckpointReader, state_dict: MutableMapping[str, Any], comm: Comm) -> None:
        self.ck, self.meta, self.comm, self.target = ck, ck.meta, comm, state_dict
        empty: list[tuple[int, Path]] = []
        self.leaves = {leaf.key: leaf for leaf in iter_leaves(state_dict, empty)}
        self.empty = [typed_path(state_dict, p) for _, p in empty]
        # a tensor placed by rules is read from its consolidated key
        # (and an alias of tied tensors from its canonical key)
        self.stored_key: dict[str, str | None] = {
            k: ck.meta.canonical(leaf.value.key if isinstance(leaf.value, Placed) else k) for k, leaf in self.leaves.items()
        }
        self.saved = [*self.meta.tensors, *self.meta.values, *self.meta.rank_values]
        self.optimizers = _optimizers(state_dict)

    def match(self, strict: bool) -> _Matched:
        """The target's keys matched against the checkpoint, on this rank alone (no
        collective): what :meth:`plan` needs, and what this rank tells the others."""
        kept = self._match_optimizer_state()
        absent = self._absent_entries()
        missing = [k for k, s in self.stored_key.items() if not self._saved(s) and not self._names_of_group(k)]
        held = set(self.stored_key.values()) | {key for _, key in absent}
        placed = [leaf.value for leaf in self.leaves.values() if isinstance(leaf.value, Placed)]
        # placed state dicts hold different keys on different ranks (pipeline stages, experts);
        # only all ranks' placements together show a tensor placed twice or a pattern unused
        told = (held, frozenset().union(*(p.used for p in placed))) if strict and placed else None
        return _Matched(kept, absent, missing, held, placed, told)

    def plan(self, matched: _Matched, placements: list[Any], strict: bool, allow_new_ranks: bool, lossy: bool,
             other_rules: bool) -> _Plan:
        """The reads and values of this rank's load, from :meth:`match` and every rank's
        ``placements`` (its :attr:`_Matched.placements`, None from a rank without)."""
        meta, rank = self.meta, self.comm.rank
        kept, absent, missing, held, placed = matched.kept, matched.absent, matched.missing, matched.held, matched.placed
        gathered = [p for p in placements if p is not None]
        saved_rules = meta.layout.get("rules")
        if placed and not other_rules and placed[0].hooks is not None and placed[0].rules and saved_rules:
            other = placed[0].hooks.other_layout(saved_rules, placed[0].rules)
            if other is not None:
                raise LayoutError(f"checkpoint {self.ck.store.url}: {other}; pass allow_other_rules=True to load it anyway")
        if matched.placements is not None:
            held = set().union(*(h for h, _ in gathered))
            hooks = placed[0].hooks
            if hooks is not None and placed[0].rules is not None:
                hooks.check_placements(placed[0].rules, [u for _, u in gathered])
        unexpected = [k for k in self.saved if k not in held and not self._names_of_group(k)]
        if strict and (missing or unexpected):
            raise KeyMismatchError(missing, unexpected)

        reads: list[_Read] = []
        values: list[tuple[Path, Any]] = []
        unrestorable: list[str] = []
        for leaf_key, leaf in self.leaves.items():
            key = self.stored_key[leaf_key]
            wrapped = isinstance(leaf.value, PerRank)
            value = leaf.value.value if wrapped else leaf.value
            if key in meta.tensors:
                read = self._read(key, leaf_key, value, lossy, other_rules)
                if read is None:
                    unrestorable.append(key)
                else:
                    reads.append(read)
            elif self._saved(key):
                if is_fragment_value(value):
                    raise DtypeMismatchError(f"key {key!r}: the state dict holds a tensor, the checkpoint a JSON value")
                saved = self._value(key)
                if isinstance(value, io.BytesIO) and isinstance(saved, bytes):  # (as dcp.load fills it)
                    saved = io.BytesIO(saved)
                if saved is _NONE:
                    unrestorable.append(key)
                elif leaf_key not in kept:
                    values.append((typed_path(self.target, leaf.path), PerRank(saved) if wrapped else saved))
        if strict and unrestorable and not allow_new_ranks:
            raise PerRankStateError(
                f"rank {rank} has no saved copy of the per-rank state {unrestorable} (the checkpoint was saved by "
                f"{meta.world_size} rank(s)), so it cannot be restored; pass allow_new_ranks=True to keep the current values"
            )
        for where, key in absent:
            if key in meta.tensors:
                made = self._make(key, where)
                read = self._read(key, key_of(where), made, lossy, other_rules)
                assert read is not None  # (only restorable entries are made)
                reads.append(read)
            else:
                made = self._value(key)
            values.append((where, made))
        return _Plan(reads, values, missing + unrestorable, unexpected)

    # --- the checkpoint's side ---------------------------------------------------------------

    def _names_of_group(self, key: str) -> bool:
        """Whether ``key`` is the ``param_names`` of a param group of an optimizer of the
        target: one side may lack them (an optimizer built from ``model.parameters()``, state
        saved by ``get_state_dict``), as ``Optimizer.load_state_dict`` allows; neither missing
        nor unexpected (the target keeps its own, or has none)."""
        for opt in self.optimizers:
            head = f"{opt.prefix}param_groups."
            if key.startswith(head) and key.endswith(".param_names") and key[len(head) : -len(".param_names")].isdigit():
                return True
        return False

    def _saved(self, key: str) -> bool:
        return key in self.meta.tensors or key in self.meta.values or key in self.meta.rank_values

    def _restorable(self, key: str) -> bool:
        """Whether this rank can load ``key`` (per-rank state: whether its rank saved a copy)."""
        entry = self.meta.tensors.get(key)
        if entry is not None:
            return entry.ranks is None or self.comm.rank in entry.ranks
        return key in self.meta.values or self.comm.rank in self.meta.rank_values.get(key, {})

    def _value(self, key: str) -> Any:
        """The JSON value of ``key`` for this rank, or ``_NONE`` when its rank saved none."""
        if key in self.meta.values:
            return from_json(self.meta.values[key], key)
        per = self.meta.rank_values[key]
        return from_json(per[self.comm.rank], key) if self.comm.rank in per else _NONE

    def _saved_path(self, key: str) -> Path | None:
        structure = self.meta.structure
        return None if structure is None else structure.paths.get(key)

    def _read(self, key: str, leaf_key: str, value: Any, lossy: bool, other_rules: bool) -> _Read | None:
        """The read filling ``value`` from tensor ``key``, every check passed; None when this
        rank has no copy of per-rank state ``key``."""
        entry = self.meta.tensors[key]
        if not is_fragment_value(value):
            raise DtypeMismatchError(f"key {key!r}: the checkpoint holds a tensor, the state dict a {type(value).__name__}")
        frag = to_fragment(key, value)
        hooks = value.hooks if isinstance(value, Placed) else None
        rows = None if hooks is None else hooks.stored_padding(entry.rule, frag.meaning)
        if rows is not None and frag.shape == (rows, *entry.shape[1:]):
            if self.comm.rank == 0:
                warnings.warn(f"tensor {key!r}: the checkpoint stores {entry.shape[0]} rows, the rules loading it "
                              f"{rows}: rows {rows} to {entry.shape[0] - 1} are left out as padding", stacklevel=4)
        elif not other_rules and hooks is not None and not hooks.same_form(entry.rule, frag.meaning):
            raise LayoutError(
                f"tensor {key!r} was saved as {entry.rule} and the rules loading it ({frag.rule!r}) make it "
                f"{frag.meaning}: another consolidated form (pass allow_other_rules=True to load it anyway)"
            )
        elif frag.shape != entry.shape:
            raise ShapeMismatchError(f"tensor {key!r}: checkpoint shape {list(entry.shape)}, state dict shape {list(frag.shape)}")
        saved_dtype = stored_dtype_by_name(entry.dtype).torch_dtype
        if not lossy and not is_lossless_cast(saved_dtype, frag.dtype):
            raise DtypeMismatchError(
                f"tensor {key!r}: the checkpoint holds {saved_dtype}, the state dict {frag.dtype}; "
                "converting loses information (pass allow_lossy_cast=True to convert anyway)"
            )
        for _, view in frag.pieces:
            check_destination(leaf_key, view)
        if not self._restorable(key):
            return None
        return _Read(key, leaf_key, frag, entry.ranks is not None)

    # --- what the target lacks --------------------------------------------------------------

    def _match_optimizer_state(self) -> set[str]:
        """Point each optimizer state entry of the target at its key in the checkpoint (the
        checkpoint may key parameters otherwise: by number for FQNs, or the reverse); note
        what the target lacks for ``_absent_entries``. Returns the leaves whose values stay
        (the param groups' ``params`` when the two key parameters differently)."""
        kept: set[str] = set()
        self.absent_state: list[tuple[Path, str, _Optimizer, Any]] = []
        taken: set[str] = set()
        for opt in self.optimizers:
            translate, unmatched = self._translation(opt)
            if any(s != t for s, t in translate.items()) or unmatched:
                kept |= {f"{opt.prefix}param_groups.{g}.params" for g in range(len(opt.groups))}
            if unmatched:  # their state is missing, not another parameter's of the same number
                state = (*opt.path, "state")
                for leaf_key, leaf in self.leaves.items():
                    if leaf.path[: len(state)] == state and len(leaf.path) > len(state) and leaf.path[len(state)] in unmatched:
                        self.stored_key[leaf_key] = None
            spelled = {str(s): s for s in translate}
            for key in self.saved:
                split = self._split_state_key(key, opt, spelled)
                if split is None or split[0] not in translate:
                    continue
                where = (*opt.path, "state", translate[split[0]], *split[1])
                leaf_key = key_of(where)
                if leaf_key in self.leaves:
                    if self.stored_key[leaf_key] == leaf_key and not isinstance(self.leaves[leaf_key].value, Placed):
                        self.stored_key[leaf_key] = key
                elif leaf_key not in taken and self._restorable(key) and _can_hold(self.target, where):
                    taken.add(leaf_key)
                    self.absent_state.append((where, key, opt, translate[split[0]]))
        return kept

    def _translation(self, opt: _Optimizer) -> tuple[dict[Any, Any], set[Any]]:
        """Saved parameter id -> the target's, and the target's ids no saved one matches: by
        name where both name every parameter (ids that are names, as ``get_state_dict`` keys
        state, or the groups' ``param_names``) and some names are on both sides, whatever the
        order of the parameters in the groups; a name on one side only is missing or unexpected
        (as DCP's ``set_state_dict`` matches it: an optimizer of some of the saved parameters
        gets their state, never another's of the same number); else (no name in common: the
        model renamed whole, as a ``module.`` wrapper does) by position in the param groups (as
        ``Optimizer.load_state_dict`` matches numbered state) when both have the same group
        sizes; else each id to itself."""
        same = {t: t for ids in opt.groups for t in ids}, set()
        saved, saved_names = [], []
        while (raw := self.meta.values.get(f"{opt.prefix}param_groups.{len(saved)}.params")) is not None:
            names = self.meta.values.get(f"{opt.prefix}param_groups.{len(saved)}.param_names")
            saved.append(from_json(raw))
            saved_names.append(None if names is None else from_json(names))
        if not all(isinstance(ids, list) for ids in saved):
            return same
        saved_ids = _named(saved, saved_names)
        target_ids = _named(opt.groups, [[opt.names.get(t) for t in ids] for ids in opt.groups])
        if saved_ids is not None and target_ids is not None and saved_ids.keys() & target_ids.keys():
            return ({saved_ids[n]: target_ids[n] for n in saved_ids if n in target_ids},
                    {t for n, t in target_ids.items() if n not in saved_ids})
        if all(isinstance(i, str) for ids in [*saved, *opt.groups] for i in ids):
            return same
        saved = saved[: len(opt.groups)]
        if len(saved) != len(opt.groups) or any(
            not isinstance(ids, list) or len(ids) != len(targets) for ids, targets in zip(saved, opt.groups)
        ):
            return same
        return {s: t for ids, targets in zip(saved, opt.groups) for s, t in zip(ids, targets) if hashable(s)}, set()

    def _split_state_key(self, key: str, opt: _Optimizer, spelled: dict[str, Any]) -> tuple[Any, Path] | None:
        """``(saved parameter id, path below it)`` of a checkpoint key in ``opt``'s state:
        from the recorded structure, else by the longest id spelled at its start (the rest
        one key: a checkpoint that does not record its nesting cannot tell more)."""
        head = f"{opt.prefix}state."
        if not key.startswith(head):
            return None
        path = self._saved_path(key)
        if path is not None:
            i = len(opt.path)
            if len(path) > i + 2 and key_of(path[: i + 1]) + "." == head:
                return path[i + 1], tuple(path[i + 2 :])
            return None
        tail = key[len(head) :]
        dots = [i for i, c in enumerate(tail) if c == "."]
        for i in reversed(dots):  # the longest id first
            if tail[:i] in spelled and i + 1 < len(tail):
                return spelled[tail[:i]], (tail[i + 1 :],)
        return None

    def _absent_entries(self) -> list[tuple[Path, str]]:
        """``(where in the target, checkpoint key)`` of every entry the target lacks that a
        load fills: optimizer state of the target's parameters, and what an empty mapping
        of the target (below its root) held when saved."""
        out = [(where, key) for where, key, _, _ in self.absent_state]
        self.parameter_of = {key: (opt, pid) for _, key, opt, pid in self.absent_state}
        taken = {key_of(w) for w, _ in out} | set(self.leaves)
        matched = set(self.stored_key.values()) | {key for _, key in out}
        for hole in self.empty:
            head = key_of(hole) + "."
            for key in self.saved:
                if key in matched or not key.startswith(head) or not self._restorable(key):
                    continue
                path = self._saved_path(key)
                if path is not None:
                    rest = path[len(hole) :] if key_of(path[: len(hole)]) == key_of(hole) else None
                else:
                    rest = (key[len(head) :],) if "." not in key[len(head) :] else None  # else: its nesting is unknown
                where = (*hole, *rest) if rest else None
                if where is not None and key_of(where) not in taken and _can_hold(self.target, where):
                    taken.add(key_of(where))
                    matched.add(key)
                    out.append((where, key))
        return out

    def _make(self, key: str, where: Path) -> Any:
        """An empty tensor for the absent entry ``key``: of the checkpoint's shape and dtype,
        in the layout of its parameter when it is optimizer state of one whose shape it has
        (a DTensor, ``Shard`` or ``FlatShard`` like it), else whole on its device."""
        entry = self.meta.tensors[key]
        shape, dtype = tuple(entry.shape), stored_dtype_by_name(entry.dtype).torch_dtype
        param = self._parameter(key)
        if param is None:
            if self.comm.active and key in self.parameter_of and shape:
                raise LayoutError(
                    f"optimizer state {key!r} is not in the state dict, and which of its tensors is its parameter "
                    "cannot be told (no param_names in its param group, no parameter beside it in the checkpoint), so "
                    "its layout on this rank is unknown. Build the optimizer from model.named_parameters() and load the "
                    "model's state dict with it, or create the optimizer state first "
                    "(torch.distributed.checkpoint.state_dict.get_state_dict does)"
                )
            return torch.empty(shape, dtype=dtype, device=self.device)
        return _empty_like(param, shape, dtype, key)

    def _parameter(self, key: str) -> Any:
        """The target's value of the parameter whose optimizer state ``key`` is: by its name
        (an FQN-keyed state, or ``param_names``), else the one tensor of the target stored in
        the same Zarr group as ``key`` (the checkpoint keeps moments beside their parameter)."""
        if key not in self.parameter_of:
            return None
        opt, pid = self.parameter_of[key]
        name = pid if isinstance(pid, str) else opt.names.get(pid)
        by_name = self._outside[0].get(name, []) if name is not None else []
        if len(by_name) == 1:
            return by_name[0]
        by_group = self._outside[1].get(self.meta.tensors[key].path.partition("/")[0], [])
        return by_group[0] if len(by_group) == 1 else None

    @functools.cached_property
    def _outside(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The target's tensors outside its optimizers, by every dotted suffix of their key
        (a parameter's name is one) and by the Zarr group of their stored key."""
        by_name: dict[str, list[Any]] = {}
        by_group: dict[str, list[Any]] = {}
        roots = [o.path for o in self.optimizers]
        for k, leaf in self.leaves.items():
            if _under(leaf.path, roots) or _local(leaf.value) is None:
                continue
            parts = k.split(".")
            for i in range(len(parts)):
                by_name.setdefault(".".join(parts[i:]), []).append(leaf.value)
            entry = self.meta.tensors.get(self.stored_key[k])
            if entry is not None:
                by_group.setdefault(entry.path.partition("/")[0], []).append(leaf.value)
        return by_name, by_group

    @functools.cached_property
    def device(self) -> torch.device:
        """The one device every tensor of the target is on (else the CPU)."""
        devices = {t.device for leaf in self.leaves.values() if (t := _local(leaf.value)) is not None}
        return devices.pop() if len(devices) == 1 else torch.device("cpu")


_NONE = object()


def _named(groups: list[list[Any]], names: list[Any]) -> dict[str, Any] | None:
    """Name -> parameter id over ``groups``: an id that is a string is its own name, another
    has the name at its place in ``names`` (a group's ``param_names``); None unless every
    parameter has a name and no two share one."""
    out: dict[str, Any] = {}
    for ids, group_names in zip(groups, names):
        for i, p in enumerate(ids):
            if isinstance(p, str):
                name = p
            elif isinstance(group_names, list) and len(group_names) == len(ids) and hashable(p):
                name = group_names[i]
            else:
                return None
            if not isinstance(name, str) or name in out:
                return None
            out[name] = p
    return out


def _optimizers(state_dict: Any) -> list[_Optimizer]:
    """The optimizer state dicts in ``state_dict`` (itself included), outermost only."""
    out: list[_Optimizer] = []

    def walk(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            groups = value.get("param_groups")
            if isinstance(value.get("state"), Mapping) and isinstance(groups, list) and all(
                isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
            ):
                names = {
                    i: n
                    for g in groups
                    if isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"])
                    for i, n in zip(g["params"], g["param_names"])
                    if isinstance(n, str) and hashable(i)
                }
                prefix = key_of(path) + "." if path else ""
                out.append(_Optimizer(typed_path(state_dict, path), prefix, [list(g["params"]) for g in groups], names))
                return
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            return
        for k, v in items:
            walk((*path, k), v)

    walk((), state_dict)
    return out


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path[: len(r)] == r for r in roots)


def _can_hold(root: Any, where: Path) -> bool:
    """Whether ``where`` can be made in ``root``: every node on the way that exists is a
    mutable mapping (or a list, for a position), and ``where`` itself does not exist."""
    node = root
    for i, here in enumerate(where):
        if isinstance(here, ListIndex):
            if not isinstance(node, list):
                return False
            if here >= len(node) or node[here] is None:
                return True
        else:
            if not isinstance(node, MutableMapping):
                return False
            if here not in node:
                return True
        if i == len(where) - 1:
            return False
        node = node[here]
    return False


def _local(value: Any) -> torch.Tensor | None:
    value = value.value if isinstance(value, PerRank) else value
    if is_dtensor(value):
        return value.to_local()
    if isinstance(value, (Shard, FlatShard, Placed)):
        return value.local
    if is_sharded_tensor(value):
        return next((s.tensor for s in value.local_shards()), None)
    return value if isinstance(value, torch.Tensor) else None


def _empty_like(param: Any, shape: tuple[int, ...], dtype: torch.dtype, key: str) -> Any:
    """An empty tensor of ``shape`` and ``dtype`` laid out as ``param`` when it has that
    (global) shape, else whole on its device."""
    local = _local(param)
    assert local is not None
    if isinstance(param, Placed):
        raise LayoutError(
            f"optimizer state {key!r} is not in the state dict, and its parameter is placed by rules; place the "
            "optimizer state too (create it first, e.g. with one optimizer step on zero gradients)"
        )
    fresh = torch.empty(local.shape, dtype=dtype, device=local.device)
    if is_dtensor(param) and tuple(param.shape) == shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(fresh, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    if isinstance(param, Shard) and param.global_shape == shape:
        return Shard(fresh, shape, param.global_offset, param.replica_id)
    if isinstance(param, FlatShard) and param.global_shape == shape:
        return FlatShard(fresh, shape, param.flat_offset, param.replica_id, param.slab_offset, param.slab_shape)
    return torch.empty(shape, dtype=dtype, device=local.device)
