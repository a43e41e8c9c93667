"""Real DeepSpeed checkpoints of pipeline engines, MoE engines and AutoTP, made by DeepSpeed
itself on gloo processes (``DS_ACCELERATOR=cpu``), with oracles taken from the live engines.

Import from tests as ``import ds_parallel``. Like ``ds_checkpoints`` (whose launcher, lock and
cache this reuses), nothing here imports deepspeed in the calling process. Each build is one
launch, cached under ``ds_checkpoints.cache_root().parent`` in a folder keyed by this file's
hash and the versions; :func:`build` returns the entry (read-only; copy to modify).

Builds (``build(name)``):

``pipe`` (2 ranks: 2 pipeline stages, tied embedding/head across them, a buffer): for each of
  ``z1-fp32`` (ZeRO-1) and ``z0-bf16`` (ZeRO-0 in bf16: DeepSpeed's BF16_Optimizer), under
  ``<variant>/``: ``D`` (``engine.save_checkpoint`` after 3 steps), ``X`` (the adapter's save at
  the same step), ``universal/`` (``ds_to_universal`` of ``D``), ``reference.pt`` (the live
  engine's full fp32 masters, Adam moments and module weights, every stage's), ``run.json``
  (``losses_after``: the 2 uninterrupted steps after the save). Then, in the same processes, a
  pipeline of 1 stage on 2 data-parallel ranks (``z1-fp32`` only): ``pp1/`` holds, for ``X``
  and for ``ucp_zarr.convert(D)`` (``CV``), the state it holds after the adapter's load and the
  losses of the same 2 steps. Last, ``CV`` exported to a universal folder (``XU``) is loaded
  by a 2-stage engine with DeepSpeed's ``load_universal``: ``pp2u/state.pt`` (its state after
  the load) and ``pp2u/run.json`` (the losses of the same 2 steps).
``pipe3`` (3 ranks, ``long``): a pipeline of 3 stages loads ``pipe``'s ``X`` the same way.
``moe`` (2 ranks, a ``deepspeed.moe.layer.MoE`` of 4 experts at ``ep_size=2``): variants
  ``z1-fp32`` and ``z2-bf16`` as above (``D``, ``X``, ``reference.pt`` with every expert under
  its global id, ``run.json``, ``universal_error.txt``: DeepSpeed's converter fails on these);
  then an ``ep_size=1`` engine loads ``z1-fp32``'s ``X``: ``ep1/state.pt`` (its state after the
  load), ``ep1/X`` (its adapter save, right after the load), ``ep1/run.json``; and one
  loads ``z1-fp32``'s conversion (``CV``) exported to a universal folder (``XU``, with
  ``ep_size=1``) with DeepSpeed's own ``load_universal``: ``ep1u/state.pt``, ``ep1u/run.json``.
``moe4`` (4 ranks, ``long``): ``ep_size=2`` x 2 expert-data-parallel ranks, ZeRO-2 fp32.
``autotp`` (2 ranks, AutoTP over a GPTBigCode model with multi-query attention): ``D0`` saved
  right after ``deepspeed.initialize``, with ``original.pt`` (the model's weights before AutoTP
  cut them), ``rebuilt.pt`` (DeepSpeed's own ``ParamAffineMap.rebuild`` of every mapped weight
  from the ranks' shards) and ``universal_error.txt`` (``ds_to_universal`` fails on a checkpoint
  without optimizer moments); ``D2`` after 2 steps, with ``rebuild_error.txt``: DeepSpeed's
  AutoTP gives every rank the whole key/value block of ``c_attn`` but each rank only its own
  query heads' gradient for it, so the "replicated" rows drift apart in training and
  DeepSpeed's own ``rebuild`` refuses them. The config's ``num_key_value_heads`` (1) is removed
  before AutoTP reads it: with it, AutoTP hands every query head to rank 0 and none to rank 1;
  without it, it splits them by attention head, 2 per rank (the segmented map's both parts).
  And ``codegen.pt``: CodeGen's fused QKV at TP 2 and 4 as AutoTP describes it
  (``fused_LinearLayer._codegen_affine_map``: ``codegen_block_layout`` + ``block_gather_map``)
  with the shards DeepSpeed's own partition function cuts (``prepare_tp_fused_qkvw`` on a
  ``CodeGenBlock``). DeepSpeed's training AutoTP does not reach that path (it hands the whole
  model to the fused layer, whose layout then falls back to a plain split), so these are
  DeepSpeed's own functions, not an engine's checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import ds_checkpoints as D
import torch
import torch.nn as nn

VOCAB, DIM, HIDDEN, SEQ = 11, 6, 10, 4
MICRO, ACCUM = 2, 2  # samples per micro-batch (all data-parallel ranks together), micro-batches per step
MOE_BATCH = 16  # samples per step, all data-parallel ranks together
STEPS, MORE = 3, 2
TIMEOUT_S = 600
BUILDS = {"pipe": 2, "pipe3": 3, "moe": 2, "moe4": 4, "autotp": 2}
"""Build name -> world size."""


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def _root() -> Path:
    h = hashlib.sha256(Path(__file__).read_bytes() + Path(D.__file__).read_bytes())
    h.update(json.dumps(D._versions(), sort_keys=True).encode())
    root = D.cache_root().parent / f"parallel-{h.hexdigest()[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def build(name: str) -> Path:
    """The cached entry of build ``name`` (built on first use, under a lock)."""
    entry = _root() / name
    if (entry / "done").is_file():
        return entry
    needs = {"pipe3": "pipe"}.get(name)
    source = build(needs) if needs else None
    with D._locked(f"parallel-{name}"):
        if (entry / "done").is_file():
            return entry
        work = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=_root()))
        try:
            t0 = time.perf_counter()
            D.launch(BUILDS[name], [{"kind": name, "out": str(work / "out"), "source": str(source) if source else None}],
                     work / "logs", timeout_s=TIMEOUT_S, worker=__file__)
            (work / "out" / "build.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}))
            (work / "out" / "done").write_text("")
            D._publish(work / "out", entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return entry


def reference(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {"fp32", "exp_avg", "exp_avg_sq", "lp"}}``: a live engine's full state (every
    stage's parameters, every expert under its global id)."""
    return torch.load(folder / "reference.pt", weights_only=True)


