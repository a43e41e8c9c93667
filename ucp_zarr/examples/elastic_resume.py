"""The demo job: elastic resume of a small GPT-like model from 4 processes onto 3.

1. Four CPU processes (gloo) train :class:`TinyGPT` with TP=2 x DP=2 (DTensor tensor
   parallelism on the "tp" mesh dimension, FSDP2 on the "dp" dimension) and save the full
   training state with ``ucp_zarr.save`` at step ``save_at``, every rank writing its own shards.
2. The same four processes carry on to the last step: the uninterrupted reference.
3. Three fresh processes build a differently initialised model, shard it with FSDP2 over 3
   ranks, ``ucp_zarr.load`` the checkpoint straight into that layout (no conversion step) and
   train on with the same global batches.
4. The resumed parameters and optimizer state must equal the saved ones bit for bit, and the
   resumed losses must match the reference (see :data:`FIRST_STEP_RTOL` for why not bit for bit).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

GLOBAL_BATCH = 12
"""Samples per step, divisible by 2 (the TP2xDP2 run's DP degree) and 3 (the resumed run)."""

FIRST_STEP_RTOL = 1e-5
"""Relative tolerance on the loss of the first resumed step.

At that step both runs start from bit-identical parameters and optimizer state (checked with
``torch.equal``) and see the same global batch, so the only difference is the order of fp32
additions: TP=2 splits the contraction of ``proj``/``fc2`` over two ranks and adds the partial
sums with an all-reduce, the matmuls run on 6 samples per rank instead of 4, and the per-rank
mean losses are averaged over 2 ranks instead of 3. Each reordered fp32 sum moves the result
by a few units of fp32 epsilon (1.2e-7) relative: measured, the first-step loss differs by
0 to 1.5e-7 relative. 1e-5 leaves a 60x margin and still catches any real resume error: a
model that did not load differs by ~0.2 relative, a single wrong shard by far more than 1e-5.
"""

LATER_STEPS_RTOL = 1e-4
"""Relative tolerance on the losses after the first resumed step.

The rounding differences above feed back through AdamW, so later losses could drift apart;
measured, they stay below 2e-7 relative over 35 resumed steps. The first resumed step cannot
see the optimizer state (the loss depends on the weights only); the second can: a resume that
restored the weights but kept fresh Adam moments and step count differs there by ~5e-3
relative (measured). 1e-4 sits 500x above the observed drift and 50x below that failure.
"""


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32


class Block(nn.Module):
    """A pre-norm transformer block. ``qkv`` is fused with its rows grouped per head
    (``[q_h, k_h, v_h]`` for each head ``h``, as in Megatron), so a column-parallel split of
    ``qkv`` hands each TP rank whole heads; the forward pass takes the number of heads from
    the local width, so the same code runs unsharded, under FSDP2 and under TP."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.norm1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.norm2 = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, 4 * c.dim)
        self.fc2 = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.qkv(self.norm1(x))  # (b, t, local heads * 3 * head_dim)
        h = h.view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (3, b, heads, t, hd)
        y = nn.functional.scaled_dot_product_attention(h[0], h[1], h[2], is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(step: int, c: GPTConfig, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data for ``step``: a noisy counting sequence to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, c.vocab, (size, 1), generator=g)
    seq = (start + torch.arange(c.seq + 1)) % c.vocab
    noise = torch.randint(0, c.vocab, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def local_batch(step: int, c: GPTConfig, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's equal part of the global batch (TP ranks of one DP group get the same)."""
    x, y = batch(step, c)
    n = GLOBAL_BATCH // dp_size
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


# --------------------------------------------------------------------------------------------
# process plumbing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # gathering FSDP2+TP (_StridedShard) weights for the check warns that it takes two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


_PRELOAD = ["ucp_zarr.demo", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint.state_dict"]


def _spawn(world: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` new processes; re-raise the first failure.

    Uses the "forkserver" start method where available: one server process imports torch
    once and forks the workers from it, which saves ~5 s of imports per worker on a 2-core
    machine (plain "spawn" elsewhere). The workers start clean: no threads, no process group.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.get_context(method).set_forkserver_preload(_PRELOAD)  # no-op once the server runs
    mp.start_processes(_entry, args=(world, _free_port(), fn, args), nprocs=world, start_method=method, join=True)


def _make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, c: GPTConfig, dp_group: Any, dp_rank: int, dp_size: int) -> float:
    """One step on this rank's part of the global batch; returns the global-batch mean loss."""
    import torch.distributed as dist

    x, y = local_batch(step, c, dp_rank, dp_size)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()  # FSDP2 averages the gradients over the DP ranks
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_group)
    return total.item() / dp_size


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor gathered to its global value (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        flat.update({f"optim.state.{fqn}.{name}": v for name, v in st.items()})
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in flat.items()}


# --------------------------------------------------------------------------------------------
# the two jobs


def _train_tp2_dp2(rank: int, world: int, steps: int, save_at: int, ckpt: str, work: str) -> None:
    """TP=2 x DP=2: train, save at ``save_at``, carry on to ``steps`` (the reference)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ucp_zarr import save

    c = GPTConfig()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyGPT(c)
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], plan)
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _make_optimizer(model, lr=3e-3)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()

    losses, t_save = [], 0.0
    for step in range(steps):
        if step == save_at:
            msd, osd = get_state_dict(model, opt)
            data = {"next_step": step, "global_batch": GLOBAL_BATCH, "data_seed": 1000}
            t0 = time.perf_counter()
            save({"model": msd, "optim": osd, "step": step, "data": data}, ckpt)
            t_save = time.perf_counter() - t0
            full = _full_state(model, opt)
            if rank == 0:
                torch.save(full, os.path.join(work, "saved_full.pt"))
        losses.append(_train_step(model, opt, step, c, dp_group, dp_rank, 2))
    if rank == 0:
        hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        with open(os.path.join(work, "reference.json"), "w") as f:
            json.dump({"losses": losses, "save_s": t_save, "hyper": hp}, f)


def _resume_fsdp3(rank: int, world: int, steps: int, ckpt: str, work: str) -> None:
    """FSDP2 over 3 ranks: a fresh model, load the checkpoint, check it, train on."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucp_zarr import load

    c = GPTConfig()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(1)  # a different initialisation: everything must come from the checkpoint
    model = TinyGPT(c)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _make_optimizer(model, lr=1.0)  # hyper-parameters come from the checkpoint
    dp_group, dp_rank = mesh.get_group(), mesh.get_local_rank()

    # get_state_dict creates the optimizer state to load into (a zero-lr step, as DCP does)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1, "data": {"next_step": -1, "global_batch": 0, "data_seed": 0}}
    t0 = time.perf_counter()
    load(state, ckpt)
    t_load = time.perf_counter() - t0
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    loaded = _full_state(model, opt)
    start = state["data"]["next_step"]
    assert start == state["step"], (start, state["step"])
    losses = [_train_step(model, opt, step, c, dp_group, dp_rank, world) for step in range(start, steps)]
    if rank == 0:
        saved = torch.load(os.path.join(work, "saved_full.pt"), weights_only=True)
        bad = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
        bad += sorted(k for k in loaded if k not in saved)
        hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        with open(os.path.join(work, "resumed.json"), "w") as f:
            json.dump({"start": start, "losses": losses, "load_s": t_load, "n_tensors": len(saved), "mismatched": bad, "hyper": hp}, f)


# --------------------------------------------------------------------------------------------


def train_and_resume(ckpt: str, steps: int = 20, save_at: int = 10) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two jobs: train on TP2xDP2 (4 processes) saving at ``save_at`` into ``ckpt``, then
    resume from ``ckpt`` on FSDP2(3) (3 new processes). Returns the records of the reference
    run (``losses`` of steps ``0..steps-1``, ``save_s``, ``hyper``, ``wall_s``) and of the
    resumed run (``start``, ``losses`` of steps ``save_at..steps-1``, ``load_s``,
    ``n_tensors``, ``mismatched``: the tensors not bit-identical to the saved ones, ``hyper``,
    ``wall_s``)."""
    if not 0 < save_at < steps:
        raise ValueError(f"need 0 < save_at < steps, got save_at={save_at}, steps={steps}")
    with tempfile.TemporaryDirectory(prefix="ucp_zarr_demo_") as work:
        print(f"[1+2] 4 processes, TP=2 x DP=2 (DTensor TP + FSDP2): train {steps} steps, save at step {save_at}")
        t0 = time.perf_counter()
        _spawn(4, _train_tp2_dp2, steps, save_at, ckpt, work)
        t_ref = time.perf_counter() - t0
        from ucp_zarr import open as open_checkpoint

        print(f"      checkpoint {ckpt}: {len(open_checkpoint(ckpt))} tensors")
        print(f"[3]   3 processes, FSDP2(3), fresh model (other seed): load, train steps {save_at}..{steps - 1}")
        t0 = time.perf_counter()
        _spawn(3, _resume_fsdp3, steps, ckpt, work)
        t_res = time.perf_counter() - t0
        with open(os.path.join(work, "reference.json")) as f:
            ref = json.load(f) | {"wall_s": t_ref}
        with open(os.path.join(work, "resumed.json")) as f:
            res = json.load(f) | {"wall_s": t_res}
    return ref, res


def run(steps: int = 20, save_at: int = 10, directory: str | None = None) -> bool:
    """Train on TP2xDP2, save at ``save_at``, resume on FSDP2(3), compare with the reference.

    The checkpoint goes to a temporary directory, or to a new folder inside ``directory``
    (kept, for ``ucp-zarr info``/``verify``). Returns True when the runs agree.
    """
    if not 0 < save_at < steps:
        raise ValueError(f"need 0 < save_at < steps, got save_at={save_at}, steps={steps}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ucp_zarr_demo_") as tmp:
        root = tempfile.mkdtemp(prefix="ucp_zarr_demo_", dir=directory) if directory else tmp
        ref, res = train_and_resume(os.path.join(root, f"step_{save_at}"), steps, save_at)
        t_ref, t_res = ref["wall_s"], res["wall_s"]

    print(f"      save {ref['save_s'] * 1e3:.0f} ms (4 ranks), reshard load {res['load_s'] * 1e3:.0f} ms (3 ranks); "
          f"runs took {t_ref:.1f} s and {t_res:.1f} s")
    exact = not res["mismatched"] and res["start"] == save_at
    print(f"\nloaded state vs saved state (full tensors, torch.equal): {res['n_tensors']} tensors, "
          + ("all bit-identical" if exact else f"MISMATCH in {res['mismatched'] or 'start step'}"))
    same_hyper = res["hyper"] == ref["hyper"]
    print(f"optimizer hyper-parameters from the checkpoint (lr {res['hyper'].get('lr')}, "
          f"weight_decay {res['hyper'].get('weight_decay')}): " + ("equal to the saving run's" if same_hyper else
          f"DIFFERENT: saved {ref['hyper']}, resumed {res['hyper']}"))

    reference, resumed = ref["losses"][save_at:], res["losses"]
    print(f"\n{'step':>5} {'reference':>12} {'resumed':>12} {'|diff|':>10} {'rel':>9}")
    rels = []
    for i, (a, b) in enumerate(zip(reference, resumed)):
        rel = abs(a - b) / abs(a)
        rels.append(rel)
        print(f"{save_at + i:>5} {a:>12.7f} {b:>12.7f} {abs(a - b):>10.2e} {rel:>9.2e}")
    finite = len(resumed) == len(reference) and all(math.isfinite(v) for v in resumed)
    first_ok = finite and rels[0] <= FIRST_STEP_RTOL
    later_ok = finite and all(r <= LATER_STEPS_RTOL for r in rels[1:])
    print(
        f"\nTolerance: first resumed step {FIRST_STEP_RTOL:.0e} relative, later steps {LATER_STEPS_RTOL:.0e}. "
        "Not bit-exact by design: TP=2 vs FSDP2(3) add the same fp32 numbers in a different order\n"
        "(split matmul contractions + all-reduce, 6 vs 4 samples per rank, mean over 2 vs 3 ranks), "
        "a few fp32 ulps (~1e-7 relative) at the first step,\n"
        "possibly drifting through AdamW afterwards. Measured failures for scale: a model that did not load "
        "is off by ~0.2, lost Adam moments by ~5e-3 (second step)."
    )
    print(f"max relative diff: first step {rels[0]:.2e}, all steps {max(rels):.2e}; total {time.perf_counter() - t_start:.1f} s")
    ok = exact and same_hyper and first_ok and later_ok
    print(
        "VERDICT: PASS - resumed on 3 processes (FSDP2) from a 4-process TP2xDP2 checkpoint; state bit-identical, losses agree"
        if ok
        else "VERDICT: FAIL - the resumed run disagrees with the reference"
    )
    return ok
