"""A DeepSpeed fp16 ZeRO checkpoint made by DeepSpeed itself, with tensors in its client
state, for tests/test_convert_deepspeed.py: ``python _ds_fp16_job.py OUT STAGE`` trains a tiny
model one step on one gloo process and writes ``OUT/ds`` (``engine.save_checkpoint``) and
``OUT/truth.pt`` (DeepSpeed's ``zero_to_fp32`` masters and the client state's tensors).

This CPU has no fp16 kernels for DeepSpeed's check (``is_fp16_supported``), which is bypassed:
the engine keeps fp16 weights, fp32 masters and a dynamic loss scaler as on a GPU, and writes
the same files."""

from __future__ import annotations

import collections
import os
import socket
import sys
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cpu"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402


def main(out: Path, stage: int) -> None:
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)  # (no shm op build)
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "fp16": {"enabled": True, "initial_scale_power": 8}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=cfg)
    for _ in range(2):
        loss = engine(torch.randn(2, 5).half()).float().square().sum()
        engine.backward(loss)
        engine.step()
    client = {"rng": torch.get_rng_state(), "seen": torch.arange(3), "epoch": 4}
    engine.save_checkpoint(str(out / "ds"), client_state=client)
    truth = get_fp32_state_dict_from_zero_checkpoint(str(out / "ds"))
    torch.save({"fp32": dict(truth), "rng": client["rng"], "seen": client["seen"]}, out / "truth.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    os._exit(0)  # (DeepSpeed's atexit hooks can hang a gloo process)
