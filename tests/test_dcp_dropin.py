"""ZarrStorageWriter / ZarrStorageReader as drop-ins for DCP's FileSystemWriter / FileSystemReader.

Code written for DCP's own plug-ins must work unchanged with ours:

* saving again to one ``checkpoint_id`` overwrites (crash-safely: old or new, never a mix);
* a checkpoint may share its directory with other files, which no save touches;
* DCP's ``planner_data`` comes back, so ``dcp_to_torch_save``, ``torch_save_to_dcp`` and
  ``_load_state_dict_from_keys`` give the nested structure, as with DCP's own plug-ins (the
  format_utils functions hard-code DCP's plug-ins: they are run with ours patched in);
* ``io.BytesIO`` values round-trip as BytesIO, stored as bytes (never pickled).
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import run
from _faulty import MUTATING, Crash, FaultyStore, Log
from torch.distributed.checkpoint import DefaultSavePlanner, format_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from _states import record_text

import ucp_zarr
import ucp_zarr.adapters.dcp as dcp_adapter
from ucp_zarr.protocol import liveness
from ucp_zarr.io.local import LocalStore
from ucp_zarr.protocol.liveness import Liveness, host_identity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    """Same nested structure (container types included), tensors bit for bit, BytesIO by content."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert _bits_equal(got, want), where
    elif isinstance(want, io.BytesIO):
        assert got.getvalue() == want.getvalue(), where
    elif isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, (where, got, want)


def _nested_state(seed: int) -> dict:
    """A nested state dict as trainers hand DCP: modules, a list of layers (one a dict),
    optimizer param groups, plain values and a bf16 tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "emb.weight": torch.randn(20, 8, generator=g),
            "layers": [torch.randn(8, 8, generator=g), {"w": torch.randn(8, generator=g).to(torch.bfloat16)}],
        },
        "optim": {"param_groups": [{"lr": 0.01 * (seed + 1), "betas": (0.9, 0.95), "params": [0, 1]}]},
        "step": 100 + seed,
        "tag": f"run-{seed}",
    }


def _assert_valid_root(doc: dict) -> None:
    """The commit record against schema/checkpoint.schema.json (layout.dcp included)."""
    import jsonschema

    schema = json.loads((Path(__file__).resolve().parent.parent / "schema" / "checkpoint.schema.json").read_text())
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    assert not errors, errors
    dcp_layout = doc["attributes"]["ucp_zarr"]["layout"]["dcp"]
    bad = copy.deepcopy(doc)
    bad["attributes"]["ucp_zarr"]["layout"]["dcp"] = {**dcp_layout, "planner_data": {"a": ["a", -1]}}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))  # the schema can fail


def _template(sd: Any) -> Any:
    """``sd`` with zeroed tensors and other placeholders of the same types, to load into."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, io.BytesIO):
        return io.BytesIO(b"placeholder")
    if isinstance(sd, dict):
        return {k: _template(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_template(v) for v in sd]
    return sd


OTHER_FILES = {
    "config.json": b'{"hidden_size": 8}',
    "model.pt": b"PK\x03\x04 a torch.save file",
    "tokenizer/vocab.json": b'{"a": 0}',
    "notes/2024/run.txt": b"lr sweep",
    ".hidden": b"x",
}


def _put_other_files(root: Path) -> dict[str, tuple[bytes, int, int]]:
    for name, data in OTHER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return _snapshot(root, OTHER_FILES)


def _snapshot(root: Path, names) -> dict[str, tuple[bytes, int, int]]:
    """Content, inode and modification time of each file: untouched means all three equal."""
    return {n: ((root / n).read_bytes(), (root / n).stat().st_ino, (root / n).stat().st_mtime_ns) for n in names}


def _checkpoint_files_only_of_its_index(root: Path, other: set[str]) -> None:
    """Besides ``other``, the directory holds exactly the committed checkpoint's objects: the
    root, the documents it lists and shards of the arrays it indexes (no leftover of an
    older checkpoint or of the save protocol)."""
    meta = ucp_zarr.open(root).meta
    paths = {t.path for t in meta.tensors.values()} | {a.path for t in meta.tensors.values() for a in (t.ranks or {}).values()}
    for p in root.rglob("*"):
        key = p.relative_to(root).as_posix()
        if p.is_dir() or key in other:
            continue
        if key == "zarr.json" or key in meta.documents:
            continue
        array, _, rest = key.rpartition("/c")
        assert array in paths and (rest == "" or rest.startswith("/")), key


# --- 1. saving again to one checkpoint_id -------------------------------------------------------


def test_saving_twice_to_one_checkpoint_id_with_default_args_overwrites(tmp_path):
    path = tmp_path / "ck"
    first, second = _nested_state(0), _nested_state(1)
    dcp.save(first, storage_writer=ucp_zarr.ZarrStorageWriter(path))
    writer = ucp_zarr.ZarrStorageWriter("elsewhere")
    dcp.save(second, checkpoint_id=path, storage_writer=writer)  # as with FileSystemWriter: no error
    out = _template(second)
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(path))
    _assert_same(out, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the staging copy is gone
    # the same writer object again (DCP does not reset it without a checkpoint_id)
    dcp.save(first, storage_writer=writer)
    out = _template(first)
    dcp.load(out, checkpoint_id=path, storage_reader=ucp_zarr.ZarrStorageReader(path))
    _assert_same(out, first)

    with pytest.raises(CheckpointException) as info:
        dcp.save(second, storage_writer=ucp_zarr.ZarrStorageWriter(path, overwrite=False))
    assert isinstance(info.value.failures[0][0], ucp_zarr.CheckpointExistsError)
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(path))
    _assert_same(out, first)


