"""Type and range checks of the rule vocabulary, field by field.

:func:`check_rules` reads a rules dict in the vocabulary of :meth:`Rules.from_dict
<ucp_zarr.Rules.from_dict>` (as given, as read from JSON or TOML, or as ``Rules.to_dict()``
writes any :class:`~ucp_zarr.Rules`, those made from DeepSpeed's dicts included) and raises
:class:`~ucp_zarr.rules.params.RuleError` at the first field that is not what the vocabulary allows,
naming the rule (``params[2] (fused rule ['qkv'])``) and the field. Integers are JSON
integers, or floats of integral value (``2.0``); booleans are not integers, and strings are
never read as numbers. A field that the rule's kind does not use is refused like an unknown
one: it would be ignored, and a rule that means something else than it says is a silent
error. What only a tensor can tell (a dim beyond its rank, sizes that do not add up to it) is
checked by :func:`ucp_zarr.place`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

from .params import PRECEDENCE, RuleError

KIND_FIELDS: dict[str, frozenset[str]] = {
    "split": frozenset({"dim", "widths", "axis"}),
    "fused": frozenset({"dim", "sizes", "widths", "view", "names"}),
    "grouped": frozenset({"dim", "sizes", "groups", "names"}),
    "replicated": frozenset(),
    "average": frozenset(),
    "pieces": frozenset({"shape", "pieces"}),
}
"""The fields each kind of parameter rule takes besides ``kind`` and ``patterns``."""
_TOP = frozenset({"format", "params", "vocab", "rename", "pipeline", "pipeline_replicated", "experts", "model",
                  "default", "strict"})
_NEEDS = {"fused": (("sizes",), "the sub-parameter sizes ('sizes')"),
          "grouped": (("sizes", "groups"), "'groups' and the sizes of a group's sub-parameters ('sizes')"),
          "pieces": (("shape", "pieces"), "'shape' and 'pieces'")}
_COUNT = {"pipeline": ("count", "num_layers"), "experts": ("count", "num_experts")}
GLOBAL = "global"
"""``pipeline`` / ``experts`` value: names are already global across the ranks of that axis."""


def check_rules(d: Mapping[str, Any]) -> None:
    """Raise :class:`RuleError` naming the rule and the field of ``d`` of a wrong type or range."""
    _mapping(d, "rules", "the rules")
    _known(d, _TOP, "rules")
    for i, rule in enumerate(_list(d.get("params", []), "rules", "params")):
        _check_param(rule, i)
    if d.get("vocab") is not None:
        vocab = _mapping(d["vocab"], "rules", "vocab")
        _known(vocab, frozenset({"patterns", "size"}), "vocab")
        if vocab.get("size") is None:
            raise RuleError("vocab: vocabulary patterns need the original (unpadded) vocabulary size ('size')")
        _required(vocab, ("patterns",), "vocab")
        _patterns(vocab["patterns"], "vocab", "patterns", allow_empty=False)
        _int(vocab["size"], "vocab", "size", minimum=1)
    for i, r in enumerate(_list(d.get("rename", []), "rules", "rename")):
        where = f"rename[{i}]"
        _known(_mapping(r, "rules", where), frozenset({"pattern", "to"}), where)
        _required(r, ("pattern", "to"), where)
        _pattern(r["pattern"], where, "pattern")
        _str(r["to"], where, "to")
    for axis in ("pipeline", "experts"):
        if d.get(axis) is not None:
            _check_renumber(d[axis], axis)
    _patterns(d.get("pipeline_replicated", []), "rules", "pipeline_replicated", allow_empty=True)
    if d.get("model") is not None:
        for name, value in _mapping(d["model"], "rules", "model").items():
            if not isinstance(name, str) or not all(_fact(v) for v in (value if isinstance(value, list) else [value])):
                _bad("model", str(name), value, "a JSON scalar or a list of them, by name")
    if "default" in d and d["default"] not in ("split", "replicated", "error"):
        raise RuleError(f"rules: default must be 'split', 'replicated' or 'error', not {d['default']!r}")
    if "strict" in d and not isinstance(d["strict"], bool):
        _bad("rules", "strict", d["strict"], "true or false")


def _check_param(rule: Any, i: int) -> None:
    where = f"params[{i}]"
    _mapping(rule, "rules", where)
    kind = rule.get("kind")
    if not isinstance(kind, str) or kind not in PRECEDENCE:
        raise RuleError(f"{where}: unknown rule kind {kind!r} ('kind' must be one of {', '.join(PRECEDENCE)})")
    fields = KIND_FIELDS.get(kind)
    if fields is None:
        raise RuleError(f"{where}: rule kind {kind!r} has no field schema (ucp_zarr.rules.schema.KIND_FIELDS)")
    patterns = rule.get("patterns")
    where = f"{where} ({kind} rule {patterns!r})"
    _required(rule, ("patterns",), where)
    _patterns(patterns, where, "patterns", allow_empty=False)
    extra = sorted(map(str, set(rule) - fields - {"kind", "patterns"}))
    if extra:
        raise RuleError(f"{where}: unknown member(s) {extra}: a {kind} rule takes {sorted(fields | {'kind', 'patterns'})}")
    needs = _NEEDS.get(kind)
    if needs is not None and any(rule.get(n) is None for n in needs[0]):
        raise RuleError(f"{where}: a {kind} rule needs {needs[1]}")
    if "dim" in rule:
        _int(rule["dim"], where, "dim", minimum=0)
    if "axis" in rule and rule["axis"] not in ("tp", "ep"):
        _bad(where, "axis", rule["axis"], "'tp' or 'ep'")
    sizes = None
    if "sizes" in rule:
        sizes = _ints(rule["sizes"], where, "sizes", minimum=1, placeholder=kind == "fused", allow_empty=False)
    if "groups" in rule:
        _int(rule["groups"], where, "groups", minimum=1)
    if "names" in rule:
        names = [rule["names"]] if isinstance(rule["names"], str) else _list(rule["names"], where, "names")
        if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            _bad(where, "names", names, "a list of distinct non-empty strings")
        if sizes is not None and len(names) != len(sizes):
            raise RuleError(f"{where}: 'names' gives {len(names)} names for {len(sizes)} sub-parameters")
    if "view" in rule:
        view = _ints(rule["view"], where, "view", minimum=1, placeholder=True, allow_empty=False)
        if rule.get("dim", 0) >= len(view):
            raise RuleError(f"{where}: 'dim' {rule.get('dim', 0)} is not a dim of the view {view}")
    if "widths" in rule:
        _check_widths(rule["widths"], where, kind, sizes)
    if "pieces" in rule:
        ndim = len(_ints(rule["shape"], where, "shape", minimum=0))
        _by_tp(rule["pieces"], where, "pieces", lambda per_rank, tp, at: _check_pieces(per_rank, tp, where, at, ndim))


def _check_widths(widths: Any, where: str, kind: str, sizes: list[int] | None) -> None:
    def one(ws: Any, tp: int, at: str) -> None:
        subs = [ws] if kind == "split" else _list(ws, where, at)
        if sizes is not None and len(subs) != len(sizes):
            raise RuleError(f"{where}: '{at}' gives widths of {len(subs)} sub-parameters, the rule has {len(sizes)}")
        for j, w in enumerate(subs):
            name = at if kind == "split" else f"{at}[{j}]"
            got = _ints(w, where, name, minimum=0)
            if len(got) != tp:
                raise RuleError(f"{where}: '{name}' must give {tp} widths, one per rank, not {got}")
            if sizes is not None and sizes[j] != -1 and sum(got) != sizes[j]:
                raise RuleError(f"{where}: '{name}' {got} sums to {sum(got)}, not sub-parameter {j}'s size {sizes[j]}")

    _by_tp(widths, where, "widths", one)


def _check_pieces(per_rank: Any, tp: int, where: str, at: str, ndim: int) -> None:
    """One TP size's pieces: a list per rank of pieces ``{"dst": box, "src": box + step, base}``."""
    ranks = _list(per_rank, where, at)
    if len(ranks) != tp:
        raise RuleError(f"{where}: '{at}' gives {len(ranks)} ranks' pieces for TP size {tp}")
    for r, pieces in enumerate(ranks):
        for k, piece in enumerate(_list(pieces, where, f"{at}[{r}]")):
            here = f"{at}[{r}][{k}]"
            _known(_mapping(piece, where, here), frozenset({"dst", "src"}), f"{where}: {here}")
            _required(piece, ("dst", "src"), f"{where}: {here}")
            for name, allowed in (("dst", {"offset", "shape"}), ("src", {"offset", "shape", "step", "base"})):
                box = _mapping(piece[name], where, f"{here}.{name}")
                _known(box, frozenset(allowed), f"{where}: {here}.{name}")
                _required(box, ("offset", "shape"), f"{where}: {here}.{name}")
                offset = _ints(box["offset"], where, f"{here}.{name}.offset", minimum=0)
                shape = _ints(box["shape"], where, f"{here}.{name}.shape", minimum=0)
                if len(offset) != ndim or len(shape) != ndim:
                    raise RuleError(f"{where}: '{here}.{name}' offset {offset} and shape {shape} must have the "
                                    f"{ndim} dims of the rule's shape")
                if "step" in box and len(_ints(box["step"], where, f"{here}.{name}.step", minimum=1)) != ndim:
                    raise RuleError(f"{where}: '{here}.{name}.step' needs one step per dim ({ndim})")
                if "base" in box:
                    base = _mapping(box["base"], where, f"{here}.{name}.base")
                    _known(base, frozenset({"start", "shape"}), f"{where}: {here}.{name}.base")
                    _required(base, ("start", "shape"), f"{where}: {here}.{name}.base")
                    _int(base["start"], where, f"{here}.{name}.base.start", minimum=0)
                    _ints(base["shape"], where, f"{here}.{name}.base.shape", minimum=0)


