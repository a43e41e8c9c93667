"""Reads are strict and verified: missing data is corruption, foreign metadata is refused,
shards are bound to their checkpoint, ``verify`` covers everything in bounded memory, and
authenticated checkpoints refuse any change.

Each test damages a real checkpoint the way the defect or the threat does, then checks
that ``open`` reads, ``load`` and ``verify`` (and the CLI) all notice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ucp_zarr
from ucp_zarr import errors
from ucp_zarr.cli import main as cli
from ucp_zarr.format.codec import CRC_BYTES, crc_bytes, trailer_nbytes
from ucp_zarr.format.integrity import RECORD_DIGEST, record_digest

KEY = b"0123456789abcdef-secret"


def _sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(64, 32, generator=g),  # a and b: same shape, same grid
        "b": torch.randn(64, 32, generator=g),
        "half": torch.randn(40, 8, generator=g).half(),
        "step": 12,
        "betas": (0.9, 0.999),
    }


def _save(path: Path, sd: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    sd = sd if sd is not None else _sd()
    ucp_zarr.save(sd, path, chunk_bytes=1024, **kw)
    return sd


def _shard(path: Path, key: str, index: str = "c/0/0") -> Path:
    return path / ucp_zarr.open(path).array_path(key) / index


def _root(path: Path) -> dict[str, Any]:
    return json.loads((path / "zarr.json").read_text())


def _rewrite_root(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the commit record's attributes as a consistent foreign writer would: its
    ``record_digest`` recomputed (a signature cannot be)."""
    doc = _root(path)
    attrs = doc["attributes"]["ucp_zarr"]
    edit(attrs)
    attrs[RECORD_DIGEST] = record_digest(attrs)
    (path / "zarr.json").write_text(json.dumps(doc))


def _all_fail(path: Path, error: type, match: str, key: str = "a", hmac_key: bytes | None = None) -> None:
    """``open`` reads, ``load`` and ``verify`` all refuse, with ``error`` matching ``match``."""
    with pytest.raises(error, match=match):
        ucp_zarr.open(path, hmac_key=hmac_key)[key][...]
    with pytest.raises(error, match=match):
        ucp_zarr.load(_zeros(), path, hmac_key=hmac_key)
    with pytest.raises(error, match=match):
        ucp_zarr.open(path, hmac_key=hmac_key).verify()


def _zeros() -> dict[str, Any]:
    return {"a": torch.zeros(64, 32), "b": torch.zeros(64, 32), "half": torch.zeros(40, 8).half(), "step": 0, "betas": (0, 0)}


# --- missing data and foreign metadata -----------------------------------------------------


def _index_entries(shard: Path, n: int) -> tuple[bytearray, int]:
    raw = bytearray(shard.read_bytes())
    return raw, len(raw) - (n * 16 + CRC_BYTES)


def test_a_chunk_marked_absent_is_corruption_not_zeros(tmp_path):
    """Regression: an index entry marked absent inside a present shard read as zeros and
    passed ``verify``."""
    path = tmp_path / "ck"
    _save(path)
    meta = ucp_zarr.open(path).array_meta("a")
    n = int(np.prod(meta.grid.chunks_per_shard))
    assert n > 1
    shard = _shard(path, "a")
    raw, at = _index_entries(shard, n)
    index = np.frombuffer(bytes(raw[at : at + n * 16]), dtype="<u8").copy().reshape(n, 2)
    index[1] = 2**64 - 1  # chunk 1: "absent", index crc recomputed so the index itself is valid
    raw[at : at + n * 16] = index.tobytes()
    raw[at + n * 16 :] = crc_bytes(index.tobytes())
    shard.write_bytes(bytes(raw))
    _all_fail(path, ucp_zarr.CorruptChunkError, "marked absent")


def _refresh_digest(path: Path, doc_path: str) -> None:
    """Make the commit record agree with an edited document (a consistent foreign writer)."""
    raw = (path / doc_path).read_bytes()
    _rewrite_root(path, lambda a: a["documents"].__setitem__(doc_path, "sha256:" + hashlib.sha256(raw).hexdigest()))


