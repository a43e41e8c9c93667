"""A simulated Llama-405B-like training layout, without data: what every rank would hand
the save planner (:class:`ucp_zarr.protocol.planner.FragmentInfo` lists).

* Model: hidden 16384, 126 layers, GQA attention (128 query heads, 8 KV heads of 128: a
  fused QKV of 18432 rows), SwiGLU MLP (fused gate+up of 2 x 53248 rows), vocabulary 128256,
  RMSNorms; bf16 parameters.
* Parallelism: TP 8 (QKV and gate+up split by rows, output projections by columns,
  vocabulary-parallel embedding and head, norms replicated) x PP 16 (layers in contiguous
  stages; embedding on the first, final norm and head on the last) x DP n. For fewer than
  128 ranks, PP shrinks (64 ranks: TP 8 x PP 8).
* Megatron's distributed optimizer: on each (TP, PP) rank, the local parameter slabs
  concatenated into one flat fp32 buffer, split evenly over the DP ranks; each DP rank holds
  the master weights and both Adam moments of its flat range (flat ranges of TP-local slabs,
  cutting rows anywhere). Model parameters are replicated over DP.

Used by ``bench_planning.py`` and ``tests/test_plan_scale.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ucp_zarr.layout import Box
from ucp_zarr.layout.flat import flat_range_boxes
from ucp_zarr.protocol.planner import FragmentInfo

HIDDEN, LAYERS, FFN, VOCAB = 16384, 126, 53248, 128256
QKV_ROWS = (128 + 2 * 8) * 128
MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    split: int | None
    """The dim TP splits (None: replicated over TP)."""


def stage_params(pp_rank: int, pp: int, layers: int = LAYERS) -> list[Param]:
    """The parameters of pipeline stage ``pp_rank`` (consolidated shapes)."""
    lo, hi = layers * pp_rank // pp, layers * (pp_rank + 1) // pp
    out: list[Param] = []
    if pp_rank == 0:
        out.append(Param("embedding.weight", (VOCAB, HIDDEN), 0))
    for i in range(lo, hi):
        p = f"layers.{i}."
        out += [
            Param(p + "input_norm.weight", (HIDDEN,), None),
            Param(p + "attn.qkv.weight", (QKV_ROWS, HIDDEN), 0),
            Param(p + "attn.proj.weight", (HIDDEN, HIDDEN), 1),
            Param(p + "mlp_norm.weight", (HIDDEN,), None),
            Param(p + "mlp.fc1.weight", (2 * FFN, HIDDEN), 0),
            Param(p + "mlp.fc2.weight", (HIDDEN, FFN), 1),
        ]
    if pp_rank == pp - 1:
        out += [Param("final_norm.weight", (HIDDEN,), None), Param("output.weight", (VOCAB, HIDDEN), 0)]
    return out


def slab(p: Param, tp_rank: int, tp: int) -> Box:
    """The TP-local slab of ``p`` on ``tp_rank``."""
    if p.split is None:
        return Box.whole(p.shape)
    n = p.shape[p.split] // tp
    off = [0] * len(p.shape)
    shape = list(p.shape)
    off[p.split], shape[p.split] = tp_rank * n, n
    return Box(tuple(off), tuple(shape))


def degrees(world: int, tp: int = 8, max_pp: int = 16) -> tuple[int, int, int]:
    """(TP, PP, DP) of a ``world``-rank job."""
    pp = min(max_pp, world // tp)
    if world % (tp * pp):
        raise ValueError(f"{world} ranks do not divide into TP {tp} x PP {pp}")
    return tp, pp, world // (tp * pp)


def rank_infos(world: int, rank: int, layers: int = LAYERS) -> list[FragmentInfo]:
    """What rank ``rank`` of a ``world``-rank job holds (rank = ((pp * DP) + dp) * TP + tp)."""
    tp, pp, dp = degrees(world)
    tp_rank, rest = rank % tp, rank // tp
    dp_rank, pp_rank = rest % dp, rest // dp
    params, slabs, model = _stage(tp_rank, tp, pp_rank, pp, layers)
    infos = list(model)
    total = sum(s.numel for s in slabs)
    share = -(-total // dp)
    lo, hi = dp_rank * share, min(total, (dp_rank + 1) * share)
    pos = 0
    for p, s in zip(params, slabs):
        a, b = max(lo, pos), min(hi, pos + s.numel)
        pos += s.numel
        if a >= b:
            continue
        boxes = tuple(
            Box(tuple(o + so for o, so in zip(x.offset, s.offset)), x.shape)
            for x in flat_range_boxes(s.shape, a - (pos - s.numel), b - (pos - s.numel))
        )
        for m in MOMENTS:
            infos.append(FragmentInfo(f"optim.state.{p.name}.{m}", p.shape, "float32", boxes))
    return infos


@functools.lru_cache(maxsize=None)
def _stage(tp_rank: int, tp: int, pp_rank: int, pp: int, layers: int) -> tuple[list[Param], list[Box], list[FragmentInfo]]:
    """The parameters of a (TP, PP) position, their slabs and model fragments (the same on
    every data-parallel rank: computed once; each rank's list is pickled on its own)."""
    params = stage_params(pp_rank, pp, layers)
    slabs = [slab(p, tp_rank, tp) for p in params]
    model = [FragmentInfo(f"model.{p.name}", p.shape, "bfloat16", (s,), plain=p.split is None) for p, s in zip(params, slabs)]
    return params, slabs, model


def all_infos(world: int, layers: int = LAYERS) -> list[list[FragmentInfo]]:
    return [rank_infos(world, r, layers) for r in range(world)]


def model_bytes(layers: int = LAYERS) -> int:
    """Bytes of the consolidated state: bf16 parameters and three fp32 states each."""
    params = stage_params(0, 1, layers)
    return sum(math.prod(p.shape) for p in params) * (2 + 4 * len(MOMENTS))
