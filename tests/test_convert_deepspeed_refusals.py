"""What the DeepSpeed converter does not support is refused, naming it, before any work; and no
internal error (AttributeError, KeyError, TypeError, IndexError...) reaches the user, whatever
is wrong with the folder: a little fuzzing of real checkpoints (``ds_checkpoints``,
``ds_parallel``) whose files are deleted, truncated, doubled, renamed, or whose model-states
entries are replaced by values of other types. Each attempt either converts or raises a
:class:`~ucp_zarr.CheckpointError`; a refusal leaves no checkpoint behind."""

from __future__ import annotations

import importlib
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import ds_checkpoints as D
import ds_parallel as P
import pytest
import torch

import ucp_zarr
from ucp_zarr.errors import CheckpointError

pytest.importorskip("deepspeed")

SOURCES = {
    "zero1": lambda: D.step_dir(D.checkpoint(1, "fp32")),
    "zero3": lambda: D.step_dir(D.checkpoint(3, "fp32")),
    "pipe": lambda: P.build("pipe") / "z1-fp32" / "D" / "global_step3",
    "moe": lambda: P.build("moe") / "z1-fp32" / "D" / "global_step3",
}


def _copy(src: Path, tmp: Path, name: str) -> Path:
    dst = tmp / name / src.name
    shutil.copytree(src, dst)
    return dst


def _attempt(folder: Path, out: Path) -> CheckpointError | None:
    """Convert; a refusal must be a CheckpointError and leave nothing behind (any other
    exception fails the test as it is raised)."""
    try:
        ucp_zarr.convert(folder, out)
    except CheckpointError as e:
        assert not (out / "zarr.json").exists(), folder
        return e
    return None


@pytest.mark.parametrize("name, match", [
    ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE experts trained without ZeRO"),
    ("layer_01-model_01-model_states.pt", "pipeline parallelism combined with tensor parallelism"),
    ("layer_0_expert_0_mp_rank_01_model_states.pt", "MoE experts combined with tensor parallelism"),
    ("expert_0_mp_rank_00_model_states.pt", "without a layer index"),
    ("something_new_model_states.pt", "a DeepSpeed file this converter does not know"),
    ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "two files for the same rank"),
    ("zero_pp_rank_5_mp_rank_00_optim_states.pt", r"files of ranks \[2, 3, 4\] are missing"),
])
def test_unsupported_features_are_named_before_any_work(tmp_path: Path, name: str, match: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from the file names alone: no file is read."""
    folder = _copy(SOURCES["zero1"](), tmp_path, "src")
    shutil.copy(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", folder / name)
    loads: list[Path] = []
    monkeypatch.setattr(importlib.import_module("ucp_zarr.converters.deepspeed_files"), "torch_load_mapped",
                        lambda path, **kw: loads.append(path))
    with pytest.raises(CheckpointError, match=match):
        ucp_zarr.convert(folder, tmp_path / "out")
    assert loads == []


def test_autoep_is_refused_by_name(tmp_path: Path) -> None:
    """A model-states file recording DeepSpeed AutoEP layers (``ds_autoep_layers``: expert
    placements with affine maps of their own) is refused naming AutoEP (before: the key was
    taken for engine state and the folder converted as if it had no experts)."""
    folder = _copy(SOURCES["zero1"](), tmp_path, "src")
    f = folder / "mp_rank_00_model_states.pt"
    d = torch.load(f, weights_only=True)
    d["ds_autoep_layers"] = [{"layer": "moe", "num_experts": 4, "ep_size": 2}]
    torch.save(d, f)
    with pytest.raises(CheckpointError, match=r"DeepSpeed AutoEP expert layers \(ds_autoep_layers\) are not supported"):
        ucp_zarr.convert(folder, tmp_path / "out")


def test_zero0_with_a_torch_optimizer_is_refused_by_name(tmp_path: Path) -> None:
    """ZeRO-0 in fp32 keeps a torch optimizer's state in the model-states file, keyed by position;
    the checkpoint does not say which parameter each position is."""
    folder = _copy(SOURCES["pipe"](), tmp_path, "src")
    for f in folder.glob("*optim_states.pt"):
        f.unlink()
    for f in folder.glob("mp_rank_*_model_states.pt"):
        d = torch.load(f, weights_only=True)
        d["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0]}]}
        torch.save(d, f)
    with pytest.raises(CheckpointError, match="ZeRO stage 0 with a torch optimizer is not supported"):
        ucp_zarr.convert(folder, tmp_path / "out")


def _file_mutations(folder: Path) -> list[tuple[str, Callable[[Path], None]]]:
    out: list[tuple[str, Callable[[Path], None]]] = []
    for f in sorted(folder.iterdir()):
        out.append((f"delete {f.name}", lambda d, n=f.name: (d / n).unlink()))
        out.append((f"truncate {f.name}", lambda d, n=f.name: (d / n).write_bytes((d / n).read_bytes()[:300])))
    return out


_JUNK = (None, "x", {"a": [1]})
_READ = {"module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
         "checkpoint_parallel_dimensions", "num_experts", "ds_config", "universal_checkpoint_info", "global_steps",
         "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "lr_scheduler", "optimizer"}
"""The model-states entries the converter reads (every entry of a layer or expert file is read)."""


def _content_mutations(folder: Path, rng: random.Random, count: int | None) -> list[tuple[str, Callable[[Path], None]]]:
    """Entries of the model-states, layer and expert files replaced by values of other types."""
    out = []
    for f in sorted(folder.glob("*model_states.pt")):
        keys = [k for k in torch.load(f, weights_only=True) if k in _READ or f.name.startswith("layer_")]
        for key in keys:
            for junk in _JUNK:
                def change(d: Path, n: str = f.name, k: Any = key, v: Any = junk) -> None:
                    state = torch.load(d / n, weights_only=True)
                    state[k] = v
                    torch.save(state, d / n)
                out.append((f"{f.name}[{key!r}] = {type(junk).__name__}", change))
    if count is not None and len(out) > count:
        out = rng.sample(out, count)
    return out


def _fuzz(tmp_path: Path, source: str, count: int | None) -> tuple[int, int]:
    src = SOURCES[source]()
    rng = random.Random(1234)
    mutations = _file_mutations(src) + _content_mutations(src, rng, count)
    if count is not None:
        mutations = rng.sample(mutations, min(count, len(mutations)))
    refused = converted = 0
    for i, (what, change) in enumerate(mutations):
        folder = _copy(src, tmp_path, f"m{i}")
        change(folder)
        try:
            e = _attempt(folder, tmp_path / f"out{i}")
        except Exception as err:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"{source}: {what}: an internal {type(err).__name__} reached the user: {err}") from err
        refused += e is not None
        converted += e is None
        shutil.rmtree(tmp_path / f"m{i}")
        shutil.rmtree(tmp_path / f"out{i}", ignore_errors=True)
    return refused, converted


@pytest.mark.parametrize("source", ["zero1", "pipe", "moe"])
def test_fuzzed_folders_convert_or_are_refused(tmp_path: Path, source: str) -> None:
    refused, converted = _fuzz(tmp_path, source, count=12)
    assert refused >= 6


@pytest.mark.long
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_fuzzed_folders_exhaustive(tmp_path: Path, source: str) -> None:
    refused, _ = _fuzz(tmp_path, source, count=None)
    assert refused > 0
