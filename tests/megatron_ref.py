"""Reference Megatron-LM-style GPT sharding (TP / PP / DP) in plain torch, for tests.

Deliberately independent of ucp_zarr: it states the layouts a Megatron job holds per rank,
so checkpoint tests can compare ucp_zarr's resharding against it.

Model (``global_params``): tied word embeddings (no position embeddings), ``num_layers``
pre-norm blocks, final norm. Norm types: ``input_layernorm`` is a LayerNorm with weight and
bias; ``pre_mlp_layernorm`` and ``decoder.final_layernorm`` are weight-only **RMSNorm**
(eps 1e-5 everywhere). Attention is causal GQA with [Q; K; V] fused rows; the MLP is SwiGLU
with fc1 rows [gate; up] and no MLP biases.

TP autograd uses Megatron's conjugate mappings (``copy_to`` = identity forward / all-reduce
backward before column-parallel layers, ``reduce_from`` = all-reduce forward / identity
backward after row-parallel layers, ``gather_from`` = all-gather forward / split backward).
``torch.distributed.nn.functional``'s collectives are not used: their backward all-reduces
(or reduce-scatters) the gradient, i.e. treats each rank's loss as a separate summand, which
with a loss replicated over TP ranks scales sharded grads by ``tp`` and leaves replicated
grads partial. With these mappings and no sequence parallelism, the grads of replicated
params (norms, ``linear_proj.bias``) are identical on every TP rank, so no TP grad sync is
needed; only the tied embedding / output-layer pair needs ``sync_tied_embedding_grads``.

Run ``python tests/megatron_ref.py`` for the self-check.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

Params = dict[str, torch.Tensor]
Group = dist.ProcessGroup | None

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
NORM_EPS = 1e-5

# Per-layer parameter suffixes (after "decoder.layers.{i}."), in state-dict order.
LAYER_SUFFIXES: tuple[str, ...] = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a small Megatron-style GPT."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 8
    seq_len: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocab: round up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def check_layout(cfg: GPTConfig, tp: int, pp: int) -> None:
    """Raise ValueError unless ``cfg`` can be split ``tp``-way (heads, kv heads, ffn) and ``pp``-way (layers)."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_kv_heads={cfg.num_kv_heads} does not divide num_heads={cfg.num_heads}")
    for field in ("num_heads", "num_kv_heads", "ffn_hidden"):
        if getattr(cfg, field) % tp:
            raise ValueError(f"tp={tp} does not divide {field}={getattr(cfg, field)}")
    if cfg.num_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_layers={cfg.num_layers}")


def rules_dict(cfg: GPTConfig, pp: int = 1) -> dict[str, Any]:
    """These conventions in ucp_zarr's rule vocabulary (plain data: this module stays
    independent of the library). The tied output layer exists only when ``pp > 1``."""
    hd = cfg.head_dim
    d: dict[str, Any] = {
        "params": [
            {"kind": "fused", "patterns": [r"decoder\.layers\.\d+\.self_attention\.linear_qkv\."], "dim": 0,
             "sizes": [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]},
            {"kind": "fused", "patterns": [r"decoder\.layers\.\d+\.mlp\.linear_fc1\.weight"], "dim": 0, "sizes": [-1, -1]},
            {"kind": "split", "dim": 1,
             "patterns": [r"decoder\.layers\.\d+\.(self_attention\.linear_proj|mlp\.linear_fc2)\.weight"]},
            {"kind": "replicated",
             "patterns": [r".*layernorm\.", r"decoder\.layers\.\d+\.self_attention\.linear_proj\.bias"]},
        ],
        "vocab": {"patterns": [r"embedding\.word_embeddings\.weight"], "size": cfg.vocab_size},
        "pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "num_layers": cfg.num_layers},
    }
    if pp > 1:
        d["vocab"]["patterns"].append(r"output_layer\.weight")
        d["rename"] = [{"pattern": r"output_layer\.weight", "to": EMBEDDING}]
        d["pipeline_replicated"] = [r"output_layer\.weight"]
    return d


