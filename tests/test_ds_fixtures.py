"""Sanity of the DeepSpeed fixtures in ``ds_checkpoints.py``: real ZeRO-1/2/3 checkpoints (fp32, bf16,
BF16_Optimizer, SGD) with the expected files; the flat-partition layout described in /tmp/ds_notes.md
(re-derived here from the files alone) matches DeepSpeed's live engine and zero_to_fp32; DeepSpeed's
ds_to_universal oracle writes zero/<param>/fp32.pt; a checkpoint resumes with the recorded losses.

The whole standard set builds once per session (one launch of 2 processes, ~10-15 s cold on 2 cores;
cache hits afterwards, also across sessions, see ``ds_checkpoints.cache_root``)."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

import ds_checkpoints as D  # noqa: E402


@pytest.fixture(scope="session")
def ds_standard() -> dict[str, float]:
    """Every standard variant (and its oracles) built or found in the cache, once per session."""
    return D.prebuild(D.standard_variants())


def _load(f: Path):
    return torch.load(f, map_location="cpu", weights_only=False)  # trusted: made by the fixture above


def _rank(f: Path) -> int:
    return int(f.name.split("zero_pp_rank_")[1].split("_")[0])


def test_zero2_fp32_files(ds_standard) -> None:
    ck = D.checkpoint(2, "fp32")
    assert (ck / "latest").read_text().strip() == "global_step3"
    names = sorted(p.name for p in (ck / "global_step3").iterdir())
    assert names == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    ms = _load(ck / "global_step3" / "mp_rank_00_model_states.pt")
    assert [list(g) for g in ms["param_shapes"]] == D.GROUP_NAMES
    assert ms["shared_params"] == D.TIED and list(ms["frozen_param_shapes"]) == D.FROZEN
    assert ms["global_steps"] == 3 and ms["epoch"] == 1 and ms["note"] == D.CLIENT_STATE["note"]
    info = D.run_info(ck)
    assert len(info["losses"]) == 3 and len(info["losses_after_save"]) == D.CONTINUE_STEPS
    assert all(math.isfinite(x) for x in info["losses"]) and info["losses"][-1] < info["losses"][0]


def test_zero3_bf16_files(ds_standard) -> None:
    ck = D.checkpoint(3, "bf16")
    names = sorted(p.name for p in (ck / "global_step3").iterdir())
    assert names == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    ms0 = _load(ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    module = ms0["module"]
    assert all(module[n].numel() == 0 and module[n].dtype == torch.bfloat16 for n in D.PARAM_NAMES + ["head.weight"])
    assert module["out_scale"].shape == (D.VOCAB,) and ms0["buffer_names"] == D.BUFFERS  # buffers: whole, not bf16
    assert ms0["shared_params"] == D.TIED  # only rank 0's file records it on ZeRO-3
    osd = _load(ck / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert [t.dtype for t in osd["fp32_flat_groups"]] == [torch.float32] * 2


def rebuild_zero12(step: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors from ZeRO-1/2 files by the documented rule: each group's params are laid end to end
    in ``param_shapes`` order (each followed by its ``param_alignment_paddings`` entry), the group padded to
    a multiple of 2 * world and cut into ``world`` equal partitions. Saved fp32 partitions drop the
    trailing padding (not BF16_Optimizer's); optimizer states keep it."""
    ms = _load(step / "mp_rank_00_model_states.pt")
    files = sorted(step.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank)
    osd = [_load(f)["optimizer_state_dict"] for f in files]
    world = len(files)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g, shapes in enumerate(ms["param_shapes"]):
        gaps = osd[0].get("param_alignment_paddings", [[0] * len(s) for s in ms["param_shapes"]])[g]
        numel = sum(math.prod(s) for s in shapes.values()) + sum(gaps)
        size = math.ceil(numel / (2 * world)) * 2 * world // world  # partition size
        flats = {"fp32": torch.cat([torch.nn.functional.pad(o["single_partition_of_fp32_groups"][g],
                                                            (0, size - o["single_partition_of_fp32_groups"][g].numel()))
                                    for o in osd])}
        for k, v in osd[0]["base_optimizer_state"]["state"][g].items():
            if torch.is_tensor(v) and v.dim() == 1:
                flats[k] = torch.cat([o["base_optimizer_state"]["state"][g][k] for o in osd])
        start = 0
        for (name, shape), gap in zip(shapes.items(), gaps):
            n = math.prod(shape)
            out[name] = {k: f[start:start + n].view(shape) for k, f in flats.items()}
            for r, o in enumerate(osd):  # the saved fragment addresses agree
                lo, hi = max(start, r * size), min(start + n, (r + 1) * size)
                addr = o["param_slice_mappings"][g].get(name)
                want = (lo - r * size, hi - lo) if lo < hi else None
                assert (None if addr is None else (addr.start, addr.numel)) == want, (name, r, addr, want)
            start += n + gap
    return out