# --- 2. other files in the directory -----------------------------------------------------------


def test_other_files_survive_save_overwrite_and_refusal(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    before = _put_other_files(path)
    # a checkpoint DCP's own writer left here too (switching writers in place)
    dcp.save({"w": torch.arange(3.0)}, storage_writer=dcp.FileSystemWriter(path))
    dcp_files = sorted(p.name for p in path.iterdir() if p.name == ".metadata" or p.suffix == ".distcp")
    assert dcp_files
    before.update(_snapshot(path, dcp_files))

    old = {"a": torch.randn(30, 5), "gone": torch.randn(7), "v": {"x": 1}}
    dcp.save(old, storage_writer=ucp_zarr.ZarrStorageWriter(path, chunk_bytes=256, shard_bytes=512))
    assert _snapshot(path, before) == before
    _checkpoint_files_only_of_its_index(path, set(before))

    new = {"a": torch.randn(30, 5), "b": torch.ones(4, dtype=torch.int64), "v": {"x": 2}}
    dcp.save(new, storage_writer=ucp_zarr.ZarrStorageWriter(path, chunk_bytes=256, shard_bytes=512))
    assert _snapshot(path, before) == before
    _checkpoint_files_only_of_its_index(path, set(before))  # "gone" and old shards were removed
    out = _template(new)
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(path))
    _assert_same(out, new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    with pytest.raises(CheckpointException):
        dcp.save(old, storage_writer=ucp_zarr.ZarrStorageWriter(path, overwrite=False))
    assert _snapshot(path, before) == before
    # DCP's own reader still reads its checkpoint beside ours
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(got["w"], torch.arange(3.0))


class _FailingStore(FaultyStore):
    """Fails (an ordinary error, cleaned up after) the first write of a shard."""

    def write(self, key: str, buffers: Any, guard: Any = None) -> int:
        if "/c" in key:
            raise OSError(28, "No space left on device")
        return super().write(key, buffers, guard)

    def sibling(self, name: str) -> "_FailingStore":  # (an overwrite writes into a staging sibling)
        return _FailingStore(self.inner.sibling(name), self.log)


def test_failed_overwrite_leaves_the_old_checkpoint_and_other_files(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    path.mkdir()
    before = _put_other_files(path)
    old, new = _nested_state(0), _nested_state(1)
    dcp.save(old, storage_writer=ucp_zarr.ZarrStorageWriter(path))
    with monkeypatch.context() as m:
        m.setattr(dcp_adapter, "open_store", lambda p, o=None: _FailingStore(LocalStore(os.fspath(p))))
        with pytest.raises(CheckpointException, match="No space left"):
            dcp.save(new, storage_writer=ucp_zarr.ZarrStorageWriter(path))
    assert _snapshot(path, before) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the failed staging copy is gone
    _assert_same(_load_state_dict_from_keys(checkpoint_id=path, storage_reader=ucp_zarr.ZarrStorageReader(path)), old)
    # the path is free for the next save
    dcp.save(new, storage_writer=ucp_zarr.ZarrStorageWriter(path))
    _assert_same(_load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path)), new)
    assert _snapshot(path, before) == before


