"""Megatron-core's own ``dist_checkpointing`` folders (``torch_dist`` backend) through the DCP
converter: a TP=2 save by Megatron itself (2 gloo ranks, ``megatron_core_models``), and
Megatron's own load of that folder into the TP=1 model as the reference.

What is checked: Megatron's ``.metadata`` (which pickles DCP's plan records) reads without
``trust``; every tensor equals what Megatron loads at TP=1, found by the key and layer offset
Megatron's own ``sharded_state_dict`` gives each parameter; ``common.pt`` (``iteration``, the
optimizer's ``param_groups``, Megatron-LM's ``args``) is carried, not dropped; Megatron-LM's
``rng_state`` objects are left out with a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import random
from pathlib import Path
from typing import Iterator

import megatron_core_models as MC
import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr.adapters.megatron_sharded import sharded_state
from ucp_zarr.errors import ConversionError, UntrustedInputError
from ucp_zarr.format.statedict import from_json

VARIANT = MC.VARIANTS["gqa"]
SEED = 3
VOCAB = 256
"""Padded alike at TP=1 and TP=2 (Megatron's allow_shape_mismatch reshapes other paddings at load)."""


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    """``MC._cuda_is_cpu``, and ``torch.cuda.synchronize`` a no-op (Megatron's writer calls it
    before it copies the tensors; no layout effect)."""
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with MC._cuda_is_cpu():
            yield
    finally:
        torch.cuda.synchronize = sync  # type: ignore[assignment]


def _save_job(rank: int, world: int, path: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = MC.build(VARIANT, world, 1, SEED, vocab=VOCAB)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}  # (as Megatron-LM's get_rng_state)
    sd = {
        "model": model.sharded_state_dict(),
        "iteration": 7,
        "optimizer": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "step": 1}]},
        "args": argparse.Namespace(tensor_model_parallel_size=world, seq_length=16, lr=0.01),
        "rng_state": ShardedObject("rng_state", [rng], (1, world), (0, ps.get_tensor_model_parallel_rank()),
                                   replica_id=ps.get_data_parallel_rank()),
    }
    with _on_cpu():
        dist_checkpointing.save(sd, path, sharded_strategy=("torch_dist", 1))
    for child in multiprocessing.active_children():  # (the writer's worker, which would outlive the job)
        child.terminate()
    groups = {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "step": 1}]}
    ucp_zarr.save(sharded_state({"model": model.sharded_state_dict(), "iteration": 7, "optimizer": groups}), path + "_ucp")
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from ucp_zarr.errors import LayoutError

    try:  # an optimizer's state (a load would fill buffers only Megatron's load_state_dict copies in) is refused
        sharded_state({"optimizer": {"state": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.w", torch.zeros(2))}})
    except LayoutError as e:
        assert "is Megatron optimizer state" in str(e), e
    else:
        raise AssertionError("the optimizer's sharded state was taken")


def _load_job(rank: int, world: int, src: str, out: str) -> None:
    """A fresh TP=1 model (other values) loaded from ``src`` through :func:`sharded_state`."""
    model = MC.build(VARIANT, world, 1, SEED + 1, vocab=VOCAB)
    ucp_zarr.load(sharded_state(model.sharded_state_dict()), src, strict=False)
    torch.save({n: t.detach().clone() for n, t in model.state_dict().items() if t is not None}, out)


def _reference_job(rank: int, world: int, path: str, out: str) -> None:
    """Megatron's own load of ``path`` into the TP=1 model, with each parameter's checkpoint
    key and offset on the stacked layer axis, as its ``sharded_state_dict`` gives them."""
    from megatron.core import dist_checkpointing

    model = MC.build(VARIANT, 1, 1, SEED + 1, vocab=VOCAB)  # other values: the load must replace them
    sharded = model.sharded_state_dict()
    where = {name: (sh.key, list(sh.global_offset[:sh.prepend_axis_num])) for name, sh in sharded.items()
             if hasattr(sh, "prepend_axis_num")}
    with _on_cpu():
        loaded = dist_checkpointing.load({"model": sharded}, path)
    common = dist_checkpointing.load_common_state_dict(path)
    torch.save({"tensors": {n: (where[n], t.detach().clone()) for n, t in loaded["model"].items() if n in where},
                "loaded": {n: t.detach().clone() for n, t in loaded["model"].items() if isinstance(t, torch.Tensor)},
                "iteration": common["iteration"], "param_groups": common["optimizer"]["param_groups"]}, out)


@pytest.fixture(scope="module")
def megatron_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron_dist")
    (root / "ck").mkdir()  # (Megatron saves into an empty folder that exists)
    MC.run_job(_save_job, 2, str(root / "ck"))
    MC.run_job(_reference_job, 1, str(root / "ck"), str(root / "reference.pt"))
    with pytest.warns(UserWarning, match="rng_state"):
        ucp_zarr.convert(root / "ck", root / "converted")
    for name in ("ck_ucp", "converted"):
        MC.run_job(_load_job, 1, str(root / name), str(root / f"{name}.pt"))
    return root


def test_megatron_torch_dist_folder_converts_with_its_common_state(megatron_dist: Path, tmp_path: Path) -> None:
    src = megatron_dist / "ck"
    assert json.loads((src / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    with pytest.warns(UserWarning, match=r"Megatron's rng_state objects \['rng_state/shard_0.0_1.2', "
                                         r"'rng_state/shard_0.1_1.2'\] .* are not converted"):
        ucp_zarr.convert(src, tmp_path / "ck")  # (no trust: DCP's plan records and argparse.Namespace are inert)
    ck = ucp_zarr.open(tmp_path / "ck")
    ref = torch.load(megatron_dist / "reference.pt", weights_only=True)
    assert len(ref["tensors"]) > 10
    for name, ((key, offset), want) in ref["tensors"].items():
        assert torch.equal(ck.read(key)[tuple(offset)], want), name
    values = {k: from_json(v) for k, v in ck.meta.values.items()}
    assert values["iteration"] == ref["iteration"] == 7
    assert ref["param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.999), "step": 1}]  # (flattened as a save flattens)
    assert {k: v for k, v in values.items() if k.startswith("optimizer.")} == {
        "optimizer.param_groups.0.lr": 0.01, "optimizer.param_groups.0.betas": (0.9, 0.999), "optimizer.param_groups.0.step": 1}
    args = values["args"]
    assert args["class"] == "argparse.Namespace" and args["state"] == {"tensor_model_parallel_size": 2, "seq_length": 16,
                                                                       "lr": 0.01}
    assert not [k for k in values if k.startswith("rng_state")]
    assert ck.meta.layout["source"] == {"format": "dcp", "megatron": "torch_dist"}


def test_megatron_sharded_state_saves_and_loads_at_another_tp(megatron_dist: Path) -> None:
    """Megatron's own sharded_state_dict through ucp_zarr: saved at TP=2 by every rank, and
    loaded into a TP=1 model (in place, its own part) from that save and from the conversion
    of Megatron's torch_dist folder of the same model; every parameter equals what Megatron's
    own load of its folder gives. The save holds the keys and global shapes of the folder."""
    ref = torch.load(megatron_dist / "reference.pt", weights_only=True)["loaded"]
    assert any(".linear_fc1.weight" in n for n in ref)  # (a factory's: [gate; up] as two boxes of one key)
    saved, converted = ucp_zarr.open(megatron_dist / "ck_ucp"), ucp_zarr.open(megatron_dist / "converted")
    assert sorted(saved.meta.tensors) == sorted(converted.meta.tensors)
    for key in saved.meta.tensors:
        assert torch.equal(saved.read(key), converted.read(key)), key
    assert saved.meta.values == {k: v for k, v in converted.meta.values.items() if k != "args"}  # (the same keys)
    for name in ("ck_ucp", "converted"):
        got = torch.load(megatron_dist / f"{name}.pt", weights_only=True)
        assert sorted(got) == sorted(ref)
        for param, want in ref.items():
            assert torch.equal(got[param], want), (name, param)


def test_megatron_folder_refusals_name_the_file(megatron_dist: Path, tmp_path: Path) -> None:
    src = tmp_path / "ck"
    import shutil

    shutil.copytree(megatron_dist / "ck", src)
    (src / "common.pt").unlink()
    with pytest.raises(ConversionError, match=r"common.pt: missing: a Megatron torch_dist folder keeps its non-sharded"):
        ucp_zarr.convert(src, tmp_path / "out")
    torch.save({"iteration": 7, "hook": _reference_job}, src / "common.pt")  # (a function: code to run)
    with pytest.raises(UntrustedInputError, match="common.pt"):
        ucp_zarr.convert(src, tmp_path / "out")


def test_megatron_records_that_are_left_out_or_refused() -> None:
    """The keys are those Megatron-core 0.16 wrote in a review run: Megatron-LM's rng_state
    objects, and the DistributedOptimizer's 'dp_reshardable' and 'dp_zero_gather_scatter'
    state, whose flat buffers are pickled per data-parallel rank."""
    from ucp_zarr.converters import megatron_dist

    assert megatron_dist.left_out("rng_state/shard_0.0_1.2") and megatron_dist.left_out("model.rng_state/shard_1_2")
    assert not megatron_dist.left_out("rng_state") and not megatron_dist.left_out("x.my_rng_state/shard_0_1")
    for key in ("optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1",
                "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"):
        assert "distrib_optim_sharding_type='fully_reshardable'" in (megatron_dist.refusal(key) or "")
    assert megatron_dist.refusal("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2") is None


def test_a_torch_dist_conversion_exported_to_llama_names_its_layout(megatron_dist: Path, tmp_path: Path) -> None:
    """names="megatron_to_llama" on a converted torch_dist folder (layers stacked, vocabulary
    padded, fused tensors without their rules) was refused for having "no place" for an input
    norm Llama has: the refusal names the folder's layout and the way out."""
    with pytest.raises(ConversionError, match=r"converted from a Megatron-core torch_dist folder: its layers are "
                                              r"stacked.*Rules.from_megatron"):
        ucp_zarr.export(megatron_dist / "converted", tmp_path / "hf", to="hf", names="megatron_to_llama")
    assert not (tmp_path / "hf").exists()