@pytest.mark.parametrize(
    "what, edit, match",
    [
        ("big-endian", lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(endian="big"), "codecs"),
        ("index at the start", lambda d: d["codecs"][0]["configuration"].update(index_location="start"), "codecs"),
        ("compressed", lambda d: d["codecs"][0]["configuration"]["codecs"].append({"name": "zstd", "configuration": {"level": 1, "checksum": False}}), "codecs"),
        ("unsharded", lambda d: d.update(codecs=[{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]), "sharding_indexed"),
        ("data type of another torch dtype", lambda d: d.update(data_type="int32"), "data_type"),
        ("fill value", lambda d: d.update(fill_value=1.0), "fill_value"),
        ("shape", lambda d: (d.update(shape=[65, 32]), d["attributes"]["ucp_zarr"].update(global_shape=[65, 32])), "the index says"),
    ],
)
def test_array_metadata_this_library_did_not_write_is_refused(tmp_path, what, edit, match):
    path = tmp_path / "ck"
    _save(path)
    doc_path = f"{ucp_zarr.open(path).array_path('a')}/zarr.json"
    doc = json.loads((path / doc_path).read_text())
    edit(doc)
    (path / doc_path).write_text(json.dumps(doc))
    # ucp_zarr reads the root's consolidated copy, checked against the digest, so the change
    # cannot mislead a load; verify checks the stored documents that generic readers use
    assert torch.equal(ucp_zarr.open(path)["a"][...], ucp_zarr.open(path)["a"].read())
    with pytest.raises(ucp_zarr.CorruptChunkError, match="changed or replaced"):
        ucp_zarr.open(path).verify()  # first line of defence: the document's digest
    _refresh_digest(path, doc_path)
    _all_fail(path, ucp_zarr.FormatError, match)


# --- shards bound to their checkpoint ------------------------------------------------------


def test_shards_swapped_between_same_shape_arrays_are_detected(tmp_path):
    """Regression: two same-shape arrays with their shard files swapped loaded without error."""
    path = tmp_path / "ck"
    _save(path)
    sa, sb = _shard(path, "a"), _shard(path, "b")
    da, db = sa.read_bytes(), sb.read_bytes()
    assert len(da) == len(db)
    sa.write_bytes(db)
    sb.write_bytes(da)
    _all_fail(path, ucp_zarr.CorruptChunkError, "another array")


def test_a_stale_object_of_an_earlier_save_is_detected(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _save(old, {**_sd(), "a": torch.zeros(64, 32)})
    _save(new)
    shutil.copy(_shard(old, "a"), _shard(new, "a"))  # same key, same size, earlier save
    _all_fail(new, ucp_zarr.CorruptChunkError, "written by another save")


def test_a_checkpoint_replaced_or_deleted_while_read_is_not_called_corrupt(tmp_path):
    """A reader opened before an overwrite commits (or a delete) finds objects of another save,
    or none: CheckpointReplacedError says so, and that nothing is corrupt (before:
    CorruptChunkError "written by another save", and users deleted good checkpoints); verify
    exits 2, not 1. An object corrupt in the checkpoint still open is corruption."""
    path = tmp_path / "ck"
    state = {"a": torch.randn(64, 32), "b": torch.randn(8)}
    ucp_zarr.save(state, path)
    for change in ("overwrite", "delete"):
        ck = ucp_zarr.open(path)
        if change == "overwrite":
            ucp_zarr.save({"a": torch.zeros(64, 32), "b": torch.zeros(8)}, path, overwrite=True)
        else:
            shutil.rmtree(path)
        what = "replaced" if change == "overwrite" else "deleted"
        with pytest.raises(ucp_zarr.CheckpointReplacedError, match=f"was {what} while it was being read.*nothing is corrupt"):
            ck["a"].read()
        with pytest.raises(ucp_zarr.CheckpointReplacedError):
            ck.verify()
        ucp_zarr.save(state, path, overwrite=True)
    ck = ucp_zarr.open(path)
    ucp_zarr.save({"a": torch.zeros(64, 32), "b": torch.zeros(8)}, path, overwrite=True)
    assert cli(["verify", str(path)]) == 0
    ck2 = ucp_zarr.open(path)
    ucp_zarr.save({"a": torch.ones(64, 32), "b": torch.ones(8)}, path, overwrite=True)
    with pytest.raises(ucp_zarr.CheckpointReplacedError):
        ck2.read_numpy("b")
    raw = bytearray(_shard(path, "a").read_bytes())
    raw[0] ^= 1
    _shard(path, "a").write_bytes(bytes(raw))
    ck3 = ucp_zarr.open(path)
    with pytest.raises(ucp_zarr.CorruptChunkError) as e:
        ck3["a"].read()
    assert not isinstance(e.value, ucp_zarr.CheckpointReplacedError)
    with open(path / "zarr.json", "a") as f:  # (the commit record damaged too: still corruption, not "deleted")
        f.write("garbage")
    with pytest.raises(ucp_zarr.CorruptChunkError) as e:
        ck3["a"].read()
    assert not isinstance(e.value, ucp_zarr.CheckpointReplacedError)
    del ck


def test_a_chunk_replaced_with_a_valid_crc_is_detected(tmp_path):
    """The chunk's own crc32c is fine, but it is not the chunk its shard recorded."""
    path = tmp_path / "ck"
    _save(path)
    shard = _shard(path, "a")
    raw = bytearray(shard.read_bytes())
    chunk = ucp_zarr.open(path).array_meta("a").grid.chunk_shape
    n = int(np.prod(chunk)) * 4
    raw[0:4] = b"\x00\x00\x80\x7f"  # first element: +inf
    raw[n : n + CRC_BYTES] = crc_bytes(bytes(raw[:n]))
    shard.write_bytes(bytes(raw))
    _all_fail(path, ucp_zarr.CorruptChunkError, "chunk was replaced")


def _drop_consolidated(path: Path) -> None:
    """The root without its consolidated metadata (as older checkpoints are): readers read
    each array's stored document."""
    doc = _root(path)
    del doc["consolidated_metadata"]
    (path / "zarr.json").write_text(json.dumps(doc))


def _only_verify_fails(path: Path, error: type, match: str) -> None:
    """Reads use the root's consolidated copy of the documents (checked against their
    digests), so they are right; ``verify`` finds the stored document a generic reader uses."""
    expected = _sd()
    assert torch.equal(ucp_zarr.open(path)["a"][...], expected["a"])
    assert torch.equal(ucp_zarr.load(_zeros(), path)["a"], expected["a"])
    with pytest.raises(error, match=match):
        ucp_zarr.open(path).verify()


def test_a_replaced_array_document_is_detected(tmp_path):
    path = tmp_path / "ck"
    _save(path)
    ck = ucp_zarr.open(path)
    src, dst = f"{ck.array_path('b')}/zarr.json", f"{ck.array_path('a')}/zarr.json"
    (path / dst).write_bytes((path / src).read_bytes())
    _only_verify_fails(path, ucp_zarr.CorruptChunkError, "changed or replaced")
    _drop_consolidated(path)
    _all_fail(path, ucp_zarr.CorruptChunkError, "changed or replaced")


def test_a_changed_consolidated_copy_is_not_trusted(tmp_path):
    path = tmp_path / "ck"
    _save(path)
    doc = _root(path)
    node = ucp_zarr.open(path).array_path("a")
    doc["consolidated_metadata"]["metadata"][node]["shape"] = [65, 32]
    (path / "zarr.json").write_text(json.dumps(doc))
    # the copy fails its digest, so the stored document is read instead
    assert torch.equal(ucp_zarr.open(path)["a"][...], _sd()["a"])
    # but generic readers of consolidated metadata (zarr.open_group, xarray) read the copy:
    # verify names it (before: verify passed, and zarr.open_group read another array)
    with pytest.raises(ucp_zarr.CorruptChunkError, match=rf"consolidated metadata of {node}/zarr.json differs"):
        ucp_zarr.open(path).verify()
    del doc["consolidated_metadata"]["metadata"][node]  # (none: generic readers read the document itself)
    other = doc["consolidated_metadata"]["metadata"][ucp_zarr.open(path).array_path("b")]
    doc["consolidated_metadata"]["metadata"]["a/extra"] = other  # (an array no document of the record is)
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ucp_zarr.CorruptChunkError, match="names 'a/extra', which is no document"):
        ucp_zarr.open(path).verify()


def test_missing_shard_and_missing_document(tmp_path):
    path = tmp_path / "ck"
    _save(path)
    _shard(path, "a").unlink()
    _all_fail(path, ucp_zarr.CorruptChunkError, "missing")
    path2 = tmp_path / "ck2"
    _save(path2)
    (path2 / ucp_zarr.open(path2).array_path("a") / "zarr.json").unlink()
    _only_verify_fails(path2, ucp_zarr.CorruptChunkError, "missing")
    _drop_consolidated(path2)
    _all_fail(path2, ucp_zarr.CorruptChunkError, "missing")


# --- verify ----------------------------------------------------------------------------------


def _save_per_rank(rank: int, world: int, path: str) -> None:
    ucp_zarr.save({"rng": ucp_zarr.PerRank(torch.arange(1000) + 1000 * rank), "w": torch.ones(4)}, path)


@pytest.fixture(scope="module")
def per_rank_ckpt(tmp_path_factory) -> Path:
    """A checkpoint of three ranks with per-rank state: one copy of ``rng`` per rank."""
    from _dist import run

    path = tmp_path_factory.mktemp("per_rank") / "ck"
    run(3, _save_per_rank, str(path))
    return path


def test_verify_checks_every_per_rank_copy(tmp_path, per_rank_ckpt):
    """Regression: verify read only the lowest rank's copy of per-rank state."""
    path = tmp_path / "ck"
    shutil.copytree(per_rank_ckpt, path)
    ck = ucp_zarr.open(path)
    entry = ck.meta.tensors["rng"]
    assert sorted(entry.ranks) == [0, 1, 2]
    assert ck.verify() > 0
    shard = path / entry.ranks[2].path / "c" / "0"
    raw = bytearray(shard.read_bytes())
    raw[3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ucp_zarr.CorruptChunkError, match="crc32c mismatch.*rng"):
        ucp_zarr.open(path).verify()
    assert torch.equal(ucp_zarr.open(path)["rng"][...], torch.arange(1000))  # rank 0's copy is fine


def test_verify_streams_in_bounded_memory(tmp_path):
    """``verify`` of a 256 MiB tensor holds one bounded buffer, not the tensor (measured as
    the growth of the process's peak RSS in a fresh interpreter)."""
    path = tmp_path / "big"
    ucp_zarr.save({"w": torch.ones(64, 1 << 20)}, path)  # 256 MiB
    code = """
import resource, sys, ucp_zarr
ck = ucp_zarr.open(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = ck.verify()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(n, (after - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True).stdout.split()
    checked, grew_mib = int(out[0]), int(out[1])
    assert checked == 256 << 20
    assert grew_mib < 64, f"verify grew the peak RSS by {grew_mib} MiB for a 256 MiB tensor"


# --- values, casts, the error hierarchy ----------------------------------------------------


def test_tuples_come_back_as_tuples_at_every_depth(tmp_path):
    """Regression: ``(1, (2, 3))`` came back as ``[1, [2, 3]]``."""
    value = {"t": (1, (2, 3)), "l": [1, [2, (3, [4])]], "e": (), "d": {"x": ((1.5, "s"), [None])}}
    ucp_zarr.save({"v": value, "w": torch.ones(2)}, tmp_path / "ck")
    out = {"v": {"t": None, "l": None, "e": None, "d": {"x": None}}, "w": torch.zeros(2)}
    ucp_zarr.load(out, tmp_path / "ck")
    assert out["v"] == value
    assert type(out["v"]["t"][1]) is tuple and type(out["v"]["l"][1]) is list and type(out["v"]["l"][1][1]) is tuple
    assert type(out["v"]["d"]["x"][0]) is tuple and type(out["v"]["d"]["x"][1]) is list


def test_lossless_casts_are_automatic_and_lossy_ones_need_an_opt_in(tmp_path):
    path = tmp_path / "ck"
    sd = _save(path)
    out = {**_zeros(), "half": torch.zeros(40, 8)}  # float16 -> float32: exact
    ucp_zarr.load(out, path)
    assert torch.equal(out["half"], sd["half"].float())
    lossy = {**_zeros(), "a": torch.zeros(64, 32, dtype=torch.bfloat16)}
    with pytest.raises(ucp_zarr.DtypeMismatchError, match="'a'.*torch.float32.*torch.bfloat16.*allow_lossy_cast"):
        ucp_zarr.load(lossy, path)
    assert not lossy["a"].any()  # refused before reading
    ucp_zarr.load(lossy, path, allow_lossy_cast=True)
    assert torch.equal(lossy["a"], sd["a"].bfloat16())
    with pytest.raises(ucp_zarr.DtypeMismatchError):
        ucp_zarr.open(path).read("a", out=torch.zeros(64, 32, dtype=torch.int64))
    with pytest.raises(ucp_zarr.ShapeMismatchError, match="'a'"):
        ucp_zarr.load({**_zeros(), "a": torch.zeros(64, 31)}, path)


def test_every_error_is_a_checkpoint_error_and_exported():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 14
    for cls in classes:
        assert issubclass(cls, ucp_zarr.CheckpointError), cls
        if not cls.__name__.startswith("Agreed"):
            assert getattr(ucp_zarr, cls.__name__) is cls, cls


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ucp_zarr.NotACheckpointError):
        ucp_zarr.open(tmp_path / "nothing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    with pytest.raises(ucp_zarr.IncompleteCheckpointError, match="no commit record"):
        ucp_zarr.open(tmp_path / "junk")


# --- authentication ----------------------------------------------------------------------------


def test_signed_checkpoint_loads_with_the_key(tmp_path):
    path = tmp_path / "ck"
    sd = _save(path, hmac_key=KEY)
    out = _zeros()
    ucp_zarr.load(out, path, hmac_key=KEY)
    assert torch.equal(out["a"], sd["a"]) and out["betas"] == (0.9, 0.999)
    ck = ucp_zarr.open(path, hmac_key=KEY)
    assert ck.meta.authenticated and ck.verify() > 0
    assert torch.equal(ucp_zarr.open(path)["a"][...], sd["a"])  # readers without the key still read


@pytest.mark.parametrize("where", ["chunk", "value", "document digest", "array digest"])
def test_any_change_to_a_signed_checkpoint_is_refused(tmp_path, where):
    path = tmp_path / "ck"
    _save(path, hmac_key=KEY)
    if where == "chunk":  # data changed, and the chunk crc32c AND the trailer crc forged
        shard = _shard(path, "a")
        raw = bytearray(shard.read_bytes())
        meta = ucp_zarr.open(path).array_meta("a")
        n_bytes = int(np.prod(meta.grid.chunk_shape)) * 4
        raw[0:4] = b"\x00\x00\x80\x7f"
        crc = crc_bytes(bytes(raw[:n_bytes]))
        raw[n_bytes : n_bytes + 4] = crc
        n = int(np.prod(meta.grid.chunks_per_shard))
        tail = trailer_nbytes(n, True) + n * 16 + 4
        crcs_at = len(raw) - tail + 48
        raw[crcs_at : crcs_at + 4] = crc
        shard.write_bytes(bytes(raw))
        match = "HMAC does not verify"
    elif where == "value":
        _rewrite_root(path, lambda a: a["values"].__setitem__("step", 13))
        match = "signature does not verify"
    elif where == "document digest":
        _rewrite_root(path, lambda a: a["documents"].__setitem__(next(iter(a["documents"])), "sha256:" + "0" * 64))
        match = "signature does not verify"
    else:
        _rewrite_root(path, lambda a: a["tensors"]["a"].__setitem__("digest", "sha256:" + "1" * 64))
        match = "signature does not verify"
    _all_fail(path, ucp_zarr.AuthenticationError, match, hmac_key=KEY)


def test_a_key_refuses_unsigned_checkpoints_and_other_keys(tmp_path):
    _save(tmp_path / "plain")
    with pytest.raises(ucp_zarr.AuthenticationError, match="not signed"):
        ucp_zarr.open(tmp_path / "plain", hmac_key=KEY)
    _save(tmp_path / "signed", hmac_key=KEY)
    with pytest.raises(ucp_zarr.AuthenticationError, match="does not verify"):
        ucp_zarr.load(_zeros(), tmp_path / "signed", hmac_key=b"another key")
    # stripping the signature does not help: a key demands one
    _rewrite_root(tmp_path / "signed", lambda a: a.pop("signature"))
    with pytest.raises(ucp_zarr.AuthenticationError, match="not signed"):
        ucp_zarr.open(tmp_path / "signed", hmac_key=KEY)


def test_cli_verify_with_a_key_file(tmp_path, capsys):
    path = tmp_path / "ck"
    _save(path, hmac_key=KEY)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    assert cli(["verify", str(path), "--key-file", str(key_file)]) == 0
    assert "signature verified" in capsys.readouterr().out
    _rewrite_root(path, lambda a: a["values"].__setitem__("step", 13))
    assert cli(["verify", str(path), "--key-file", str(key_file)]) == 1  # (damage: 1, as for any other)
    assert "signature does not verify" in capsys.readouterr().err
    shard = _shard(tmp_path / "ck", "b")
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 1
    shard.write_bytes(bytes(raw))
    assert cli(["verify", str(path)]) == 1  # without the key: the crc32c catches it
    assert "FAILED" in capsys.readouterr().err


# --- shards of column-block chunks, read whole ----------------------------------------------


def _column_blocks() -> dict[str, torch.Tensor]:
    """Tensors whose default chunks are blocks of columns (none lands in a row-major target
    directly): a shard read whole is checked chunk by chunk and copied in one strided pass."""
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(256, 1024, generator=g),
        "bf": torch.randn(256, 2048, generator=g).bfloat16(),
        "f64": torch.randn(256, 1024, generator=g).double(),  # stored chunks of 8-byte values at 4-byte offsets
        "t3": torch.randn(8, 64, 512, generator=g),
        "big": torch.randn(2048, 4096, generator=g),  # a shard above MAX_STAGED_BYTES: index first, then bands
    }


def test_column_block_chunks_read_whole_land_bit_exact(tmp_path):
    sd = _column_blocks()
    ucp_zarr.save(sd, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    for key, t in sd.items():
        grid = ck.array_meta(key).grid
        assert grid.chunk_shape[1:] != grid.shard_shape[1:], (key, grid)  # (what this test is about)
    contiguous = {k: torch.full_like(v, -1) for k, v in sd.items()}
    transposed = {k: torch.full(v.shape[::-1], -1, dtype=v.dtype).permute(*reversed(range(v.ndim))) for k, v in sd.items()}
    for target in (contiguous, transposed):
        ucp_zarr.load(target, tmp_path / "ck")
        for k, v in sd.items():
            assert torch.equal(target[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("key, row", [("w", 3), ("big", 37)])
@pytest.mark.parametrize("damage", ["flipped byte", "replaced with a valid crc"])
def test_each_column_block_chunk_of_a_shard_read_whole_is_checked(tmp_path, damage, key, row):
    sd = _column_blocks()
    ucp_zarr.save(sd, tmp_path / "ck")
    grid = ucp_zarr.open(tmp_path / "ck").array_meta(key).grid
    shard = _shard(tmp_path / "ck", key)
    raw = bytearray(shard.read_bytes())
    n = int(np.prod(grid.chunk_shape)) * 4
    # (row: a chunk of the shard, in C order of its chunk grid)
    at = row * (n + CRC_BYTES)
    raw[at + 100] ^= 1
    if damage == "replaced with a valid crc":
        raw[at + n : at + n + CRC_BYTES] = crc_bytes(bytes(raw[at : at + n]))
    shard.write_bytes(bytes(raw))
    local = np.unravel_index(row, grid.chunks_per_shard)
    origin = tuple(int(i) * c for i, c in zip(local, grid.chunk_shape))
    match = rf"chunk at \({origin[0]}, {origin[1]}\).*" + ("the data is corrupt" if damage == "flipped byte" else "chunk was replaced")
    with pytest.raises(ucp_zarr.CorruptChunkError, match=match):
        ucp_zarr.load({k: torch.zeros_like(v) for k, v in sd.items()}, tmp_path / "ck")


@pytest.mark.parametrize("change", [(b'"step":100', b'"step":900'), (b'"opt.lr":0.5', b'"opt.lr":0.7'),
                                    (b'"library":"ucp_zarr', b'"library":"ucp_zarz')])
def test_a_changed_record_is_refused_by_its_digest(tmp_path, change) -> None:
    """One flipped bit in an unsigned commit record (a value, an entry) is refused by every
    reader and makes ``verify`` exit 1 (before: ``verify`` passed and a load gave step 900)."""
    ck = tmp_path / "ck"
    ucp_zarr.save({"w": torch.ones(3), "step": 100, "opt": {"lr": 0.5}}, ck)
    raw = (ck / "zarr.json").read_bytes()
    assert raw.count(change[0]) == 1
    (ck / "zarr.json").write_bytes(raw.replace(*change))
    with pytest.raises(ucp_zarr.FormatError, match="record_digest"):
        ucp_zarr.read_state_dict(ck)
    with pytest.raises(ucp_zarr.FormatError, match="record_digest"):
        ucp_zarr.load({"w": torch.empty(3), "step": 0, "opt": {"lr": 0.0}}, ck)
    r = subprocess.run([sys.executable, "-m", "ucp_zarr.cli", "verify", str(ck)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "verify FAILED" in r.stderr and "record_digest" in r.stderr
    (ck / "zarr.json").write_bytes(raw)
    assert ucp_zarr.read_state_dict(ck)["step"] == 100


@pytest.mark.parametrize("value_changed", [False, True])
def test_a_record_whose_digest_lost_its_name_is_refused(tmp_path, value_changed) -> None:
    """A flipped bit in the member name ``record_digest`` (``secord_digest``) left the record
    as unchecked as one of an older version: a second flip then changed step 100 to 900
    unnoticed. A record with a member this reader does not know carries a digest, so it is refused."""
    ck = tmp_path / "ck"
    ucp_zarr.save({"w": torch.ones(3), "step": 100}, ck)
    raw = (ck / "zarr.json").read_bytes()
    assert raw.count(b'"record_digest"') == 1
    raw = raw.replace(b'"record_digest"', b'"secord_digest"')
    (ck / "zarr.json").write_bytes(raw.replace(b'"step":100', b'"step":900') if value_changed else raw)
    for read in (lambda: ucp_zarr.read_state_dict(ck), lambda: ucp_zarr.load({"w": torch.empty(3), "step": 0}, ck)):
        with pytest.raises(ucp_zarr.FormatError, match="no record_digest but members.*'secord_digest'"):
            read()


def test_the_record_members_are_the_schemas() -> None:
    """The members a reader knows (the rest need a record_digest) are the schema's."""
    from ucp_zarr.format.commit_record import RECORD_MEMBERS

    schema = json.loads((Path(__file__).parents[1] / "schema" / "checkpoint.schema.json").read_text())
    assert set(schema["$defs"]["ucpAttributes"]["properties"]) == RECORD_MEMBERS


def test_a_manager_skips_a_step_whose_record_was_changed(tmp_path) -> None:
    """A step whose commit record fails its digest is an unreadable step, like any other
    malformed record: ``latest`` gives the step before, ``list_steps`` says so, and a save
    over it goes on (its objects are left in place)."""
    from ucp_zarr import CheckpointManager
    from ucp_zarr.ops.steps import list_steps, step_name

    m = CheckpointManager(tmp_path)
    for step in (1, 2):
        m.save(step, {"w": torch.full((3,), float(step)), "step": step})
    root = tmp_path / step_name(2) / "zarr.json"
    root.write_bytes(root.read_bytes().replace(b'"step":2', b'"step":3'))
    assert m.latest() == 1
    assert [(s.step, s.state) for s in list_steps(tmp_path)] == [(1, "committed"), (2, "unreadable")]
    m.save(2, {"w": torch.full((3,), 2.0), "step": 2}, overwrite=True)
    assert m.latest() == 2 and ucp_zarr.read_state_dict(tmp_path / step_name(2))["step"] == 2
    m.close()
