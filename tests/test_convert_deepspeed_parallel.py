"""DeepSpeed as it really writes checkpoints, converted with ``ucp_zarr.convert`` and checked
against the real framework (``ds_parallel`` builds; DeepSpeed 0.19.8 on gloo CPU processes):

* pipeline engines (2 stages, an embedding tied to the head across them, ZeRO-1 fp32 and
  ZeRO-0 bf16): every fp32 master, Adam moment and module weight equals the live engines'
  and DeepSpeed's own ``ds_to_universal`` output, bit for bit; the adapter's save at the same
  step holds the same tensors; a 1-stage (and, ``long``, a 3-stage) pipeline resumes from
  either, holding the saved state exactly and training on with the same losses;
* MoE engines (4 experts, ``ep_size=2``, ZeRO-1 fp32 and ZeRO-2 bf16; ``long``: 2 x 2
  expert-data-parallel ranks): every expert, under its global id, equals the live engines'
  (DeepSpeed's own converter fails on these); an ``ep_size=1`` engine loads the adapter's save;
* AutoTP over GPTBigCode (multi-query attention): the fused ``c_attn`` weight, described only
  by an affine map (query rows split, key/value rows held by every rank), placed as
  DeepSpeed's own ``rebuild`` places it, equal to the weights AutoTP cut and to
  ``ds_to_universal``; a trained one whose replicated blocks differ is refused, as DeepSpeed
  refuses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ds_checkpoints as D
import ds_parallel as P
import pytest
import torch

import ucp_zarr
from ucp_zarr.errors import ConversionError

pytest.importorskip("deepspeed")


@pytest.fixture(scope="session")
def pipe() -> Path:
    return P.build("pipe")


@pytest.fixture(scope="session")
def moe() -> Path:
    return P.build("moe")


def _convert(src: Path, dst: Path) -> ucp_zarr.Checkpoint:
    ucp_zarr.convert(src, dst)
    return ucp_zarr.open(dst)


def _equal_to_reference(ck: ucp_zarr.Checkpoint, ref: dict[str, dict[str, torch.Tensor]]) -> int:
    """Every tensor of the live engines' state equals the checkpoint's; returns the count."""
    n = 0
    for name, entry in ref.items():
        for k, want in entry.items():
            key = f"model.{name}" if k == "lp" else D.converted_key(ck.meta.tensors, name, k)
            got = ck.read(key)
            assert got.dtype == want.dtype and torch.equal(got, want), key
            n += 1
    return n


def _same_tensors(a: ucp_zarr.Checkpoint, b: ucp_zarr.Checkpoint) -> None:
    assert sorted(a.meta.tensors) == sorted(b.meta.tensors)
    for key in a.meta.tensors:
        assert torch.equal(a.read(key), b.read(key)), key


# --- pipeline ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["z1-fp32", "z0-bf16"])
def test_pipeline_equals_live_engines_and_ds_to_universal(pipe: Path, variant: str, tmp_path: Path) -> None:
    src = pipe / variant
    assert (src / "D" / "global_step3" / "layer_01-model_states.pt").is_file()
    assert not (src / "D" / "global_step3" / "layer_05-model_states.pt").exists()  # the tied head: no file
    ck = _convert(src / "D", tmp_path / "ck")
    ref = P.reference(src)
    assert "tied_modules.embed.weight" in ref and "5.weight" not in ref
    assert _equal_to_reference(ck, ref) == 25 * 4  # fp32, two moments, the module's weight
    for layer in range(1, 5):  # the blocks' buffers
        assert torch.equal(ck.read(f"model.{layer}.scale"), 1.0 + 0.1 * torch.arange(P.DIM, dtype=torch.float32))
    assert "model.0.weight" not in ck.meta.tensors  # layer 0's file is the tied module's
    groups = ck.meta.values["optim.param_groups"]
    assert len(groups) == 1 and len(groups[0]["params"]) == 25
    assert ck.meta.layout["source"]["pp"] == 2 and ck.meta.values["client_state.epoch"] == 2
    if variant == "z1-fp32":
        compared = 0
        for name, state_key, want in D.universal_tensors(src / "universal"):
            assert torch.equal(ck.read(D.converted_key(ck.meta.tensors, name, state_key)), want), (name, state_key)
            compared += 1
        assert compared == 25 * 3
    else:  # DeepSpeed's own converter fails on the BF16_Optimizer's files (no param_shapes)
        assert "param_shapes must contain dictionaries" in (src / "universal_error.txt").read_text()
    _same_tensors(ucp_zarr.open(src / "X"), ck)  # the adapter's save of the same step


def test_pipeline_files_in_any_listing_order(pipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer files sort beside the stages' files (``layer_00-model_states.pt``,
    ``mp_rank_00_model_states.pt``): the result must not depend on the order a listing gives
    (one order gave ``AttributeError: 'NoneType' object has no attribute 'get'``)."""
    first = _convert(pipe / "z1-fp32" / "D", tmp_path / "a")
    listing, glob = Path.iterdir, Path.glob
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(listing(self), reverse=True)))
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(sorted(glob(self, pattern), reverse=True)))
    _same_tensors(_convert(pipe / "z1-fp32" / "D", tmp_path / "b"), first)


