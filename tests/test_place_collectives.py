"""What a placed save decides across ranks (real gloo jobs): averaged replicas store their
mean, TP-replicated copies that differ are refused naming the rule and the ranks, a pattern
no rank uses is refused in strict mode when the ranks hold different parameters (pipeline
stages, expert ranks), and a tensor two pipeline stages place is refused naming the stages."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import Rules, place

RULES = {"params": [{"kind": "average", "patterns": [r"norm\.weight"]},
                    {"kind": "replicated", "patterns": [r"norm\.bias"]}]}


def _values(rank: int) -> dict[str, torch.Tensor]:
    return {"norm.weight": torch.tensor([1.0, 2.0, 3.0]) + rank * torch.tensor([0.5, 1.0, -1.0]),
            "norm.bias": torch.tensor([0.25, 0.5, 0.75]), "w": torch.full((2, 3), float(rank))}


def _save_average(rank: int, world: int, path: str) -> None:
    ucp_zarr.save(place(_values(rank), Rules.from_dict(RULES), tp_rank=rank, tp_size=world), path)


def _save_differing_replicas(rank: int, world: int, path: str) -> None:
    values = _values(rank)
    values["norm.bias"] = values["norm.bias"] + rank  # TP-replicated, but drifted
    with pytest.raises(ucp_zarr.LayoutError) as e:
        ucp_zarr.save(place(values, Rules.from_dict(RULES), tp_rank=rank, tp_size=world), path)
    assert "norm.bias" in str(e.value) and r"norm\\.bias" in str(e.value) and "ranks [0]" in str(e.value)


def _save_unused_pattern(rank: int, world: int, path: str) -> None:
    rules = Rules.from_dict({"params": [{"kind": "replicated", "patterns": [r"norm\.", r"nothing\.here"]}],
                             "pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 2}})
    state = {"layers.0.norm.weight": torch.ones(3)} if rank == 0 else {"layers.0.w": torch.ones(2)}
    placed = place(state, rules, pp_rank=rank, pp_size=world)  # (not checked here: other stages may use them)
    with pytest.raises(ucp_zarr.RuleError, match=r"nothing\\\\.here"):
        ucp_zarr.save(placed, path)


def _save_expert_unused_pattern(rank: int, world: int, path: str) -> None:
    rules = Rules.from_dict({"params": [{"kind": "split", "dim": 1, "patterns": [r"experts\.local_experts\.\d+\.fc2"]},
                                        {"kind": "replicated", "patterns": [r"router\.", r"no\.such\.router"]}],
                             "experts": {"pattern": r"experts\.local_experts\.(\d+)\.", "num_experts": 4}})
    state = {"router.weight": torch.ones(4), "experts.local_experts.0.fc2": torch.full((2, 3), float(rank)),
             "experts.local_experts.1.fc2": torch.full((2, 3), 10.0 + rank)}
    placed = place(state, rules, ep_rank=rank, ep_size=world)  # (deferred: other expert ranks may use them)
    with pytest.raises(ucp_zarr.RuleError, match=r"no\\\\.such\\\\.router"):
        ucp_zarr.save(placed, path)


def _save_one_tensor_from_two_stages(rank: int, world: int, path: str) -> None:
    """Both stages hold a final norm (a stage split gone wrong, or a tied weight not listed
    as pipeline-replicated): equal values, so no replica check could tell."""
    rules = Rules.from_dict({"params": [{"kind": "replicated", "patterns": [r"final_norm\."]}],
                             "pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 2}})
    state = {"model": {"layers.0.w": torch.full((2,), float(rank)), "final_norm.weight": torch.ones(3)},
             "optim": {"state": {"final_norm.weight": {"exp_avg": torch.zeros(3)}}}}
    with pytest.raises(ucp_zarr.LayoutError, match=r"'model\.final_norm\.weight' is placed by pipeline stages \[0, 1\]"):
        ucp_zarr.save(place(state, rules, pp_rank=rank, pp_size=world), path)


TIED_RULES = {"default": "replicated", "pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 2},
              "rename": [{"pattern": r"output_layer\.weight", "to": "embedding.weight"}],
              "pipeline_replicated": [r"output_layer\.weight"]}


def _tied_stage(rank: int, output: torch.Tensor) -> dict:
    """Stage 0 holds the embedding, stage 1 the output layer (renamed onto it: tied) and
    the optimizer state of each."""
    name, weight = ("embedding.weight", torch.arange(6.0).reshape(3, 2)) if rank == 0 else ("output_layer.weight", output)
    return {"model": {f"layers.0.w": torch.full((2,), float(rank)), name: weight},
            "optim": {"state": {name: {"exp_avg": weight / 2}}}}


def _save_untied_output_as_tied(rank: int, world: int, path: str) -> None:
    """The last stage's output layer is not tied to the embedding, but the rules say so."""
    with pytest.raises(ucp_zarr.LayoutError, match=r"'model\.embedding\.weight'.*differ.*pipeline_replicated"):
        ucp_zarr.save(place(_tied_stage(rank, torch.ones(3, 2)), Rules.from_dict(TIED_RULES), pp_rank=rank, pp_size=world), path)


