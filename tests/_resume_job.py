"""The two sides of a fresh-process resume for ``test_resume_fresh.py``: ``main("train", ...)`` runs
in the test's process, ``python _resume_job.py resume CKPT OUT STEPS`` in a fresh one.

``train``: build a model and its optimizers, train STEPS steps, save
``{"model": model.state_dict(), "<kind>": opt.state_dict(), "step": STEPS}`` with ``ucp_zarr.save``,
train STEPS more and write those losses to OUT (the uninterrupted run).
``resume``: build them afresh (other initial values; optimizer state empty), ``ucp_zarr.load`` the
state dict torch users write, ``opt.load_state_dict``, train STEPS steps, write the losses to OUT.
"""

from __future__ import annotations

import json
import sys

import torch

import ucp_zarr

KINDS = ("adamw", "sgd", "adam_named")
"""One optimizer per part of the model: AdamW over ``model.parameters()``, SGD with momentum
and Nesterov, Adam over ``named_parameters()``."""


def build(seed: int) -> tuple[torch.nn.Module, dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    opts = {
        "adamw": torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1),
        "sgd": torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9, nesterov=True),
        "adam_named": torch.optim.Adam(model[4].named_parameters(), lr=3e-3, amsgrad=True),
    }
    return model, opts


def step(model: torch.nn.Module, opts: dict[str, torch.optim.Optimizer], i: int) -> float:
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    for opt in opts.values():
        opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for opt in opts.values():
        opt.step()
    return loss.item()


def main(mode: str, ckpt: str, out: str, steps: int) -> None:
    if mode == "train":
        model, opts = build(0)
        for i in range(steps):
            step(model, opts, i)
        state = {"model": model.state_dict(), **{k: o.state_dict() for k, o in opts.items()}, "step": steps}
        ucp_zarr.save(state, ckpt)
    else:
        model, opts = build(1)
        assert all(not o.state_dict()["state"] for o in opts.values())  # a fresh optimizer holds no state
        state = {"model": model.state_dict(), **{k: o.state_dict() for k, o in opts.items()}, "step": 0}
        state = ucp_zarr.load(state, ckpt)
        for kind, opt in opts.items():
            opt.load_state_dict(state[kind])
        assert state["step"] == steps
    losses = [step(model, opts, i) for i in range(steps, 2 * steps)]
    with open(out, "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
