"""place() with a plain ``optimizer.state_dict()``: state keyed by parameter number.

A real ``torch.optim.Adam`` over a TP-sharded model takes a step; its moments must be placed
exactly as their parameter is (here a fused ``[q; k; v]`` vector, a row-parallel weight and a
replicated norm), whether the numbers are named by ``param_names`` (the optimizer was built
from ``named_parameters()``) or by the model's parameter order (``place(..., model=)``), and
refused by name otherwise. The reference is the same step taken by an unsharded model (Adam
is elementwise, so its moments are bit-identical however the parameters are sharded).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import Placed, RuleError, Rules, place

RULES = {"params": [{"kind": "fused", "patterns": [r"attn\.qkv"], "dim": 0, "sizes": [4, 2, 2]},
                    {"kind": "split", "patterns": [r"proj\.weight"], "dim": 1},
                    {"kind": "replicated", "patterns": [r"norm\.weight"]}]}
MOMENTS = {"Adam": ("exp_avg", "exp_avg_sq", "step"), "SGD": ("momentum_buffer",)}


def consolidated() -> dict[str, torch.Tensor]:
    return {"attn.qkv": torch.arange(8.0), "proj.weight": torch.arange(12.0).reshape(3, 4) / 4,
            "norm.weight": torch.tensor([0.5, 1.5, 2.5])}


def shard(name: str, t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    """Rank ``r``'s local tensor as the trainer holds it (Megatron's conventions)."""
    if name == "attn.qkv":  # each of q (4), k (2), v (2) split over the ranks, concatenated
        return torch.cat([part.chunk(tp)[r] for part in t.split([4, 2, 2])])
    if name == "proj.weight":
        return t.chunk(tp, 1)[r]
    return t.clone()


def net(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named_parameters() are ``params``, in order."""
    m = torch.nn.Module()
    for name, t in params.items():
        mod, attr = name.split(".")
        if not hasattr(m, mod):
            m.add_module(mod, torch.nn.Module())
        getattr(m, mod).register_parameter(attr, torch.nn.Parameter(t.clone()))
    return m


def trained(params: dict[str, torch.Tensor], named: bool, kind: str = "Adam") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One step of Adam (moments and a 0-d step) or SGD with momentum (a momentum buffer, no
    scalar) on ``0.5 * sum(p^2)`` (gradient ``p``)."""
    m = net(params)
    named_or_not = m.named_parameters() if named else m.parameters()
    opt = torch.optim.Adam(named_or_not, lr=0.1) if kind == "Adam" else torch.optim.SGD(named_or_not, lr=0.1, momentum=0.9)
    sum(0.5 * (p * p).sum() for p in m.parameters()).backward()
    opt.step()
    return m, opt


def state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": m.state_dict(), "optim": opt.state_dict()}


def local_params(r: int, tp: int) -> dict[str, torch.Tensor]:
    return {n: shard(n, t, r, tp) for n, t in consolidated().items()}


def _save_tp2(rank: int, world: int, path: str, named: bool, kind: str) -> None:
    m, opt = trained(local_params(rank, world), named, kind)
    ucp_zarr.save(place(state(m, opt), Rules.from_dict(RULES), tp_rank=rank, tp_size=world, **by_order(named, m)), path)


def by_order(named: bool, m: torch.nn.Module) -> dict[str, Any]:
    """place()'s ``model`` argument when the optimizer's numbers follow the model's order."""
    return {} if named else {"model": m}


