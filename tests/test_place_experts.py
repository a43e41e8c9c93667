"""A mixture-of-experts layer saved through rules at EP=2 x TP=2, loaded at other EP and TP
degrees (real gloo jobs).

The reference sharding below is written independently of ucp_zarr: experts numbered
locally per expert-parallel rank (local expert ``i`` on EP rank ``e`` is global expert
``e * E / ep + i``), each expert's SwiGLU ``fc1`` fused ``[gate_r; up_r]`` and its ``fc2``
row-parallel over TP, grouped-GEMM weights stacked over experts and split over EP
(replicated over TP), a router replicated everywhere, and an attention projection split over
TP (replicated over EP). After ``place`` + ``save`` at EP2 x TP2, ``open(path)[key]`` equals
the consolidated tensor for parameters and Adam moments; after ``place`` + ``load`` at EP4,
EP1 x TP2 and on one process, every local tensor equals the reference shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import Rules, place

E, H, F = 4, 8, 12  # experts, hidden, expert FFN width
L = r"layers\.\d+\.mlp\."
RULES = {
    "params": [
        {"kind": "fused", "patterns": [L + r"experts\.local_experts\.\d+\.fc1\.weight"], "sizes": [-1, -1]},
        {"kind": "split", "dim": 1, "patterns": [L + r"experts\.local_experts\.\d+\.fc2\.weight"]},
        {"kind": "split", "axis": "ep", "patterns": [L + r"experts\.weight1"]},
        {"kind": "replicated", "patterns": [L + r"router\.weight"]},
    ],
    "experts": {"pattern": L + r"experts\.local_experts\.(\d+)\.", "num_experts": E},
}
STEP = 3.0


def consolidated() -> dict[str, dict[str, torch.Tensor]]:
    """The consolidated (EP=1, TP=1) parameters and Adam moments of one MoE layer."""
    g = torch.Generator().manual_seed(0)
    params = {"layers.0.attn.qkv.weight": torch.randn(3 * H, H, generator=g),
              "layers.0.mlp.router.weight": torch.randn(E, H, generator=g),
              "layers.0.mlp.experts.weight1": torch.randn(E, H, F, generator=g)}
    for e in range(E):
        params[f"layers.0.mlp.experts.local_experts.{e}.fc1.weight"] = torch.randn(2 * F, H, generator=g)
        params[f"layers.0.mlp.experts.local_experts.{e}.fc2.weight"] = torch.randn(H, F, generator=g)
    return {"param": params,
            "exp_avg": {k: torch.randn(v.shape, generator=g) for k, v in params.items()},
            "exp_avg_sq": {k: torch.rand(v.shape, generator=g) for k, v in params.items()}}


def _rows(t: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // n
    return t.narrow(dim, r * size, size).clone()


def local(glob: dict[str, torch.Tensor], ep: int, ep_size: int, tp: int, tp_size: int) -> dict[str, torch.Tensor]:
    """What EP rank ``ep``, TP rank ``tp`` holds of ``glob`` (local expert numbering)."""
    per = E // ep_size
    out = {"layers.0.attn.qkv.weight": _rows(glob["layers.0.attn.qkv.weight"], tp, tp_size),
           "layers.0.mlp.router.weight": glob["layers.0.mlp.router.weight"].clone(),
           "layers.0.mlp.experts.weight1": glob["layers.0.mlp.experts.weight1"][ep * per:(ep + 1) * per].clone()}
    for i in range(per):
        g, lo = "layers.0.mlp.experts.local_experts.", f"layers.0.mlp.experts.local_experts.{i}."
        gate, up = glob[f"{g}{ep * per + i}.fc1.weight"].split(F)
        out[lo + "fc1.weight"] = torch.cat([_rows(gate, tp, tp_size), _rows(up, tp, tp_size)])
        out[lo + "fc2.weight"] = _rows(glob[f"{g}{ep * per + i}.fc2.weight"], tp, tp_size, dim=1)
    return out


def local_state(ep: int, ep_size: int, tp: int, tp_size: int, fill: float | None = None) -> dict[str, Any]:
    glob = consolidated()
    shards = {k: local(g, ep, ep_size, tp, tp_size) for k, g in glob.items()}
    if fill is not None:
        shards = {k: {n: torch.full_like(t, fill) for n, t in s.items()} for k, s in shards.items()}
    state = {n: {"exp_avg": shards["exp_avg"][n], "exp_avg_sq": shards["exp_avg_sq"][n],
                 "step": torch.tensor(STEP if fill is None else fill)} for n in shards["param"]}
    return {"model": shards["param"], "optim": {"state": state}}


def coords(rank: int, tp_size: int) -> tuple[int, int]:
    """(EP rank, TP rank): TP fastest."""
    return rank // tp_size, rank % tp_size


def _save(rank: int, world: int, path: str, tp_size: int) -> None:
    ep, tp = coords(rank, tp_size)
    sd = local_state(ep, world // tp_size, tp, tp_size)
    ucp_zarr.save(place(sd, Rules.from_dict(RULES), tp_rank=tp, tp_size=tp_size, ep_rank=ep,
                        ep_size=world // tp_size), path)


def _load(rank: int, world: int, path: str, tp_size: int) -> None:
    ep, tp = coords(rank, tp_size)
    ep_size = world // tp_size
    target = local_state(ep, ep_size, tp, tp_size, fill=-7.0)
    placed = place(target, Rules.from_dict(RULES), tp_rank=tp, tp_size=tp_size, ep_rank=ep, ep_size=ep_size)
    ucp_zarr.load(placed, path)
    want = local_state(ep, ep_size, tp, tp_size)
    for n, t in want["model"].items():
        assert torch.equal(target["model"][n], t), (rank, n)
        for m, s in want["optim"]["state"][n].items():
            assert torch.equal(target["optim"]["state"][n][m], s), (rank, n, m)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "ck"
    run(4, _save, str(path), 2, timeout_s=120)
    return path


def test_open_holds_the_consolidated_experts(saved: Path) -> None:
    ck = ucp_zarr.open(saved)
    glob = consolidated()
    for n, t in glob["param"].items():
        assert torch.equal(ck[f"model.{n}"][...], t), n
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ck[f"optim.state.{n}.{m}"][...], glob[m][n]), (n, m)
    assert ck.meta.tensors["model.layers.0.mlp.experts.weight1"].rule == {"kind": "split"}
    assert len([k for k in ck if k.startswith("model.layers.0.mlp.experts.local_experts.")]) == 2 * E


@pytest.mark.parametrize("world, tp_size", [(4, 1), (2, 2), (1, 1)], ids=["EP4", "EP1xTP2", "one-process"])
def test_load_at_other_expert_and_tensor_parallel_degrees(saved: Path, world: int, tp_size: int) -> None:
    run(world, _load, str(saved), tp_size, timeout_s=120)


def test_an_expert_count_the_ep_degree_cannot_divide_is_refused(saved: Path) -> None:
    target = local_state(0, 1, 0, 1, fill=0.0)
    with pytest.raises(ucp_zarr.RuleError, match="experts"):
        place(target, Rules.from_dict(RULES), ep_rank=0, ep_size=3)
