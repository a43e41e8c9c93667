"""A Megatron-style GPT saved through rules on one 3-D layout, loaded on others (real gloo jobs).

The reference (``megatron_ref``, written independently of ucp_zarr) builds the consolidated
(TP=1) parameters and Adam moments, and shards them the Megatron way: fused QKV with
grouped-query attention stored per TP rank as ``[q_r; k_r; v_r]``, fused SwiGLU
``[gate_r; up_r]``, a vocabulary padded per TP degree, row-parallel output projections,
TP-replicated norms, layers renumbered from 0 on every pipeline stage, the output layer
tied to the embedding on the last stage, and a distributed optimizer holding flat ranges
of the TP-local parameters over DP. After ``place`` + ``save`` on one layout,
``open(path)[key]`` equals the consolidated tensor bit for bit, for parameters and every
optimizer state; after ``place`` + ``load`` on another layout (other TP, PP and DP degrees,
one process, a world of 3 ranks), every local tensor equals the reference shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import megatron_ref as M
import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import FlatShard, Rules, place

CFG = M.GPTConfig(num_layers=4, hidden=32, num_heads=4, num_kv_heads=2, ffn_hidden=48, vocab_size=50,
                  make_vocab_size_divisible_by=8, seq_len=8)
STEP = 5.0


def megatron_rules(cfg: M.GPTConfig, pp: int) -> Rules:
    """The rules of this model (the tied output layer exists only when PP > 1)."""
    return Rules.from_dict(M.rules_dict(cfg, pp))


def consolidated(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """The consolidated parameters and Adam moments."""
    glob = M.global_params(CFG, seed)
    g = torch.Generator().manual_seed(seed + 1)
    m1 = {k: torch.randn(v.shape, generator=g) for k, v in glob.items()}
    m2 = {k: torch.rand(v.shape, generator=g) for k, v in glob.items()}
    return {"param": glob, "exp_avg": m1, "exp_avg_sq": m2}


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """Megatron's rank order: TP fastest, then DP, then PP."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def local_state(glob: dict[str, dict[str, torch.Tensor]], tp: int, pp: int, dp: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of a TPxPPxDP Megatron job holds (the reference sharding)."""
    tp_rank, dp_rank, pp_rank = coords(rank, tp, pp, dp)
    shards = {k: M.shard_params(g, CFG, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank) for k, g in glob.items()}
    if pp == 1:  # one stage: the output layer is the embedding itself (one parameter)
        for s in shards.values():
            s.pop(M.OUTPUT_LAYER, None)
    params = shards["param"]
    state: dict[str, Any] = {}
    for name, rng in M.dp_flat_ranges(params, dp, dp_rank).items():
        state[name] = {
            k: FlatShard(M.flat_slice(shards[k][name], rng), tuple(params[name].shape), rng[0])
            for k in ("exp_avg", "exp_avg_sq")
        } | {"step": torch.tensor(STEP)}
    return {"model": params, "optim": {"state": state}}


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, FlatShard):
            return FlatShard(torch.full_like(v.local, -1.0), v.global_shape, v.flat_offset)
        return torch.full_like(v, -1.0)

    return z(state)


def assert_equal_states(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(b, dict):
            assert set(a) == set(b), (where, key)
            for k in b:
                walk(a[k], b[k], f"{key}.{k}")
        else:
            ta, tb = (a.local, b.local) if isinstance(b, FlatShard) else (a, b)
            assert torch.equal(ta, tb), f"{where}: {key} differs from the reference shard"

    walk(got, want, "")


def _save(rank: int, world: int, path: str, tp: int, pp: int, dp: int) -> None:
    state = local_state(consolidated(), tp, pp, dp, rank)
    tp_rank, _, pp_rank = coords(rank, tp, pp, dp)
    ucp_zarr.save(place(state, megatron_rules(CFG, pp), tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp), path)


def _load(rank: int, world: int, path: str, tp: int, pp: int, dp: int) -> None:
    want = local_state(consolidated(), tp, pp, dp, rank)
    got = zeros_like_state(want)
    tp_rank, _, pp_rank = coords(rank, tp, pp, dp)
    ucp_zarr.load(place(got, megatron_rules(CFG, pp), tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp), path)
    assert_equal_states(got, want, f"rank {rank} of TP{tp} PP{pp} DP{dp}")


def _check_consolidated(path: Path) -> None:
    glob = consolidated()
    ck = ucp_zarr.open(path)
    for name, t in glob["param"].items():
        assert torch.equal(ck[f"model.{name}"][...], t), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ck[f"optim.state.{name}.{k}"][...], glob[k][name]), (name, k)
        assert float(ck[f"optim.state.{name}.step"][...]) == STEP
    assert len(ck) == 4 * len(glob["param"])
    assert ck.meta.layout["rules"]["format"] == "ucp_zarr.rules/1"
    qkv = ck.meta.tensors["model.decoder.layers.3.self_attention.linear_qkv.weight"]
    assert qkv.rule == {"kind": "fused", "dim": 0, "sizes": [32, 16, 16]}
    assert ck.meta.tensors["model.embedding.word_embeddings.weight"].rule == {"kind": "split", "vocab": CFG.vocab_size}


SAVES = {"tp2pp2": (2, 2, 1), "tp2dp2": (2, 1, 2), "pp2dp2": (1, 2, 2)}
LOADS = [  # (saved layout, TP, PP, DP of the load): other TP, PP and DP degrees, one process, 3 ranks
    ("tp2pp2", 1, 1, 1), ("tp2pp2", 1, 1, 3), ("tp2pp2", 1, 2, 2),
    ("tp2dp2", 1, 1, 1), ("tp2dp2", 2, 2, 1),
    ("pp2dp2", 1, 1, 1), ("pp2dp2", 2, 1, 2),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, (tp, pp, dp) in SAVES.items():
        run(tp * pp * dp, _save, str(root / name), tp, pp, dp, timeout_s=60)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", sorted(SAVES))
def test_saved_tensors_are_the_consolidated_ones(saved: dict[str, Path], name: str) -> None:
    _check_consolidated(saved[name])


@pytest.mark.parametrize("name, tp, pp, dp", LOADS, ids=[f"{n}-to-tp{t}pp{p}dp{d}" for n, t, p, d in LOADS])
def test_load_onto_another_layout_gives_the_reference_shards(saved: dict[str, Path], name: str, tp: int, pp: int,
                                                             dp: int) -> None:
    world = tp * pp * dp
    if world == 1:
        _load(0, 1, str(saved[name]), tp, pp, dp)
    else:
        run(world, _load, str(saved[name]), tp, pp, dp, timeout_s=60)
