"""Real DeepSpeed ZeRO checkpoints, made by DeepSpeed itself, plus DeepSpeed's own oracle outputs.

For tests of the DeepSpeed -> ucp_zarr converter. Import from tests as ``import ds_checkpoints``
(``tests/`` is on ``sys.path`` the same way as for ``_dist``). Nothing here imports deepspeed in
the calling process: training runs on ``world`` gloo processes (``DS_ACCELERATOR=cpu``) started
as plain subprocesses, and the oracles run in those processes too.

API (all paths returned from the cache are shared: treat them as read-only, copy to modify):

- :func:`variant` ``(stage, dtype, *, world=2, steps=3, optimizer="adam", universal_info=False,
  sub_group_size=None, round_robin=False, param_alignment=False)`` -> the dict naming one build;
  ``dtype`` is "fp32", "bf16" or "bf16_fp32_accum" (ZeRO-1 only: DeepSpeed's BF16_Optimizer);
  ``optimizer`` is "adam" | "adamw" | "sgd" (torch optimizers handed to DeepSpeed) | "ds_adamw" (the
  ds_config optimizer AdamW with torch_adam). :func:`standard_variants` is the set the tests build.
- :func:`checkpoint` ``(stage, dtype, **same keywords)`` -> cached DeepSpeed save folder (holds
  ``latest`` and ``global_step{steps}/``), built on first use.
- :func:`make_checkpoint` ``(out_dir, *, stage, dtype, ..., cache=True)`` -> ``out_dir / "checkpoint"``,
  a private copy of the cached build (or a fresh build with ``cache=False``); beside it ``run.json``
  (:func:`run_info`: losses, lrs, names, timings) and ``reference.pt`` (:func:`reference`).
- :func:`prebuild` ``(variants)``: build every missing variant, with its oracles, in one launch per world
  size (~9-10 s for the 12 standard variants on 2 cores; then cache hits, in this and later sessions).
- :func:`ds_to_universal` ``(ckpt_dir, out_dir)`` -> ``out_dir / "<tag>_universal"`` (holds ``zero/``;
  ``out_dir / "latest_universal"`` names it, so ``out_dir`` loads with ``load_universal``).
- :func:`zero_to_fp32` ``(ckpt_dir)`` -> ``{name: tensor}`` from
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``.
- :func:`reference` ``(ckpt_dir)`` -> the live engine's full fp32 master weights and optimizer states
  (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), module weights and buffers at save
  time: a third oracle that never reads the checkpoint files.
- :func:`resume` ``(ckpt_dir, *, stage, dtype, world=2, optimizer="adam", steps=2, load_universal=False)``
  -> losses of ``steps`` more steps after DeepSpeed loads the checkpoint (any world size dividing 12), to
  compare with ``run_info(ckpt)["losses_after_save"]`` (the same steps of the uninterrupted run).

Both oracle functions raise RuntimeError where DeepSpeed's own tool fails (ds_to_universal on SGD;
zero_to_fp32 on BF16_Optimizer files). The files and their layout are described in /tmp/ds_notes.md.

Cache: ``$UCP_ZARR_DS_CACHE`` or ``~/.cache/ucp_zarr_test_ds``, one folder per (deepspeed version,
torch version, python version, hash of this file); ``UCP_ZARR_DS_CACHE=off`` uses a temporary
folder for this process only. Entries are built in a temporary folder and renamed into place under a
file lock, so a half-built entry is never seen. Oracle outputs are keyed by the content hash of the
checkpoint's step folder, so a copy (``make_checkpoint``) hits the same entry. (ZeRO-3 rebuilds are not
byte-identical: its per-parameter padding is uninitialised memory.)

DeepSpeed's ``deepspeed_shm_comm`` JIT build (~90 s for the first run on this 2-core machine, needs g++
and ninja) is skipped: ``TorchBackend`` only builds it when ``deepspeed.ops.__compatible_ops__`` marks it
compatible, and the workers set that dict to all-False before ``init_distributed`` (the op serves only
``inference_all_reduce``; training collectives use gloo). ``TORCH_EXTENSIONS_DIR`` still points into the
cache as a safety net.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

# ---------------------------------------------------------------------------------------------
# The model and its data
# ---------------------------------------------------------------------------------------------

SEED = 1234
VOCAB, SEQ, DIM, HIDDEN = 13, 5, 7, 11
GLOBAL_BATCH = 12  # sequences per step, split evenly over 1, 2, 3, 4 or 6 ranks
LR = (1e-2, 2e-2)  # per parameter group
WEIGHT_DECAY = (0.1, 0.0)
CLIENT_STATE = {"epoch": 1, "note": "ucp_zarr test fixture", "nested": {"samples": [1, 2, 3]}}
OPTIMIZERS = ("adam", "adamw", "sgd", "ds_adamw")
DTYPES = ("fp32", "bf16", "bf16_fp32_accum")


class TinyModel(nn.Module):
    """Odd sizes everywhere. Parameter order (``named_parameters``, tied head skipped):

    ``embed.weight`` 13x7 (tied: ``head.weight is embed.weight``), ``pos.weight`` 5x7 (frozen),
    ``fc1.weight`` 11x7, ``fc1.bias`` 11, ``ln.weight`` 11, ``ln.bias`` 11, ``fc2.weight`` 7x11,
    ``fc2.bias`` 7, ``ln_f.weight`` 7, ``ln_f.bias`` 7; buffer ``out_scale`` 13.

    Group 0 (2-D, weight decay 0.1): embed, fc1.weight, fc2.weight = 245 elements.
    Group 1 (1-D, no decay): the biases and LayerNorms = 54 elements.
    On 2 ranks ZeRO-1/2 pads them to 248 and 56 (alignment 2 * world); fc1.weight (91..168) straddles
    the rank boundary at 124 and ln.bias (22..33) the boundary at 28. ZeRO-3 pads each parameter to a
    multiple of the world size (embed 91 -> 92, fc1.bias 11 -> 12, ...).
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("out_scale", torch.ones(VOCAB))  # a persistent buffer (not a parameter)
        g = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for name, p in self.named_parameters():
                base = 1.0 if name.startswith("ln") and name.endswith("weight") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
            self.out_scale.add_(0.1 * torch.randn(VOCAB, generator=g))
        self.pos.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        x = x + self.fc2(self.ln(nn.functional.gelu(self.fc1(x))))
        logits = (self.head(self.ln_f(x)) * self.out_scale).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