@pytest.mark.parametrize("named, kind", [(True, "Adam"), (False, "SGD")], ids=["param_names-Adam", "model-order-SGD"])
def test_moments_saved_at_tp2_load_at_tp1_beside_their_parameters(tmp_path: Path, named: bool, kind: str) -> None:
    """Saved from two gloo ranks, loaded into an unsharded model and optimizer: every moment
    is the unsharded run's, bit for bit (before the fix Adam's 0-d steps were refused as
    parameter '0.step', and the momentum buffers were stored by the default rule: the fused
    vector's permuted, the others' in shapes that do not load)."""
    run(2, _save_tp2, str(tmp_path / "ck"), named, kind, timeout_s=60)
    ref_model, ref_opt = trained(consolidated(), named, kind)
    m, opt = trained({n: torch.zeros_like(t) for n, t in consolidated().items()}, named, kind)
    sd = state(m, opt)
    ucp_zarr.load(place(sd, Rules.from_dict(RULES), **by_order(named, m)), tmp_path / "ck")
    opt.load_state_dict(sd["optim"])
    for (name, p), ref in zip(m.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, ref), name
        for k in MOMENTS[kind]:
            assert torch.equal(opt.state[p][k], ref_opt.state[ref][k]), (name, k)
    keys = set(ucp_zarr.open(tmp_path / "ck").keys())
    assert keys >= {f"optim.state.{n}.{k}" for n in consolidated() for k in MOMENTS[kind]}, keys
    assert (tmp_path / "ck" / "attn.qkv" / f"optim.{MOMENTS[kind][0]}" / "zarr.json").is_file()  # beside its parameter


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_fused_moments_are_not_permuted(kind: str) -> None:
    """The issue's case, placed on both TP ranks in one process: the fused vector's moments
    tile the consolidated tensor exactly as the parameter does (before the fix, SGD's
    momentum came out as [0, 1, 4, 6, 2, 3, 5, 7], silently)."""
    rules = Rules.from_dict(RULES)
    placed = [place(state(*trained(local_params(r, 2), True, kind)), rules, tp_rank=r, tp_size=2) for r in range(2)]
    ref_model, ref_opt = trained(consolidated(), True, kind)
    ref = ref_model.attn.qkv
    assert torch.equal(assemble([p["model"]["attn.qkv"] for p in placed]), ref)
    for k in MOMENTS[kind]:
        moments = [p["optim"]["state"][0][k] for p in placed]
        assert {m.key for m in moments} == {f"optim.state.attn.qkv.{k}"}
        if k != "step":
            assert [m.pieces for m in moments] == [p["model"]["attn.qkv"].pieces for p in placed]
            got = assemble(moments)
            assert torch.equal(got, ref_opt.state[ref][k]), (k, got.tolist())


def assemble(placed: list[Placed]) -> torch.Tensor:
    """The consolidated tensor the ranks' pieces describe (plain boxes only)."""
    out = torch.full(placed[0].global_shape, float("nan"))
    for pl in placed:
        for p in pl.pieces:
            src = tuple(slice(o, o + n) for o, n in zip(p.src.offset, p.src.shape))
            out[tuple(slice(o, o + n) for o, n in zip(p.dst.offset, p.dst.shape))] = pl.local[src]
    return out


@pytest.mark.parametrize("where", ["nested", "root"])
def test_unnamed_numbers_are_refused(where: str) -> None:
    """An optimizer built from ``parameters()``, placed without the model: which parameter
    state 0 belongs to is unknowable, so place() refuses, naming the key and the fixes."""
    m, opt = trained(local_params(0, 2), named=False)
    sd = state(m, opt) if where == "nested" else opt.state_dict()
    key = "optim.state.0" if where == "nested" else "state.0"
    with pytest.raises(RuleError, match=re.escape(repr(key))) as e:
        place(sd, Rules.from_dict(RULES), tp_size=2)
    assert "named_parameters" in str(e.value) and "model=" in str(e.value)


def test_numbers_named_by_the_model_order_are_checked() -> None:
    """``model=`` names the numbers by ``model.named_parameters()`` only when the optimizer
    holds exactly the model's parameters, in order, with their shapes."""
    m, _ = trained(local_params(0, 2), named=False)
    sub = torch.optim.Adam([m.proj.weight, m.norm.weight])  # not every parameter: numbers != order
    sum(0.5 * (p * p).sum() for p in m.parameters()).backward()
    sub.step()
    with pytest.raises(RuleError, match="'optim.state.0'"):
        place(state(m, sub), Rules.from_dict(RULES), tp_size=2, model=m)


def test_param_names_that_are_not_the_models_are_refused() -> None:
    """Names from param_names that are not the state dict's parameters (an optimizer built on
    a wrapper, ``module.attn.qkv``) would take another rule than their parameter: refused."""
    wrapper = torch.nn.Module()
    wrapper.add_module("module", net(local_params(0, 2)))
    opt = torch.optim.Adam(wrapper.named_parameters())
    sum(0.5 * (p * p).sum() for p in wrapper.parameters()).backward()
    opt.step()
    sd = {"model": wrapper.module.state_dict(), "optim": opt.state_dict()}
    with pytest.raises(RuleError, match=re.escape("'module.attn.qkv'")):
        place(sd, Rules.from_dict(RULES), tp_size=2)


def test_optimizer_alone_is_placed_by_its_names() -> None:
    """A bare ``optimizer.state_dict()`` with param_names is placed by the names' rules."""
    rules = Rules.from_dict(RULES)
    placed = [place(trained(local_params(r, 2), named=True)[1].state_dict(), rules, tp_rank=r, tp_size=2)
              for r in range(2)]
    assert placed[0]["state"][0]["exp_avg"].key == "state.attn.qkv.exp_avg"
    assert torch.equal(assemble([p["state"][0]["exp_avg"] for p in placed]), 0.1 * torch.arange(8.0))
    assert torch.equal(assemble([p["state"][1]["exp_avg"] for p in placed]), 0.1 * consolidated()["proj.weight"])
