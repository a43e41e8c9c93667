"""Bad input gets a clear error naming the key or file, and nothing committed is lost."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ucp_zarr


def test_not_jsonable_value_is_named(tmp_path):
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"optim\.param_groups\.0\.weird"):
        ucp_zarr.save({"optim": {"param_groups": [{"weird": object(), "lr": 1.0}]}}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.NotJSONableError, match="'dt'"):
        ucp_zarr.save({"dt": torch.float32}, tmp_path / "ck2")
    assert not (tmp_path / "ck").exists(), "nothing may be written before validation"
    # an integer of more digits than Python reads from JSON by default: refused naming its key,
    # whatever this process allows (before: a ValueError of json naming nothing)
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"'sched\.seed': an integer of more than 4300 digits"):
        ucp_zarr.save({"sched": {"seed": 7**6000}}, tmp_path / "ck3")
    ucp_zarr.save({"n": -(10**4299)}, tmp_path / "ck4")
    assert ucp_zarr.read_state_dict(tmp_path / "ck4")["n"] == -(10**4299)


def test_tensor_inside_a_json_value_is_named_with_the_way_out(tmp_path):
    """A tuple is one value (as in torch DCP), and so is what one PerRank wraps: a tensor in
    either was refused as 'of type Tensor is neither a tensor nor JSON-able'."""
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"'rng\.np\.1' is a tensor inside a value stored as JSON.*"
                                                        r"make the tuple a list, or wrap each tensor in a PerRank"):
        ucp_zarr.save({"rng": {"np": ("MT19937", torch.arange(3))}}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"'rng\.torch' is a tensor inside"):
        ucp_zarr.save({"w": torch.ones(2), "rng": ucp_zarr.PerRank({"torch": torch.ones(2), "seen": 3})}, tmp_path / "ck2")
    ucp_zarr.save({"rng": {"np": ["MT19937", torch.arange(3)]}}, tmp_path / "ck3")
    assert torch.equal(ucp_zarr.read_state_dict(tmp_path / "ck3")["rng"]["np"][1], torch.arange(3))
    # a 0-d tensor too (Adam's betas given as tensors, a PerRank's epoch): before, it was saved as a number and
    # loaded as a float, silently (Adam's next steps then differed from a resume through torch.load)
    betas = {"optim": {"param_groups": [{"lr": 0.1, "betas": (torch.tensor(0.9), torch.tensor(0.99))}]}}
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"'optim\.param_groups\.0\.betas\.0' is a tensor inside"):
        ucp_zarr.save(betas, tmp_path / "ck4")
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"'data\.epoch' is a tensor inside"):
        ucp_zarr.save({"data": ucp_zarr.PerRank({"epoch": torch.tensor(3)})}, tmp_path / "ck5")
    assert not (tmp_path / "ck4").exists() and not (tmp_path / "ck5").exists()
    betas["optim"]["param_groups"][0]["betas"] = list(betas["optim"]["param_groups"][0]["betas"])  # (the way out)
    ucp_zarr.save(betas, tmp_path / "ck6")
    assert ucp_zarr.read_state_dict(tmp_path / "ck6")["optim"]["param_groups"][0]["betas"][0].dtype == torch.float32


def test_incomplete_checkpoint_is_refused(tmp_path):
    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck")
    os.remove(tmp_path / "ck" / "zarr.json")
    with pytest.raises(ucp_zarr.IncompleteCheckpointError, match="commit record"):
        ucp_zarr.open(tmp_path / "ck")
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.load({"w": torch.zeros(3)}, tmp_path / "ck")


def test_crashed_save_leaves_invisible_checkpoint_and_can_be_redone(tmp_path, monkeypatch):
    from ucp_zarr.io import arrayio

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr("ucp_zarr.protocol.saver.write_shard", boom)
    with pytest.raises(OSError, match="disk on fire"):
        ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(tmp_path / "ck")
    monkeypatch.setattr("ucp_zarr.protocol.saver.write_shard", arrayio.write_shard)
    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck")  # replaces the failed attempt
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][:], torch.ones(3))


def test_committed_checkpoint_is_never_overwritten(tmp_path):
    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.CheckpointExistsError):
        ucp_zarr.save({"w": torch.zeros(3)}, tmp_path / "ck")
    assert torch.equal(ucp_zarr.open(tmp_path / "ck")["w"][:], torch.ones(3))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ucp_zarr.CheckpointExistsError, match="not empty"):
        ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_strict_load_lists_every_missing_and_unexpected_key(tmp_path):
    ucp_zarr.save({"a": torch.ones(2), "b": torch.ones(2), "n": 1}, tmp_path / "ck")
    with pytest.raises(ucp_zarr.KeyMismatchError) as e:
        ucp_zarr.load({"a": torch.zeros(2), "c": torch.zeros(2), "d": 5}, tmp_path / "ck")
    assert e.value.missing == ["c", "d"] and e.value.unexpected == ["b", "n"]
    assert "c, d" in str(e.value) and "b, n" in str(e.value)
    target = {"a": torch.zeros(2), "c": torch.zeros(2)}
    ucp_zarr.load(target, tmp_path / "ck", strict=False)
    assert torch.equal(target["a"], torch.ones(2)) and torch.equal(target["c"], torch.zeros(2))


def test_shape_mismatch_names_the_tensor(tmp_path):
    ucp_zarr.save({"layer.w": torch.ones(2, 3)}, tmp_path / "ck")
    with pytest.raises(ValueError, match=r"'layer\.w'.*\[2, 3\]"):
        ucp_zarr.load({"layer.w": torch.zeros(3, 2)}, tmp_path / "ck")


def test_corrupt_chunk_is_detected_and_named(tmp_path):
    ucp_zarr.save({"w": torch.arange(1000, dtype=torch.float32)}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    chunk = tmp_path / "ck" / ck.array_path("w") / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ucp_zarr.CorruptChunkError, match="'w'"):
        ucp_zarr.open(tmp_path / "ck")["w"][:]


def test_unknown_format_version_is_refused(tmp_path):
    ucp_zarr.save({"w": torch.ones(3)}, tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "zarr.json").read_text())
    doc["attributes"]["ucp_zarr"]["format_version"] = 99
    (tmp_path / "ck" / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ucp_zarr.FormatError, match="format_version 99"):
        ucp_zarr.open(tmp_path / "ck")


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        ucp_zarr.open(tmp_path / "nothing")


def test_reserved_names_and_tag_like_keys_round_trip(tmp_path):
    sd = {
        "model": {"zarr.json": torch.ones(2), ".ucp_zarr_pending": torch.zeros(2), "__x": torch.ones(1)},
        "meta": {"$float": "nan", "$bytes": "x", "plain": b"\x00\x01raw"},
    }
    ucp_zarr.save(sd, tmp_path / "ck")
    out = {
        "model": {"zarr.json": torch.zeros(2), ".ucp_zarr_pending": torch.ones(2), "__x": torch.zeros(1)},
        "meta": {"$float": None, "$bytes": None, "plain": None},
    }
    ucp_zarr.load(out, tmp_path / "ck")
    assert torch.equal(out["model"]["zarr.json"], torch.ones(2))
    assert torch.equal(out["model"][".ucp_zarr_pending"], torch.zeros(2))
    assert out["meta"] == {"$float": "nan", "$bytes": "x", "plain": b"\x00\x01raw"}
    names = {p.name for p in (tmp_path / "ck").iterdir()}
    assert names.isdisjoint({"zarr.json.d"}) and ".ucp_zarr_pending" not in names


def test_missing_shard_is_an_error_not_zeros(tmp_path):
    import shutil

    ucp_zarr.save({"w": torch.randn(64, 64)}, tmp_path / "ck", chunk_bytes=1024)
    ck = ucp_zarr.open(tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / ck.array_path("w") / "c")
    with pytest.raises(ucp_zarr.CorruptChunkError, match="missing"):
        ucp_zarr.open(tmp_path / "ck").verify()


def test_ranks_failing_with_a_bare_checkpoint_error_agree_on_a_save_error():
    """Every failing rank raised a plain CheckpointError (an async save's writer process
    killed): the agreed error was built as a class of bases (CheckpointError, SaveError),
    which Python cannot order, and every rank raised a TypeError about an MRO instead of the
    cause. Now a SaveError naming the ranks and their messages; other classes as before."""
    from ucp_zarr.errors import agreed_error

    e = agreed_error("saving x failed on 2 of 2 ranks", {0: ("CheckpointError", "writer killed"), 1: ("CheckpointError", "w")})
    assert type(e) is ucp_zarr.SaveError and "saving x failed" in str(e)
    assert e.failures == {0: "CheckpointError: writer killed", 1: "CheckpointError: w"}
    layout = agreed_error("m", {1: ("LayoutError", "bad")})
    assert isinstance(layout, ucp_zarr.LayoutError) and isinstance(layout, ucp_zarr.SaveError)
