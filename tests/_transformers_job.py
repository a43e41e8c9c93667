"""Hugging Face Trainer runs for tests/test_integration_transformers.py: a tiny GPT-2 (built
from a config, dropout on, so the generators matter) trained on random tokens, with
ZarrCheckpointCallback. Imported by the test for single-process runs; under torchrun
(``python -m torch.distributed.run --nproc_per_node 2 _transformers_job.py OUT``) it runs the
same three trainings on 2 processes (DDP, gloo) and writes each rank's losses to OUT/losses_<rank>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

STEPS = 8
"""Two epochs of 4 steps (16 sequences, 4 per step: on two processes, 2 each)."""


class StopAt(TrainerCallback):
    """Ends training after ``step`` (a crash after the last save, without losing the process)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_trainer(root: Path, out: Path, *, seed: int, save_steps: int, stop_at: int | None = None) -> tuple[Trainer, ZarrCheckpointCallback]:
    torch.manual_seed(seed)  # the resumed run starts from other weights: the checkpoint must bring them
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        str(out), max_steps=STEPS, per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", 1)), save_steps=save_steps,
        logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=seed, data_seed=1, learning_rate=1e-2,
    )
    callback = ZarrCheckpointCallback(root, keep_last=2)
    callbacks: list[TrainerCallback] = [callback] + ([StopAt(stop_at)] if stop_at is not None else [])
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks), callback


def losses(trainer: Trainer) -> dict[int, float]:
    """The loss logged at each step (logging_steps=1)."""
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def uninterrupted(tmp: Path) -> dict[int, float]:
    trainer, callback = make_trainer(tmp / "full", tmp / "out_full", seed=0, save_steps=STEPS)
    assert callback.resume(trainer) is None  # nothing saved yet: a fresh start
    trainer.train()
    return losses(trainer)


def interrupted_and_resumed(tmp: Path, *, save_steps: int, stop_at: int) -> tuple[dict[int, float], dict[int, float], list[int]]:
    """Train until ``stop_at`` (saving every ``save_steps``), then resume in a new Trainer
    with other initial weights; the losses of both legs and the steps kept after the first."""
    root = tmp / "ckpt"
    first, callback = make_trainer(root, tmp / "out1", seed=0, save_steps=save_steps, stop_at=stop_at)
    first.train(resume_from_checkpoint=callback.resume(first))
    kept = callback.manager.steps()
    second, callback = make_trainer(root, tmp / "out2", seed=123, save_steps=save_steps)
    second.train(resume_from_checkpoint=callback.resume(second))
    return losses(first), losses(second), kept


if __name__ == "__main__":
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    result = {"full": uninterrupted(out)}
    first, second, kept = interrupted_and_resumed(out, save_steps=3, stop_at=5)
    result |= {"first": first, "second": second, "kept": kept}
    (out / f"losses_{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (gloo's threads may abort a finished process at teardown, "terminate called": see _dist.py)