def rebuild_zero3(step: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors from ZeRO-3 files: per sub-group, each param takes ceil(numel / world) elements of every
    rank's flat tensor (rank r holds elements [r*k, (r+1)*k) of the flattened param, the tail is padding)."""
    ms = [_load(f) for f in sorted(step.glob("zero_pp_rank_*_model_states.pt"), key=_rank)]
    osd = [_load(f)["optimizer_state_dict"] for f in sorted(step.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank)]
    world = len(osd)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, shapes in enumerate(ms[0]["param_shapes"]):
        flats = [{"fp32": o["fp32_flat_groups"][i]} | {k: v for k, v in o["optimizer_state_dict"]["state"][i].items()
                                                        if torch.is_tensor(v) and v.dim() == 1} for o in osd]
        start = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            k = math.ceil(n / world)
            out[name] = {key: torch.cat([f[key][start:start + k] for f in flats])[:n].view(shape) for key in flats[0]}
            start += k
        assert all(f["fp32"].numel() == start for f in flats)
    for name, shape in ms[0]["frozen_param_shapes"].items():
        out[name] = {"lp": torch.cat([m["frozen_param_fragments"][name] for m in ms])[:math.prod(shape)].view(shape)}
    return out


@pytest.mark.parametrize("v", [v for v in D.standard_variants() if not v["round_robin"]], ids=D.variant_name)
def test_layout_rule_matches_live_engine_and_zero_to_fp32(ds_standard, v) -> None:
    ck = D.checkpoint(**v)
    step = D.step_dir(ck)
    ref = D.reference(ck)
    got = rebuild_zero3(step) if v["stage"] == 3 else rebuild_zero12(step)
    for name, full in ref["fp32"].items():
        assert torch.equal(got[name]["fp32"], full), name
        for key, t in ref["optim"][name].items():
            assert torch.equal(got[name][key], t), (name, key)
    if v["dtype"] == "bf16_fp32_accum":  # DeepSpeed's zero_to_fp32 does not read BF16_Optimizer files
        with pytest.raises(RuntimeError, match="is not a zero checkpoint"):
            D.zero_to_fp32(ck)
        return
    z = D.zero_to_fp32(ck)
    assert all(torch.equal(z[n], t) for n, t in ref["fp32"].items())
    assert torch.equal(z["head.weight"], z["embed.weight"])  # tied: written out again as a copy
    if v["stage"] == 1:
        assert "pos.weight" not in z  # DeepSpeed 0.19 drops frozen params of ZeRO-1 checkpoints
    else:
        assert torch.equal(z["pos.weight"], ref["lp"]["pos.weight"])  # frozen: in the model dtype


def test_round_robin_slice_mappings_are_wrong(ds_standard) -> None:
    """round_robin_gradients: the flat groups follow param_shapes (round-robin order) and zero_to_fp32 is
    right, but DeepSpeed's saved param_slice_mappings (and so ds_to_universal) assume model order."""
    ck = D.checkpoint(2, "fp32", round_robin=True)
    ref = D.reference(ck)
    assert not ref["hp_trusted"]
    z = D.zero_to_fp32(ck)
    assert all(torch.equal(z[n], ref["lp"][n]) for n in ref["lp"])
    with pytest.raises(AssertionError):
        rebuild_zero12(D.step_dir(ck))  # the fragment addresses disagree with the real layout


def test_sgd_state_and_universal_limit(ds_standard, tmp_path) -> None:
    ck = D.checkpoint(2, "fp32", optimizer="sgd")
    osd = _load(D.step_dir(ck) / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert sorted(osd["base_optimizer_state"]["state"][0]) == ["momentum_buffer"]
    with pytest.raises(RuntimeError, match="exp_avg"):  # ds_to_universal knows Adam state only
        D.ds_to_universal(ck, tmp_path / "u")


@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (3, "bf16")])
def test_ds_to_universal_oracle(ds_standard, tmp_path, stage, dtype) -> None:
    ck = D.checkpoint(stage, dtype)
    ref = D.reference(ck)
    u = D.ds_to_universal(ck, tmp_path / "u")
    assert u == tmp_path / "u" / "global_step3_universal"
    assert (tmp_path / "u" / "latest_universal").read_text().strip() == u.name
    for name, full in ref["fp32"].items():
        fp32 = torch.load(u / "zero" / name / "fp32.pt", weights_only=True)
        if stage == 3:  # bare flat tensors, no step.pt, no folder for tied or frozen params
            assert torch.equal(fp32, full.reshape(-1))
            assert not (u / "zero" / name / "step.pt").exists()
        else:
            assert fp32["cat_dim"] == 0 and torch.equal(fp32["param"], full)
            assert torch.load(u / "zero" / name / "step.pt", weights_only=True) == 3
    assert (u / "zero" / "head.weight").is_dir() == (stage < 3)
    assert (u / "zero" / "pos.weight").is_dir() == (stage < 3)


