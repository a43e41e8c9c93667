"""Phase 1 of a save: a state dict as the save sees it (:func:`collect`), what each rank
tells the coordinator of its fragments (:func:`fragment_infos`) and the values every rank
gave, global or per rank (:func:`merge_values`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..errors import LayoutError
from ..format.optimizer_names import alias, state_names
from ..format.statedict import Structure, iter_leaves, structure_of, to_json
from .fragments import Fragment, PerRank, Placed, is_fragment_value, to_fragment
from .hooks import LayoutHooks
from .planner import FragmentInfo
from .ties import find_ties


@dataclass
class Collected:
    """A state dict as a save sees it: tensors as fragments, other leaves as JSON."""

    fragments: dict[str, Fragment]
    values: dict[str, Any]
    per_rank_values: frozenset[str] = frozenset()
    """Keys of values wrapped in :class:`~ucp_zarr.PerRank`."""
    rules: dict[str, Any] | None = None
    """The document of the layout that placed this state dict (``Rules.to_dict()``), if any."""
    used: frozenset[str] = frozenset()
    """What that layout recorded of this rank's placements (the rule patterns that matched)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tensor key -> the key its array is named after (see :mod:`..format.optimizer_names`)."""
    structure: Structure | None = None
    """How the state dict nested (stored with the checkpoint)."""
    ties: dict[str, str] = field(default_factory=dict)
    """Alias key -> canonical key of tensors given under several keys (see :mod:`.ties`)."""
    hooks: LayoutHooks | None = None
    """That layout's checks (:mod:`.hooks`)."""


def collect(state_dict: Mapping[str, Any], model: Any = None) -> Collected:
    """A state dict's tensors as fragments and its other leaves as JSON, by flattened key
    (a :class:`~ucp_zarr.Placed` tensor under its consolidated key; two placed on one key,
    such as tied weights, are merged). Optimizer state keyed by parameter number is named
    after its parameter where the name is knowable (``param_names``, or ``model``)."""
    paths: dict[str, tuple[Any, ...]] = {}
    fragments: dict[str, Fragment] = {}
    values: dict[str, Any] = {}
    per_rank: set[str] = set()
    rules: dict[str, Any] | None = None
    hooks: LayoutHooks | None = None
    used: set[str] = set()
    empty: list[tuple[int, tuple[Any, ...]]] = []
    unplaced: list[tuple[str, Any, Fragment]] = []
    renamed: dict[str, str] = {}
    for leaf in iter_leaves(state_dict, empty):
        value, wrapped = leaf.value, isinstance(leaf.value, PerRank)
        if wrapped:
            value = value.value
        if isinstance(value, Placed) and value.alias is not None:
            renamed[value.alias] = value.key
        if is_fragment_value(value):
            frag = to_fragment(leaf.key, value)
            if wrapped and not frag.plain:
                raise LayoutError(
                    f"tensor {leaf.key!r}: PerRank holds a {type(value).__name__}; per-rank state is a "
                    "plain tensor (or a JSON value) that each rank holds whole"
                )
            frag.per_rank = wrapped
            if not wrapped and not isinstance(value, Placed):
                unplaced.append((frag.key, value, frag))
            if isinstance(value, Placed):
                if rules is not None and value.rules != rules:
                    raise LayoutError(f"tensor {leaf.key!r} was placed by other rules than the rest of the state dict")
                rules, hooks = value.rules, value.hooks
                used |= value.used
            if frag.key in fragments:
                _merge_tied(fragments[frag.key], frag, leaf.key)
            else:
                fragments[frag.key] = frag
                paths[frag.key] = leaf.path
        else:
            values[leaf.key] = to_json(value, leaf.key)
            paths[leaf.key] = leaf.path
            if wrapped:
                per_rank.add(leaf.key)
    _warn_of_padding(fragments)
    clash = sorted(set(fragments) & set(values))
    if clash:
        raise LayoutError(f"keys {clash} are both a placed tensor and a value")
    names = state_names(state_dict, model)  # (after iter_leaves refused cycles and deep nesting)
    aliases = {k: a for k, p in paths.items() if (a := alias(k, p, names)) is not None} if names else {}
    structure = structure_of(state_dict, paths, empty)
    ties = find_ties(unplaced) | renamed
    return Collected(fragments, values, frozenset(per_rank), rules, frozenset(used), aliases, structure, ties, hooks)


