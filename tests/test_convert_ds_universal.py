"""DeepSpeed universal checkpoints in and out, against DeepSpeed itself (ds_checkpoints):
DeepSpeed's own ``ds_to_universal`` output imports to the same checkpoint, bit for bit, as
the ZeRO checkpoint it was made from; our export loads with DeepSpeed's
``load_checkpoint(..., load_universal)`` on other world sizes and trains on as the
uninterrupted run did, and exactly as DeepSpeed's own universal output does; every
optimizer's state goes out (SGD's too, which ``ds_to_universal`` cannot convert); bad input
is named by file, nothing complete-looking left behind.

Resumes are batched: one DeepSpeed launch per world size (two in all, each training several
engines one after the other), see :func:`_resume_all`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

import ds_checkpoints as D  # noqa: E402

import ucp_zarr  # noqa: E402
from ucp_zarr.converters import read_source  # noqa: E402
from ucp_zarr.errors import ConversionError, UntrustedInputError  # noqa: E402

VARIANTS = {
    "z1-bf16": dict(stage=1, dtype="bf16"),
    "z2-fp32": dict(stage=2, dtype="fp32"),
    "z2-bf16": dict(stage=2, dtype="bf16"),
    "z3-fp32": dict(stage=3, dtype="fp32"),
    "z3-bf16": dict(stage=3, dtype="bf16"),
    "z2-sgd": dict(stage=2, dtype="fp32", optimizer="sgd"),
    "z3-sg50": dict(stage=3, dtype="fp32", sub_group_size=50),  # 3 flat sub-groups for 2 param groups
}
ADAM = [v for v in VARIANTS if v != "z2-sgd"]  # ds_to_universal knows only Adam's keys

# Tolerances on the losses after a resume on another world size, against the uninterrupted run
# on 2 ranks. The gradient of a step is reduced over 3 (or 1) ranks instead of 2, so it is
# summed in another order: in fp32 the first update differs by an ulp here and there, which
# moves the next loss by about one fp32 ulp of the loss (2.4e-7 at 2.7; observed: 1.6e-7 on
# 3 ranks, 2.4e-7 on 1). In bf16 ZeRO-2 reduces bf16 gradients: a gradient element rounded
# differently flips its weight by one bf16 ulp (2^-8 relative), which moves this loss (2.7) by
# up to ~1e-3 (observed: 2.9e-5 and 8.2e-4 on 3 ranks in two fixture builds, 2.4e-7 on 1).
# The exact check is the other one: DeepSpeed's own ds_to_universal output, resumed the same
# way, gives bit-identical losses to ours.
TOL = {"fp32": 1e-6, "bf16": 2e-3}


@pytest.fixture(scope="session", autouse=True)
def built() -> None:
    D.prebuild([D.variant(**v) for v in VARIANTS.values()])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """variant -> {"ds": ZeRO checkpoint, "ck": its conversion, "own": DeepSpeed's universal
    output (parent folder, holding latest_universal), "ours": our export of "ck"}."""
    out = {}
    for vid, v in VARIANTS.items():
        base = tmp_path_factory.mktemp(vid)
        ds = D.checkpoint(**v)
        ucp_zarr.convert(ds, base / "ck")
        with warnings.catch_warnings():
            # z3-sg50: the ZeRO importer lists sub-groups as param groups (some parameters in none);
            # the export writes every parameter with optimizer state anyway, and warns
            warnings.simplefilter("ignore")
            ucp_zarr.export(base / "ck", base / "ours", to="ds-universal")
        out[vid] = {"ds": ds, "ck": base / "ck", "ours": base / "ours"}
        if vid in ADAM:
            out[vid]["own"] = D.ds_to_universal(ds, base / "own").parent
    return out


def _assert_same(a: ucp_zarr.Checkpoint, b: ucp_zarr.Checkpoint) -> None:
    """Same keys, same dtypes, bit-equal tensors, equal values."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a.meta.tensors[k].dtype == b.meta.tensors[k].dtype, k
        assert a.meta.tensors[k].shape == b.meta.tensors[k].shape, k
        assert torch.equal(a.read(k), b.read(k)), k
    assert a.meta.values == b.meta.values