class _DyingStore(FaultyStore):
    """Crashes at the chosen mutating operation and stays dead: every later mutation fails
    too, so no clean-up runs (as when the process is killed there)."""

    def _op(self, name: str, key: str = "") -> None:
        if name in MUTATING and getattr(self.log, "dead", False):
            raise Crash(f"dead: {name} {key}")
        try:
            super()._op(name, key)
        except Crash:
            self.log.dead = True  # type: ignore[attr-defined]
            raise

    def sibling(self, name: str) -> "_DyingStore":
        return _DyingStore(self.inner.sibling(name), self.log)


def test_overwrite_interrupted_at_every_operation_leaves_old_or_new_and_other_files(tmp_path, monkeypatch):
    """A crash at every storage operation of an overwrite through the writer: a reader finds
    the old or the new checkpoint, complete, the other files are untouched, and the next
    save (once the crashed one counts as dead) completes, still beside them."""
    old = {"a": torch.randn(12, 4), "gone": torch.arange(6), "v": {"x": 1}}
    new = {"a": torch.randn(12, 4), "b": torch.ones(3), "v": {"x": 2}}
    third = {"c": torch.full((5,), 3.0)}
    small = dict(chunk_bytes=64, shard_bytes=128)

    def overwrite(path: Path, log: Log) -> None:
        with monkeypatch.context() as m:
            m.setattr(dcp_adapter, "open_store", lambda p, o=None: _DyingStore(LocalStore(os.fspath(p)), log))
            dcp.save(new, storage_writer=ucp_zarr.ZarrStorageWriter(path, **small))

    counted = Log()
    (tmp_path / "count").mkdir()
    dcp.save(old, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "count" / "ck", **small))
    overwrite(tmp_path / "count" / "ck", counted)
    total = counted.mutations
    assert total > 15

    seen = {"old": 0, "new": 0}
    dead_everywhere = Liveness(host_identity(), alive=lambda pid, start: False)
    for k in range(total):
        path = tmp_path / f"k{k}" / "ck"
        path.mkdir(parents=True)
        before = _put_other_files(path)
        dcp.save(old, storage_writer=ucp_zarr.ZarrStorageWriter(path, **small))
        with pytest.raises(CheckpointException, match="crash at|dead:"):
            overwrite(path, Log(crash_at=k))
        assert _snapshot(path, before) == before, k
        got = _load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path))
        which = "new" if "b" in got else "old"
        _assert_same(got, new if which == "new" else old, f"k={k}")
        seen[which] += 1
        # the next save onto the path, once the crashed one is known dead
        with monkeypatch.context() as m:
            m.setattr(liveness.Liveness, "here", lambda: dead_everywhere)
            dcp.save(third, storage_writer=ucp_zarr.ZarrStorageWriter(path, **small))
        _assert_same(_load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path)), third)
        assert _snapshot(path, before) == before, k
        _checkpoint_files_only_of_its_index(path, set(before))
    assert seen["old"] > 0 and seen["new"] > 0  # crashes hit both sides of the switch


def test_first_save_interrupted_at_every_operation_then_taken_over_beside_other_files(tmp_path, monkeypatch):
    """A crash at every storage operation of the first save into a directory of other files:
    nothing reads as a checkpoint, the files are untouched, and the next save takes over the
    dead save's leftovers (deleting only those) and commits beside them."""
    sd = {"a": torch.randn(12, 4), "v": {"x": 1}}
    small = dict(chunk_bytes=64, shard_bytes=128)

    def save(path: Path, log: Log) -> None:
        with monkeypatch.context() as m:
            m.setattr(dcp_adapter, "open_store", lambda p, o=None: _DyingStore(LocalStore(os.fspath(p)), log))
            dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(path, **small))

    counted = Log()
    save(tmp_path / "count", counted)
    total = counted.mutations
    assert total > 8
    dead_everywhere = Liveness(host_identity(), alive=lambda pid, start: False)
    committed = 0
    for k in range(total):
        path = tmp_path / f"k{k}"
        path.mkdir()
        before = _put_other_files(path)
        with pytest.raises(CheckpointException, match="crash at|dead:"):
            save(path, Log(crash_at=k))
        assert _snapshot(path, before) == before, k
        if (path / "zarr.json").exists():  # crashed after its commit: complete
            committed += 1
            _assert_same(_load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path)), sd)
        else:
            with pytest.raises(ucp_zarr.IncompleteCheckpointError):
                ucp_zarr.ZarrStorageReader(path).read_metadata()
        with monkeypatch.context() as m:
            m.setattr(liveness.Liveness, "here", lambda: dead_everywhere)
            dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(path, **small))
        _assert_same(_load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path)), sd)
        assert _snapshot(path, before) == before, k
        _checkpoint_files_only_of_its_index(path, set(before))
    assert 0 < committed < total / 2


