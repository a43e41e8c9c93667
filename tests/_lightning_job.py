"""PyTorch Lightning runs for tests/test_integration_lightning.py: a small regression model
with AdamW and a StepLR scheduler, checkpointed by ModelCheckpoint through ZarrCheckpointIO.
Imported by the test for single-process runs; run as a script
(``python _lightning_job.py OUT``) it trains with ``strategy="ddp"`` on 2 CPU processes
(Lightning starts the second one by running this script again) and writes each rank's
losses to OUT/losses_<rank>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ucp_zarr.integrations.lightning import ZarrCheckpointIO

EPOCHS = 3
STEPS_PER_EPOCH = 2
"""64 samples, batch 32 (on two processes: one step of 32 each)."""


class Regression(L.LightningModule):
    def __init__(self, lr: float = 0.05, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__()
        self.save_hyperparameters()  # (a tuple among them: it must come back a tuple)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=self.hparams.betas)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


class Losses(Callback):
    """Every training step's loss, exactly (by global step)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=32)


def fit(dirpath: Path, epochs: int, *, seed: int, ckpt_path: str | None = None, plugin: Any = None, devices: int = 1,
        **checkpoint: Any) -> dict[int, float]:
    """Train to ``epochs`` (resuming from ``ckpt_path``), a model first built with ``seed``;
    ModelCheckpoint(``checkpoint``) saves in ``dirpath``. The losses by step."""
    torch.manual_seed(seed)
    model = Regression()
    losses = Losses()
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        plugins=[plugin if plugin is not None else ZarrCheckpointIO()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[losses, ModelCheckpoint(dirpath=dirpath, **checkpoint)],
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return losses.losses


if __name__ == "__main__":
    out = Path(sys.argv[1])
    full = fit(out / "full", EPOCHS, seed=0, devices=2, save_top_k=0)
    first = fit(out / "ckpts", EPOCHS - 1, seed=0, devices=2, save_last=True)
    second = fit(out / "ckpts", EPOCHS, seed=123, devices=2, ckpt_path=str(out / "ckpts" / "last.ckpt"))
    rank = torch.distributed.get_rank()
    (out / f"losses_{rank}.json").write_text(json.dumps({"full": full, "first": first, "second": second}))
