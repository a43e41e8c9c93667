"""``ucp_zarr.layout.affine`` against DeepSpeed's own ``ParamAffineMap.rebuild`` as the oracle.

Every map kind of DeepSpeed 0.19.8's ``deepspeed/checkpoint/affine.py`` (replicated,
contiguous split, sub-parameters, segmented, block gather), built by DeepSpeed's own builders
with random arguments; the shards cut by DeepSpeed's ``extract``; the consolidated tensor
placed by our pieces must equal ``rebuild``'s, element for element. Then fuzzed maps: where
DeepSpeed rebuilds one (after its coverage check), we place it identically or refuse it by
name; where DeepSpeed refuses one, so do we.

``affine.py`` is loaded from DeepSpeed's installed source by path (it imports only torch), so
this module does not pay for ``import deepspeed``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp_zarr
from ucp_zarr.layout.affine import AffineMapError, affine_layout


def _deepspeed_affine() -> Any:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepspeed is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "checkpoint" / "affine.py"
    mod_spec = importlib.util.spec_from_file_location("_ds_affine", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


A = _deepspeed_affine()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _json(m: Any) -> dict[str, Any]:
    """The map as a checkpoint holds it after a JSON round trip (rank keys become strings)."""
    return json.loads(json.dumps(m.to_dict()))


def _place(entry: dict[str, Any], shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """The consolidated tensor from the shards, by our pieces."""
    layout = affine_layout(entry)
    out = torch.full(layout.shape, float("nan"))
    for rank, pieces in enumerate(layout.pieces):
        assert tuple(shards[rank].shape) == layout.shard_shapes[rank]
        for p in pieces:
            out[p.dst.slices()] = shards[rank][p.src.slices()]
    return out


def _check(m: Any) -> None:
    full = torch.randn(m.logical_shape) if math.prod(m.logical_shape) else torch.empty(m.logical_shape)
    shards = {r: m.extract(full, r) for r in m.shard_shapes}
    want = m.rebuild(dict(shards))
    assert torch.equal(want, full)
    got = _place(_json(m), shards)
    assert torch.equal(got, want)


def _widths(draw: Any, total: int, tp: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=tp - 1, max_size=tp - 1)))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


@st.composite
def shapes(draw: Any, dim_size: int | None = None) -> tuple[tuple[int, ...], int]:
    ndim = draw(st.integers(1, 3))
    shape = list(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(0, ndim - 1))
    if dim_size is not None:
        shape[dim] = dim_size
    return tuple(shape), dim


@given(st.data())
@SETTINGS
def test_replicated_and_contiguous_maps(data: Any) -> None:
    tp = data.draw(st.integers(1, 4))
    shape, dim = data.draw(shapes())
    _check(A.replicated_map(shape, tp))
    _check(A.contiguous_split_map(shape, _widths(data.draw, shape[dim], tp), dim))


@given(st.data())
@SETTINGS
def test_sub_param_maps(data: Any) -> None:
    tp = data.draw(st.integers(1, 4))
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    shape, dim = data.draw(shapes(sum(sizes)))
    widths = [_widths(data.draw, n, tp) for n in sizes]
    _check(A.sub_param_map(shape, sizes, widths, dim))


@given(st.data())
@SETTINGS
def test_segmented_maps(data: Any) -> None:
    """GPTBigCode's fused QKV is the case: query rows split (unevenly, by head), the key/value
    block held whole by every rank."""
    tp = data.draw(st.integers(1, 4))
    segments = data.draw(st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=4))
    shape, dim = data.draw(shapes(sum(n for n, _ in segments)))
    widths = [_widths(data.draw, n, tp) for n, replicated in segments if not replicated]
    _check(A.segmented_map(shape, segments, dim, tp, widths))


@given(st.data())
@SETTINGS
def test_block_gather_maps(data: Any) -> None:
    """CodeGen's fused QKV and Yuan's shared QK: each rank gathers equal blocks, out of order."""
    tp = data.draw(st.integers(1, 4))
    blocks = data.draw(st.integers(tp, 12))
    order = data.draw(st.permutations(list(range(blocks))))
    cuts = sorted(data.draw(st.lists(st.integers(1, blocks - 1), min_size=tp - 1, max_size=tp - 1, unique=True))) \
        if tp > 1 else []
    bounds = [0] + cuts + [blocks]
    ids = {r: list(order[bounds[r]:bounds[r + 1]]) for r in range(tp)}
    block = data.draw(st.integers(1, 3))
    shape, dim = data.draw(shapes(blocks * block))
    _check(A.block_gather_map(shape, ids, block, dim))


# --- fuzzed maps ------------------------------------------------------------------------------


def _mutations(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for rank, value in entry["ranks"].items():
        for i, piece in enumerate(value["pieces"]):
            for field, change in (("source", lambda v: [v[0] + 1, v[1]]), ("source", lambda v: [v[0] - 1, v[1]]),
                                  ("dest", lambda v: [v[0] + 1, v[1]]), ("locations", lambda v: v[:1]),
                                  ("locations", lambda v: sorted(set(v) | {int(rank) + 1})),
                                  ("shape", lambda v: [max(0, v[0] - 1)] + v[1:]),
                                  ("source", lambda v: [v[0], [s * 2 for s in v[1]]])):
                e = copy.deepcopy(entry)
                e["ranks"][rank]["pieces"][i][field] = change(e["ranks"][rank]["pieces"][i][field])
                out.append((f"rank {rank} piece {i} {field}", e))
            e = copy.deepcopy(entry)
            del e["ranks"][rank]["pieces"][i]
            out.append((f"rank {rank} piece {i} dropped", e))
        e = copy.deepcopy(entry)
        e["ranks"][rank]["shard_shape"] = [n + 1 for n in value["shard_shape"]]
        out.append((f"rank {rank} shard shape", e))
    return out


def _deepspeed_accepts(entry: dict[str, Any]) -> bool:
    try:
        m = A.ParamAffineMap.from_dict(entry)
        m.validate_coverage()
        return True
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, RuntimeError):
        return False


@pytest.mark.parametrize("build", [
    lambda: A.segmented_map((5, 3), [(3, False), (2, True)], 0, 2, [[2, 1]]),
    lambda: A.block_gather_map((6, 2), {0: [4, 1, 2], 1: [0, 5, 3]}, 1, 0),
    lambda: A.sub_param_map((4, 7), [4, 3], [[2, 2], [1, 2]], 1),
    lambda: A.replicated_map((3, 2), 3),
], ids=["segmented", "block_gather", "sub_param", "replicated"])
def test_fuzzed_maps_are_placed_like_deepspeed_or_refused(build: Any) -> None:
    """A mutated map DeepSpeed refuses is refused; one it rebuilds is placed identically, or
    refused by name (this library is stricter: a shard element used twice, strides that are
    no box); never placed otherwise."""
    m = build()
    full = torch.randn(m.logical_shape)
    compared = 0
    for what, entry in _mutations(_json(m)):
        if not _deepspeed_accepts(entry):
            with pytest.raises(AffineMapError):
                affine_layout(entry)
            continue
        try:
            ours = affine_layout(entry)
        except AffineMapError:
            continue
        mutated = A.ParamAffineMap.from_dict(entry)
        cut = {r: mutated.extract(full, r) for r in mutated.shard_shapes}
        want = mutated.rebuild(dict(cut))
        got = torch.full(ours.shape, float("nan"))
        for rank, pieces in enumerate(ours.pieces):
            for p in pieces:
                got[p.dst.slices()] = cut[rank][p.src.slices()]
        assert torch.equal(got, want), what
        compared += 1
    assert compared >= 1


@pytest.mark.parametrize("change, match", [
    (lambda e: e["ranks"]["0"]["pieces"][0].__setitem__("scale", 0.5), "scaled piece"),
    (lambda e: e["ranks"]["0"]["pieces"][0].__setitem__("stride", 1), r"unknown field\(s\) \['stride'\]"),
    (lambda e: e.__setitem__("kind", "block_gather"), r"unknown field\(s\) \['kind'\]"),
    (lambda e: e["ranks"].pop("1"), "as its holders"),
    (lambda e: e["ranks"]["1"]["pieces"][1].__setitem__("locations", [1]), "held by ranks"),
    (lambda e: e.__setitem__("logical_shape", [5, "x"]), "not an integer"),
    (lambda e: e["ranks"]["0"].__setitem__("pieces", None), "must be a list"),
])
def test_refusals_name_the_field(change: Any, match: str) -> None:
    entry = _json(A.segmented_map((5, 3), [(3, False), (2, True)], 0, 2, [[2, 1]]))
    change(entry)
    with pytest.raises(AffineMapError, match=match):
        affine_layout(entry)


def test_rules_refuse_other_versions_and_autoep() -> None:
    entry = _json(A.replicated_map((2,), 2))
    info = {"universal_checkpoint_version": 0.4, "affine_map": {"version": 2, "params": {"^a$": entry}}}
    with pytest.raises(ucp_zarr.RuleError, match="affine_map format version 2"):
        ucp_zarr.Rules.from_deepspeed(info)
    with pytest.raises(ucp_zarr.RuleError, match="AutoEP"):
        ucp_zarr.Rules.from_deepspeed({"universal_checkpoint_version": 0.4, "ds_autoep_layers": [{"moe_layer_id": 0}]})
    bad = copy.deepcopy(entry)
    bad["ranks"]["0"]["pieces"][0]["scale"] = 2.0
    info["affine_map"] = {"version": 1, "params": {"^a$": bad}}
    with pytest.raises(ucp_zarr.RuleError, match=r"affine map of '\^a\$': .*scaled piece"):
        ucp_zarr.Rules.from_deepspeed(info)


def test_an_affine_map_takes_precedence_over_the_categories() -> None:
    """AutoTP publishes a map beside the category patterns; DeepSpeed's converter prefers the
    map (a GPTBigCode QKV also falls to the default dim-0 split, which misplaces it)."""
    m = A.segmented_map((6, 2), [(4, False), (2, True)], 0, 2, [[2, 2]])
    full = torch.randn(6, 2)
    info = {"universal_checkpoint_version": 0.4, "tp_replicated_parameter_patterns": [r"^w$"],
            "affine_map": {"version": 1, "params": {r"^w$": _json(m)}}}
    rules = ucp_zarr.Rules.from_deepspeed(info)
    out = torch.full((6, 2), float("nan"))
    for rank in range(2):
        shard = m.extract(full, rank)
        for p in ucp_zarr.place({"w": shard}, rules, tp_rank=rank, tp_size=2)["w"].pieces:
            out[p.dst.slices()] = shard[p.src.slices()]
    assert torch.equal(out, full)


def test_what_an_affine_map_does_not_name_is_whole_on_every_rank() -> None:
    """AutoTP's map names every parameter it splits or keeps; a buffer and a tied weight's
    alias (``lm_head.weight`` of a tied Falcon: DeepSpeed maps the embedding alone) it leaves
    whole on every rank. They were placed by the default rule, split on dim 0: saved stacked
    twice ((200, 32) for a (100, 32) head), nothing said. Now whole, compared at save."""
    emb, w = torch.randn(100, 32), torch.randn(8, 4)
    maps = {r"^emb$": _json(A.replicated_map((100, 32), 2)), r"^w$": _json(A.contiguous_split_map((8, 4), [4, 4], 0))}
    rules = ucp_zarr.Rules.from_deepspeed({"universal_checkpoint_version": 0.4, "affine_map": {"version": 1, "params": maps}})
    for rank in range(2):
        placed = ucp_zarr.place({"emb": emb, "head": emb, "buf": torch.ones(3, 4), "w": w[4 * rank : 4 * rank + 4]}, rules,
                                tp_rank=rank, tp_size=2)
        shapes = {k: placed[k].global_shape for k in ("emb", "head", "buf", "w")}
        assert shapes == {"emb": (100, 32), "head": (100, 32), "buf": (3, 4), "w": (8, 4)}, shapes
    assert ucp_zarr.Rules.from_deepspeed({"universal_checkpoint_version": 0.4}).default == "split"  # (Megatron-DeepSpeed's)