def _check_renumber(value: Any, axis: str) -> None:
    if value == GLOBAL:
        return
    _mapping(value, "rules", axis)
    counts = _COUNT[axis]
    _known(value, frozenset({"pattern", "offsets", *counts}), axis)
    _required(value, ("pattern",), axis)
    _pattern(value["pattern"], axis, "pattern")
    if re.compile(value["pattern"]).groups < 1:
        raise RuleError(f"{axis}: 'pattern' {value['pattern']!r} needs a group capturing the index")
    given = [k for k in (*counts, "offsets") if k in value]
    if len(given) != 1:
        raise RuleError(f"{axis}: give exactly one of {' / '.join(counts)} (the number) or 'offsets', not {given}")
    if given[0] != "offsets":
        _int(value[given[0]], axis, given[0], minimum=1)
        return
    offsets = _ints(value["offsets"], axis, "offsets", minimum=0, allow_empty=False)
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        _bad(axis, "offsets", offsets, "non-decreasing from 0 (rank r holds the indices from offsets[r] on)")


# --- field readers ---------------------------------------------------------------------------


def _fact(value: Any) -> bool:
    """A JSON scalar (a finite number)."""
    return value is None or isinstance(value, (bool, int, str)) or isinstance(value, float) and math.isfinite(value)