# --- 3. planner_data: DCP's nested structure ---------------------------------------------------


def _with_reader(monkeypatch) -> None:
    """Run format_utils with our plug-ins where it hard-codes DCP's (the drop-in claim)."""
    monkeypatch.setattr(format_utils, "FileSystemReader", ucp_zarr.ZarrStorageReader)
    monkeypatch.setattr(format_utils, "FileSystemWriter", ucp_zarr.ZarrStorageWriter)


def test_dcp_to_torch_save_gives_the_nested_structure_of_dcps_own_writer(tmp_path, monkeypatch):
    sd = _nested_state(3)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ours"))
    format_utils.dcp_to_torch_save(tmp_path / "theirs", tmp_path / "theirs.pt")
    with monkeypatch.context() as m:
        _with_reader(m)
        format_utils.dcp_to_torch_save(tmp_path / "ours", tmp_path / "ours.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    _assert_same(theirs, sd)  # what DCP's own plug-ins give (nested, list of layers kept)
    _assert_same(ours, theirs)
    # stored as JSON in the commit record, next to the rest of the layout
    root = json.loads((tmp_path / "ours" / "zarr.json").read_text())
    _assert_valid_root(root)
    stored = root["attributes"]["ucp_zarr"]["layout"]["dcp"]
    assert stored["format"] == "ucp_zarr.dcp/1"
    assert stored["planner_data"]["model.layers.1.w"] == ["model", "layers", 1, "w"]
    assert ucp_zarr.ZarrStorageReader(tmp_path / "ours").read_metadata().planner_data == (
        dcp.FileSystemReader(tmp_path / "theirs").read_metadata().planner_data
    )


class _CachingPlanner(DefaultSavePlanner):
    """Plan caching on, with a cache of its own (DCP keys its class-level cache by class name)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


def test_load_state_dict_from_keys_works_as_with_dcps_own_reader(tmp_path):
    sd = _nested_state(4)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    # with plan caching, the second save's global plans are empty deltas: planner_data must
    # still come from DCP's Metadata
    for _ in range(2):
        dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ours"), planner=_CachingPlanner())
    for keys in ({"model"}, "step", {"model.layers", "optim"}, {"model.emb.weight"}, None):
        theirs = _load_state_dict_from_keys(keys, storage_reader=dcp.FileSystemReader(tmp_path / "theirs"))
        ours = _load_state_dict_from_keys(keys, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ours"))
        _assert_same(ours, theirs, str(keys))
        assert ours, keys
    _assert_same(_load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ours")), sd)


def test_torch_save_to_dcp_with_our_writer_beside_the_torch_file(tmp_path, monkeypatch):
    """torch_save_to_dcp converting a torch.save file into the directory that holds it."""
    sd = _nested_state(5)
    torch.save(sd, tmp_path / "model.pt")
    before = _snapshot(tmp_path, ["model.pt"])
    with monkeypatch.context() as m:
        _with_reader(m)
        format_utils.torch_save_to_dcp(tmp_path / "model.pt", tmp_path)
        assert _snapshot(tmp_path, ["model.pt"]) == before
        format_utils.torch_save_to_dcp(tmp_path / "model.pt", tmp_path)  # again: overwrites, file kept
        assert _snapshot(tmp_path, ["model.pt"]) == before
        format_utils.dcp_to_torch_save(tmp_path, tmp_path / "back.pt")
    _assert_same(torch.load(tmp_path / "back.pt", weights_only=True), sd)
    ck = ucp_zarr.open(tmp_path)
    assert _bits_equal(ck["model.emb.weight"][...], sd["model"]["emb.weight"])
    _checkpoint_files_only_of_its_index(tmp_path, {"model.pt", "back.pt"})


@pytest.mark.parametrize(
    "dcp_layout, message",
    [
        ({"format": "ucp_zarr.dcp/1", "planner_data": {"a": ["b"]}}, "joins to the key"),
        ({"format": "ucp_zarr.dcp/1", "planner_data": {"a": ["a", -1]}}, "joins to the key"),
        ({"format": "ucp_zarr.dcp/1", "planner_data": {"x.999999999999": ["x", 999999999999]}}, "list slots"),
        ({"format": "ucp_zarr.dcp/1", "bytes_io": ["a"]}, "not a bytes value"),
        ({"format": "ucp_zarr.dcp/9"}, "this library reads"),
    ],
)
def test_reader_refuses_planner_data_it_did_not_write(tmp_path, dcp_layout, message):
    """DCP's loaders build containers from these paths: a path that does not spell its key,
    or one that would allocate huge lists, is refused before DCP sees it."""
    dcp.save({"a": torch.ones(2), "v": 1}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    root = tmp_path / "ck" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["ucp_zarr"]["layout"]["dcp"] = dcp_layout
    root.write_text(record_text(doc))
    with pytest.raises(ucp_zarr.FormatError, match=message):
        ucp_zarr.ZarrStorageReader(tmp_path / "ck").read_metadata()


# --- 4. io.BytesIO values -----------------------------------------------------------------------


def test_bytesio_round_trip_stored_as_bytes(tmp_path):
    blob = io.BytesIO()
    torch.save({"opaque": [1, 2]}, blob)  # position at its end, as after torch.save
    payload = bytes(range(256)) * 40
    sd = {"w": torch.randn(4), "extra": {"blob": blob, "empty": io.BytesIO(), "raw": io.BytesIO(payload)}}
    position = blob.tell()
    dcp.save(sd, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    assert blob.tell() == position  # the caller's object is left as it was

    out = _template(sd)
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    _assert_same(out, sd)
    assert isinstance(out["extra"]["raw"], io.BytesIO) and out["extra"]["raw"].tell() == 0
    assert torch.load(out["extra"]["blob"], weights_only=True) == {"opaque": [1, 2]}

    # stored as bytes in the JSON commit record (no pickle anywhere), read as bytes elsewhere
    root = json.loads((tmp_path / "ck" / "zarr.json").read_text())
    _assert_valid_root(root)
    assert root["attributes"]["ucp_zarr"]["layout"]["dcp"]["bytes_io"] == ["extra.blob", "extra.empty", "extra.raw"]
    values = root["attributes"]["ucp_zarr"]["values"]
    assert values["extra.raw"] == {"$bytes": base64.b64encode(payload).decode()}
    assert values["extra.empty"] == {"$bytes": ""}
    assert ucp_zarr.open(tmp_path / "ck").metadata["values"]["extra.raw"] == payload
    plain = {"extra": {"blob": b"", "empty": b"", "raw": b""}}
    ucp_zarr.load(plain, tmp_path / "ck", strict=False)
    assert plain["extra"]["raw"] == payload and plain["extra"]["blob"] == blob.getvalue()

    # the metadata-only loaders give BytesIO back too
    got = _load_state_dict_from_keys("extra", storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    _assert_same(got, {"extra": sd["extra"]})
    # a BytesIO nested inside a value (a list without tensors is one value) is refused
    with pytest.raises(CheckpointException, match="neither a tensor nor JSON-able"):
        dcp.save({"w": torch.ones(1), "l": [io.BytesIO(b"x")]}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "no"))


def _job_bytesio_2(rank: int, world: int, d: str) -> None:
    """2 ranks: BytesIO values (one on both ranks, one on rank 1 only, so written by rank 1),
    saved twice to one path beside another file; every check after every collective."""
    path = Path(d) / "ck"

    def state(gen: int) -> dict:
        sd = {
            "w": torch.arange(12.0).reshape(3, 4) + gen,
            "nested": {"blob": io.BytesIO(b"shared-%d" % gen), "n": [torch.full((2,), float(gen)), {"k": gen}]},
        }
        if rank == 1:
            sd["only1"] = io.BytesIO(b"rank1-%d" % gen)
        return sd

    dcp.save(state(0), storage_writer=ucp_zarr.ZarrStorageWriter(path))
    dcp.save(state(1), storage_writer=ucp_zarr.ZarrStorageWriter(path))  # overwrite, 2 ranks
    out = {"w": torch.zeros(3, 4), "nested": {"blob": io.BytesIO(), "n": [torch.zeros(2), {"k": -1}]}}
    out["only1"] = io.BytesIO()
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(path))
    whole = _load_state_dict_from_keys(storage_reader=ucp_zarr.ZarrStorageReader(path))
    dist.barrier()
    want = state(1)
    want["only1"] = io.BytesIO(b"rank1-1")
    _assert_same(out, want)
    _assert_same(whole, want)
    assert (path / "config.json").read_bytes() == b'{"keep": true}'


def test_bytesio_two_ranks_gloo(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_bytes(b'{"keep": true}')
    run(2, _job_bytesio_2, str(tmp_path), timeout_s=60)
    layout = ucp_zarr.open(tmp_path / "ck").metadata["layout"]["dcp"]
    assert layout["bytes_io"] == ["nested.blob", "only1"]
    assert layout["planner_data"]["nested.n.1.k"] == ["nested", "n", 1, "k"]
    assert (tmp_path / "ck" / "config.json").read_bytes() == b'{"keep": true}'


def test_values_come_back_as_dcp_gives_them_or_are_refused(tmp_path: Path) -> None:
    """DCP's own writer pickles a non-tensor value, so dcp.load gives it back as it was. The
    drop-in stores JSON: a value that would come back as another type (an IntEnum as an int,
    a namedtuple as a tuple, a numpy scalar as a float, a bytearray as bytes) is refused at
    save, naming its key (before: saved, and loaded back as the base type, silently)."""
    import enum
    from collections import OrderedDict, namedtuple

    import numpy as np

    class Phase(enum.IntEnum):
        WARMUP = 1

    Pos = namedtuple("Pos", "epoch step")
    class Mode(str, enum.Enum):
        TRAIN = "train"

    odd = {"phase": Phase.WARMUP, "pos": Pos(1, 2), "size": torch.Size([2, 3]), "f32": np.float32(0.1),
           "i64": np.int64(7), "arr0": np.array(2.5), "ba": bytearray(b"ab"), "deep": [1, (2, Phase.WARMUP)],
           "od": OrderedDict(a=(1, OrderedDict(b=2))), "keyed": ("cfg", {Mode.TRAIN: 1})}
    for name, value in odd.items():
        with pytest.raises(CheckpointException, match=f"value at key '{name}[^']*'.*come back as"):
            dcp.save({"w": torch.ones(1), name: value}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / name))
    plain = {"w": torch.ones(2), "n": 3, "x": 0.5, "s": "a", "b": b"\x00", "t": (1, [2.0, None]), "d": [{"k": (True,)}]}
    dcp.save(plain, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "plain"))
    out = _template(plain)
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "plain"))
    _assert_same(out, plain)


def test_a_lossy_cast_is_refused_unless_the_reader_allows_it(tmp_path: Path) -> None:
    """DCP's FileSystemReader copies fp32 into a bf16 destination silently; the drop-in refuses
    it naming allow_lossy_cast, which ZarrStorageReader now takes (before: the error named an
    option the reader did not have), and then gives what FileSystemReader gives."""
    for src, dtype in [(torch.arange(4.0) / 3, torch.bfloat16), (torch.arange(4), torch.float32)]:
        dcp.save({"w": src}, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"))
        dcp.save({"w": src}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "zarr", overwrite=True))
        want = {"w": torch.zeros(4, dtype=dtype)}
        dcp.load(want, storage_reader=dcp.FileSystemReader(tmp_path / "fs"))
        got = {"w": torch.zeros(4, dtype=dtype)}
        with pytest.raises(CheckpointException, match="allow_lossy_cast"):
            dcp.load(got, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "zarr"))
        dcp.load(got, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "zarr", allow_lossy_cast=True))
        assert got["w"].dtype == dtype and torch.equal(got["w"], want["w"]), (src.dtype, dtype)


def test_a_save_beside_a_dcp_filesystem_checkpoint_warns(tmp_path: Path) -> None:
    """A folder holding DCP's own FileSystemWriter checkpoint: the drop-in's save leaves it
    (as every other file), and ``dcp.load(checkpoint_id=path)`` (which picks
    FileSystemReader) reads that one, not the new save: the save says so (before: nothing)."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "ck")
    with pytest.warns(UserWarning, match=r"holds a checkpoint of DCP's own FileSystemWriter \(\.metadata\)"):
        dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=ucp_zarr.ZarrStorageWriter(tmp_path / "ck"))
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=ucp_zarr.ZarrStorageReader(tmp_path / "ck"))
    assert torch.equal(out["w"], torch.full((3,), 2.0))