def _save_tied_output(rank: int, world: int, path: str) -> None:
    ucp_zarr.save(place(_tied_stage(rank, torch.arange(6.0).reshape(3, 2)), Rules.from_dict(TIED_RULES),
                        pp_rank=rank, pp_size=world), path)


def _save_replicated_on_the_last_stage_only(rank: int, world: int, path: str) -> None:
    rules = {k: v for k, v in TIED_RULES.items() if k != "rename"}
    state = {"layers.0.w": torch.full((2,), float(rank))} | ({"output_layer.weight": torch.full((3, 2), 7.0)} if rank else {})
    ucp_zarr.save(place(state, Rules.from_dict(rules), pp_rank=rank, pp_size=world), path)


def test_a_pipeline_replicated_copy_is_compared_and_stored_from_the_stage_holding_it(tmp_path: Path) -> None:
    """A parameter the rules list in ``pipeline_replicated`` is stored once, from whichever
    stage holds it: the copies of later stages are compared with the first stage's at save
    (before, they were dropped unread: an output layer the rules wrongly tie to the embedding
    was lost, the embedding loaded in its place; one that only the last stage holds was
    missing from the checkpoint, and the save returned success)."""
    run(2, _save_untied_output_as_tied, str(tmp_path / "untied"), timeout_s=60)
    assert not (tmp_path / "untied" / "zarr.json").exists()
    run(2, _save_tied_output, str(tmp_path / "tied"), timeout_s=60)
    ck = ucp_zarr.open(tmp_path / "tied")
    assert sorted(ck.keys()) == ["model.embedding.weight", "model.layers.0.w", "model.layers.1.w",
                                 "optim.state.embedding.weight.exp_avg"]
    assert torch.equal(ck["model.embedding.weight"][...], torch.arange(6.0).reshape(3, 2))
    assert torch.equal(ck["optim.state.embedding.weight.exp_avg"][...], torch.arange(6.0).reshape(3, 2) / 2)
    run(2, _save_replicated_on_the_last_stage_only, str(tmp_path / "last"), timeout_s=60)
    assert torch.equal(ucp_zarr.open(tmp_path / "last")["output_layer.weight"][...], torch.full((3, 2), 7.0))


def test_averaged_replicas_store_their_mean(tmp_path: Path) -> None:
    run(3, _save_average, str(tmp_path / "ck"), timeout_s=60)
    ck = ucp_zarr.open(tmp_path / "ck")
    assert torch.equal(ck["norm.weight"][...], torch.tensor([1.5, 3.0, 2.0]))  # mean over the 3 ranks
    assert torch.equal(ck["norm.bias"][...], torch.tensor([0.25, 0.5, 0.75]))
    assert torch.equal(ck["w"][...], torch.tensor([[0.0] * 3, [0.0] * 3, [1.0] * 3, [1.0] * 3, [2.0] * 3, [2.0] * 3]))


@pytest.mark.parametrize("job", [_save_differing_replicas, _save_unused_pattern, _save_expert_unused_pattern,
                                 _save_one_tensor_from_two_stages],
                         ids=["differing-replicas", "unused-pattern-pp", "unused-pattern-ep", "two-stages-one-tensor"])
def test_refused_saves_commit_nothing(tmp_path: Path, job: Callable[[int, int, str], None]) -> None:
    """Each job asserts the error on every rank (before, the two stages' tensor was saved
    from one stage and the save returned success)."""
    run(2, job, str(tmp_path / "ck"), timeout_s=60)
    assert not (tmp_path / "ck" / "zarr.json").exists()
