"""The one-process streaming writer converters use: lazy sources read shard by shard, at
most ``max_workers`` at once, one transaction (a failing source leaves nothing committed)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import ucp_zarr
from ucp_zarr.errors import LayoutError
from ucp_zarr.layout import Box
from ucp_zarr.protocol.saver import SaveOptions
from ucp_zarr.io.factory import open_store
from ucp_zarr.protocol.writer import InMemory, write_checkpoint


@dataclass(frozen=True)
class Lazy:
    """A tensor of known shape and dtype, loaded whole by ``load()`` when a shard needs it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        t = self.load()
        if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
            raise LayoutError(f"a source announced {list(self.shape)} {self.dtype}, but holds {list(t.shape)} {t.dtype}")
        return t, Box.whole(self.shape)


class Rows:
    """A big tensor produced row block by row block (never whole), counting concurrent reads."""

    def __init__(self, rows: int, cols: int) -> None:
        self.shape = (rows, cols)
        self.dtype = torch.float32
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.boxes: list[Box] = []

    def value(self) -> torch.Tensor:
        return torch.arange(self.shape[0] * self.shape[1], dtype=torch.float32).reshape(self.shape)

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.boxes.append(box)
        try:
            start = box.offset[0] * self.shape[1]
            flat = torch.arange(start, start + box.numel, dtype=torch.float32)
            threading.Event().wait(0.01)
            return flat.reshape(box.shape), box
        finally:
            with self.lock:
                self.active -= 1


def test_sources_stream_shard_by_shard(tmp_path: Path) -> None:
    big = Rows(1024, 256)  # 1 MiB, in shards of 64 KiB
    bf = torch.randn(5, 7).to(torch.bfloat16)
    tensors = {"model.big": big, "model.bf": InMemory(bf), "optim.step": Lazy((), torch.int64, lambda: torch.tensor(7))}
    options = SaveOptions(chunk_bytes=16 << 10, shard_bytes=64 << 10, max_workers=3)
    seen: list[int] = []
    write_checkpoint(open_store(tmp_path / "ck"), tensors, {"meta": {"epoch": 2, "name": "x"}}, options=options,
                     progress=seen.append)
    ck = ucp_zarr.open(tmp_path / "ck")
    assert torch.equal(ck.read("model.big"), big.value())
    assert torch.equal(ck.read("model.bf"), bf) and int(ck.read("optim.step")) == 7
    assert ck.meta.values == {"meta": {"epoch": 2, "name": "x"}}
    assert len(big.boxes) == 16 and all(b.numel * 4 <= 64 << 10 for b in big.boxes)  # never the whole tensor
    assert big.peak <= 3
    assert sum(seen) == 1024 * 256 * 4 + bf.numel() * 2 + 8
    target = {"model": {"big": torch.zeros(1024, 256), "bf": torch.zeros(5, 7, dtype=torch.bfloat16)},
              "optim": {"step": torch.tensor(0)}, "meta": None}
    ucp_zarr.load(target, tmp_path / "ck")
    assert torch.equal(target["model"]["big"], big.value()) and target["meta"] == {"epoch": 2, "name": "x"}


def test_a_failing_source_commits_nothing(tmp_path: Path) -> None:
    def broken() -> torch.Tensor:
        raise OSError("truncated file rank3.pt")

    tensors = {"a": InMemory(torch.ones(3)), "b": Lazy((4,), torch.float32, broken)}
    with pytest.raises(Exception, match="truncated file rank3.pt"):
        write_checkpoint(open_store(tmp_path / "ck"), tensors)
    assert not (tmp_path / "ck" / "zarr.json").exists()
    with pytest.raises(ucp_zarr.CheckpointError):
        ucp_zarr.open(tmp_path / "ck")
    write_checkpoint(open_store(tmp_path / "ck"), {"a": InMemory(torch.ones(3))})  # a rerun takes the path over
    assert torch.equal(ucp_zarr.open(tmp_path / "ck").read("a"), torch.ones(3))


def test_a_source_of_the_wrong_shape_or_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 'b': .*announced \[4\] torch.float32, but holds \[3\]"):
        write_checkpoint(open_store(tmp_path / "a"), {"b": Lazy((4,), torch.float32, lambda: torch.ones(3))})
    with pytest.raises(ucp_zarr.LayoutError, match=r"tensor 'b': .*holds \[3\] torch.float64"):
        write_checkpoint(open_store(tmp_path / "b"), {"b": Lazy((3,), torch.float32, lambda: torch.ones(3, dtype=torch.float64))})
    with pytest.raises(ucp_zarr.LayoutError, match=r"keys \['b'\] are both"):
        write_checkpoint(open_store(tmp_path / "c"), {"b": InMemory(torch.ones(3))}, {"b": 1})
    assert not any((tmp_path / n / "zarr.json").exists() for n in "abc")
