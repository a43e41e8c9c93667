"""Every field of the rules is checked for type and range (``ucp_zarr.rules.schema``).

The mutation tests take valid rules of every kind and field and change one field at a time
into a value of another type (a string for a number, a boolean, a non-integral float, a list
for a scalar, a mapping for a list, ...), a negative number, or add an unknown member: each
must be refused with a :class:`RuleError` naming the rule (``params[i]``) and the field,
from ``Rules.from_dict``, from ``Rules.load`` (JSON), and for rules built in Python or from
DeepSpeed's dicts. Before these checks, ``{"kind": "split", "dim": "1"}`` was read as dim 1,
``"strict": "false"`` as strict, ``True`` as 1, and fields a kind does not use were ignored.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr import RuleError, Rules
from ucp_zarr.rules.params import PRECEDENCE, ParamRule, Renumber
from ucp_zarr.rules.schema import KIND_FIELDS


def _piece(dst: list[int], src: list[int], n: list[int], **src_extra: Any) -> dict[str, Any]:
    return {"dst": {"offset": dst, "shape": n}, "src": {"offset": src, "shape": n, **src_extra}}


VALID: dict[str, Any] = {
    "format": "ucp_zarr.rules/1",
    "params": [
        {"kind": "split", "patterns": [r"a\.proj", r"a\.fc2"], "dim": 1, "widths": {"3": [4, 3, 3]}},
        {"kind": "split", "patterns": [r"a\.experts\.w"], "axis": "ep"},
        {"kind": "fused", "patterns": [r"a\.qkv"], "dim": 0, "sizes": [8, -1, -1], "names": ["q", "k", "v"],
         "view": [-1, 4]},
        {"kind": "fused", "patterns": [r"a\.fc1"], "sizes": [6, 6], "widths": {"3": [[3, 2, 1], [2, 2, 2]]}},
        {"kind": "grouped", "patterns": [r"b\.qkv"], "dim": 0, "groups": 2, "sizes": [4, 2, 2], "names": ["q", "k", "v"]},
        {"kind": "replicated", "patterns": [r".*norm"]},
        {"kind": "average", "patterns": [r".*bias"]},
        {"kind": "pieces", "patterns": [r"c\.w"], "shape": [4, 2],
         "pieces": {"2": [[_piece([0, 0], [0, 0], [2, 2], step=[2, 1])],
                          [_piece([2, 0], [0, 0], [2, 2], base={"start": 0, "shape": [2, 2]})]]}},
    ],
    "vocab": {"patterns": [r"embed\.w"], "size": 50},
    "rename": [{"pattern": r"out\.w", "to": "embed.w"}],
    "pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 4},
    "pipeline_replicated": [r"out\.w"],
    "experts": {"pattern": r"experts\.(\d+)\.", "offsets": [0, 2, 2, 5]},
    "default": "error",
    "strict": False,
}
VALID_GLOBAL: dict[str, Any] = {"params": [], "pipeline": "global", "experts": {"pattern": r"e\.(\d+)", "count": 8}}


def test_valid_rules_are_read_and_written_back() -> None:
    for d in (VALID, VALID_GLOBAL):
        rules = Rules.from_dict(d)
        assert Rules.from_dict(rules.to_dict()) == rules
        assert Rules.from_dict(json.loads(json.dumps(rules.to_dict()))) == rules


def test_model_facts_are_json_scalars_or_lists_of_them() -> None:
    """``model`` (what the weights compute: Rules.from_megatron's settings) round-trips; a
    value that is no JSON scalar or list of them is refused naming it."""
    facts = {"framework": "megatron-core", "rotary_inv_freq": [1.0, 0.1], "window_size": None, "num_layers": 2}
    rules = Rules.from_dict({"params": [], "model": facts})
    assert rules.model == facts and Rules.from_dict(json.loads(json.dumps(rules.to_dict()))) == rules
    for bad in ({"a": 1}, [[1]], float("nan"), object()):
        with pytest.raises(RuleError, match=r"model: 'x' must be a JSON scalar"):
            Rules.from_dict({"params": [], "model": {"x": bad}})
    with pytest.raises(RuleError, match="'model' must be a mapping"):
        Rules.from_dict({"params": [], "model": [1]})


def test_every_kind_has_a_field_schema() -> None:
    assert set(KIND_FIELDS) == set(PRECEDENCE)


# --- one field at a time ---------------------------------------------------------------------


def wrong_values(value: Any, name: str = "") -> list[Any]:
    """Values no field ``name`` that holds ``value`` accepts: another type, or (numbers) out
    of range. (A list of patterns or names may be given as one string.)"""
    if isinstance(value, bool):
        return ["true", 1, 0, [value]]
    if isinstance(value, int):
        return [str(value), True, False, value + 0.5, [value], {"n": value}, -2, float("nan")]
    if isinstance(value, str):
        return [1, True, [value], {"s": value}]
    if isinstance(value, list):
        return [3, True, {"0": value}] + (["abc"] if name not in ("patterns", "pipeline_replicated", "names") else [])
    if isinstance(value, dict):
        return [[value], "abc", 3, True]
    raise AssertionError(value)


def fields(d: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of a nested rules dict, containers and leaves, but the root."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        yield path + (k,), v
        yield from fields(v, path + (k,))


def replaced(d: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(d)
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return out


def field_name(path: tuple[Any, ...]) -> str:
    """The name a message must give: the innermost member that is a field name (not a TP size)."""
    names = [k for k in path if isinstance(k, str) and not k.isdigit()]
    return names[-1] if names else "params"


def rule_name(path: tuple[Any, ...]) -> str | None:
    return f"params[{path[1]}]" if len(path) > 1 and path[0] == "params" else None


def refused(d: dict[str, Any], path: tuple[Any, ...]) -> RuleError:
    with pytest.raises(RuleError) as e:
        Rules.from_dict(d)
    message = str(e.value)
    assert field_name(path) in message, (path, message)
    if rule_name(path) is not None:
        assert rule_name(path) in message, (path, message)
    return e.value


MUTATIONS = [(name, path, bad) for name, base in (("valid", VALID), ("global", VALID_GLOBAL))
             for path, value in fields(base) if path != ("format",) for bad in wrong_values(value, field_name(path))]


@pytest.mark.parametrize("base, path, bad", [(b, p, v) for b, p, v in MUTATIONS],
                         ids=[f"{b}:{'.'.join(map(str, p))}={v!r}" for b, p, v in MUTATIONS])
def test_a_wrong_type_or_range_in_any_field_is_refused_by_name(base: str, path: tuple[Any, ...], bad: Any) -> None:
    refused(replaced(VALID if base == "valid" else VALID_GLOBAL, path, bad), path)


def test_unknown_members_are_refused_at_every_level() -> None:
    """An extra member in any mapping (a rule, vocab, a renumbering, a piece, its boxes) or
    an extra TP size key that is no integer."""
    mappings = [(p, v) for p, v in fields(VALID) if isinstance(v, dict)] + [((), VALID)]
    assert len(mappings) > 15
    for path, value in mappings:
        d = replaced(VALID, path, {**value, "bogus": 1}) if path else {**VALID, "bogus": 1}
        with pytest.raises(RuleError, match="bogus"):
            Rules.from_dict(d)


def test_mutations_through_json_files(tmp_path: Path) -> None:
    """Rules.load reads the same checks from a file (a sample of the mutations above)."""
    for i, (base, path, bad) in enumerate(MUTATIONS[::7]):
        if isinstance(bad, float) and bad != bad:
            continue  # (NaN is not JSON)
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(replaced(VALID if base == "valid" else VALID_GLOBAL, path, bad)))
        with pytest.raises(RuleError, match=re.escape(field_name(path))):
            Rules.load(f)


@pytest.mark.parametrize("toml, field", [
    ('[[params]]\nkind = "split"\npatterns = ["a"]\ndim = "1"\n', "'dim' must be an integer >= 0, not '1'"),
    ('[[params]]\nkind = "split"\npatterns = ["a"]\ndim = true\n', "'dim' must be an integer >= 0, not True"),
    ('[[params]]\nkind = "split"\npatterns = 1\n', "'patterns' must be a list"),
    ('[[params]]\nkind = "fused"\npatterns = ["a"]\nsizes = [4, "4"]\n', "'sizes[1]'"),
    ('strict = "false"\n', "'strict' must be true or false"),
    ('[pipeline]\npattern = "l\\\\.(\\\\d+)"\nnum_layers = 2.5\n', "'num_layers' must be an integer >= 1"),
    ('[vocab]\npatterns = ["e"]\nsize = -3\n', "'size' must be an integer >= 1"),
])
def test_toml(tmp_path: Path, toml: str, field: str) -> None:
    f = tmp_path / "rules.toml"
    f.write_text(toml)
    with pytest.raises(RuleError, match=re.escape(field)):
        Rules.load(f)


# --- ranges and cross-field checks that a type change does not reach ----------------------


def rule(**fields: Any) -> dict[str, Any]:
    return {"params": [{"patterns": ["a"], **fields}]}


@pytest.mark.parametrize("d, message", [
    (rule(kind="split", dim=-1), "'dim' must be an integer >= 0, not -1"),
    (rule(kind="split", patterns=[]), "'patterns' must be a non-empty list"),
    (rule(kind="split", patterns=[""]), "'patterns[0]' must be a non-empty regular expression"),
    (rule(kind="split", patterns=["a", "b("]), "'patterns[1]' 'b(' is not a regular expression"),
    (rule(kind="split", sizes=[2, 2]), "unknown member(s) ['sizes']: a split rule takes"),
    (rule(kind="fused", sizes=[2, 2], axis="ep"), "unknown member(s) ['axis']: a fused rule takes"),
    (rule(kind="replicated", dim=0), "unknown member(s) ['dim']: a replicated rule takes"),
    (rule(kind="average", view=[2]), "unknown member(s) ['view']"),
    (rule(kind="pieces", shape=[2], pieces={"1": [[]]}, dim=0), "unknown member(s) ['dim']"),
    (rule(kind="fused", sizes=[]), "'sizes' must be a non-empty list of integers"),
    (rule(kind="fused", sizes=[4, 0]), "'sizes[1]' must be an integer >= 1 or -1, not 0"),
    (rule(kind="fused", sizes=[4, -3]), "'sizes[1]' must be an integer >= 1 or -1, not -3"),
    (rule(kind="grouped", groups=2, sizes=[4, -1]), "'sizes[1]' must be an integer >= 1, not -1"),
    (rule(kind="grouped", groups=0, sizes=[4]), "'groups' must be an integer >= 1, not 0"),
    (rule(kind="grouped", sizes=[4]), "needs 'groups'"),
    (rule(kind="fused", sizes=[2, 2], names=["q", "q"]), "'names' must be a list of distinct non-empty strings"),
    (rule(kind="fused", sizes=[2, 2], names=["q"]), "'names' gives 1 names for 2 sub-parameters"),
    (rule(kind="fused", sizes=[2, 2], view=[]), "'view' must be a non-empty list"),
    (rule(kind="fused", sizes=[2, 2], dim=2, view=[-1, 3]), "'dim' 2 is not a dim of the view"),
    (rule(kind="split", widths={"0": []}), "'widths' is keyed by TP size (an integer >= 1), not '0'"),
    (rule(kind="split", widths={"-2": [1, 1]}), "keyed by TP size"),
    (rule(kind="split", widths={" 2": [1, 1]}), "keyed by TP size"),
    (rule(kind="split", widths={"2": [1, 1, 1]}), "'widths[2]' must give 2 widths, one per rank"),
    (rule(kind="split", widths={"2": [1, -1]}), "'widths[2][1]' must be an integer >= 0, not -1"),
    (rule(kind="fused", sizes=[4, 2], widths={"2": [[2, 2]]}), "'widths[2]' gives widths of 1 sub-parameters"),
    (rule(kind="fused", sizes=[4, 2], widths={"2": [[2, 2], [1, 2]]}), "'widths[2][1]' [1, 2] sums to 3"),
    (rule(kind="pieces", shape=[4], pieces={"2": [[]]}), "gives 1 ranks' pieces for TP size 2"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[_piece([0, 0], [0, 0], [4, 1])]]}), "must have the 1 dims"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[_piece([0], [0], [4], step=[0])]]}), "'pieces[1][0][0].src.step[0]'"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[_piece([0], [0], [4], step=[1, 1])]]}), "one step per dim"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[_piece([0], [-1], [4])]]}), "'pieces[1][0][0].src.offset[0]'"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[{"dst": {"offset": [0], "shape": [4]}}]]}), "needs 'src'"),
    (rule(kind="pieces", shape=[4], pieces={"1": [[_piece([0], [0], [4], base={"start": -1, "shape": [4]})]]}),
     "'pieces[1][0][0].src.base.start' must be an integer >= 0"),
    (rule(kind="pieces", shape=[4]), "a pieces rule needs 'shape' and 'pieces'"),
    ({"vocab": {"patterns": [], "size": 3}}, "'patterns' must be a non-empty list"),
    ({"vocab": {"patterns": ["e"], "size": 0}}, "'size' must be an integer >= 1, not 0"),
    ({"vocab": {}}, "unpadded"),
    ({"rename": [{"pattern": "", "to": "x"}]}, "rename[0]: 'pattern' must be a non-empty regular expression"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "num_layers": 0}}, "'num_layers' must be an integer >= 1, not 0"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "num_layers": 4, "count": 4}}, "give exactly one of count / num_layers"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "num_experts": 4}}, "unknown member(s) ['num_experts']"),
    ({"experts": {"pattern": r"e\.(\d+)", "num_layers": 4}}, "unknown member(s) ['num_layers']"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "offsets": []}}, "'offsets' must be a non-empty list"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "offsets": [0, 3, 2]}}, "'offsets' must be non-decreasing from 0"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "offsets": [1, 3]}}, "'offsets' must be non-decreasing from 0"),
    ({"pipeline": "local"}, "'pipeline' must be a mapping"),
    ({"pipeline_replicated": 3}, "'pipeline_replicated' must be a list"),
    ({"default": "fused"}, "default must be 'split', 'replicated' or 'error'"),
    ({"strict": None}, "'strict' must be true or false"),
    ({"params": {"kind": "split"}}, "'params' must be a list"),
])
def test_ranges(d: dict[str, Any], message: str) -> None:
    with pytest.raises(RuleError, match=re.escape(message)):
        Rules.from_dict(d)


def test_integral_floats_are_integers() -> None:
    """JSON writers may write 2 as 2.0: read as the integer (2.5 is refused above)."""
    rules = Rules.from_dict({"params": [{"kind": "split", "patterns": ["a"], "dim": 1.0}],
                             "pipeline": {"pattern": r"l\.(\d+)", "offsets": [0, 2.0]}})
    assert rules.params[0].dim == 1 and rules.pipeline == Renumber(r"l\.(\d+)", offsets=(0, 2))


# --- rules not read from a dict ----------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: Rules((ParamRule("split", ("a",), dim=True),)), "'dim' must be an integer >= 0, not True"),
    (lambda: Rules((ParamRule("split", ("a",), dim=-1),)), "'dim' must be an integer >= 0, not -1"),
    (lambda: Rules((ParamRule("fused", ("a",), sizes=(2, True)),)), "'sizes[1]'"),
    (lambda: Rules(vocab_patterns=("e",), vocab_size=True), "'size' must be an integer >= 1, not True"),
    (lambda: Rules(strict="no"), "'strict' must be true or false"),  # type: ignore[arg-type]
    (lambda: Rules(pipeline=Renumber(r"l\.(\d+)", offsets=(0, 4, 2))), "non-decreasing"),
    (lambda: Rules(pipeline="everywhere"), "'pipeline' must be a mapping"),
])
def test_rules_built_in_python_are_checked(make: Any, message: str) -> None:
    with pytest.raises(RuleError, match=re.escape(message)):
        make()


@pytest.mark.parametrize("info, message", [
    ({"parameter_with_sub_params": [{"patterns": ["a"], "shape": [[4, "4"], -1], "partition_dim": 0}]}, "'4' is not an integer"),
    ({"parameter_with_sub_params": [{"patterns": ["a"], "shape": [[4, True], -1], "partition_dim": 0}]}, "True is not an integer"),
    ({"parameter_with_sub_params": [{"patterns": ["a"], "shape": [-1, [4, 4]], "partition_dim": True}]},
     "'dim' must be an integer >= 0, not True"),
    ({"vocabulary_parameter_patterns": ["e"], "original_vocab_size": True}, "'size' must be an integer >= 1, not True"),
    ({"vocabulary_parameter_patterns": ["e"], "original_vocab_size": 0}, "'size' must be an integer >= 1, not 0"),
    ({"universal_checkpoint_version": 0.4, "sub_param_shard_widths": {"a": [[2, True], [1, 1]]},
      "parameter_with_sub_params": [{"patterns": ["a"], "shape": [[3, 2], -1], "partition_dim": 0}]}, "True is not an integer"),
    ({"parameter_with_row_parallelism_patterns": [""]}, "'patterns[0]' must be a non-empty regular expression"),
])
def test_rules_from_deepspeed_are_checked(info: dict[str, Any], message: str) -> None:
    with pytest.raises(RuleError, match=re.escape(message)):
        Rules.from_deepspeed({"universal_checkpoint_version": 0.2} | info)


# --- generated rules ------------------------------------------------------------------------

ints = st.integers(1, 64)


@st.composite
def param_rules(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["split", "fused", "grouped", "replicated", "average"]))
    d: dict[str, Any] = {"kind": kind, "patterns": draw(st.lists(st.from_regex(r"[a-z]{1,6}(\\\.[a-z]{1,6})?", fullmatch=True),
                                                              min_size=1, max_size=3))}
    if kind in ("split", "fused", "grouped") and draw(st.booleans()):
        d["dim"] = draw(st.integers(0, 3))
    if kind == "split":
        if draw(st.booleans()):
            d["axis"] = draw(st.sampled_from(["tp", "ep"]))
        if draw(st.booleans()):
            tp = draw(st.integers(1, 4))
            d["widths"] = {str(tp): draw(st.lists(st.integers(0, 9), min_size=tp, max_size=tp))}
    if kind in ("fused", "grouped"):
        n = draw(st.integers(1, 3))
        d["sizes"] = draw(st.lists(ints if kind == "grouped" else st.one_of(ints, st.just(-1)), min_size=n, max_size=n))
        if draw(st.booleans()):
            d["names"] = [f"s{j}" for j in range(n)]
    if kind == "grouped":
        d["groups"] = draw(ints)
    return d


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_generated_rules_and_one_wrong_field(data: st.DataObject) -> None:
    """Random valid rules are accepted and written back; one field of them changed to a
    value of another type (or out of range) is refused, naming the rule and the field."""
    d = {"params": data.draw(st.lists(param_rules(), max_size=4)), "strict": data.draw(st.booleans())}
    rules = Rules.from_dict(d)
    assert Rules.from_dict(rules.to_dict()) == rules
    path, value = data.draw(st.sampled_from(list(fields(d))))
    refused(replaced(d, path, data.draw(st.sampled_from(wrong_values(value, field_name(path))))), path)
