"""Two saves into one path, from separate processes, interleaved both ways, on the local
disk and on a real S3 server (SeaweedFS on loopback; through obstore, the default, and for
the overwrite, whose adoption copies objects server-side, through fsspec too).

Regression: a second save used to delete the first one's files, and the later commit
silently replaced an already committed root. Now the path has exactly one owner: a live
owner is never disturbed; a dead one's leftovers are reclaimed; a forced takeover
(``overwrite_incomplete``) wins and the stale save can no longer commit; a committed
checkpoint is replaced only with ``overwrite=True``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp_zarr

HERE = Path(__file__).resolve().parent
BUCKET = "concurrent"


@dataclass
class Backend:
    name: str
    base: str
    storage_options: dict[str, Any] | None

    def url(self) -> str:
        return f"{self.base}/{uuid.uuid4().hex[:8]}/ck"


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path), None)
    server = request.getfixturevalue("seaweed")
    fsspec = {"backend": "fsspec"} if request.param == "s3-fsspec" else {}
    return Backend(request.param, f"s3://{BUCKET}", {**server.storage_options(), **fsspec})


class Save:
    """``_save_proc.py`` running one save (under the command ``wrap``, e.g. ``unshare``)."""

    def __init__(
        self, tmp: Path, backend: Backend, url: str, value: float, pause: bool = False, wrap: tuple[str, ...] = (), **options: Any
    ) -> None:
        self.dir = tmp / uuid.uuid4().hex[:8]
        self.dir.mkdir()
        self.result = self.dir / "result.json"
        spec = {"url": url, "value": value, "storage_options": backend.storage_options, "options": options,
                "pause": str(self.dir) if pause else None, "result": str(self.result)}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([*wrap, sys.executable, str(HERE / "_save_proc.py"), json.dumps(spec)], env=env)

    def wait_paused(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dir / "paused").exists():
            assert self.proc.poll() is None, f"the save exited before pausing: {self.outcome()}"
            assert time.monotonic() < deadline, "the save never reached its write phase"
            time.sleep(0.05)

    def go(self) -> None:
        (self.dir / "go").write_text("")

    def outcome(self, timeout: float = 120) -> dict[str, Any]:
        self.proc.wait(timeout)
        return json.loads(self.result.read_text()) if self.result.exists() else {"ok": False, "types": ["died"], "message": ""}


def _value(backend: Backend, url: str) -> float:
    ck = ucp_zarr.open(url, storage_options=backend.storage_options)
    ck.verify()  # every shard is this save's: none was clobbered by the other
    w, b = ck["w"][...], ck["b"][...]
    assert torch.equal(w, torch.full_like(w, w[0, 0].item())) and torch.equal(b, torch.full_like(b, w[0, 0].item()))
    assert ck.metadata["step"] == w[0, 0].item()
    return w[0, 0].item()


def test_a_live_save_is_never_disturbed(tmp_path, backend):
    """A claims the path and is writing; B comes second: B is refused, A commits."""
    url = backend.url()
    a = Save(tmp_path, backend, url, 1.0, pause=True)
    a.wait_paused()
    b = Save(tmp_path, backend, url, 2.0).outcome()
    assert not b["ok"] and "OwnershipError" in b["types"] and "still alive" in b["message"], b
    a.go()
    assert a.outcome()["ok"]
    assert _value(backend, url) == 1.0


def test_a_forced_takeover_wins_and_the_stale_save_cannot_commit(tmp_path, backend):
    """A stalls after its claim; B, told the path's save is dead (overwrite_incomplete),
    takes over and commits; A resumes: it must neither write over B nor replace B's root."""
    url = backend.url()
    a = Save(tmp_path, backend, url, 1.0, pause=True)
    a.wait_paused()
    b = Save(tmp_path, backend, url, 2.0, overwrite_incomplete=True).outcome()
    assert b["ok"], b
    a.go()
    out = a.outcome()
    assert not out["ok"] and "OwnershipError" in out["types"] and "lost its claim" in out["message"], out
    assert _value(backend, url) == 2.0


def test_a_dead_save_is_recognised_and_its_leftovers_reclaimed(tmp_path, backend):
    url = backend.url()
    a = Save(tmp_path, backend, url, 1.0, pause=True)
    a.wait_paused()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    with pytest.raises(ucp_zarr.IncompleteCheckpointError):
        ucp_zarr.open(url, storage_options=backend.storage_options)
    assert Save(tmp_path, backend, url, 2.0).outcome()["ok"]
    assert _value(backend, url) == 2.0


@pytest.mark.parametrize("backend", ["local", "s3", "s3-fsspec"], indirect=True)
def test_a_committed_checkpoint_is_replaced_only_when_asked(tmp_path, backend):
    url = backend.url()
    assert Save(tmp_path, backend, url, 1.0).outcome()["ok"]
    b = Save(tmp_path, backend, url, 2.0).outcome()
    assert not b["ok"] and "CheckpointExistsError" in b["types"], b
    assert _value(backend, url) == 1.0
    assert Save(tmp_path, backend, url, 3.0, overwrite=True).outcome()["ok"]
    assert _value(backend, url) == 3.0
    parent = url.rsplit("/", 1)[0]
    if backend.name == "local":
        assert sorted(p.name for p in Path(parent).iterdir()) == ["ck"]  # the staging copy is gone
    else:
        from s3fs import S3FileSystem

        fs = S3FileSystem(**{k: v for k, v in backend.storage_options.items() if k != "backend"})
        assert [p.rsplit("/", 1)[1] for p in fs.ls(parent.removeprefix("s3://"), refresh=True)] == ["ck"]


def test_two_clean_ups_of_one_abandoned_folder_both_succeed(tmp_path, monkeypatch) -> None:
    """Two saves racing to overwrite one path may both remove the same abandoned staging
    folder: what the other took first is gone, as wanted (one of them raised a bare
    ``FileNotFoundError`` naming an entry of the folder)."""
    from ucp_zarr.io.local import LocalStore

    store = LocalStore(str(tmp_path / "staging"))
    for key in ("zarr.json", "w/zarr.json", "w/c/0/0"):
        store.write(key, [b"x"])
    unlink = os.unlink

    def raced(path, *args, **kwargs):  # the other clean-up unlinks each entry just before this one
        unlink(path, *args, **kwargs)
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", raced)
    store.remove()
    assert not (tmp_path / "staging").exists()