def _warn_of_padding(fragments: Mapping[str, Fragment]) -> None:
    """Warn of placed tensors whose padding (vocabulary rows beyond the rules' ``vocab_size``)
    is not zero: it is not stored, and a load fills it with zeros."""
    dropped = sorted(k for k, f in fragments.items() if any(bool(v.any()) for v in f.pad if v.numel()))
    if dropped:
        warnings.warn(
            f"ucp_zarr: the vocabulary padding rows of {dropped[:3]}{' ...' * (len(dropped) > 3)} are not zero, and "
            "are not stored: the checkpoint holds the tokenizer's vocab_size rows, and a load fills the padding with "
            "zeros (as DeepSpeed's universal checkpoints do). A trainer whose loss counts the padded logits "
            "(Megatron's vocab-parallel cross entropy) resumes with another loss; to resume exactly, give the rules "
            "the padded size as vocab_size (Rules.from_megatron(model, vocab_size=...)): the padding is then stored",
            stacklevel=3,
        )


def _merge_tied(into: Fragment, other: Fragment, leaf_key: str) -> None:
    """Two local tensors placed on one consolidated tensor (tied weights): the same boxes
    must hold the same values; other boxes must not overlap."""
    key = into.key
    if (into.shape, into.dtype, into.meaning) != (other.shape, other.dtype, other.meaning):
        raise LayoutError(
            f"tensor {key!r}: {leaf_key!r} is placed on it as {list(other.shape)} {other.dtype}, another local "
            f"tensor as {list(into.shape)} {into.dtype} (or by another kind of rule)"
        )
    held = dict(into.pieces)
    for box, t in other.pieces:
        if box in held:
            if not torch.equal(held[box].detach().cpu(), t.detach().cpu()):
                raise LayoutError(f"tensor {key!r}: {leaf_key!r} and another local tensor tied to it differ")
            continue
        if any((i := box.intersect(b)) is not None and not i.is_empty() for b in held):
            raise LayoutError(f"tensor {key!r}: {leaf_key!r} overlaps another local tensor placed on it")
        into.pieces.append((box, t))
        held[box] = t


def fragment_infos(fragments: dict[str, Fragment], aliases: dict[str, str]) -> list[FragmentInfo]:
    """What each fragment is, for the planner."""
    return [
        FragmentInfo(
            f.key,
            f.shape,
            str(f.dtype).removeprefix("torch."),
            tuple(b for b, _ in f.pieces),
            f.flat,
            f.plain,
            f.per_rank,
            None if f.meaning is None else json.dumps(f.meaning, sort_keys=True),
            f.rule,
            aliases.get(f.key),
        )
        for f in fragments.values()
    ]


def merge_values(
    per_rank: list[tuple[dict[str, Any], frozenset[str]]],
) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """Values wrapped in PerRank, or differing between ranks, are per-rank; the others
    global. A key wrapped on some ranks only is an error."""
    seen: dict[str, dict[int, Any]] = {}
    wrapped: dict[str, set[int]] = {}
    for r, (vals, explicit) in enumerate(per_rank):
        for k, v in vals.items():
            seen.setdefault(k, {})[r] = v
        for k in explicit:
            wrapped.setdefault(k, set()).add(r)
    global_values: dict[str, Any] = {}
    rank_values: dict[str, dict[int, Any]] = {}
    for k, by_rank in seen.items():
        if k in wrapped and wrapped[k] != set(by_rank):
            raise LayoutError(
                f"value {k!r}: ranks {sorted(wrapped[k])} wrap it in PerRank, ranks "
                f"{sorted(set(by_rank) - wrapped[k])} do not"
            )
        first = next(iter(by_rank.values()))
        if k not in wrapped and all(_same(v, first) for v in by_rank.values()):
            global_values[k] = first
        else:
            rank_values[k] = by_rank
    return global_values, rank_values


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