PARAM_NAMES = ["embed.weight", "pos.weight", "fc1.weight", "fc1.bias", "ln.weight", "ln.bias", "fc2.weight",
               "fc2.bias", "ln_f.weight", "ln_f.bias"]
FROZEN = ["pos.weight"]
BUFFERS = ["out_scale"]
TIED = {"head.weight": "embed.weight"}


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in trainable if p.dim() >= 2], "lr": LR[0], "weight_decay": WEIGHT_DECAY[0]},
        {"params": [p for _, p in trainable if p.dim() < 2], "lr": LR[1], "weight_decay": WEIGHT_DECAY[1]},
    ]


GROUP_NAMES = [["embed.weight", "fc1.weight", "fc2.weight"],
               ["fc1.bias", "ln.weight", "ln.bias", "fc2.bias", "ln_f.weight", "ln_f.bias"]]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of global step ``step``'s batch (same global batch for every world size)."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    m = GLOBAL_BATCH // world
    return idx[rank * m:(rank + 1) * m], tgt[rank * m:(rank + 1) * m]


def ds_config(stage: int, dtype: str, world: int, optimizer: str, *, sub_group_size: int | None = None,
              round_robin: bool = False, param_alignment: bool = False) -> dict[str, Any]:
    if GLOBAL_BATCH % world:
        raise ValueError(f"world {world} does not divide the global batch {GLOBAL_BATCH}")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        # partition every parameter (the default, 1e5, would keep all of this tiny model's
        # parameters whole on every rank)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if sub_group_size is not None:
        # ZeRO-3 splits each param group into sub-groups of about this many partitioned elements,
        # each with its own fp32 flat tensor and optimizer state entry
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    if round_robin:
        # ZeRO-1/2 reorders each group's parameters before flattening (rank-interleaved)
        cfg["zero_optimization"]["round_robin_gradients"] = True
    if param_alignment:
        # ZeRO-1/2 pads after every parameter but the last to 16 bytes (4 fp32 / 8 bf16 elements):
        # the saved param_alignment_paddings become non-zero
        cfg["zero_optimization"]["parameter_alignment"] = True
    if dtype in ("bf16", "bf16_fp32_accum"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16_fp32_accum":
        # ZeRO-1 + bf16 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, not the ZeRO optimizer
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if optimizer == "ds_adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR[0], "torch_adam": True}}
    return cfg


def make_optimizer(name: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    if name == "adam":
        return torch.optim.Adam(groups)
    if name == "adamw":
        return torch.optim.AdamW(groups)
    if name == "sgd":
        return torch.optim.SGD(groups, momentum=0.9)
    if name == "ds_adamw":
        return None  # built by DeepSpeed from the config, on ``model_parameters=groups``
    # Not "adagrad": DeepSpeed 0.19 ZeRO-1/2/3 rebuilds a torch Adagrad over all fp32 partitions as ONE
    # param group (stage_1_and_2.py: torch.optim.Adagrad(self.single_partition_of_fp32_groups, ...)), so
    # with two groups the first step fails with IndexError.
    raise ValueError(f"unknown optimizer {name!r}; one of {OPTIMIZERS}")


def make_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    """Halve every group's lr every 2 steps (keeps the groups' different lrs, unlike WarmupLR)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


# ---------------------------------------------------------------------------------------------
# Variants, cache
# ---------------------------------------------------------------------------------------------

CONTINUE_STEPS = 2  # steps trained after the save, for resume tests


def variant(stage: int, dtype: str, *, world: int = 2, steps: int = 3, optimizer: str = "adam",
            universal_info: bool = False, sub_group_size: int | None = None, round_robin: bool = False,
            param_alignment: bool = False) -> dict[str, Any]:
    if stage not in (1, 2, 3):
        raise ValueError(f"stage {stage}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; one of {DTYPES}")
    if dtype == "bf16_fp32_accum" and stage != 1:
        raise ValueError("bf16_fp32_accum (BF16_Optimizer) is a ZeRO-1 variant")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}; one of {OPTIMIZERS}")
    if world < 1 or GLOBAL_BATCH % world:
        raise ValueError(f"world {world}")
    if sub_group_size is not None and stage != 3:
        raise ValueError("sub_group_size is a ZeRO-3 setting")
    if (round_robin or param_alignment) and (stage == 3 or dtype == "bf16_fp32_accum"):
        raise ValueError("round_robin and param_alignment are settings of the ZeRO-1/2 optimizer")
    return {"stage": stage, "dtype": dtype, "world": world, "steps": steps, "optimizer": optimizer,
            "universal_info": bool(universal_info), "sub_group_size": sub_group_size, "round_robin": bool(round_robin),
            "param_alignment": bool(param_alignment)}


def standard_variants() -> list[dict[str, Any]]:
    """The set a converter test suite wants (all on 2 ranks, built by one launch): ZeRO-1/2/3 x fp32/bf16
    with Adam, ZeRO-1 with DeepSpeed's BF16_Optimizer, SGD-with-momentum (state ``momentum_buffer``) on
    ZeRO-2 and 3, ZeRO-3 with sub-groups (3 flat groups for 2 param groups), ZeRO-2 round-robin and ZeRO-2
    bf16 with per-parameter alignment padding."""
    return ([variant(s, d) for d in ("fp32", "bf16") for s in (1, 2, 3)]
            + [variant(1, "bf16_fp32_accum"), variant(2, "fp32", optimizer="sgd"), variant(3, "fp32", optimizer="sgd"),
               variant(3, "fp32", sub_group_size=50), variant(2, "fp32", round_robin=True),
               variant(2, "bf16", param_alignment=True)])


def variant_name(v: dict[str, Any]) -> str:
    return (f"z{v['stage']}-{v['dtype']}-w{v['world']}-s{v['steps']}-{v['optimizer']}"
            + ("-uci" if v["universal_info"] else "") + (f"-sg{v['sub_group_size']}" if v["sub_group_size"] else "")
            + ("-rr" if v["round_robin"] else "") + ("-pa" if v["param_alignment"] else ""))


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"deepspeed": version("deepspeed"), "torch": torch.__version__, "python": sys.version.split()[0]}


_ROOT: Path | None = None


def cache_root() -> Path:
    """This file's cache folder (created on first use)."""
    global _ROOT
    if _ROOT is None:
        setting = os.environ.get("UCP_ZARR_DS_CACHE", "")
        if setting.lower() in ("off", "0", "no", "false"):
            base = Path(tempfile.mkdtemp(prefix="ucp_zarr_test_ds_"))
            import atexit

            atexit.register(shutil.rmtree, base, True)
        else:
            base = Path(setting) if setting else Path.home() / ".cache" / "ucp_zarr_test_ds"
        h = hashlib.sha256(Path(__file__).read_bytes())
        h.update(json.dumps(_versions(), sort_keys=True).encode())
        _ROOT = base / h.hexdigest()[:16]
        _ROOT.mkdir(parents=True, exist_ok=True)
        (_ROOT / "versions.json").write_text(json.dumps(_versions()))
    return _ROOT


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    with open(cache_root() / f".lock-{name}", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:  # someone else published it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise


def _entry(v: dict[str, Any]) -> Path:
    return cache_root() / variant_name(v)


def prebuild(variants: Iterable[dict[str, Any]], *, timeout_s: float = 600) -> dict[str, float]:
    """Build every variant not yet in the cache, with their oracles: one launch per world size,
    each launch training its variants one after the other in the same process group. Returns the
    seconds spent per launch (empty when everything was cached)."""
    todo: dict[int, list[dict[str, Any]]] = {}
    for v in variants:
        if not (_entry(v) / "run.json").is_file() and v not in todo.setdefault(v["world"], []):
            todo[v["world"]].append(v)
    spent: dict[str, float] = {}
    for world, vs in todo.items():
        if not vs:
            continue
        with _locked(f"build-w{world}"):
            vs = [v for v in vs if not _entry(v).is_dir()]
            if not vs:
                continue
            # all in one launch; if that fails, one launch each (so one bad variant costs only itself)
            batches = [vs] + ([[v] for v in vs] if len(vs) > 1 else [])
            errors: dict[str, str] = {}
            for chunk in batches:
                chunk = [v for v in chunk if not _entry(v).is_dir()]
                if not chunk:
                    continue
                work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_root()))
                try:
                    tasks = [{"kind": "train", "variant": v, "out": str(work / variant_name(v)), "oracles": True,
                              "oracle_root": str(cache_root() / "oracles")} for v in chunk]
                    t0 = time.perf_counter()
                    launch(world, tasks, work, timeout_s=timeout_s)
                    spent[f"w{world}:" + ",".join(variant_name(v) for v in chunk)] = time.perf_counter() - t0
                    for v in chunk:
                        _publish(work / variant_name(v), _entry(v))
                except RuntimeError as e:
                    if len(chunk) == 1:
                        errors[variant_name(chunk[0])] = str(e)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            if errors:
                raise RuntimeError("\n\n".join(f"== {k} ==\n{e}" for k, e in errors.items()))
    return spent


def _checkpoint_entry(stage: int, dtype: str, **kw: Any) -> Path:
    v = variant(stage, dtype, **kw)
    if not (_entry(v) / "run.json").is_file():
        prebuild([v])
    return _entry(v)


def checkpoint(stage: int, dtype: str, *, world: int = 2, steps: int = 3, optimizer: str = "adam",
               universal_info: bool = False, sub_group_size: int | None = None, round_robin: bool = False,
               param_alignment: bool = False) -> Path:
    """The cached checkpoint folder (holding ``latest``) of this variant, built on first use. Read-only."""
    return _checkpoint_entry(stage, dtype, world=world, steps=steps, optimizer=optimizer, universal_info=universal_info,
                             sub_group_size=sub_group_size, round_robin=round_robin,
                             param_alignment=param_alignment) / "checkpoint"


def run_info(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """``run.json`` beside a checkpoint folder: variant, versions, ``losses`` (mean over ranks, one
    per step before the save), ``losses_after_save`` (the next steps, same data), ``lrs`` (per group
    after each step), parameter names, tied and frozen names, build seconds."""
    return json.loads((Path(ckpt_dir).parent / "run.json").read_text())


def make_checkpoint(out_dir: str | os.PathLike, *, stage: int, dtype: str, world: int = 2, steps: int = 3,
                    optimizer: str = "adam", universal_info: bool = False, sub_group_size: int | None = None,
                    round_robin: bool = False, param_alignment: bool = False, cache: bool = True) -> Path:
    """A DeepSpeed ZeRO checkpoint in ``out_dir / "checkpoint"`` (returned; it holds ``latest``), with
    ``out_dir / "run.json"`` (:func:`run_info`). Copied from the cache, or trained afresh (no oracles)
    with ``cache=False``."""
    out_dir = Path(out_dir)
    v = variant(stage, dtype, world=world, steps=steps, optimizer=optimizer, universal_info=universal_info,
                sub_group_size=sub_group_size, round_robin=round_robin, param_alignment=param_alignment)
    if cache:
        src = _checkpoint_entry(**v)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src / "checkpoint", out_dir / "checkpoint")
        shutil.copy2(src / "run.json", out_dir / "run.json")
        shutil.copy2(src / "reference.pt", out_dir / "reference.pt")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        logs = Path(tempfile.mkdtemp(prefix="ds-logs-"))
        try:
            launch(world, [{"kind": "train", "variant": v, "out": str(out_dir), "oracles": False}], logs)
        finally:
            shutil.rmtree(logs, ignore_errors=True)
    return out_dir / "checkpoint"


def reference(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The live engine's state when it saved ``ckpt_dir``: ``{"fp32": {name: t}, "optim": {name: {key: t}},
    "lp": {name: t}, "buffers": {name: t}, "optim_keys": [...], "hp_trusted": bool}`` (full, unpadded, shaped tensors; frozen
    params only in ``lp``). For ``round_robin`` variants ``fp32``/``optim`` are empty and ``hp_trusted`` is
    False: DeepSpeed's own fragment mapping is wrong there (see ``_full_state``)."""
    return torch.load(Path(ckpt_dir).parent / "reference.pt", weights_only=True)


def step_dir(ckpt_dir: str | os.PathLike) -> Path:
    """``ckpt_dir / <latest tag>``, or ``ckpt_dir`` itself when it is already a step folder."""
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / "latest"
    return ckpt_dir / latest.read_text().strip() if latest.is_file() else ckpt_dir


def content_hash(folder: str | os.PathLike) -> str:
    h = hashlib.sha256()
    folder = Path(folder)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _oracle_entry(ckpt_dir: str | os.PathLike, timeout_s: float = 600) -> Path:
    sd = step_dir(ckpt_dir)
    final = cache_root() / "oracles" / content_hash(sd)
    if (final / "done").is_file():
        return final
    with _locked("oracles"):
        if not (final / "done").is_file():
            final.parent.mkdir(exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=".oracle-", dir=final.parent))
            try:
                _run_oracles_subprocess(sd, work, timeout_s)
                (work / "done").write_text("")
                _publish(work, final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return final


def zero_to_fp32(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint(ckpt_dir)`` (cached; raises where
    DeepSpeed's own function raised)."""
    entry = _oracle_entry(ckpt_dir)
    err = entry / "zero_to_fp32_error.txt"
    if err.is_file():
        raise RuntimeError(f"zero_to_fp32 failed on {ckpt_dir}:\n{err.read_text()[-3000:]}")
    return torch.load(entry / "zero_to_fp32.pt", weights_only=True)


def ds_to_universal(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """DeepSpeed's ``ds_to_universal --inject_missing_state`` of ``ckpt_dir``'s latest step (cached),
    copied to ``out_dir``: returns ``out_dir / "<tag>_universal"`` (holding ``zero/<param>/*.pt``, the
    model-states files and ``zero/optimizer_state.pt``); ``out_dir / "latest_universal"`` names it."""
    entry = _oracle_entry(ckpt_dir)
    err = entry / "universal_error.txt"
    if err.is_file():
        raise RuntimeError(f"ds_to_universal failed on {ckpt_dir}:\n{err.read_text()[-3000:]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = (entry / "universal" / "latest_universal").read_text().strip()
    shutil.copytree(entry / "universal" / tag, out_dir / tag)
    shutil.copy2(entry / "universal" / "latest_universal", out_dir / "latest_universal")
    return out_dir / tag


def universal_tensors(universal: str | os.PathLike) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(parameter name, state key, tensor)`` for every ``zero/<name>/<key>.pt`` of a
    ``ds_to_universal`` output folder but ``step`` (ZeRO-3 tensors stay flat, as DeepSpeed left them)."""
    for folder in sorted((Path(universal) / "zero").iterdir()):
        if not folder.is_dir():
            continue
        for f in sorted(folder.glob("*.pt")):
            if f.stem != "step":
                v = torch.load(f, weights_only=False)
                yield folder.name, f.stem, v["param"] if isinstance(v, dict) else v


def converted_key(keys: Any, name: str, state_key: str) -> str:
    """The key of a ``ds_to_universal`` tensor in a checkpoint converted by ucp_zarr (``keys``:
    its keys): the fp32 master is ``model.<name>`` when training was in fp32."""
    key = f"optim.state.{name}.{state_key}"
    return f"model.{name}" if state_key == "fp32" and key not in keys else key


def universal_stats(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Wall seconds and peak RSS (KiB) of the ds_to_universal and zero_to_fp32 runs that filled the cache."""
    return json.loads((_oracle_entry(ckpt_dir) / "stats.json").read_text())


def resume(ckpt_dir: str | os.PathLike, *, stage: int, dtype: str, world: int = 2, optimizer: str = "adam",
           steps: int = CONTINUE_STEPS, load_universal: bool = False, tag: str | None = None,
           sub_group_size: int | None = None, round_robin: bool = False, param_alignment: bool = False,
           timeout_s: float = 600) -> list[float]:
    """Start a fresh engine of this variant on ``world`` ranks, ``engine.load_checkpoint(ckpt_dir, tag)``
    (``"checkpoint": {"load_universal": true}`` when ``load_universal``; then ``ckpt_dir`` is the folder
    holding ``latest_universal``), train ``steps`` steps on the data of the steps after the save, and
    return their losses (mean over ranks). Not cached."""
    v = variant(stage, dtype, world=world, optimizer=optimizer, sub_group_size=sub_group_size, round_robin=round_robin,
                param_alignment=param_alignment)
    work = Path(tempfile.mkdtemp(prefix="ds-resume-"))
    try:
        launch(world, [{"kind": "resume", "variant": v, "load": str(ckpt_dir), "tag": tag, "steps": steps,
                         "load_universal": load_universal, "out": str(work / "losses.json")}], work,
                timeout_s=timeout_s)
        return json.loads((work / "losses.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(cache_root().parent / "torch_extensions"))
    env.update(extra or {})
    return env


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def launch(world: int, tasks: list[dict[str, Any]], work: Path, timeout_s: float = 600, worker: str = __file__) -> None:
    """Run ``tasks`` on ``world`` fresh processes (one gloo group) of ``python worker _worker JOB``
    (JOB: ``{"tasks": [...], "timeout_s": s}``); raise with the logs on any failure. Every process is
    its own session: on failure or timeout all of them (and their children) are killed."""
    work.mkdir(parents=True, exist_ok=True)
    job = work / "job.json"
    for attempt in range(2):  # a second try only for a port taken between probe and bind
        job.write_text(json.dumps({"tasks": tasks, "timeout_s": timeout_s}))
        port = str(_free_port())
        procs, logs = [], []
        for rank in range(world):
            log = work / f"rank{rank}.log"
            logs.append(log)
            env = _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), RANK=str(rank),
                            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)))
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, worker, "_worker", str(job)], env=env, stdout=f,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, cwd=work))
        deadline = time.monotonic() + timeout_s
        failed = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = f"rank {bad[0]} exited with {codes[bad[0]]}"
                    break
                if all(c == 0 for c in codes):
                    return
                if time.monotonic() > deadline:
                    failed = f"timed out after {timeout_s:.0f} s"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        first = bad[0] if failed and failed.startswith("rank") else 0
        order = [first] + [r for r in range(world) if r != first]
        text = "\n".join(f"--- rank {r} ---\n{_tail(logs[r], 6000 if r == first else 1500)}" for r in order)
        if attempt == 0 and "address already in use" in text.lower():
            continue
        raise RuntimeError(f"DeepSpeed worker failed ({failed}):\n{text}")


