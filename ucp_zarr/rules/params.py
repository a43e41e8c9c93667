"""The parts :class:`~ucp_zarr.Rules` are made of: one parameter's rule (:class:`ParamRule`),
renumbering (:class:`Renumber`), the precedence of kinds, pattern matching and the field helpers
(the vocabulary itself is described in :mod:`ucp_zarr.rules.language`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import CheckpointError
from ..layout import pieces as P

PRECEDENCE = ("pieces", "replicated", "average", "fused", "grouped", "split")
"""The kinds of parameter rules, strongest first: explicit pieces (DeepSpeed's affine maps,
which its converter prefers to every category), then DeepSpeed's order of categories
(replicated, averaged, sub-parameters, row/column)."""
RULES_FORMAT = "ucp_zarr.rules/1"


class RuleError(CheckpointError, ValueError):
    """Rules that are malformed, ambiguous, unused, or that do not fit a tensor."""


@dataclass(frozen=True)
class ParamRule:
    """How one kind of parameter's local tensor maps onto its consolidated tensor."""

    kind: str
    patterns: tuple[str, ...]
    dim: int = 0
    sizes: tuple[int, ...] | None = None
    """``fused``: the consolidated size of each sub-parameter along ``dim`` (``-1``: inferred:
    all ``-1`` share the rest equally); ``grouped``: each sub-parameter's size in one group."""
    groups: int | None = None
    """``grouped``: the number of groups, each ``[sub_1; ...; sub_k]`` of ``sizes``, that TP
    splits contiguously (``ucp_zarr.layout.groups``)."""
    names: tuple[str, ...] | None = None
    """``fused``/``grouped``: a name per sub-parameter (``q``, ``k``, ``v``), for exports that split them."""
    widths: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Uneven shards: TP size -> per sub-parameter, each rank's width (``split``: one
    sub-parameter, the whole tensor; its size along ``axis``)."""
    shape: tuple[int, ...] | None = None
    """``pieces``: the consolidated shape."""
    pieces: Mapping[int, tuple[tuple[P.Piece, ...], ...]] = field(default_factory=dict)
    """``pieces``: TP size -> each rank's pieces."""
    axis: str = "tp"
    """The parallel dimension a ``split`` divides: ``tp``, or ``ep`` (experts stacked in one tensor)."""
    view: tuple[int, ...] | None = None
    """``fused``: the consolidated shape as DeepSpeed's sub-parameter ``shape`` gives it
    (``-1``: any size); it must be the tensor's own shape (views that reshape are not supported)."""

    def __post_init__(self) -> None:
        if self.kind not in PRECEDENCE:
            raise RuleError(f"unknown rule kind {self.kind!r} (known: {', '.join(PRECEDENCE)})")
        if not self.patterns or not all(isinstance(p, str) for p in self.patterns):
            raise RuleError(f"a {self.kind} rule needs a list of pattern strings, got {self.patterns!r}")
        for p in self.patterns:
            _compile(p)
        if self.kind == "fused" and not self.sizes:
            raise RuleError(f"fused rule {list(self.patterns)} needs the sub-parameter sizes")
        if self.kind == "grouped":
            if not self.sizes or min(self.sizes) < 1 or self.groups is None or self.groups < 1:
                raise RuleError(f"grouped rule {list(self.patterns)} needs 'groups' >= 1 and sizes >= 1 per group, "
                                f"got groups={self.groups!r}, sizes={self.sizes!r}")
            if self.widths or self.view is not None or self.axis != "tp":
                raise RuleError(f"grouped rule {list(self.patterns)}: no widths, view or axis (TP splits the groups)")
        elif self.groups is not None:
            raise RuleError(f"{self.kind} rule {list(self.patterns)}: 'groups' is for grouped rules")
        if self.names is not None and (
            self.kind not in ("fused", "grouped") or len(self.names) != len(self.sizes or ())
            or len(set(self.names)) != len(self.names) or not all(isinstance(n, str) and n for n in self.names)
        ):
            raise RuleError(f"{self.kind} rule {list(self.patterns)}: names must be distinct strings, one per "
                            f"sub-parameter of a fused or grouped rule, got {self.names!r}")
        if self.kind == "pieces" and (self.shape is None or not self.pieces):
            raise RuleError(f"pieces rule {list(self.patterns)} needs 'shape' and 'pieces'")
        if self.axis not in ("tp", "ep"):
            raise RuleError(f"rule {list(self.patterns)}: axis must be 'tp' or 'ep', not {self.axis!r}")
        for n, ws in self.widths.items():
            if self.kind not in ("split", "fused") or any(len(w) != n or min(w, default=0) < 0 for w in ws):
                raise RuleError(f"rule {list(self.patterns)}: widths for size {n} must give {n} widths >= 0 "
                                f"(per sub-parameter) to a split or fused rule, got {[list(w) for w in ws]}")
            if self.kind == "split" and len(ws) != 1:
                raise RuleError(f"split rule {list(self.patterns)}: widths for size {n} are one list of {n} widths")
        for tp, per_rank in self.pieces.items():
            if len(per_rank) != tp:
                raise RuleError(f"pieces rule {list(self.patterns)}: {len(per_rank)} ranks' pieces for TP size {tp}")
            try:  # (each rank's pieces are checked against its local shape by place)
                P.check_cover(self.shape or (), per_rank)
            except P.PieceError as e:
                raise RuleError(f"pieces rule {list(self.patterns)} at TP size {tp}: {e}") from None

    def meaning(self, vocab: int | None) -> dict[str, Any]:
        """What the consolidated tensor is, independent of how a layout splits it (stored
        per tensor; a load with rules of another meaning is refused)."""
        m: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("fused", "grouped"):
            m |= {"dim": self.dim, "sizes": list(self.sizes or ())}
        if self.groups is not None:
            m["groups"] = self.groups
        if self.names is not None:
            m["names"] = list(self.names)
        if vocab is not None:
            m["vocab"] = vocab
        return m

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "patterns": list(self.patterns)}
        if self.kind in ("split", "fused", "grouped"):
            d["dim"] = self.dim
        if self.axis != "tp":
            d["axis"] = self.axis
        if self.sizes is not None:
            d["sizes"] = list(self.sizes)
        if self.groups is not None:
            d["groups"] = self.groups
        if self.names is not None:
            d["names"] = list(self.names)
        if self.widths and self.kind == "split":
            d["widths"] = {str(t): list(ws[0]) for t, ws in sorted(self.widths.items())}
        elif self.widths:
            d["widths"] = {str(t): [list(w) for w in ws] for t, ws in sorted(self.widths.items())}
        if self.shape is not None:
            d["shape"] = list(self.shape)
        if self.view is not None:
            d["view"] = list(self.view)
        if self.pieces:
            d["pieces"] = {str(t): [[p.to_json() for p in ps] for ps in per] for t, per in sorted(self.pieces.items())}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParamRule":
        if not isinstance(d, Mapping):
            raise RuleError(f"a parameter rule must be a mapping, not {d!r}")
        known = {"kind", "patterns", "dim", "sizes", "groups", "names", "widths", "shape", "pieces", "axis", "view"}
        _no_unknown(d, known, f"rule {d.get('patterns')!r}")
        try:
            return cls(
                kind=d["kind"],
                patterns=_patterns(d["patterns"]),
                dim=int(d.get("dim", 0)),
                sizes=None if d.get("sizes") is None else tuple(int(n) for n in d["sizes"]),
                widths={int(t): _widths(ws, d["kind"] != "fused") for t, ws in d.get("widths", {}).items()},
                shape=None if d.get("shape") is None else tuple(int(n) for n in d["shape"]),
                pieces={
                    int(t): tuple(tuple(P.Piece.from_json(p) for p in ps) for ps in per)
                    for t, per in d.get("pieces", {}).items()
                },
                axis=d.get("axis", "tp"),
                view=None if d.get("view") is None else tuple(int(n) for n in d["view"]),
                groups=None if d.get("groups") is None else as_int(d["groups"]),
                names=None if d.get("names") is None else tuple(d["names"]) if isinstance(d["names"], list)
                else (d["names"],),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, RuleError):
                raise
            raise RuleError(f"malformed rule {d!r}: {e}") from None