def test_pipeline_frozen_layer_that_fits_the_tie_is_refused(pipe: Path, tmp_path: Path) -> None:
    """A layer whose parameters are all frozen is named in no file of a pipeline checkpoint
    (DeepSpeed records frozen parameters under ZeRO-2/3 only, which pipelines do not run). One
    holding a ``weight`` of the tied embedding's size fits the tie as well as the tie's own layer
    file: it was taken for the tie, the embedding got its values and the layer was lost. Its
    file is added here as DeepSpeed's ``PipelineModule.save_state_dict`` writes a layer's."""
    src = tmp_path / "D"
    shutil.copytree(pipe / "z1-fp32" / "D", src)
    step = src / "global_step3"
    tie = torch.load(step / "layer_00-model_states.pt", weights_only=True)
    torch.save({"weight": tie["weight"] + 1}, step / "layer_06-model_states.pt")
    with pytest.raises(ConversionError, match=r"layer_00-model_states.pt and layer_06-model_states.pt both fit the "
                                              r"tied module 'embed' and hold other values.*adapters.deepspeed"):
        ucp_zarr.convert(src, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    torch.save({"weight": tie["weight"].clone()}, step / "layer_06-model_states.pt")  # a second copy of the tie
    ck = _convert(src, tmp_path / "ck")
    assert torch.equal(ck.read("model.tied_modules.embed.weight"), P.reference(pipe / "z1-fp32")["tied_modules.embed.weight"]["lp"])


# The 1-stage engine runs on 2 data-parallel ranks where the 2-stage one ran on 1: each rank's
# cross-entropy is the mean over half the tokens and the loss (and the gradient) the mean of the
# two, a sum in another order than the one rank's mean over all of them. The state it resumes
# from is checked bit for bit; the losses differ by that reassociation alone. Measured with
# DeepSpeed 0.19.8 and torch 2.13 on CPU: 1 ulp (8e-8 relative) on the first step, the second
# equal (earlier builds on other machines matched bit for bit). The tolerance keeps a 12x margin
# over that and stays far below what one training step changes (checked below).
REASSOCIATION_RTOL = 1e-6


def test_pipeline_resumes_at_another_degree(pipe: Path) -> None:
    """2 stages -> 1 stage on 2 data-parallel ranks, from the adapter's save and from the
    converted DeepSpeed checkpoint: the engine holds the saved state bit for bit, and trains on
    with the uninterrupted run's losses (up to the data-parallel mean's reassociation)."""
    src = pipe / "z1-fp32"
    ref, after = P.reference(src), P.run_info(src)["losses_after"]
    assert abs(after[1] - after[0]) > 1000 * REASSOCIATION_RTOL * abs(after[0])
    for name in ("X", "CV"):
        state = torch.load(src / "pp1" / f"{name}.pt", weights_only=True)
        assert sorted(state) == sorted(ref)
        for param, entry in ref.items():
            for k, t in entry.items():
                assert torch.equal(state[param][k], t), (name, param, k)
        info = json.loads((src / "pp1" / f"{name}.json").read_text())
        assert info["losses"] == pytest.approx(after, rel=REASSOCIATION_RTOL, abs=0), name
        assert info["client"] == {"epoch": 2}


def test_pipeline_universal_folders_in_and_out(pipe: Path, tmp_path: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of a 2-stage pipeline holds each stage's model-states
    file (``mp_world_size`` 2 counts the stages): it was refused as tensor-parallel, and so was
    the export of a pipeline checkpoint. Imported, it holds the ZeRO import's tensors (no
    buffers: the folder has no layer file); exported, DeepSpeed's ``load_universal`` loads it
    into 2 stages with every tensor of the saved state, and trains on with the uninterrupted
    run's losses."""
    src = pipe / "z1-fp32"
    with pytest.warns(UserWarning, match=r"ucp_zarr: universal: the buffers \['1.scale', '2.scale', '3.scale'\] \.\.\. of the pipeline's layer "
                                        r"files are not in its universal folder"):
        ck = _convert(src / "universal", tmp_path / "u")
    zero = ucp_zarr.open(src / "CV")
    buffers = {f"model.{i}.scale" for i in range(1, 5)}
    assert sorted(ck.meta.tensors) == sorted(set(zero.meta.tensors) - buffers)
    for key in ck.meta.tensors:
        assert torch.equal(ck.read(key), zero.read(key)), key
    assert ck.meta.values["optim.param_groups"] == zero.meta.values["optim.param_groups"]
    assert ck.meta.layout["source"]["pp"] == 2
    state, ref = torch.load(src / "pp2u" / "state.pt", weights_only=True), P.reference(src)
    assert sorted(state) == sorted(ref)
    for param, entry in ref.items():
        for k, t in entry.items():
            assert torch.equal(state[param][k], t), (param, k)
    assert json.loads((src / "pp2u" / "run.json").read_text())["losses"] == P.run_info(src)["losses_after"]
    ucp_zarr.export(src / "CV", tmp_path / "xu", to="ds-universal")
    for name in ("mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_model_states.pt"):  # (ZeRO-3's name:
        assert (tmp_path / "xu" / "global_step3_universal" / name).is_file(), name  # DeepSpeed counts them too)


@pytest.mark.long
def test_pipeline_resumes_on_three_stages() -> None:
    out, src = P.build("pipe3"), P.build("pipe") / "z1-fp32"
    state, ref = torch.load(out / "state.pt", weights_only=True), P.reference(src)
    for param, entry in ref.items():
        for k, t in entry.items():
            assert torch.equal(state[param][k], t), (param, k)
    assert P.run_info(out)["losses"] == P.run_info(src)["losses_after"]


# --- MoE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["z1-fp32", "z2-bf16"])
def test_moe_equals_live_engines(moe: Path, variant: str, tmp_path: Path) -> None:
    src = moe / variant
    ck = _convert(src / "D", tmp_path / "ck")
    ref = P.reference(src)
    experts = [n for n in ref if ".deepspeed_experts." in n]
    assert {n.split(".deepspeed_experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    assert _equal_to_reference(ck, ref) == len(ref) * 4
    groups = ck.meta.values["optim.param_groups"]
    assert sorted(groups[1]["params"]) == sorted(experts) and groups[1]["moe"] is True
    # DeepSpeed's own converter fails on expert parallelism
    assert "RuntimeError" in (src / "universal_error.txt").read_text()
    _same_tensors(ucp_zarr.open(src / "X"), ck)


def test_moe_loads_at_another_expert_parallel_degree(moe: Path) -> None:
    """The adapter's save at ``ep_size=2`` loaded by an ``ep_size=1`` engine (every rank holds
    all 4 experts): it holds the saved state bit for bit; its own save right after the load
    holds the same tensors; it trains on with the uninterrupted run's losses."""
    src = moe / "z1-fp32"
    state, ref = torch.load(src / "ep1" / "state.pt", weights_only=True), P.reference(src)
    assert sorted(state) == sorted(ref)
    for param, entry in ref.items():
        for k, t in entry.items():
            assert torch.equal(state[param][k], t), (param, k)
    _same_tensors(ucp_zarr.open(src / "ep1" / "X"), ucp_zarr.open(src / "X"))
    # deterministic routing (no random token selection): the uninterrupted run's losses. An
    # expert's gradient is one product over both ranks' tokens at ep_size=2 and the mean of two
    # ranks' products at ep_size=1: equal bit for bit in the builds so far, but only up to
    # reassociation by construction (as the pipeline's above)
    after = P.run_info(src)["losses_after"]
    assert abs(after[1] - after[0]) > 1000 * REASSOCIATION_RTOL * abs(after[0])
    assert P.run_info(src / "ep1")["losses"] == pytest.approx(after, rel=REASSOCIATION_RTOL, abs=0)
    # the groups keep the engine's own MoE names (ep_size_1): DeepSpeed finds each group's expert-parallel
    # process group by it (before: the checkpoint's ep_size_2, and bf16's first step failed on it)
    names = P.run_info(src / "ep1")["group_names"]
    assert names["loaded"] == names["fresh"] and any(n == "ep_size_1" for n in names["fresh"])


def test_moe_universal_export_for_ep_size_1(moe: Path, tmp_path: Path) -> None:
    """An MoE checkpoint exported to a universal folder: refused without ``ep_size=1``
    (``load_universal`` finds each expert's folder by the engine's local index: an
    ``ep_size=2`` engine's rank 1 took global experts 0 and 1 for its 2 and 3, silently);
    with it, DeepSpeed's own ``load_universal`` into an ``ep_size=1`` engine holds the saved
    state bit for bit and trains on with the uninterrupted run's losses."""
    src = moe / "z1-fp32"
    for given in ({}, {"ep_size": 2}):
        with pytest.raises(ConversionError, match="ep_size 1") as e:
            ucp_zarr.export(src / "CV", tmp_path / "xu", to="ds-universal", **given)
        assert "deepspeed_experts" in str(e.value) and not (tmp_path / "xu").exists()
    state, ref = torch.load(src / "ep1u" / "state.pt", weights_only=True), P.reference(src)
    assert sorted(state) == sorted(ref)
    for param, entry in ref.items():
        for k, t in entry.items():
            assert torch.equal(state[param][k], t), (param, k)
    assert P.run_info(src / "ep1u")["losses"] == pytest.approx(P.run_info(src)["losses_after"], rel=REASSOCIATION_RTOL, abs=0)


@pytest.mark.long
def test_moe_over_expert_data_parallel_groups(tmp_path: Path) -> None:
    src = P.build("moe4") / "z2-fp32"
    ck = _convert(src / "D", tmp_path / "ck")
    ref = P.reference(src)
    assert _equal_to_reference(ck, ref) == len(ref) * 4
    _same_tensors(ucp_zarr.open(src / "X"), ck)


# --- AutoTP affine maps ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def autotp() -> Path:
    pytest.importorskip("transformers")
    return P.build("autotp")


def test_autotp_affine_map_placed_as_deepspeed_rebuilds_it(autotp: Path, tmp_path: Path) -> None:
    """Right after AutoTP cut the model: every weight with an affine map, ``c_attn`` (query
    rows split 64/64, its 64 key/value rows on both ranks) included, equals DeepSpeed's own
    ``rebuild`` from the ranks' shards and the weight before the cut. (DeepSpeed's
    ``ds_to_universal`` fails on this checkpoint: it has no optimizer moments yet.)"""
    ck = _convert(autotp / "D0", tmp_path / "ck")
    original = torch.load(autotp / "original.pt", weights_only=True)
    rebuilt = torch.load(autotp / "rebuilt.pt", weights_only=True)
    name = "transformer.h.0.attn.c_attn.weight"
    assert ck.meta.tensors[f"model.{name}"].shape == (192, 128)
    assert len(rebuilt) >= 10 and name in rebuilt
    for key, want in rebuilt.items():
        assert torch.equal(want, original[key]), key
        assert torch.equal(ck.read(f"model.{key}"), want), key
    rules = ucp_zarr.Rules.from_dict(ck.meta.layout["rules"])
    assert rules.match(name)[0].kind == "pieces"
    assert "StopIteration" in (autotp / "universal_error.txt").read_text()


def test_autotp_replicas_that_differ_are_refused(autotp: Path, tmp_path: Path) -> None:
    """After 2 steps AutoTP's "replicated" key/value rows of ``c_attn`` differ between the TP
    ranks (each rank applied only its own query heads' gradient to them): DeepSpeed's own
    ``rebuild`` refuses the checkpoint, and so does the converter, naming the tensor and the
    rank, leaving nothing behind."""
    assert "hold different data for the same block" in (autotp / "rebuild_error.txt").read_text()
    with pytest.raises(ConversionError, match=r"c_attn\.weight.*: tensor-parallel rank 1 holds other values"):
        ucp_zarr.convert(autotp / "D2", tmp_path / "ck")
    assert not (tmp_path / "ck" / "zarr.json").exists()


def test_codegen_block_gather_map_from_deepspeeds_own_partition(autotp: Path) -> None:
    """CodeGen's fused QKV as AutoTP describes it (a block-gather map: each rank gathers equal
    blocks out of order) and cuts it (``prepare_tp_fused_qkvw``), at TP 2 and 4: placed by
    ``Rules.from_deepspeed`` + ``ucp_zarr.place``, the shards give back the original weight,
    which a plain split of the same shards does not."""
    data = torch.load(autotp / "codegen.pt", weights_only=True)
    weight = data["weight"]
    for tp, entry in data["maps"].items():
        info = {"universal_checkpoint_version": 0.4, "affine_map": {"version": 1, "params": {r"^qkv\.weight$": entry}}}
        rules = ucp_zarr.Rules.from_deepspeed(info)
        out = torch.full(weight.shape, float("nan"))
        for rank, shard in enumerate(data["shards"][tp]):
            placed = ucp_zarr.place({"qkv.weight": shard}, rules, tp_rank=rank, tp_size=tp)["qkv.weight"]
            for p in placed.pieces:
                out[p.dst.slices()] = shard[p.src.slices()]
        assert torch.equal(out, weight), tp
        assert not torch.equal(torch.cat(data["shards"][tp]), weight)


def test_pipeline_export_on_a_file_system_without_links(pipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's model-states file is a link to the first, or a copy where links fail."""
    def no_links(self: Path, target: Path) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(Path, "hardlink_to", no_links)
    ucp_zarr.export(pipe / "z1-fp32" / "CV", tmp_path / "u", to="ds-universal")
    folder = tmp_path / "u" / "global_step3_universal"
    first, second = (folder / f"mp_rank_0{s}_model_states.pt" for s in (0, 1))
    assert second.read_bytes() == first.read_bytes() and second.stat().st_nlink == 1