# --- (a) in ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vid", ADAM)
def test_import_equals_zero_conversion(folders: dict[str, dict[str, Path]], vid: str, tmp_path: Path) -> None:
    f = folders[vid]
    ucp_zarr.convert(f["own"], tmp_path / "u", source="ds-universal")  # the folder holding latest_universal
    got, want = ucp_zarr.open(tmp_path / "u"), ucp_zarr.open(f["ck"])
    _assert_same(got, want)
    assert got.meta.layout["source"]["format"] == "ds-universal"
    # ZeRO-1/2 outputs hold the states shaped, ZeRO-3 outputs flat: both come back shaped
    assert got.meta.tensors["optim.state.fc1.weight.exp_avg"].shape == (11, 7)
    tag = (f["own"] / "latest_universal").read_text().strip()
    imported = read_source(f["own"] / tag, "ds-universal", trust=True)  # the tag folder, full unpickling
    assert sorted(imported.tensors) == sorted(want)


def test_import_reads_files_lazily(folders: dict[str, dict[str, Path]]) -> None:
    """Import opens the files for their shapes only; a file's data is read when written."""
    imported = read_source(folders["z3-bf16"]["own"], "ds-universal")
    src = imported.tensors["optim.state.fc1.weight.exp_avg"]
    assert type(src).__name__ == "FileTensor" and src.path.name == "exp_avg.pt" and tuple(src.shape) == (11, 7)
    assert type(imported.tensors["model.fc1.weight"]).__name__ == "FileTensor"  # the master, cast when read
    assert imported.tensors["model.fc1.weight"].dtype == torch.bfloat16


# --- (b) out, resumed by DeepSpeed -------------------------------------------------------------------


