"""A strict load of a placed state dict checks what only all ranks' placements together show,
as the save does: every rule pattern matches some parameter, and no tensor is placed by two
pipeline stages (before, both passed silently at load)."""

from __future__ import annotations

import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import Rules, place

RULES = {"params": [{"kind": "split", "dim": 0, "patterns": [r"w$"]}, {"kind": "replicated", "patterns": [r"norm$"]}]}


def test_a_strict_load_refuses_a_rule_pattern_that_matches_nothing(tmp_path):
    state = {"w": torch.arange(8.0), "norm": torch.ones(3)}
    ucp_zarr.save(place(state, Rules.from_dict(RULES), tp_rank=0, tp_size=1), tmp_path / "ck")
    typo = {"params": [*RULES["params"], {"kind": "replicated", "patterns": [r"nrom\.bias$"]}]}
    target = {"w": torch.zeros(8), "norm": torch.zeros(3)}
    with pytest.raises(ucp_zarr.RuleError, match=r"nrom"):
        ucp_zarr.load(place(target, Rules.from_dict(typo), tp_rank=0, tp_size=1), tmp_path / "ck")
    loose = {**typo, "strict": False}
    ucp_zarr.load(place(target, Rules.from_dict(loose), tp_rank=0, tp_size=1), tmp_path / "ck")
    assert torch.equal(target["w"], torch.arange(8.0))


PIPE = {
    "params": [{"kind": "replicated", "patterns": [r"layers\.\d+\.w$", r"final\.w$"]}],
    "pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 2},
}


def _two_stages(rank: int, world: int, path: str) -> None:
    rules = Rules.from_dict(PIPE)
    if rank == 0:
        ucp_zarr.save(
            place({"layers.0.w": torch.ones(2), "layers.1.w": torch.full((2,), 2.0), "final.w": torch.ones(1)},
                  rules, pp_rank=0, pp_size=1),
            path, process_group=torch.distributed.new_group([0]),
        )
    else:
        torch.distributed.new_group([0])
    torch.distributed.barrier()
    # both stages hold the final layer (a stage split gone wrong): refused on both ranks
    mine = {"layers.0.w": torch.zeros(2), "final.w": torch.zeros(1)}
    with pytest.raises(ucp_zarr.LayoutError, match=r"'final\.w' is placed by pipeline stages \[0, 1\]"):
        ucp_zarr.load(place(mine, rules, pp_rank=rank, pp_size=2), path)
    assert torch.equal(mine["layers.0.w"], torch.zeros(2))  # refused before anything was read


def test_a_strict_load_refuses_a_tensor_placed_by_two_stages(tmp_path):
    run(2, _two_stages, str(tmp_path / "ck"), timeout_s=120)