def _run_oracles_subprocess(sd: Path, out: Path, timeout_s: float) -> None:
    log = out / "oracle.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, __file__, "_oracles", str(sd), str(out)], env=_env(), stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        _kill(p)
    if rc != 0:
        raise RuntimeError(f"DeepSpeed oracles failed ({rc}) on {sd}:\n{_tail(log)}")


# ---------------------------------------------------------------------------------------------
# Worker side (runs in the subprocesses; the only place deepspeed is imported)
# ---------------------------------------------------------------------------------------------


def _import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import collections

    import deepspeed
    import deepspeed.ops

    # Skip the deepspeed_shm_comm JIT build (and the compiler probes of every op): TorchBackend
    # builds it only when __compatible_ops__ marks it compatible; it serves inference_all_reduce only.
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)
    return deepspeed


def _oracles(sd: Path, out: Path, *, split_ranks: tuple[int, int] | None = None) -> None:
    """zero_to_fp32 -> ``out/zero_to_fp32.pt``; ds_to_universal -> ``out/universal/<tag>_universal`` (or
    ``out/universal_error.txt``); timings and peak RSS -> ``out/stats.json``. With ``split_ranks=(rank,
    world)`` and world > 1, rank 0 runs ds_to_universal and rank 1 zero_to_fp32, each writing its own
    stats file (merged by the caller)."""
    import resource
    import traceback

    out.mkdir(parents=True, exist_ok=True)
    rank, world = split_ranks or (0, 1)
    do_fp32 = world == 1 or rank == 1
    do_univ = rank == 0
    stats: dict[str, Any] = {}
    if do_fp32:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        t0 = time.perf_counter()
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(sd.parent), tag=sd.name)
            torch.save({k: v.clone() for k, v in state.items()}, out / "zero_to_fp32.pt")
        except Exception:
            (out / "zero_to_fp32_error.txt").write_text(traceback.format_exc())
        stats["zero_to_fp32_s"] = time.perf_counter() - t0
    if do_univ:
        import argparse

        from deepspeed.checkpoint import ds_to_universal as d2u

        args = argparse.Namespace(input_folder=str(sd), output_folder=str(out / "universal" / f"{sd.name}_universal"),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)
        t0 = time.perf_counter()
        try:
            d2u.main(args)
        except Exception:
            shutil.rmtree(out / "universal", ignore_errors=True)
            (out / "universal_error.txt").write_text(traceback.format_exc())
        stats["ds_to_universal_s"] = time.perf_counter() - t0
    stats["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (out / (f"stats.rank{rank}.json" if split_ranks else "stats.json")).write_text(json.dumps(stats))


def _full_state(engine: Any, model: nn.Module, dtype: str) -> dict[str, Any]:
    """Full fp32 master / optimizer states / low-precision weights from the live engine (collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero_opt = engine.optimizer
    if hasattr(zero_opt, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19 (ZeRO-1/2, BF16_Optimizer) links each parameter to its optimizer-state
        # fragments once, right after the first param group's step: every later group keeps an empty
        # fragment dict and safe_get_full_optimizer_state raises "exp_avg not found". Re-link now.
        zero_opt._hp_optimizer_states_linked = False
        zero_opt._lazy_init_hp_params_optimizer_state()
    base = zero_opt.optimizer if hasattr(zero_opt, "optimizer") else zero_opt
    keys = sorted({k for s in base.state.values() for k in s if k != "step"})
    # With round_robin_gradients DeepSpeed 0.19 lays the flat groups out in round-robin order (as
    # param_shapes says) but links each parameter to its fp32/optimizer fragment as if they were in
    # model order: safe_get_full_* (and the saved param_slice_mappings) return other parameters'
    # values. Keep only the module weights ("lp", which are views of the real flat buffer) then.
    trusted = not getattr(engine.optimizer, "round_robin_gradients", False)
    ref: dict[str, Any] = {"fp32": {}, "optim": {}, "lp": {}, "optim_keys": keys, "hp_trusted": trusted}
    for name, p in model.named_parameters():
        if p.requires_grad and trusted:
            ref["fp32"][name] = safe_get_full_fp32_param(p).detach().clone().float().cpu()
            ref["optim"][name] = {k: safe_get_full_optimizer_state(p, k).detach().clone().cpu() for k in keys}
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            ref["lp"][name] = p.detach().clone().cpu()
    ref["buffers"] = {name: b.detach().clone().cpu() for name, b in model.named_buffers()}
    return ref


def _variant_config(v: dict[str, Any], world: int) -> dict[str, Any]:
    return ds_config(v["stage"], v["dtype"], world, v["optimizer"], sub_group_size=v["sub_group_size"],
                     round_robin=v["round_robin"], param_alignment=v["param_alignment"])


def train_step(engine: Any, step: int, rank: int, world: int) -> float:
    """One training step on ``step``'s batch; the loss averaged over the ranks."""
    import torch.distributed as dist

    idx, tgt = batch(step, rank, world)
    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def _train(task: dict[str, Any], rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed as dist

    deepspeed = _import_deepspeed()
    v = task["variant"]
    out = Path(task["out"])
    t_start = time.perf_counter()
    model = TinyModel()
    groups = param_groups(model)
    opt = make_optimizer(v["optimizer"], groups)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=groups if opt is None else None,
                                           lr_scheduler=make_scheduler, config=_variant_config(v, world))
    losses, lrs, after = [], [], []
    t_save = 0.0
    ref = None
    for step in range(v["steps"] + CONTINUE_STEPS):
        if step == v["steps"]:
            ref = _full_state(engine, model, v["dtype"])
            client = dict(CLIENT_STATE)
            if v["universal_info"]:
                client["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4}
            t0 = time.perf_counter()
            engine.save_checkpoint(str(out / "checkpoint"), client_state=client)
            t_save = time.perf_counter() - t0
        (losses if step < v["steps"] else after).append(train_step(engine, step, rank, world))
        if step < v["steps"]:
            lrs.append([g["lr"] for g in engine.optimizer.param_groups])
    t_train = time.perf_counter() - t_start
    sd = out / "checkpoint" / f"global_step{v['steps']}"
    dist.barrier()
    if rank == 0:
        torch.save(ref, out / "reference.pt")
    t_oracle = 0.0
    if task.get("oracles"):
        t0 = time.perf_counter()
        oracle_final = Path(task["oracle_root"]) / content_hash(sd)
        tmp = Path(task["oracle_root"]) / f".tmp-{content_hash(sd)}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if not (oracle_final / "done").is_file():
            _oracles(sd, tmp, split_ranks=(rank, world))
        dist.barrier()
        if rank == 0 and not (oracle_final / "done").is_file():
            stats: dict[str, Any] = {}
            for f in sorted(tmp.glob("stats.rank*.json")):
                part = json.loads(f.read_text())
                stats["peak_rss_kib"] = max(stats.get("peak_rss_kib", 0), part.pop("peak_rss_kib"))
                stats.update(part)
                f.unlink()
            stats["note"] = "measured inside the training ranks (peak RSS includes training)"
            (tmp / "stats.json").write_text(json.dumps(stats))
            (tmp / "done").write_text("")
            _publish(tmp, oracle_final)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        t_oracle = time.perf_counter() - t0
    if rank == 0:
        info = {
            "variant": v, "versions": _versions(), "tag": sd.name, "losses": losses, "losses_after_save": after,
            "lrs": lrs, "param_names": PARAM_NAMES, "group_names": GROUP_NAMES, "frozen": FROZEN, "tied": TIED,
            "buffers": BUFFERS,
            "client_state": CLIENT_STATE, "engine_optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(engine.basic_optimizer).__name__,
            "seconds": {"train_and_save": t_train, "save": t_save, "oracles": t_oracle},
        }
        (out / "run.json").write_text(json.dumps(info, indent=1))
    engine.destroy()
    dist.barrier()


def _resume(task: dict[str, Any], rank: int, world: int) -> None:
    import torch.distributed as dist

    deepspeed = _import_deepspeed()
    v = task["variant"]
    model = TinyModel()
    groups = param_groups(model)
    opt = make_optimizer(v["optimizer"], groups)
    cfg = _variant_config(v, world)
    if task["load_universal"]:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=groups if opt is None else None,
                                           lr_scheduler=make_scheduler, config=cfg)
    path, _ = engine.load_checkpoint(task["load"], tag=task["tag"])
    if path is None:
        raise RuntimeError(f"load_checkpoint({task['load']!r}) found nothing")
    first = engine.global_steps
    losses = []
    for step in range(first, first + task["steps"]):
        losses.append(train_step(engine, step, rank, world))
    if rank == 0:
        Path(task["out"]).write_text(json.dumps(losses))
    engine.destroy()
    dist.barrier()


def exit_cleanly() -> None:
    """End a worker that finished its work: flush and leave without the interpreter's
    teardown, where gloo's native threads were seen to abort a finished process
    ("terminate called without an active exception", exit -6) under load."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(job_file: str, handlers: dict[str, Callable[[dict[str, Any], int, int], None]]) -> None:
    """A worker process of :func:`launch`: join the gloo group, run each task of the job with
    ``handlers[task["kind"]](task, rank, world)``, meet the other ranks, leave."""
    job = json.loads(Path(job_file).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    deepspeed = _import_deepspeed()
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=job["timeout_s"]),
                               verbose=False)
    try:
        for task in job["tasks"]:
            if task["kind"] not in handlers:
                raise ValueError(f"unknown task kind {task['kind']!r}")
            handlers[task["kind"]](dict(task, timeout_s=job["timeout_s"]), rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_cleanly()


if __name__ == "__main__":
    if sys.argv[1] == "_worker":
        run_worker(sys.argv[2], {"train": lambda t, r, w: _train(t, r, w, t["timeout_s"]), "resume": _resume})
    elif sys.argv[1] == "_oracles":
        _import_deepspeed()
        _oracles(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} _worker JOB.json | _oracles STEP_DIR OUT_DIR")
