"""Tied tensors (issue 19 section 3): one tensor under several keys is stored once, under its
first key, and every other key is recorded as an alias of it in the commit record (``ties``),
so that every name reads the one array: ``ck[alias]``, its optimizer state (DeepSpeed's
``shared_params``: the fp32 master ``zero_to_fp32`` gives for the alias), a load into a state
dict holding both keys (tied: filled once; untied: both filled), ``read_state_dict``, DCP.
Sources: a module with shared parameters (its ``state_dict()`` gives two keys of one memory),
DeepSpeed's ``shared_params``, a rules ``rename``. Views of one storage that are different
tensors stay separate, and ranks that disagree about a tie are refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _dist import run
from _states import record_text

import ucp_zarr
from ucp_zarr.protocol.reader import CheckpointReader


class TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight


def _trained() -> tuple[TiedLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.named_parameters())
    model.head(model.ln(model.emb(torch.arange(11)))).square().sum().backward()
    opt.step()
    return model, opt


def _arrays(path: Path) -> list[str]:
    """The array documents of a checkpoint, as stored."""
    return sorted(str(p.parent.relative_to(path)) for p in path.rglob("zarr.json") if p.parent != path
                  and json.loads(p.read_text())["node_type"] == "array")


def test_a_tied_module_is_stored_once_and_read_under_both_names(tmp_path: Path) -> None:
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.ties == {"model.head.weight": "model.emb.weight"}
    assert "model.head.weight" not in ck.keys() and "model.head.weight" in ck
    assert [a for a in _arrays(tmp_path / "ck") if a.endswith("/model")] == ["emb.weight/model", "ln.bias/model",
                                                                              "ln.weight/model"]
    assert ck.nbytes() == sum(t.numel() * 4 for t in (model.emb.weight, model.ln.weight, model.ln.bias)) * 3 + 3 * 4
    assert torch.equal(ck["model.head.weight"][2:5], model.head.weight.detach()[2:5])
    assert torch.equal(ck.read("model.head.weight"), model.emb.weight.detach())
    assert ck["model.head.weight"].shape == (11, 6)
    ck.verify()


def test_a_load_fills_tied_memory_once_and_untied_targets_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict()}, tmp_path / "ck")
    filled: list[str] = []
    prepare = CheckpointReader.prepare_read  # (every read into a target: read calls it too)

    def counting(self: CheckpointReader, key: str, box: object = None, out: object = None, *args: object, **kw: object) -> object:
        if out is not None:
            filled.append(key)
        return prepare(self, key, box, out, *args, **kw)

    monkeypatch.setattr(CheckpointReader, "prepare_read", counting)
    fresh = TiedLM()
    ucp_zarr.load({"model": fresh.state_dict()}, tmp_path / "ck")  # strict: both keys are the checkpoint's
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)
    assert sorted(filled) == ["model.emb.weight", "model.ln.bias", "model.ln.weight"]  # the tied memory once
    filled.clear()
    untied = {"emb.weight": torch.zeros(11, 6), "head.weight": torch.zeros(11, 6), "ln.weight": torch.zeros(6),
              "ln.bias": torch.zeros(6)}
    ucp_zarr.load({"model": untied}, tmp_path / "ck")
    assert torch.equal(untied["head.weight"], model.emb.weight.detach()) and torch.equal(untied["emb.weight"], untied["head.weight"])
    assert sorted(filled) == ["model.emb.weight", "model.emb.weight", "model.ln.bias", "model.ln.weight"]
    # a state dict without the alias: not a missing key of the checkpoint (the alias is a name, not a tensor)
    alone = {k: v for k, v in TiedLM().state_dict().items() if k != "head.weight"}
    ucp_zarr.load({"model": alone}, tmp_path / "ck")
    assert torch.equal(alone["emb.weight"], model.emb.weight.detach())


def test_read_state_dict_gives_one_tensor_under_both_names(tmp_path: Path) -> None:
    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    state = ucp_zarr.read_state_dict(tmp_path / "ck")
    assert list(state["model"]) == list(model.state_dict())
    assert state["model"]["head.weight"] is state["model"]["emb.weight"]
    fresh = TiedLM()
    fresh.load_state_dict(state["model"])  # strict, as torch.load's dict would load
    assert torch.equal(fresh.head.weight, model.head.weight)
    assert list(ucp_zarr.read_state_dict(tmp_path / "ck", keys=["model.head.weight"])["model"]) == ["head.weight"]


def test_views_of_one_storage_that_are_other_tensors_stay_separate(tmp_path: Path) -> None:
    w = torch.randn(4, 6)
    c = torch.randn(5, dtype=torch.complex64)
    empty = torch.empty(0)
    state = {
        "w": w, "rows": w[1:3], "t": w.t(), "flat": w.view(-1), "bits": w.view(torch.int32), "again": w.detach(),
        "c": c, "conj": c.conj(), "neg": c._neg_view(),
        "e1": empty, "e2": torch.empty(0), "e3": empty,
    }
    ucp_zarr.save(state, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.ties == {"again": "w", "e3": "e1"}
    for key, value in state.items():
        assert torch.equal(ck.read(key), value.resolve_conj().resolve_neg()), key


def test_deepspeed_shared_params_alias_reads_the_master(tmp_path: Path) -> None:
    """ZeRO-3 bf16 with a tied head: the alias's fp32 master is what zero_to_fp32 gives for
    it, its module weight the bf16 one; the head is stored once."""
    import ds_checkpoints as D

    src = D.checkpoint(3, "bf16")
    ucp_zarr.convert(src, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.ties["model.head.weight"] == "model.embed.weight"
    assert ck.ties["optim.state.head.weight.fp32"] == "optim.state.embed.weight.fp32"
    assert not any(k.startswith(("model.head.", "optim.state.head.")) for k in ck.keys())
    master = D.zero_to_fp32(src)["head.weight"]
    assert torch.equal(ck.read("optim.state.head.weight.fp32"), master)
    assert ck["model.head.weight"].dtype == torch.bfloat16
    assert torch.equal(ck.read("model.head.weight"), D.reference(src)["lp"]["embed.weight"])


def test_rules_rename_is_a_tie(tmp_path: Path) -> None:
    rules = ucp_zarr.Rules.from_dict({
        "params": [{"kind": "split", "patterns": [r"(emb|out)\.weight"]}, {"kind": "replicated", "patterns": [r"ln\."]}],
        "rename": [{"pattern": r"out\.weight", "to": "emb.weight"}]})
    emb, ln = torch.randn(8, 3), torch.randn(3)
    states = [{"model": {"emb.weight": emb[r * 4:(r + 1) * 4], "out.weight": emb[r * 4:(r + 1) * 4].clone(), "ln.w": ln}}
              for r in range(2)]
    placed = [ucp_zarr.place(s, rules, tp_rank=r, tp_size=2) for r, s in enumerate(states)]
    assert placed[0]["model"]["out.weight"].key == "model.emb.weight"
    # (one process stands for TP=2: each rank's half is saved by its own placement)
    ucp_zarr.save(ucp_zarr.place({"model": {"emb.weight": emb, "out.weight": emb.clone(), "ln.w": ln}}, rules), tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.ties == {"model.out.weight": "model.emb.weight"} and sorted(ck.keys()) == ["model.emb.weight", "model.ln.w"]
    assert torch.equal(ck.read("model.out.weight"), emb)


def test_exports_write_a_tie_once_and_imports_restore_it(tmp_path: Path) -> None:
    from safetensors import safe_open

    model, opt = _trained()
    ucp_zarr.save({"model": model.state_dict()}, tmp_path / "ck")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "m.safetensors", to="safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["model.emb.weight", "model.ln.bias", "model.ln.weight"]
    ucp_zarr.convert(tmp_path / "m.safetensors", tmp_path / "back")
    assert ucp_zarr.open(tmp_path / "back").ties == {"model.head.weight": "model.emb.weight"}
    # DCP: the data once, both names described
    import torch.distributed.checkpoint as dcp

    ucp_zarr.export(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    fresh = {"model": TiedLM().state_dict()}
    dcp.load(fresh, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(fresh["model"]["head.weight"], model.emb.weight.detach())
    fresh = {"model": TiedLM().state_dict()}
    dcp.load(fresh, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"), no_dist=True)  # (and DCP reads it)
    assert torch.equal(fresh["model"]["head.weight"], model.emb.weight.detach())


def test_the_commit_record_of_ties_is_checked(tmp_path: Path) -> None:
    model, _ = _trained()
    ucp_zarr.save({"model": model.state_dict()}, tmp_path / "ck")
    root = tmp_path / "ck" / "zarr.json"
    doc = json.loads(root.read_text())
    assert doc["attributes"]["ucp_zarr"]["ties"] == {"format": "ucp_zarr.ties/1",
                                                      "aliases": {"model.head.weight": "model.emb.weight"}}
    for bad, message in (
        ({"format": "ucp_zarr.ties/2", "aliases": {}}, "not a ucp_zarr.ties/1 object"),
        ({"format": "ucp_zarr.ties/1", "aliases": {"model.head.weight": "model.nothing"}}, "must be no tensor"),
        ({"format": "ucp_zarr.ties/1", "aliases": {"model.ln.weight": "model.emb.weight"}}, "must be no tensor"),
    ):
        doc["attributes"]["ucp_zarr"]["ties"] = bad
        root.write_text(record_text(doc))
        with pytest.raises(ucp_zarr.FormatError, match=message):
            ucp_zarr.open(tmp_path / "ck")
    del doc["attributes"]["ucp_zarr"]["ties"]  # a checkpoint without ties (older ones): the alias is no name
    del doc["attributes"]["ucp_zarr"]["structure"]["paths"]["model.head.weight"]
    root.write_text(record_text(doc))
    assert ucp_zarr.open(tmp_path / "ck").ties == {} and "model.head.weight" not in ucp_zarr.open(tmp_path / "ck")


def _distributed(rank: int, world: int, base: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(4.0).reshape(1, 4)  # one row: rank 1 holds nothing of it
    dt = distribute_tensor(w, mesh, [Shard(0)])
    flat = ucp_zarr.FlatShard(torch.arange(3.0) + 3 * rank, (2, 3), 3 * rank)
    ucp_zarr.save({"emb": dt, "head": dt.detach(), "f": flat, "g": flat}, f"{base}/ck")
    ck = ucp_zarr.open(f"{base}/ck")
    assert ck.ties == {"head": "emb", "g": "f"} and sorted(ck.keys()) == ["emb", "f"]
    assert torch.equal(ck.read("head"), w) and torch.equal(ck.read("g"), torch.arange(6.0).reshape(2, 3))
    plain = torch.ones(3)
    with pytest.raises(ucp_zarr.LayoutError, match="share memory .* on some ranks but not on rank 1"):
        ucp_zarr.save({"a": plain, "b": plain if rank == 0 else plain.clone()}, f"{base}/bad")
    assert not os.path.exists(f"{base}/bad/zarr.json")


def test_ties_across_ranks(tmp_path: Path) -> None:
    run(2, _distributed, str(tmp_path))