def _bad(where: str, name: str, value: Any, what: str) -> None:
    raise RuleError(f"{where}: '{name}' must be {what}, not {value!r} ({type(value).__name__})")


def _mapping(value: Any, where: str, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        _bad(where, name, value, "a mapping")
    return value


def _list(value: Any, where: str, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        _bad(where, name, value, "a list")
    return list(value)


def _known(d: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(map(str, set(d) - known))
    if unknown:
        raise RuleError(f"{where}: unknown member(s) {unknown} (known: {sorted(known)})")


def _required(d: Mapping[str, Any], names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise RuleError(f"{where}: needs {' and '.join(repr(n) for n in missing)}")


def _str(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str):
        _bad(where, name, value, "a string")
    return value


def _int(value: Any, where: str, name: str, *, minimum: int, placeholder: bool = False) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if ok and (int(value) >= minimum or (placeholder and value == -1)):
        return int(value)
    _bad(where, name, value, f"an integer >= {minimum}{' or -1' if placeholder else ''}")
    raise AssertionError  # (unreachable: _bad raises)


def _ints(value: Any, where: str, name: str, *, minimum: int, placeholder: bool = False,
          allow_empty: bool = True) -> list[int]:
    items = _list(value, where, name)
    if not items and not allow_empty:
        _bad(where, name, value, "a non-empty list of integers")
    return [_int(v, where, f"{name}[{k}]", minimum=minimum, placeholder=placeholder) for k, v in enumerate(items)]


def _patterns(value: Any, where: str, name: str, *, allow_empty: bool) -> list[str]:
    """A list of patterns, or one pattern as a string."""
    items = [value] if isinstance(value, str) else _list(value, where, name)
    if not items and not allow_empty:
        _bad(where, name, value, "a non-empty list of pattern strings")
    return [_pattern(p, where, f"{name}[{k}]") for k, p in enumerate(items)]


def _pattern(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str) or not value:
        _bad(where, name, value, "a non-empty regular expression string")
    try:
        re.compile(value)
    except re.error as e:
        raise RuleError(f"{where}: '{name}' {value!r} is not a regular expression: {e}") from None
    return value


def _by_tp(value: Any, where: str, name: str, check: Callable[[Any, int, str], None]) -> None:
    """A mapping TP size -> entry (keys: integers >= 1, or their decimal strings as JSON and
    TOML write them); ``check(entry, tp, "name[tp]")`` for each."""
    for key, entry in _mapping(value, where, name).items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit()
        tp = int(key) if digits else key
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise RuleError(f"{where}: '{name}' is keyed by TP size (an integer >= 1), not {key!r}")
        check(entry, tp, f"{name}[{tp}]")
