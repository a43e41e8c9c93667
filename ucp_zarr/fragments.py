"""Fragments: the part of each tensor that this rank holds, in any of the accepted forms.

A state-dict tensor value may be

* a ``DTensor`` with any placements (FSDP2, TP, FSDP2 + TP, uneven shards);
* :class:`Shard`: a Megatron-style slab at ``global_offset`` of ``global_shape``;
* :class:`FlatShard`: a 1-D fragment of the row-major flattened global tensor starting at
  element ``flat_offset`` (ZeRO-1/2/3, distributed optimizers), cutting rows anywhere;
* a plain tensor: the whole tensor, identical on every rank;
* :class:`PerRank` of a plain tensor: this rank's own copy (per-rank state).

Each is normalised to a :class:`Fragment`: ``(global box, local tensor view)`` pieces.
The same forms describe the target layout at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import DtypeMismatchError, LayoutError, NotJSONableError
from .layout import Box
from .layout.flat import box_flat_start, flat_range_boxes
from .layout.placements import DimSplit, local_runs, runs_to_boxes


@dataclass
class Shard:
    """``local`` is the box ``[global_offset, global_offset + local.shape)`` of a tensor of
    ``global_shape``. Ranks holding the same box are replicas (``replica_id`` tells them
    apart for the caller; any replica may be chosen to write)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)


@dataclass
class FlatShard:
    """``local`` (1-D) holds elements ``[flat_offset, flat_offset + local.numel())`` of the
    row-major flattened tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int
    replica_id: int = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)
        self.flat_offset = int(self.flat_offset)


@dataclass
class PerRank:
    """State that is each rank's own (RNG states, data-loader positions): a plain tensor
    or a JSON-able value, saved once per saving rank and restored on the rank of the same
    number. A plain tensor that differs between ranks without this wrapper is an error."""

    value: Any


@dataclass
class Fragment:
    """What one rank holds of one tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[Box, torch.Tensor]]
    flat: tuple[int, int] | None = None
    """``(start, stop)`` when the fragment is a flat range (recorded as such in metadata)."""
    plain: bool = False
    """A plain tensor: the whole tensor, expected identical on every rank."""
    per_rank: bool = False
    """A plain tensor wrapped in :class:`PerRank`."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b, _ in self.pieces) * self.dtype.itemsize

    def holding(self, box: Box) -> tuple[Box, torch.Tensor]:
        """The piece that holds ``box`` whole: its global box and local tensor."""
        for pbox, t in self.pieces:
            if pbox.contains(box):
                return pbox, t
        raise AssertionError(f"this rank holds no piece of {self.key!r} containing {box}")


def is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def dtensor_pieces(dt: Any, key: str) -> tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]:
    """The global shape of ``dt`` and ``(global box, local view)`` for each box it holds here.

    Raises for ``Partial`` placements (pending reductions are not state).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dt.device_mesh
    shape = tuple(dt.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        return shape, []
    splits: list[DimSplit | None] = []
    for p in dt.placements:
        if isinstance(p, _StridedShard):
            splits.append(DimSplit(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            splits.append(DimSplit(p.dim))
        elif isinstance(p, Replicate):
            splits.append(None)
        else:
            raise LayoutError(f"tensor {key!r}: cannot checkpoint a DTensor with placement {p}; reduce it first")
    local = dt.to_local()
    pieces = []
    for gbox, lbox in runs_to_boxes(local_runs(shape, tuple(mesh.shape), coord, splits)):
        pieces.append((gbox, local[lbox.slices()]))
    return shape, pieces


def is_fragment_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Shard, FlatShard))


def check_tensor(key: str, t: Any) -> torch.Tensor:
    """``t`` if it is a dense tensor with data (strided, not nested or quantized, not on the
    meta device), else :class:`LayoutError` / :class:`DtypeMismatchError` naming ``key``."""
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"tensor {key!r}: the local part is a {type(t).__name__}, not a torch.Tensor")
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested" if t.is_nested else f"a {t.layout}"
        raise LayoutError(f"tensor {key!r} is {kind} tensor; only dense (strided) tensors can be checkpointed")
    if t.device.type == "meta":
        raise LayoutError(f"tensor {key!r} is on the meta device: it holds no data to save or load into")
    if t.is_quantized:
        raise DtypeMismatchError(f"tensor {key!r} is quantized ({t.dtype}); save its integer representation instead")
    return t


def _check_geometry(key: str, global_shape: tuple[int, ...], offset: tuple[int, ...] = ()) -> None:
    if any(n < 0 for n in global_shape) or any(o < 0 for o in offset):
        raise LayoutError(
            f"tensor {key!r}: negative global shape {list(global_shape)} or offset {list(offset)}"
        )


def to_fragment(key: str, value: Any) -> Fragment:
    """Normalise a state-dict value (DTensor, Shard, FlatShard or tensor) to a Fragment."""
    if is_dtensor(value):
        check_tensor(key, value.to_local())
        shape, pieces = dtensor_pieces(value, key)
        return Fragment(key, shape, value.dtype, pieces, device=value.device)
    if isinstance(value, Shard):
        local = check_tensor(key, value.local)
        _check_geometry(key, value.global_shape, value.global_offset)
        if len(value.global_offset) != len(value.global_shape) or local.dim() != len(value.global_shape):
            raise LayoutError(
                f"tensor {key!r}: Shard with local shape {list(local.shape)}, global shape "
                f"{list(value.global_shape)} and offset {list(value.global_offset)} differ in rank"
            )
        box = Box(value.global_offset, tuple(local.shape))
        if not Box.whole(value.global_shape).contains(box):
            raise LayoutError(f"tensor {key!r}: Shard {box} lies outside the global shape {list(value.global_shape)}")
        return Fragment(key, value.global_shape, local.dtype, [(box, local)] if box.numel else [], device=local.device)
    if isinstance(value, FlatShard):
        local = check_tensor(key, value.local)
        _check_geometry(key, value.global_shape)
        if local.dim() != 1:
            raise LayoutError(f"tensor {key!r}: FlatShard.local must be 1-D, got shape {list(local.shape)}")
        start, stop = value.flat_offset, value.flat_offset + local.numel()
        if not 0 <= start <= stop <= math.prod(value.global_shape):
            raise LayoutError(
                f"tensor {key!r}: FlatShard [{start}, {stop}) is outside {math.prod(value.global_shape)} elements"
            )
        pieces = []
        for box in flat_range_boxes(value.global_shape, start, stop):
            lo = box_flat_start(value.global_shape, box) - start
            pieces.append((box, local[lo : lo + box.numel].view(box.shape)))
        return Fragment(key, value.global_shape, local.dtype, pieces, flat=(start, stop), device=local.device)
    if isinstance(value, torch.Tensor):
        check_tensor(key, value)
        shape = tuple(value.shape)
        pieces = [(Box.whole(shape), value)] if math.prod(shape) else []
        return Fragment(key, shape, value.dtype, pieces, plain=True, device=value.device)
    raise NotJSONableError(f"tensor {key!r}: unsupported value of type {type(value).__name__}")
