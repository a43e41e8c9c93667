"""Pipeline and expert parallelism need rules that make local names global (single process).

Each stage of a pipeline names its layers from 0 (Megatron), so without a ``pipeline`` entry
every stage's layer 0 is placed as the consolidated layer 0: a save kept one stage's copy, a
load filled every stage with the first stage's layers, both without an error. The same holds
for local expert numbers without an ``experts`` entry. And a tensor that two stages place
(with a pipeline entry) is refused by the check every save runs over the ranks' placements.
"""

from __future__ import annotations

import pytest
import torch

import ucp_zarr
from ucp_zarr import LayoutError, RuleError, Rules, place
from ucp_zarr.rules.place import PlacementError, check_used

LAYERS = r"layers\.(\d+)\."


def stage(pp_rank: int) -> dict[str, torch.Tensor]:
    """Stage ``pp_rank`` of 2 of a 4-layer model: local layers 0 and 1."""
    return {f"layers.{i}.w": torch.full((2,), 2.0 * pp_rank + i) for i in range(2)}


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_stages_without_a_pipeline_entry_are_refused(pp_rank: int) -> None:
    with pytest.raises(PlacementError, match="pp_size is 2, but the rules have no 'pipeline' entry") as e:
        place(stage(pp_rank), Rules(default="replicated"), pp_rank=pp_rank, pp_size=2)
    assert isinstance(e.value, LayoutError) and isinstance(e.value, RuleError)


@pytest.mark.filterwarnings("ignore")  # (one stage loads half the checkpoint: not strict)
def test_loading_stages_without_a_pipeline_entry_is_refused(tmp_path) -> None:
    """Before, the second stage's layers 0 and 1 were filled with the model's layers 0 and 1."""
    ucp_zarr.save({f"layers.{i}.w": torch.full((2,), float(i)) for i in range(4)}, tmp_path / "ck")
    target = {n: torch.zeros_like(t) for n, t in stage(1).items()}
    with pytest.raises(LayoutError, match="'pipeline'"):
        ucp_zarr.load(place(target, Rules(default="replicated"), pp_rank=1, pp_size=2), tmp_path / "ck", strict=False)
    assert [t.tolist() for t in target.values()] == [[0.0, 0.0], [0.0, 0.0]]
    rules = Rules.from_dict({"default": "replicated", "pipeline": {"pattern": LAYERS, "num_layers": 4}})
    ucp_zarr.load(place(target, rules, pp_rank=1, pp_size=2), tmp_path / "ck", strict=False)
    assert [t.tolist() for t in target.values()] == [[2.0, 2.0], [3.0, 3.0]]


def test_expert_ranks_without_an_experts_entry_are_refused() -> None:
    experts = {"mlp.experts.local_experts.0.w": torch.ones(2)}
    with pytest.raises(PlacementError, match="ep_size is 2, but the rules have no 'experts' entry"):
        place(experts, Rules(default="replicated"), ep_rank=1, ep_size=2)
    renumbered = place(experts, Rules.from_dict({"default": "replicated", "experts": {
        "pattern": r"mlp\.experts\.local_experts\.(\d+)\.", "num_experts": 2}}), ep_rank=1, ep_size=2)
    assert renumbered["mlp.experts.local_experts.0.w"].key == "mlp.experts.local_experts.1.w"
    stacked = Rules.from_dict({"params": [{"kind": "split", "axis": "ep", "patterns": [r"mlp\.experts\.weight"]}]})
    assert place({"mlp.experts.weight": torch.ones(2, 3)}, stacked, ep_rank=1, ep_size=2)["mlp.experts.weight"].global_shape == (4, 3)
    glob = place(experts, Rules.from_dict({"default": "replicated", "experts": "global"}), ep_rank=1, ep_size=2)
    assert glob["mlp.experts.local_experts.0.w"].key == "mlp.experts.local_experts.0.w"


def test_global_names_across_stages() -> None:
    """``"pipeline": "global"`` (DeepSpeed's pipeline modules, and Rules.from_deepspeed): the
    names stay; a name two stages hold is refused, unless it is pipeline-replicated."""
    rules = Rules.from_dict({"default": "replicated", "pipeline": "global"})
    first = place({"layers.0.w": torch.ones(2), "tied.w": torch.ones(3)}, rules, pp_rank=0, pp_size=2)
    last = place({"layers.1.w": torch.ones(2), "tied.w": torch.ones(3)}, rules, pp_rank=1, pp_size=2)
    assert last["layers.1.w"].key == "layers.1.w"
    with pytest.raises(PlacementError, match=r"tensor 'tied\.w' is placed by pipeline stages \[0, 1\]"):
        check_used(rules, [first["tied.w"].used, last["tied.w"].used])
    tied = Rules.from_dict({"default": "replicated", "pipeline": "global", "pipeline_replicated": [r"tied\."]})
    used = [place({"tied.w": torch.ones(3)}, tied, pp_rank=r, pp_size=2)["tied.w"].used for r in range(2)]
    check_used(tied, used)
    assert Rules.from_deepspeed({"universal_checkpoint_version": 0.2}).pipeline == "global"


def test_renumbered_stages_do_not_clash_but_shared_names_do() -> None:
    """With a pipeline entry, the stages' layers are distinct; a norm both stages hold is not."""
    rules = Rules.from_dict({"default": "replicated", "pipeline": {"pattern": LAYERS, "num_layers": 4}})
    used = [place(stage(r), rules, pp_rank=r, pp_size=2)["layers.0.w"].used for r in range(2)]
    check_used(rules, used)
    used = [place(stage(r) | {"norm.w": torch.ones(2)}, rules, pp_rank=r, pp_size=2)["norm.w"].used for r in range(2)]
    with pytest.raises(LayoutError, match=r"'norm\.w' is placed by pipeline stages \[0, 1\]"):
        check_used(rules, used)
    check_used(rules, used[:1] + used[:1])  # (tensor-parallel ranks of one stage hold it too)