def test_make_checkpoint_copies_and_hits_the_cache(ds_standard, tmp_path) -> None:
    t0 = time.perf_counter()
    ck = D.make_checkpoint(tmp_path / "run", stage=1, dtype="bf16")
    assert time.perf_counter() - t0 < 5
    assert ck == tmp_path / "run" / "checkpoint" and (ck / "latest").is_file()
    assert D.run_info(ck)["variant"]["stage"] == 1
    assert D.content_hash(D.step_dir(ck)) == D.content_hash(D.step_dir(D.checkpoint(1, "bf16")))
    t0 = time.perf_counter()
    assert sorted(D.zero_to_fp32(ck)) == sorted(D.zero_to_fp32(D.checkpoint(1, "bf16")))  # oracle cache hit
    assert time.perf_counter() - t0 < 5
    assert not list(D.cache_root().glob(".build-*")) and not list((D.cache_root() / "oracles").glob(".*"))


def test_resume_reproduces_the_uninterrupted_losses(ds_standard) -> None:
    ck = D.checkpoint(2, "fp32")
    assert D.resume(ck, stage=2, dtype="fp32") == D.run_info(ck)["losses_after_save"]


def test_universal_resume_on_other_world_sizes(ds_standard, tmp_path) -> None:
    ck = D.checkpoint(2, "fp32")
    u = D.ds_to_universal(ck, tmp_path / "u")
    want = D.run_info(ck)["losses_after_save"]
    for world in (1, 3):
        got = D.resume(u.parent, stage=2, dtype="fp32", world=world, load_universal=True)
        assert got == pytest.approx(want, rel=1e-5), world


def test_worker_failure_is_reported_not_hung(tmp_path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="bogus"):
        D.launch(2, [{"kind": "bogus"}], tmp_path, timeout_s=120)
    assert time.perf_counter() - t0 < 60
