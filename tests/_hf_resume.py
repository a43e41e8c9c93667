"""A tiny Trainer setup whose resumes are compared with the Trainer's own
(``tests/test_integration_transformers.py``): a model with dropout whose loss draws from
Python's and NumPy's generators too (so every generator must be restored where the Trainer
restores its own), evaluation metrics scripted by step, and three runs of one setup: the
uninterrupted run with the Trainer's own saves, the Trainer's own resume from its
``checkpoint-N``, and a run stopped at step N through :class:`ZarrCheckpointCallback` then
resumed from its checkpoint.

Under torchrun (``python -m torch.distributed.run --nproc_per_node N _hf_resume.py MODE ROOT
AT``, or plain ``python`` for one process): ``save`` runs the first two legs on N processes
(the Trainer's own ``ROOT/full/checkpoint-AT``, and ``ROOT/ckpt`` through the callback);
``resume`` resumes both (ours from ``ROOT/ckpt_<N>``, a copy) on N processes and writes each
rank's :func:`outcome` of each to ``ROOT/outcome_<N>_<rank>.pt``."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from _transformers_job import StopAt
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from ucp_zarr.integrations.transformers import ZarrCheckpointCallback


class Config(PretrainedConfig):
    model_type = "ucp_zarr_tiny"

    def __init__(self, vocab: int = 32, dim: int = 16, loss_factor: float = 1.0, **kw: Any) -> None:
        self.vocab, self.dim, self.loss_factor = vocab, dim, loss_factor
        super().__init__(**kw)


class Tiny(PreTrainedModel):
    config_class = Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.hid = nn.Linear(config.dim, config.dim)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.drop(torch.tanh(self.hid(self.emb(input_ids)))))
        loss = self.config.loss_factor * nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        if self.training:
            loss = loss + 1e-3 * (random.random() + float(np.random.rand()))
        return {"loss": loss, "logits": logits}


def data(n: int = 24, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": t, "labels": t} for t in tokens]


def trainer(out: Path, args: dict[str, Any], *, seed: int, callbacks: list[Any], scores: dict[int, float] | None = None,
            eval_data: Any = None, scaler: bool = False) -> Trainer:
    """A Trainer of a model drawn from ``seed``; ``scores``: the eval metric ``score`` by step;
    ``scaler``: with a loss scaler where accelerate keeps fp16's on a GPU (none runs here),
    one that overflows every few steps and backs off."""
    torch.manual_seed(seed)
    model = Tiny(Config(loss_factor=1e4 if scaler else 1.0))  # (gradients that overflow a scale of 2**112)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    running: list[Trainer] = []
    compute = None if scores is None else (lambda _: {"score": float(scores.get(running[0].state.global_step, 10.0))})
    kw = dict(per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
              learning_rate=1e-2, save_strategy="steps", save_steps=2, max_steps=10) | args
    t = Trainer(model=model, args=TrainingArguments(str(out), log_level="error", **kw), train_dataset=data(),
                eval_dataset=eval_data if eval_data is not None else (data(4, 5) if scores is not None else None),
                callbacks=callbacks, compute_metrics=compute)
    running.append(t)
    if scaler:  # (Accelerator.__init__'s get_grad_scaler for fp16 on a GPU; prepared in train())
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**112, growth_interval=1)
    return t


def three_runs(root: Path, args: dict[str, Any], at: int, *, extra: Callable[[], list[Any]] = list,
               zarr: Callable[[], ZarrCheckpointCallback] | None = None, **kw: Any) -> dict[str, dict[str, Any]]:
    """The :func:`outcome` of the uninterrupted run, of the Trainer's own resume from its
    step ``at``, and of ucp_zarr's (each taken as its training ends: the generators are global);
    ``zarr`` makes the callbacks (default: saving under ``root / "ckpt"``)."""
    zarr = zarr or (lambda: ZarrCheckpointCallback(root / "ckpt"))
    full = trainer(root / "full", args, seed=0, callbacks=extra(), **kw)
    full.train()
    out = {"full": outcome(full)}
    own = trainer(root / "own", args, seed=7, callbacks=extra(), **kw)
    own.train(resume_from_checkpoint=str(root / "full" / f"checkpoint-{at}"))
    out["own"] = outcome(own)
    first = zarr()
    t = trainer(root / "z1", args, seed=0, callbacks=[first, StopAt(at), *extra()], **kw)
    t.train(resume_from_checkpoint=first.resume(t))
    second = zarr()
    ours = trainer(root / "z2", args, seed=7, callbacks=[second, *extra()], **kw)
    ours.train(resume_from_checkpoint=second.resume(ours))
    return out | {"ours": outcome(ours)}


def outcome(t: Trainer) -> dict[str, Any]:
    """What a resume must reproduce: losses and learning rates by step, the weights, the
    optimizer and scheduler states, the generators after training, the stop and the best."""
    history = t.state.log_history
    return {
        "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
        "lr": {h["step"]: h["learning_rate"] for h in history if "learning_rate" in h},
        "model": {k: v.clone() for k, v in t.model.state_dict().items()},
        "optimizer": t.optimizer.state_dict()["state"],
        "scheduler": t.lr_scheduler.state_dict(),
        "rng": (random.random(), float(np.random.rand()), torch.rand(1).item()),
        "stop": (t.state.global_step, t.state.best_metric, t.state.best_global_step),
        "best checkpoint": _best_checkpoint(t.state.best_model_checkpoint),
        "scaler": None if t.accelerator.scaler is None else t.accelerator.scaler.state_dict(),
    }


def _best_checkpoint(path: str | None) -> tuple[int, bool] | None:
    """The step of a ``best_model_checkpoint`` (the Trainer's ``checkpoint-N`` or a manager's
    ``step_0000000N``) and whether it is there."""
    if path is None:
        return None
    return int(re.search(r"(\d+)$", path).group(1)), Path(path).is_dir()  # type: ignore[union-attr]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


if __name__ == "__main__":
    mode, root, at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    args = dict(max_steps=12, save_steps=2, per_device_train_batch_size=2)  # (6 steps an epoch on 2, 4 on 3, 12 on 1)
    if mode == "save":
        trainer(root / "full", args, seed=0, callbacks=[StopAt(at)]).train()
        callback = ZarrCheckpointCallback(root / "ckpt")
        t = trainer(root / "z1", args, seed=0, callbacks=[callback, StopAt(at)])
        t.train(resume_from_checkpoint=callback.resume(t))
    else:
        own = trainer(root / f"own_{world}", args, seed=7, callbacks=[])
        own.train(resume_from_checkpoint=str(root / "full" / f"checkpoint-{at}"))
        out = {"own": outcome(own)}  # (as its training ends: the generators are global)
        callback = ZarrCheckpointCallback(root / f"ckpt_{world}")
        ours = trainer(root / f"z2_{world}", args, seed=7, callbacks=[callback])
        ours.train(resume_from_checkpoint=callback.resume(ours))
        torch.save(out | {"ours": outcome(ours)}, root / f"outcome_{world}_{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (gloo's threads may abort a finished process at teardown: see _dist.py)