def local_layer_offset(cfg: GPTConfig, pp: int, pp_rank: int) -> int:
    """Global index of pipeline stage ``pp_rank``'s local layer 0."""
    return pp_rank * (cfg.num_layers // pp)


# --------------------------------------------------------------------------- global params


def global_params(cfg: GPTConfig, seed: int = 0) -> Params:
    """Consolidated TP=1/PP=1 fp32 params with unpadded vocab (output layer tied to the embedding)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    h, hd = cfg.hidden, cfg.head_dim
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    out: Params = {EMBEDDING: rand(cfg.vocab_size, h, std=0.02)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        out[p + "input_layernorm.bias"] = rand(h, std=0.01)
        out[p + "self_attention.linear_qkv.weight"] = rand(qkv_rows, h, std=0.02)
        out[p + "self_attention.linear_qkv.bias"] = rand(qkv_rows, std=0.01)
        out[p + "self_attention.linear_proj.weight"] = rand(h, cfg.num_heads * hd, std=0.02)
        out[p + "self_attention.linear_proj.bias"] = rand(h, std=0.01)
        out[p + "pre_mlp_layernorm.weight"] = 1 + rand(h, std=0.1)
        out[p + "mlp.linear_fc1.weight"] = rand(2 * cfg.ffn_hidden, h, std=0.02)
        out[p + "mlp.linear_fc2.weight"] = rand(h, cfg.ffn_hidden, std=0.02)
    out[FINAL_NORM] = 1 + rand(h, std=0.1)
    return out


# --------------------------------------------------------------------------- TP / PP sharding


def tp_kind(name: str) -> str:
    """How a param name is split over TP: 'vocab', 'qkv', 'gate_up', 'row' or 'replicated'."""
    if name in (EMBEDDING, OUTPUT_LAYER):
        return "vocab"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "gate_up"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def _tp_shard(name: str, t: torch.Tensor, cfg: GPTConfig, tp: int, r: int) -> torch.Tensor:
    kind = tp_kind(name)
    if kind == "vocab":
        padded = torch.zeros(cfg.padded_vocab(tp), t.shape[1], dtype=t.dtype)
        padded[: t.shape[0]] = t
        local = padded.chunk(tp, dim=0)[r]
    elif kind == "qkv":
        hd = cfg.head_dim
        q, k, v = t.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], dim=0)
        local = torch.cat([q.chunk(tp, dim=0)[r], k.chunk(tp, dim=0)[r], v.chunk(tp, dim=0)[r]])
    elif kind == "gate_up":
        gate, up = t.chunk(2, dim=0)
        local = torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]])
    elif kind == "row":
        local = t.chunk(tp, dim=1)[r]
    else:
        local = t
    return local.clone(memory_format=torch.contiguous_format)


def shard_params(glob: Params, cfg: GPTConfig, *, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> Params:
    """The local tensors rank (``tp_rank``, ``pp_rank``) holds, in Megatron state-dict order.

    Stage 0 holds the vocab-parallel embedding; the last stage holds ``final_layernorm`` and
    ``output_layer.weight`` (a separate copy of the same padded vocab slice as the embedding).
    Layers are renumbered from 0 on each stage."""
    check_layout(cfg, tp, pp)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"rank (tp={tp_rank}, pp={pp_rank}) outside tp={tp} pp={pp}")
    out: Params = {}
    if pp_rank == 0:
        out[EMBEDDING] = _tp_shard(EMBEDDING, glob[EMBEDDING], cfg, tp, tp_rank)
    offset = local_layer_offset(cfg, pp, pp_rank)
    for j in range(cfg.num_layers // pp):
        for suffix in LAYER_SUFFIXES:
            src = f"decoder.layers.{offset + j}.{suffix}"
            out[f"decoder.layers.{j}.{suffix}"] = _tp_shard(src, glob[src], cfg, tp, tp_rank)
    if pp_rank == pp - 1:
        out[FINAL_NORM] = glob[FINAL_NORM].clone()
        out[OUTPUT_LAYER] = _tp_shard(OUTPUT_LAYER, glob[EMBEDDING], cfg, tp, tp_rank)
    return out


# --------------------------------------------------------------------------- distributed optimizer


def dp_flat_ranges(local_params: Params, dp: int, dp_rank: int) -> dict[str, tuple[int, int]]:
    """Simplified DistributedOptimizer partition: params laid end to end (dict order) in one
    flat buffer padded to a multiple of ``dp``; rank ``dp_rank`` owns one contiguous equal
    range. Returns, per intersecting param, (start, stop) within its own flattened tensor."""
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} outside dp={dp}")
    total = sum(t.numel() for t in local_params.values())
    per_rank = -(-total // dp)
    lo, hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
    out: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, t in local_params.items():
        start, stop = max(lo, offset), min(hi, offset + t.numel())
        if start < stop:
            out[name] = (start - offset, stop - offset)
        offset += t.numel()
    return out


def flat_slice(t: torch.Tensor, rng: tuple[int, int]) -> torch.Tensor:
    """``t`` flattened row-major, elements [start, stop), as a fresh tensor."""
    return t.reshape(-1)[rng[0] : rng[1]].clone()


# --------------------------------------------------------------------------- TP forward


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's ``f``, before column-parallel layers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``g``, after row-parallel layers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, keep own slice backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def loss_fn(
    local: Params, tokens: torch.Tensor, targets: torch.Tensor, cfg: GPTConfig, *, tp: int, tp_group: Group = None
) -> torch.Tensor:
    """Mean next-token cross-entropy of the GPT on one TP rank's params (pp == 1: all layers local).

    Works on ``global_params`` (tp=1, unpadded vocab) and on ``shard_params`` output; the TP
    rank is ``dist.get_rank(tp_group)``. ``tokens``/``targets``: int64 (batch, seq). Logits use
    ``output_layer.weight`` when present, else the embedding (the tied global form)."""
    if tp > 1 and dist.get_world_size(tp_group) != tp:
        raise ValueError(f"tp={tp} but the TP group has {dist.get_world_size(tp_group)} ranks")
    rank = dist.get_rank(tp_group) if tp > 1 else 0

    def copy_to(x: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(x, tp_group) if tp > 1 else x

    def reduce_from(x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(x, tp_group) if tp > 1 else x

    # Vocab-parallel embedding: each rank looks up the ids in its row block, zeros the rest.
    emb = local[EMBEDDING]
    rows = emb.shape[0]
    ids = tokens - rank * rows
    outside = (ids < 0) | (ids >= rows)
    x = F.embedding(ids.masked_fill(outside, 0), emb).masked_fill(outside.unsqueeze(-1), 0.0)
    x = reduce_from(x)

    batch, seq, h = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_heads // tp, cfg.num_kv_heads // tp
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        # Attention: column-parallel QKV over local heads, row-parallel proj, bias after reduce.
        a = F.layer_norm(x, (h,), local[p + "input_layernorm.weight"], local[p + "input_layernorm.bias"], NORM_EPS)
        qkv = F.linear(
            copy_to(a), local[p + "self_attention.linear_qkv.weight"], local[p + "self_attention.linear_qkv.bias"]
        )
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.reshape(batch, seq, nh, hd).transpose(1, 2)
        k = k.reshape(batch, seq, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.reshape(batch, seq, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(causal, float("-inf"))
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, seq, nh * hd)
        attn = reduce_from(F.linear(ctx, local[p + "self_attention.linear_proj.weight"]))
        x = x + attn + local[p + "self_attention.linear_proj.bias"]
        # SwiGLU MLP: column-parallel fc1 [gate; up], row-parallel fc2.
        m = _rms_norm(x, local[p + "pre_mlp_layernorm.weight"])
        gate, up = F.linear(copy_to(m), local[p + "mlp.linear_fc1.weight"]).chunk(2, dim=-1)
        x = x + reduce_from(F.linear(F.silu(gate) * up, local[p + "mlp.linear_fc2.weight"]))

    x = _rms_norm(x, local[FINAL_NORM])
    logits = F.linear(copy_to(x), local.get(OUTPUT_LAYER, emb))
    if tp > 1:
        logits = _GatherFromTP.apply(logits, tp_group)
    logits = logits[..., : cfg.vocab_size]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))


def sync_tied_embedding_grads(local: Params) -> None:
    """When one stage holds both the embedding and ``output_layer.weight`` (pp == 1), set both
    grads to their sum, as Megatron's tied-embedding grad all-reduce does, so the two copies
    (and their optimizer states) stay equal. No-op otherwise."""
    emb, out = local.get(EMBEDDING), local.get(OUTPUT_LAYER)
    if emb is None or out is None or emb.grad is None or out.grad is None:
        return
    total = emb.grad + out.grad
    emb.grad, out.grad = total, total.clone()


# --------------------------------------------------------------------------- self-check


def _reassemble(shards: dict[tuple[int, int], Params], cfg: GPTConfig, tp: int, pp: int) -> Params:
    """Self-check only: rebuild global tensors from {(pp_rank, tp_rank): local} with rules
    written independently of ``shard_params``; asserts replicas and tied copies are equal."""
    per, hd, v = cfg.num_layers // pp, cfg.head_dim, cfg.vocab_size
    nq, nkv = cfg.num_heads // tp * hd, cfg.num_kv_heads // tp * hd
    out: Params = {}
    for (s, r), local in sorted(shards.items()):
        for name in local:
            gname = name
            if name.startswith("decoder.layers."):
                _, _, idx, rest = name.split(".", 3)
                gname = f"decoder.layers.{s * per + int(idx)}.{rest}"
            if gname in out or gname == OUTPUT_LAYER:
                continue
            parts = [shards[(s, rr)][name] for rr in range(tp)]
            if gname == EMBEDDING:
                full = torch.cat(parts)
                assert full.shape[0] == cfg.padded_vocab(tp) and not full[v:].any(), "vocab padding not zero"
                out[gname] = full[:v]
            elif gname.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                qs, ks, vs = zip(*(t.split([nq, nkv, nkv]) for t in parts))
                out[gname] = torch.cat([*qs, *ks, *vs])
            elif gname.endswith("linear_fc1.weight"):
                gates, ups = zip(*(t.chunk(2) for t in parts))
                out[gname] = torch.cat([*gates, *ups])
            elif gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
                out[gname] = torch.cat(parts, dim=1)
            else:
                assert all(torch.equal(parts[0], t) for t in parts), f"replicas of {gname} differ"
                out[gname] = parts[0]
    tied = torch.cat([shards[(pp - 1, r)][OUTPUT_LAYER] for r in range(tp)])
    assert torch.equal(tied[:v], out[EMBEDDING]) and not tied[v:].any(), "output_layer != embedding"
    return out


def _batch(cfg: GPTConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    return tokens, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)


def _tp_worker(rank: int, world: int, port: int, cfg: GPTConfig) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        glob = global_params(cfg, seed=3)
        tokens, targets = _batch(cfg)
        ref = {k: t.clone().requires_grad_() for k, t in glob.items()}
        ref_loss = loss_fn(ref, tokens, targets, cfg, tp=1)
        ref_loss.backward()
        local = {k: t.requires_grad_() for k, t in shard_params(glob, cfg, tp=world, tp_rank=rank).items()}
        loss = loss_fn(local, tokens, targets, cfg, tp=world)
        loss.backward()
        sync_tied_embedding_grads(local)
        grads: list[Any] = [None] * world
        dist.all_gather_object(grads, {k: t.grad for k, t in local.items()})
        if rank == 0:
            rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            assert rel < 1e-5, f"loss tp={world} {loss.item()} vs tp=1 {ref_loss.item()}"
            full = _reassemble({(0, r): g for r, g in enumerate(grads)}, cfg, tp=world, pp=1)
            assert full.keys() == ref.keys()
            worst = max((full[k] - ref[k].grad).abs().max().item() for k in ref)  # type: ignore[operator]
            assert worst < 1e-5, f"grad mismatch {worst}"
            print(
                f"  tp={world} loss {loss.item():.7f} vs tp=1 {ref_loss.item():.7f} (rel {rel:.1e}); "
                f"max |grad diff| {worst:.1e}; replicated grads bit-identical across TP"
            )
    finally:
        dist.destroy_process_group()


def _self_check() -> None:
    import torch.multiprocessing as mp

    cfg = GPTConfig(
        num_layers=4,
        hidden=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden=48,
        vocab_size=50,
        make_vocab_size_divisible_by=8,
        seq_len=8,
    )
    glob = global_params(cfg)
    assert cfg.padded_vocab(1) == 56 and cfg.padded_vocab(2) == 64

    t0 = time.perf_counter()
    for tp in (1, 2):
        for pp in (1, 2):
            shards = {
                (s, r): shard_params(glob, cfg, tp=tp, tp_rank=r, pp=pp, pp_rank=s)
                for s in range(pp)
                for r in range(tp)
            }
            back = _reassemble(shards, cfg, tp, pp)
            assert back.keys() == glob.keys() and all(torch.equal(back[k], glob[k]) for k in glob)
    single = shard_params(glob, cfg, tp=1, tp_rank=0)
    assert single[EMBEDDING].data_ptr() != single[OUTPUT_LAYER].data_ptr()
    tokens, targets = _batch(cfg)
    l_glob, l_pad = loss_fn(glob, tokens, targets, cfg, tp=1), loss_fn(single, tokens, targets, cfg, tp=1)
    assert torch.allclose(l_glob, l_pad, rtol=1e-6), (l_glob, l_pad)
    print(f"(a) shard/reassemble bit-exact for tp,pp in {{1,2}}^2: {time.perf_counter() - t0:.3f}s")

    t0 = time.perf_counter()
    for tp, pp in ((1, 1), (2, 2)):
        local = shard_params(glob, cfg, tp=tp, tp_rank=tp - 1, pp=pp, pp_rank=pp - 1)
        for dp in (1, 2, 3, 4, 7, 64):
            owned: dict[str, list[tuple[int, int]]] = {k: [] for k in local}
            for d in range(dp):
                for k, rng in dp_flat_ranges(local, dp, d).items():
                    owned[k].append(rng)
            for k, t in local.items():
                spans = sorted(owned[k])
                assert spans[0][0] == 0 and spans[-1][1] == t.numel(), (k, spans)
                assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (k, spans)
                assert torch.equal(torch.cat([flat_slice(t, s) for s in spans]), t.reshape(-1))
    print(f"(b) dp_flat_ranges cover every param exactly once: {time.perf_counter() - t0:.3f}s")

    t0 = time.perf_counter()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_tp_worker, args=(2, port, cfg), nprocs=2, start_method="spawn", join=True)
    print(f"(c) 2-process gloo tp=2 vs tp=1 loss and grads: {time.perf_counter() - t0:.3f}s")


if __name__ == "__main__":
    _self_check()
