"""DeepSpeed pipelines the adapter meets at its edges; workers of ``test_deepspeed_adapter.py``,
run by :func:`ds_checkpoints.launch`:

* ``untied`` (2 stages): a tied module with a parameter DeepSpeed does not tie:
  ``TiedLayerSpec("mid", nn.Linear)`` ties ``weight`` (its ``tied_weight_attr``); each stage
  trains its own ``bias`` under the one name ``tied_modules.mid.bias``. Each rank writes what
  the adapter's save said, rank 0 what converting DeepSpeed's own save said.
* ``buffers`` (2 stages x 2 data-parallel ranks): a running buffer updated in forward, which
  differs between data-parallel replicas (each its own batches): the adapter saves, and rank 0
  converts DeepSpeed's own save of the same engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ds_checkpoints as D
import torch
import torch.nn as nn


def _engine() -> Any:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 4, 6), TiedLayerSpec("mid", nn.Linear, 6, 6), LayerSpec(nn.Tanh),
              TiedLayerSpec("mid", nn.Linear, 6, 6), LayerSpec(nn.Linear, 6, 3)]
    model = PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                           loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]


def _untied(task: dict[str, Any], rank: int, world: int) -> None:
    import torch.distributed as dist

    import ucp_zarr
    from ucp_zarr.adapters import deepspeed as ucp_ds

    out = Path(task["out"])
    engine = _engine()
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        engine.train_batch(iter([(torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)) for _ in range(2)]))
    engine.save_checkpoint(str(out / "D"))
    said: dict[str, str] = {}
    try:
        ucp_ds.save_checkpoint(engine, out / "X")
        said["save"] = "saved"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        said["save"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank == 0:
        try:
            ucp_zarr.convert(out / "D", out / "CV")
            said["convert"] = "converted"
        except Exception as e:  # noqa: BLE001
            said["convert"] = f"{type(e).__name__}: {e}"
    (out / f"said.{rank}.json").write_text(json.dumps(said))


class Running(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc(x)


def _buffers(task: dict[str, Any], rank: int, world: int) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ucp_zarr
    from ucp_zarr.adapters import deepspeed as ucp_ds

    out = Path(task["out"])
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 4, 6), LayerSpec(Running), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 6, 3)]
    model = PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                           loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)[0]
    for step in range(2):
        g = torch.Generator().manual_seed(100 + step + 10 * engine.grid.get_data_parallel_id())
        engine.train_batch(iter([(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]))
    engine.save_checkpoint(str(out / "D"))
    ucp_ds.save_checkpoint(engine, out / "X")
    if engine.grid.get_data_parallel_id() == 1 and engine.is_first_stage():  # (layer 1: the first stage's)
        torch.save(model.state_dict(), out / "dp1.pt")
    dist.barrier()
    if rank == 0:
        ucp_zarr.convert(out / "D", out / "CV")


if __name__ == "__main__":
    D.run_worker(sys.argv[2], {"untied": _untied, "buffers": _buffers})