def run_info(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "run.json").read_text())


# ---------------------------------------------------------------------------------------------
# Models and data (imported by the workers only; no deepspeed at import time)
# ---------------------------------------------------------------------------------------------


class Embed(nn.Module):
    """Token embedding, tied to the head (its weight is the head's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(VOCAB, DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]


def head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return (x @ embed.weight.t()).float()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.register_buffer("scale", 1.0 + 0.1 * torch.arange(DIM, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.ln(torch.tanh(self.fc1(x)))) * self.scale.to(x.dtype)


def pipeline_module(stages: int) -> Any:
    """Embedding (tied), 4 blocks, head (tied): 6 layers, each seeded by its global index, so
    every pipeline degree builds the same weights."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = ([TiedLayerSpec("embed", Embed)] + [LayerSpec(Block) for _ in range(4)]
              + [TiedLayerSpec("embed", Embed, forward_fn=head)])
    loss = lambda logits, y: nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))  # noqa: E731
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=loss, partition_method="uniform",
                          seed_layers=True, base_seed=D.SEED)


def pipe_batches(step: int, dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches for data-parallel rank ``dp_rank`` of ``dp`` (the same
    global batch at every pipeline and data-parallel degree)."""
    g = torch.Generator().manual_seed(D.SEED * 100 + step)
    out = []
    for _ in range(ACCUM):
        idx = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        tgt = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        m = MICRO // dp
        out.append((idx[dp_rank * m:(dp_rank + 1) * m], tgt[dp_rank * m:(dp_rank + 1) * m]))
    return out


class MoEModel(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(D.SEED)
        self.inp = nn.Linear(5, DIM)
        expert = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
        self.moe = MoE(DIM, expert=expert, num_experts=4, ep_size=ep_size, k=1, min_capacity=2, use_rts=False)
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, aux, _ = self.moe(self.inp(x))
        return nn.functional.cross_entropy(self.out(h).float(), y) + 0.01 * aux


def moe_batch(step: int, rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(D.SEED * 10 + step)
    x, y = torch.randn(MOE_BATCH, 5, generator=g), torch.randint(0, 3, (MOE_BATCH,), generator=g)
    m = MOE_BATCH // world
    return x[rank * m:(rank + 1) * m].to(dtype), y[rank * m:(rank + 1) * m]


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


def _config(stage: int, dtype: str, micro: int, accum: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                           "steps_per_print": 10**9, "gradient_clipping": 1.0}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _expert_names(module: nn.Module) -> dict[str, str]:
    """Local parameter name -> global, experts renumbered as DeepSpeed names its expert files
    (expert-parallel rank x local experts + local index)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    out = {}
    for mod_name, mod in module.named_modules():
        if isinstance(mod, MoE):
            first = groups._get_expert_parallel_rank(mod.expert_group_name) * mod.num_local_experts
            prefix = f"{mod_name}.deepspeed_moe.experts.deepspeed_experts."
            for j in range(mod.num_local_experts):
                for n, _ in mod.deepspeed_moe.experts.deepspeed_experts[j].named_parameters():
                    out[f"{prefix}{j}.{n}"] = f"{prefix}{first + j}.{n}"
    return out


def live_state(engine: Any, rename: dict[str, str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's full fp32 masters, Adam moments and module weights (collective over the
    world), merged: a parameter several ranks hold must be the same on all of them."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # see ds_checkpoints._full_state
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    mine: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        entry = {"lp": p.detach().clone()}
        if p.requires_grad:
            entry["fp32"] = safe_get_full_fp32_param(p).detach().clone().float()
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(p, key).detach().clone()
        mine[(rename or {}).get(name, name)] = entry
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rank, theirs in enumerate(everyone):
        for name, entry in theirs.items():
            if name in out:
                for k, t in entry.items():
                    if not torch.equal(out[name][k], t):
                        raise RuntimeError(f"rank {rank} holds another {k} of {name} than an earlier rank")
            else:
                out[name] = entry
    return out


def _ds_to_universal(step_dir: Path, out: Path) -> None:
    """DeepSpeed's converter on ``step_dir`` -> ``out/<tag>_universal``, or ``out/universal_error.txt``."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal as d2u

    args = argparse.Namespace(input_folder=str(step_dir), output_folder=str(out / "universal"), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    t0 = time.perf_counter()
    try:
        d2u.main(args)
    except Exception:  # noqa: BLE001 - recorded for the tests
        shutil.rmtree(out / "universal", ignore_errors=True)
        (out / "universal_error.txt").write_text(traceback.format_exc())
    (out / "ds_to_universal.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}))


def _save_all(engine: Any, out: Path, rename: dict[str, str] | None = None) -> None:
    """Reference, DeepSpeed's save ``D``, the adapter's save ``X`` (same step), ds_to_universal."""
    import torch.distributed as dist

    from ucp_zarr.adapters import deepspeed as ucp_ds

    ref = live_state(engine, rename)
    engine.save_checkpoint(str(out / "D"), client_state={"epoch": 2})
    ucp_ds.save_checkpoint(engine, out / "X", client_state={"epoch": 2})
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(ref, out / "reference.pt")
        _ds_to_universal(out / "D" / (out / "D" / "latest").read_text().strip(), out)
    dist.barrier()


def _pipe_train(engine: Any, step: int) -> float:
    """One step; the loss averaged over the data-parallel ranks (every stage gets it)."""
    grid = engine.grid
    data = pipe_batches(step, grid.get_data_parallel_id(), grid.get_data_parallel_world_size())
    return float(engine.train_batch(iter(data)))


def _pipe_engine(stages: int, stage: int, dtype: str, universal: bool = False) -> Any:
    import deepspeed
    import torch.distributed as dist

    model = pipeline_module(stages)
    dp = dist.get_world_size() // stages
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = _config(stage, dtype, MICRO // dp, ACCUM) | ({"checkpoint": {"load_universal": True}} if universal else {})
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _losses(engine: Any, first: int, count: int) -> list[float]:
    return [_pipe_train(engine, step) for step in range(first, first + count)]


def _pipe(task: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist

    import ucp_zarr
    from ucp_zarr.adapters import deepspeed as ucp_ds

    root = Path(task["out"])
    for variant, stage, dtype in (("z1-fp32", 1, "fp32"), ("z0-bf16", 0, "bf16")):
        out = root / variant
        engine = _pipe_engine(2, stage, dtype)
        for step in range(STEPS):
            _pipe_train(engine, step)
        _save_all(engine, out)
        after = _losses(engine, STEPS, MORE)
        if rank == 0:
            (out / "run.json").write_text(json.dumps({"losses_after": after, "optimizer": type(engine.optimizer).__name__}))
        engine.destroy()
    out = root / "z1-fp32"
    if rank == 0:
        ucp_zarr.convert(out / "D", out / "CV")
    dist.barrier()
    for name in ("X", "CV"):  # one stage on 2 data-parallel ranks
        engine = _pipe_engine(1, 1, "fp32")
        client = ucp_ds.load_checkpoint(engine, out / name)
        state = live_state(engine)
        losses = _losses(engine, STEPS, MORE)
        if rank == 0:
            (out / "pp1").mkdir(exist_ok=True)
            torch.save(state, out / "pp1" / f"{name}.pt")
            (out / "pp1" / f"{name}.json").write_text(json.dumps({"losses": losses, "client": client}))
        engine.destroy()
        dist.barrier()
    if rank == 0:  # the conversion exported to a universal folder, which DeepSpeed loads into 2 stages
        ucp_zarr.export(out / "CV", out / "XU", to="ds-universal")
    dist.barrier()
    engine = _pipe_engine(2, 1, "fp32", universal=True)
    engine.load_checkpoint(str(out / "XU"))
    state = live_state(engine)
    losses = _losses(engine, STEPS, MORE)
    if rank == 0:
        (out / "pp2u").mkdir()
        torch.save(state, out / "pp2u" / "state.pt")
        (out / "pp2u" / "run.json").write_text(json.dumps({"losses": losses}))
    engine.destroy()
    dist.barrier()


def _pipe3(task: dict[str, Any], rank: int) -> None:
    from ucp_zarr.adapters import deepspeed as ucp_ds

    out = Path(task["out"])
    out.mkdir(parents=True, exist_ok=True)
    engine = _pipe_engine(3, 1, "fp32")
    ucp_ds.load_checkpoint(engine, Path(task["source"]) / "z1-fp32" / "X")
    state = live_state(engine)
    losses = _losses(engine, STEPS, MORE)
    if rank == 0:
        torch.save(state, out / "state.pt")
        (out / "run.json").write_text(json.dumps({"losses": losses}))
    engine.destroy()


def _moe_engine(ep: int, stage: int, dtype: str, world: int, universal: bool = False) -> Any:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = MoEModel(ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    opt = torch.optim.AdamW(groups, lr=1e-2)
    config = _config(stage, dtype, MOE_BATCH // world, 1) | ({"checkpoint": {"load_universal": True}} if universal else {})
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _moe_steps(engine: Any, first: int, count: int, rank: int, world: int, dtype: str) -> list[float]:
    import torch.distributed as dist

    out = []
    for step in range(first, first + count):
        x, y = moe_batch(step, rank, world, torch.bfloat16 if dtype == "bf16" else torch.float32)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        out.append(mean.item() / world)
    return out


def _moe(task: dict[str, Any], rank: int, world: int) -> None:
    import torch.distributed as dist

    import ucp_zarr
    from ucp_zarr.adapters import deepspeed as ucp_ds

    root = Path(task["out"])
    variants = (("z1-fp32", 1, "fp32"), ("z2-bf16", 2, "bf16")) if world == 2 else (("z2-fp32", 2, "fp32"),)
    for variant, stage, dtype in variants:
        out = root / variant
        engine = _moe_engine(2, stage, dtype, world)
        _moe_steps(engine, 0, STEPS, rank, world, dtype)
        _save_all(engine, out, _expert_names(engine.module))
        after = _moe_steps(engine, STEPS, MORE, rank, world, dtype)
        if rank == 0:
            (out / "run.json").write_text(json.dumps({"losses_after": after, "ep_size": 2, "world": world}))
        engine.destroy()
    if world != 2:
        return
    out = root / "z1-fp32" / "ep1"
    engine = _moe_engine(1, 1, "fp32", world)
    fresh = [g.get("name") for g in engine.optimizer.param_groups]
    ucp_ds.load_checkpoint(engine, root / "z1-fp32" / "X")
    loaded = [g.get("name") for g in engine.optimizer.param_groups]
    state = live_state(engine, _expert_names(engine.module))
    ucp_ds.save_checkpoint(engine, out / "X")
    losses = _moe_steps(engine, STEPS, MORE, rank, world, "fp32")
    if rank == 0:
        torch.save(state, out / "state.pt")
        (out / "run.json").write_text(json.dumps({"losses": losses, "group_names": {"fresh": fresh, "loaded": loaded}}))
    engine.destroy()
    dist.barrier()
    src, out = root / "z1-fp32", root / "z1-fp32" / "ep1u"
    if rank == 0:  # the conversion exported to a universal folder (ep_size=1: see ds_universal.write)
        ucp_zarr.convert(src / "D", src / "CV")
        ucp_zarr.export(src / "CV", src / "XU", to="ds-universal", ep_size=1)
    dist.barrier()
    engine = _moe_engine(1, 1, "fp32", world, universal=True)
    engine.load_checkpoint(str(src / "XU"))
    state = live_state(engine, _expert_names(engine.module))
    losses = _moe_steps(engine, STEPS, MORE, rank, world, "fp32")
    if rank == 0:
        out.mkdir()
        torch.save(state, out / "state.pt")
        (out / "run.json").write_text(json.dumps({"losses": losses}))
    engine.destroy()
    dist.barrier()


def _autotp(task: dict[str, Any], rank: int) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    out = Path(task["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(D.SEED)
    config = GPTBigCodeConfig(vocab_size=64, n_positions=16, n_embd=128, n_layer=1, n_head=4, multi_query=True)
    model = GPTBigCodeForCausalLM(config)
    model.config.num_key_value_heads = None  # (see the module docstring)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2},
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.save_checkpoint(str(out / "D0"), tag="step0")
    for step in range(2):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out / "D2"), tag="step2")
    dist.barrier()
    if rank == 0:
        torch.save(original, out / "original.pt")
        torch.save(_rebuild(out / "D0" / "step0"), out / "rebuilt.pt")
        try:
            _rebuild(out / "D2" / "step2")
        except ValueError as e:
            (out / "rebuild_error.txt").write_text(str(e))
        _ds_to_universal(out / "D0" / "step0", out)
        torch.save(_codegen(), out / "codegen.pt")
    dist.barrier()
    engine.destroy()


def _codegen() -> dict[str, Any]:
    from deepspeed.checkpoint.affine import block_gather_map
    from deepspeed.module_inject.fusedqkv_utils import codegen_block_layout, prepare_tp_fused_qkvw
    from deepspeed.module_inject.tp_shard import AutoTPMeta
    from transformers import CodeGenConfig
    from transformers.models.codegen.modeling_codegen import CodeGenBlock

    torch.manual_seed(D.SEED)
    config = CodeGenConfig(n_embd=64, n_head=16, rotary_dim=4, n_layer=1, vocab_size=32, n_positions=16)
    block = CodeGenBlock(config, layer_idx=0)
    weight = block.attn.qkv_proj.weight.detach().clone()
    meta = AutoTPMeta.from_model_config(config)
    out: dict[str, Any] = {"weight": weight, "maps": {}, "shards": {}}
    for tp in (2, 4):
        size, ids = codegen_block_layout(weight.shape[0], tp, meta.num_kv_heads)
        out["maps"][tp] = block_gather_map(tuple(weight.shape), ids, size, 0).to_dict()
        out["shards"][tp] = [prepare_tp_fused_qkvw(block, weight, tp, rank, meta).clone() for rank in range(tp)]
    return out


def _rebuild(step_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own ``ParamAffineMap.rebuild`` of every mapped module weight of ``step_dir``."""
    import re

    from deepspeed.checkpoint.affine import ParamAffineMap

    shards = [torch.load(step_dir / f"mp_rank_{t:02d}_model_states.pt", weights_only=False) for t in range(2)]
    maps = shards[0]["universal_checkpoint_info"]["affine_map"]["params"]
    out = {}
    for name in shards[0]["module"]:
        hits = [p for p in maps if re.match(p, name)]
        if hits:
            out[name] = ParamAffineMap.from_dict(maps[hits[0]]).rebuild({t: s["module"][name] for t, s in enumerate(shards)})
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "_worker":
        raise SystemExit(f"usage: {sys.argv[0]} _worker JOB.json")
    D.run_worker(sys.argv[2], {"pipe": lambda t, r, w: _pipe(t, r), "pipe3": lambda t, r, w: _pipe3(t, r),
                               "moe": _moe, "moe4": _moe, "autotp": lambda t, r, w: _autotp(t, r)})