def _resume_all(world: int, jobs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, list[float]]:
    """Like ``D.resume(folder, load_universal=True, **variant)`` for every job, in ONE launch of
    ``world`` processes (each job builds its engine, loads, trains ``D.CONTINUE_STEPS`` steps)."""
    work = Path(tempfile.mkdtemp(prefix="ds-resume-all-"))
    try:
        tasks = [{"kind": "resume", "variant": D.variant(world=world, **kw), "load": str(folder), "tag": None,
                  "steps": D.CONTINUE_STEPS, "load_universal": True, "out": str(work / f"{i}.json")}
                 for i, (folder, kw) in enumerate(jobs.values())]
        D.launch(world, tasks, work, timeout_s=600)
        return {name: json.loads((work / f"{i}.json").read_text()) for i, name in enumerate(jobs)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def resumed(folders: dict[str, dict[str, Path]]) -> dict[str, list[float]]:
    """job -> losses after loading. ``<variant>/<ours|own>/z<stage>w<world>``: the folder
    loaded by an engine of that ZeRO stage on that many ranks."""
    f = folders
    on3 = {  # ZeRO-2 engines on 3 ranks (the checkpoints were saved on 2)
        "z2-fp32/ours/z2w3": (f["z2-fp32"]["ours"], VARIANTS["z2-fp32"]),
        "z2-fp32/own/z2w3": (f["z2-fp32"]["own"], VARIANTS["z2-fp32"]),
        "z2-bf16/ours/z2w3": (f["z2-bf16"]["ours"], VARIANTS["z2-bf16"]),
        "z2-bf16/own/z2w3": (f["z2-bf16"]["own"], VARIANTS["z2-bf16"]),
        "z2-sgd/ours/z2w3": (f["z2-sgd"]["ours"], VARIANTS["z2-sgd"]),
        # ZeRO-3 with sub-groups into ZeRO-2 (DeepSpeed's own output has no file a ZeRO-2 engine reads)
        "z3-sg50/ours/z2w3": (f["z3-sg50"]["ours"], dict(stage=2, dtype="fp32")),
    }
    on1 = {
        "z2-fp32/ours/z2w1": (f["z2-fp32"]["ours"], VARIANTS["z2-fp32"]),
        "z2-fp32/own/z2w1": (f["z2-fp32"]["own"], VARIANTS["z2-fp32"]),
        "z3-bf16/ours/z3w1": (f["z3-bf16"]["ours"], VARIANTS["z3-bf16"]),
        "z3-bf16/own/z3w1": (f["z3-bf16"]["own"], VARIANTS["z3-bf16"]),
        # a ZeRO-2 checkpoint into a ZeRO-3 engine: our folder has the file name ZeRO-3 looks for
        "z2-fp32/ours/z3w1": (f["z2-fp32"]["ours"], dict(VARIANTS["z2-fp32"], stage=3)),
        "z3-sg50/ours/z3w1": (f["z3-sg50"]["ours"], VARIANTS["z3-sg50"]),
        "z3-sg50/own/z3w1": (f["z3-sg50"]["own"], VARIANTS["z3-sg50"]),
    }
    return _resume_all(3, on3) | _resume_all(1, on1)


@pytest.mark.parametrize("job", ["z2-fp32/ours/z2w3", "z2-fp32/ours/z2w1", "z2-bf16/ours/z2w3", "z3-sg50/ours/z2w3"])
def test_export_resumes_on_another_world_size(folders: dict[str, dict[str, Path]], resumed: dict[str, list[float]],
                                              job: str) -> None:
    vid = job.split("/")[0]
    want = D.run_info(folders[vid]["ds"])["losses_after_save"]
    got = resumed[job]
    assert got == pytest.approx(want, rel=0, abs=TOL[VARIANTS[vid]["dtype"]]), (got, want)
    # DeepSpeed's own universal output, resumed the same way: the very same losses
    own = job.replace("/ours/", "/own/")
    if own in resumed:
        assert got == resumed[own]


def test_export_resumes_on_zero3(folders: dict[str, dict[str, Path]], resumed: dict[str, list[float]]) -> None:
    """ZeRO-3 engines load our export exactly as DeepSpeed's own output. Both drift from the
    uninterrupted run after the first step: DeepSpeed 0.19's ZeRO-3 universal loader gives
    every param group group 0's hyper-parameters (optimizer_state_dict.param_groups[0]), and
    the fixture's groups differ (lr 0.005 vs 0.01, weight decay 0.1 vs 0): the loss before
    the first step (the loaded weights) matches, the next one does not."""
    assert resumed["z3-bf16/ours/z3w1"] == resumed["z3-bf16/own/z3w1"]
    assert resumed["z3-sg50/ours/z3w1"] == resumed["z3-sg50/own/z3w1"]
    for job in ("z3-bf16/ours/z3w1", "z2-fp32/ours/z3w1", "z3-sg50/ours/z3w1"):
        vid = job.split("/")[0]
        want = D.run_info(folders[vid]["ds"])["losses_after_save"]
        assert resumed[job][0] == pytest.approx(want[0], rel=0, abs=TOL[VARIANTS[vid]["dtype"]]), (job, resumed[job])


def test_export_round_trips(folders: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """Our export imports back to the checkpoint it was made from, bit for bit."""
    for vid in ("z2-bf16", "z3-bf16", "z2-sgd"):
        ucp_zarr.convert(folders[vid]["ours"], tmp_path / vid, source="ds-universal")
        _assert_same(ucp_zarr.open(tmp_path / vid), ucp_zarr.open(folders[vid]["ck"]))
    # sub-groups: every trainable parameter is written, whatever group 'optim.param_groups' puts it in
    ours = folders["z3-sg50"]["ours"]
    zero = ours / (ours / "latest_universal").read_text() / "zero"
    assert {p.name for p in zero.iterdir() if p.is_dir()} == {n for g in D.GROUP_NAMES for n in g}
    ucp_zarr.convert(ours, tmp_path / "sg", source="ds-universal")
    got, want = ucp_zarr.open(tmp_path / "sg"), ucp_zarr.open(folders["z3-sg50"]["ck"])
    assert sorted(got) == sorted(want) and all(torch.equal(got.read(k), want.read(k)) for k in want)


def test_export_layout(folders: dict[str, dict[str, Path]]) -> None:
    ours = folders["z2-bf16"]["ours"]
    tag = (ours / "latest_universal").read_text()
    assert tag == "global_step3_universal"
    folder = ours / tag
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_model_states.pt", "zero",
                                                         "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    names = {n for g in D.GROUP_NAMES for n in g}
    assert {p.name for p in (folder / "zero").iterdir()} == names | {"optimizer_state.pt"}
    ck = ucp_zarr.open(folders["z2-bf16"]["ck"])
    fp32 = torch.load(folder / "zero" / "fc1.weight" / "fp32.pt", weights_only=True)
    assert fp32["cat_dim"] == 0 and torch.equal(fp32["param"], ck.read("optim.state.fc1.weight.fp32"))
    assert torch.equal(torch.load(folder / "zero" / "fc1.weight" / "step.pt", weights_only=True),
                       ck.read("optim.state.fc1.weight.step"))
    ms = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)  # our own file
    assert [list(g) for g in ms["param_shapes"]] == D.GROUP_NAMES
    assert ms["module"]["fc1.weight"].numel() == 0 and ms["module"]["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(ms["module"]["pos.weight"], ck.read("model.pos.weight"))  # frozen: whole
    assert ms["global_steps"] == 3 and ms["mp_world_size"] == 1 and ms["epoch"] == D.CLIENT_STATE["epoch"]
    assert ms["nested"] == D.CLIENT_STATE["nested"] and ms["lr_scheduler"]["_last_lr"] == [0.005, 0.01]
    osd = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)
    # the loss scaler comes back as DeepSpeed's own class (pickled by name, DeepSpeed not imported)
    assert type(osd["loss_scaler"]).__qualname__ == "LossScaler" and osd["loss_scaler"].cur_scale == 1.0
    assert [g["lr"] for g in osd["param_groups"]] == [0.005, 0.01] and osd["param_groups"][0]["betas"] == (0.9, 0.999)
    assert osd["optimizer_state_dict"]["state"][0]["step"] == 3 and osd["ds_version"]


# --- (c) every optimizer's state goes out ----------------------------------------------------------------


def test_export_sgd_writes_every_state_key(folders: dict[str, dict[str, Path]],
                                           resumed: dict[str, list[float]]) -> None:
    f = folders["z2-sgd"]
    ck = ucp_zarr.open(f["ck"])
    folder = f["ours"] / (f["ours"] / "latest_universal").read_text()
    for name in (n for g in D.GROUP_NAMES for n in g):
        assert sorted(p.name for p in (folder / "zero" / name).iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
        mb = torch.load(folder / "zero" / name / "momentum_buffer.pt", weights_only=True)["param"]
        assert torch.equal(mb, ck.read(f"optim.state.{name}.momentum_buffer")), name
    # DeepSpeed loads momentum_buffer from it (ZeRO-1/2 load every <key>.pt) and trains on as before
    want = D.run_info(f["ds"])["losses_after_save"]
    assert resumed["z2-sgd/ours/z2w3"] == pytest.approx(want, rel=0, abs=TOL["fp32"])
    with pytest.raises(RuntimeError, match="KeyError: 'exp_avg'"):  # DeepSpeed's own converter cannot
        D.ds_to_universal(f["ds"], folder.parent.parent / "own-sgd")


# --- (d) bad input ---------------------------------------------------------------------------------------


def test_bad_input_is_named(folders: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    src = tmp_path / "u"
    shutil.copytree(folders["z3-bf16"]["own"], src)
    folder = src / (src / "latest_universal").read_text().strip()
    # a truncated file
    f = folder / "zero" / "fc1.weight" / "exp_avg.pt"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConversionError, match="fc1.weight/exp_avg.pt"):
        ucp_zarr.convert(src, tmp_path / "a", source="ds-universal")
    f.write_bytes(raw)
    # a file that needs code to run: refused unless trusted
    torch.save({"param": torch.zeros(77), "x": __import__("argparse").Namespace(a=1)}, f)
    with pytest.raises(UntrustedInputError, match="fc1.weight/exp_avg.pt"):
        ucp_zarr.convert(src, tmp_path / "b", source="ds-universal")
    f.write_bytes(raw)
    # a file of another shape
    torch.save(torch.zeros(76), f)
    with pytest.raises(ConversionError, match=r"exp_avg.pt: holds 76 elements, but parameter 'fc1.weight'"):
        ucp_zarr.convert(src, tmp_path / "c", source="ds-universal")
    f.write_bytes(raw)
    # a parameter's folder missing
    shutil.rmtree(folder / "zero" / "ln.bias")
    with pytest.raises(ConversionError, match=r"zero/ln.bias: missing"):
        ucp_zarr.convert(src, tmp_path / "d", source="ds-universal")
    # no optimizer_state.pt, no folder at all
    (folder / "zero" / "optimizer_state.pt").unlink()
    with pytest.raises(ConversionError, match="optimizer_state.pt"):
        ucp_zarr.convert(src, tmp_path / "e", source="ds-universal")
    with pytest.raises(ConversionError, match="latest_universal"):
        ucp_zarr.convert(tmp_path, tmp_path / "f", source="ds-universal")
    assert not any((tmp_path / n / "zarr.json").exists() for n in "abcdef")


def test_export_refuses_without_param_groups(tmp_path: Path) -> None:
    ucp_zarr.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck")
    with pytest.raises(ConversionError, match="optim.param_groups"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "out", to="ds-universal")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