def _widths(ws: Any, split: bool) -> tuple[tuple[int, ...], ...]:
    """Widths as given in a dict: per sub-parameter a list of rank widths (``split``: one list)."""
    if split:
        return (tuple(int(x) for x in ws),)
    return tuple(tuple(int(x) for x in w) for w in ws)


def same_meaning(saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> bool:
    """Whether two rule descriptions (``ParamRule.meaning``) give a tensor the same
    consolidated form: the same fused sub-parameters (a fused tensor is one group), and the
    same unpadded vocabulary size. How a layout splits it (dim, replication, averaging) and
    the sub-parameters' names do not matter."""
    if saved is None or loading is None:
        return True

    def form(m: Mapping[str, Any]) -> tuple[Any, ...]:
        sub = m.get("kind") in ("fused", "grouped")
        fused = (m.get("dim"), m.get("groups", 1), tuple(m.get("sizes", ()))) if sub else None
        return fused, m.get("vocab")

    return form(saved) == form(loading)


@dataclass(frozen=True)
class Renumber:
    """Renumber the index captured by ``pattern`` (group 1): pipeline stages (local layer
    index -> global) or expert parallelism (local expert -> global)."""

    pattern: str
    count: int | None = None
    """The global number (layers, experts), split evenly over the ranks of the axis."""
    offsets: tuple[int, ...] | None = None
    """Explicit offsets per rank (uneven pipeline stages)."""

    def __post_init__(self) -> None:
        if _compile(self.pattern).groups < 1:
            raise RuleError(f"renumbering pattern {self.pattern!r} needs a group capturing the index")
        if (self.count is None) == (self.offsets is None):
            raise RuleError(f"renumbering {self.pattern!r}: give exactly one of a count or offsets")

    def offset(self, rank: int, size: int, what: str) -> int:
        if self.offsets is not None:
            if len(self.offsets) != size:
                raise RuleError(f"{what} {self.pattern!r}: {len(self.offsets)} offsets for {size} ranks")
            return self.offsets[rank]
        assert self.count is not None
        if self.count % size:
            raise RuleError(f"{what} {self.pattern!r}: {self.count} cannot be split evenly over {size} ranks")
        return rank * (self.count // size)

    def apply(self, fqn: str, rank: int, size: int, what: str) -> str:
        m = _compile(self.pattern).match(fqn)
        if m is None or size == 1:
            return fqn
        local, offset = int(m.group(1)), self.offset(rank, size, what)
        if self.count is not None:
            limit: int | None = self.count // size
        else:
            assert self.offsets is not None
            limit = self.offsets[rank + 1] - offset if rank + 1 < size else None
        if limit is not None and local >= limit:
            raise RuleError(
                f"{what} {self.pattern!r}: {fqn!r} has local index {local}, but rank {rank} of {size} holds {limit}"
            )
        start, stop = m.span(1)
        return f"{fqn[:start]}{local + offset}{fqn[stop:]}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pattern": self.pattern}
        return d | ({"offsets": list(self.offsets)} if self.offsets is not None else {"count": self.count})

    @classmethod
    def read(cls, d: Any, what: str) -> "Renumber | str | None":
        """A ``pipeline`` or ``experts`` entry: renumbering, ``"global"``, or None."""
        return d if d is None or d == "global" else cls.from_dict(d, what)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], what: str) -> "Renumber":
        _no_unknown(d, {"pattern", "count", "num_layers", "num_experts", "offsets"}, what)
        count = d.get("count", d.get("num_layers", d.get("num_experts")))
        offsets = d.get("offsets")
        try:
            return cls(str(d["pattern"]), None if count is None else int(count),
                       None if offsets is None else tuple(as_int(o) for o in offsets))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, RuleError):
                raise
            raise RuleError(f"malformed {what} rule {d!r}: {e!r}") from None


_COMPILED: dict[str, re.Pattern[str]] = {}


def _compile(pattern: str) -> re.Pattern[str]:
    rx = _COMPILED.get(pattern)
    if rx is None:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise RuleError(f"pattern {pattern!r} is not a regular expression: {e}") from None
        _COMPILED[pattern] = rx
    return rx


def as_int(value: Any) -> int:
    """``value`` as an int when it is one (also as a float); a :class:`RuleError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise RuleError(f"{value!r} is not an integer")
    return int(value)


def _first(patterns: Iterable[str], fqn: str, kind: str) -> str | None:
    hits = [p for p in patterns if _compile(p).match(fqn)]
    if len(hits) > 1:
        raise RuleError(f"parameter {fqn!r} is matched by two {kind} patterns: {hits[0]!r} and {hits[1]!r}")
    return hits[0] if hits else None


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(p) for p in value)


def _no_unknown(d: Mapping[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise RuleError(f"{what}: unknown member(s) {unknown} (known: {sorted(known)})")

