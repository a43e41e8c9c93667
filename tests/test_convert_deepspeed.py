"""DeepSpeed ZeRO checkpoints, written by DeepSpeed itself (ds_checkpoints), converted with
``ucp_zarr.convert`` and checked bit for bit against DeepSpeed's own ``zero_to_fp32`` and
``ds_to_universal`` outputs and against the live engine's state at save time; then loaded
onto another layout; bad input named by file, nothing complete-looking left behind."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ds_checkpoints as D
import pytest
import torch
from _dist import run

import ucp_zarr
from ucp_zarr import FlatShard
from ucp_zarr.errors import ConversionError, UntrustedInputError

VARIANTS = D.standard_variants()
IDS = [D.variant_name(v) for v in VARIANTS]


@pytest.fixture(scope="session", autouse=True)
def built() -> None:
    D.prebuild(VARIANTS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """variant id -> (DeepSpeed checkpoint, converted ucp_zarr checkpoint)."""
    out = {}
    for v, vid in zip(VARIANTS, IDS):
        ck = D.checkpoint(**v)
        dst = tmp_path_factory.mktemp(vid) / "ck"
        ucp_zarr.convert(ck, dst)
        out[vid] = (ck, dst)
    return out


def _master(ck: ucp_zarr.Checkpoint, name: str) -> torch.Tensor:
    return ck.read(D.converted_key(ck, name, "fp32"))


@pytest.mark.parametrize("vid", IDS)
def test_equal_to_deepspeeds_own_outputs(converted: dict[str, tuple[Path, Path]], vid: str, tmp_path: Path) -> None:
    src, dst = converted[vid]
    ck = ucp_zarr.open(dst)
    info, ref = D.run_info(src), D.reference(src)
    # 1. fp32 masters: zero_to_fp32 (its tied copies and frozen parameters included; it refuses
    #    the files of ZeRO-1's BF16_Optimizer)
    fp32 = D.zero_to_fp32(src) if "accum" not in vid else {}
    for name, t in fp32.items():
        trained = D.TIED.get(name, name)
        got = _master(ck, trained) if trained in ref["fp32"] else ck.read(f"model.{name}")
        assert torch.equal(got.float(), t.float()), name
    # 2. masters and every optimizer state: the live engine's, whatever the optimizer's keys
    #    (DeepSpeed's own view of them is wrong when it orders gradients round-robin)
    assert ref["fp32"] or not ref["hp_trusted"], "the reference holds no master weights"
    for name, t in ref["fp32"].items():
        assert torch.equal(_master(ck, name), t), name
        for key in ref["optim_keys"]:
            assert torch.equal(ck.read(f"optim.state.{name}.{key}"), ref["optim"][name][key]), (name, key)
    # 3. the weights the module holds, in the training dtype
    for name, t in ref["lp"].items():
        assert torch.equal(ck.read(f"model.{name}"), t), name
    for name, t in ref["buffers"].items():
        assert torch.equal(ck.read(f"model.{name}"), t), name
    # 4. the rest of the state
    values = ck.meta.values
    assert values["deepspeed.global_steps"] == len(info["losses"]) == ck.metadata["step"] > 0
    assert values["client_state.epoch"] == D.CLIENT_STATE["epoch"]
    assert values["client_state.nested"] == D.CLIENT_STATE["nested"]
    assert [g["lr"] for g in values["optim.param_groups"]] == values["lr_scheduler"]["_last_lr"]
    assert [sorted(g["params"]) for g in values["optim.param_groups"]] == [sorted(g) for g in D.GROUP_NAMES]
    # (the optimizer's own param_groups, as DeepSpeed's files hold them: betas a tuple, not a list)
    groups = ck.metadata["values"]["optim.param_groups"]
    assert all(type(g["betas"]) is tuple and len(g["betas"]) == 2 for g in groups if "betas" in g), groups
    # 5. ds_to_universal: same values, in real shapes (it leaves ZeRO-3 flat); it knows only Adam's keys
    if not ref["hp_trusted"]:
        return
    if "exp_avg" not in ref["optim_keys"]:
        with pytest.raises(RuntimeError, match="KeyError: 'exp_avg'"):
            D.ds_to_universal(src, tmp_path / "u")
        return
    for name, key, want in D.universal_tensors(D.ds_to_universal(src, tmp_path / "u")):
        if name in D.TIED and key == "fp32":  # (ds_to_universal writes a tie's module weight, upcast; its master,
            got = ck.read(f"model.{name}").float()  # which the alias reads, is zero_to_fp32's: step 1)
        else:
            got = ck.read(D.converted_key(ck, name, key))
        assert torch.equal(got.reshape(-1), want.reshape(-1)), (name, key)
        assert got.shape == ck[f"model.{name}"].shape


def _load_flat(rank: int, world: int, path: str, names: list[str], shapes: dict[str, tuple[int, ...]],
               want: dict[str, torch.Tensor]) -> None:
    """Each of 3 ranks loads its own ZeRO-style flat range of every parameter and moment."""
    state: dict[str, Any] = {}
    for name in names:
        numel = torch.Size(shapes[name]).numel()
        part = -(-numel // world)
        lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg"):
            state[key] = FlatShard(torch.full((hi - lo,), -1.0, dtype=want[key].dtype), shapes[name], lo)
    ucp_zarr.load(state, path, strict=False)
    for key, fs in state.items():
        numel = want[key].numel()
        part = -(-numel // world)
        lo = min(rank * part, numel)
        assert torch.equal(fs.local, want[key].reshape(-1)[lo:lo + fs.local.numel()]), (rank, key)


def test_loads_onto_another_world_size(converted: dict[str, tuple[Path, Path]]) -> None:
    src, dst = converted["z2-bf16-w2-s3-adam"]
    ck = ucp_zarr.open(dst)
    names = list(D.reference(src)["fp32"])
    shapes = {n: ck.meta.tensors[f"model.{n}"].shape for n in names}
    want = {k: ck.read(k) for n in names for k in (f"model.{n}", f"optim.state.{n}.exp_avg")}
    run(3, _load_flat, str(dst), names, shapes, want, timeout_s=120)


def test_cli_and_trust(converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    src, _ = converted["z3-fp32-w2-s3-adam"]
    from ucp_zarr.cli import main

    assert main(["convert", str(src), str(tmp_path / "ck"), "--from", "deepspeed"]) == 0
    assert "model.fc1.weight" in ucp_zarr.open(tmp_path / "ck")
    ucp_zarr.convert(src, tmp_path / "ck2", trust=True)  # full unpickling gives the same checkpoint
    a, b = ucp_zarr.open(tmp_path / "ck"), ucp_zarr.open(tmp_path / "ck2")
    assert sorted(a) == sorted(b) and all(torch.equal(a.read(k), b.read(k)) for k in a)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(src, dst)
    return D.step_dir(dst)


def test_bad_input_is_named(converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    src, _ = converted["z2-fp32-w2-s3-adam"]
    step = _copy(src, tmp_path)
    optim = sorted(step.glob("*optim_states.pt"))
    # a truncated rank file
    raw = optim[1].read_bytes()
    optim[1].write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConversionError, match=optim[1].name):
        ucp_zarr.convert(step.parent, tmp_path / "a")
    # a missing rank file
    optim[1].unlink()
    with pytest.raises(ConversionError, match=r"2 ranks, but 1 optimizer files"):
        ucp_zarr.convert(step.parent, tmp_path / "b")
    # partitions of another checkpoint (ZeRO-3 rank file among ZeRO-2 ones)
    other = D.step_dir(converted["z3-fp32-w2-s3-adam"][0])
    shutil.copy(sorted(other.glob("*optim_states.pt"))[1], optim[1])
    with pytest.raises(ConversionError):
        ucp_zarr.convert(step.parent, tmp_path / "c")
    # a file that needs code to run: refused unless trusted
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "x": __import__("argparse").Namespace(a=1)}}, optim[1])
    with pytest.raises(UntrustedInputError, match=optim[1].name):
        ucp_zarr.convert(step.parent, tmp_path / "d")
    assert not any((tmp_path / n / "zarr.json").exists() for n in "abcd")


def test_data_efficiency_state_it_does_not_convert_is_warned_of(converted: dict[str, tuple[Path, Path]],
                                                                 tmp_path: Path) -> None:
    """A folder whose engine saved DeepSpeed's curriculum sampler state (``data_sampler``, as
    engine.save_checkpoint writes it with curriculum learning on) converts with a warning that
    it is left out (before: dropped silently); a folder without it converts quietly."""
    import warnings

    src, _ = converted["z2-fp32-w2-s3-adam"]
    step = _copy(src, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ucp_zarr.convert(step.parent, tmp_path / "quiet")
    model = step / "mp_rank_00_model_states.pt"
    states = torch.load(model, weights_only=False)
    assert states.get("data_sampler") is None
    torch.save(states | {"data_sampler": {"consumed_samples": 8, "curriculum_step": 2}}, model)
    with pytest.warns(UserWarning, match=r"data_sampler state \(data efficiency"):
        ucp_zarr.convert(step.parent, tmp_path / "warned", trust=True)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_checkpoints_and_client_state_tensors(tmp_path: Path, stage: int) -> None:
    """An fp16 checkpoint (a dynamic loss scaler, which holds a dtype) converts: its fp32 masters
    equal DeepSpeed's ``zero_to_fp32``; tensors the caller put in ``client_state`` stay tensors,
    as DeepSpeed's ``load_checkpoint`` and the adapter give them back. Before: the conversion
    raised NotJSONableError on the loss scaler's dtype, and a client-state tensor became a list
    (64 elements or fewer) or the string ``'<tensor [5056] torch.uint8>'``, silently."""
    import subprocess
    import sys

    job = [sys.executable, str(Path(__file__).parent / "_ds_fp16_job.py"), str(tmp_path), str(stage)]
    subprocess.run(job, check=True, capture_output=True, timeout=300, env=D._env())
    truth = torch.load(tmp_path / "truth.pt", weights_only=True)
    ucp_zarr.convert(tmp_path / "ds", tmp_path / "cv")
    ck = ucp_zarr.open(tmp_path / "cv")
    for name, master in truth["fp32"].items():
        assert torch.equal(ck[f"optim.state.{name}.fp32"][...], master), name
    assert ck[f"model.{name}"].dtype == torch.float16
    assert torch.equal(ck["client_state.rng"][...], truth["rng"]) and torch.equal(ck["client_state.seen"][...], truth["seen"])
    assert ck.metadata["values"]["client_state.epoch"] == 4
