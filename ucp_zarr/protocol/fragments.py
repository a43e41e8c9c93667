"""Fragments: the part of each tensor that this rank holds, in any of the accepted forms.

A state-dict tensor value may be

* a ``DTensor`` with any placements (FSDP2, TP, FSDP2 + TP, uneven shards);
* :class:`Shard`: a Megatron-style slab at ``global_offset`` of ``global_shape``;
* :class:`FlatShard`: a 1-D fragment of the row-major flattened global tensor starting at
  element ``flat_offset`` (ZeRO-1/2/3, distributed optimizers), cutting rows anywhere; or
  of a slab of it (Megatron's distributed optimizer: a flat range of a TP-local slab);
* :class:`Placed`: a local tensor mapped onto a consolidated tensor by pieces, as
  :func:`ucp_zarr.place` makes from rules (fused sub-parameters, padding, renamed keys);
* a plain tensor: the whole tensor, identical on every rank;
* :class:`PerRank` of a plain tensor: this rank's own copy (per-rank state).

Each is normalised to a :class:`Fragment`: ``(global box, local tensor view)`` pieces.
The same forms describe the target layout at load.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DtypeMismatchError, LayoutError, NotJSONableError
from ..layout import Box
from ..layout.pieces import Piece, PieceError, check_pieces, flat_range
from ..layout.pieces import whole as whole_pieces
from ..layout.placements import DimSplit, local_runs, runs_to_boxes
from .hooks import LayoutHooks


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
    row-major flattened tensor of ``global_shape``; or, with ``slab_offset`` and
    ``slab_shape``, of the flattened slab (box) of the global tensor at ``slab_offset``
    (Megatron's ``global_offset``/``local_shape``/``flattened_range``)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int
    replica_id: int = 0
    slab_offset: tuple[int, ...] | None = None
    slab_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)
        self.flat_offset = int(self.flat_offset)
        if (self.slab_offset is None) != (self.slab_shape is None):
            raise LayoutError("FlatShard: give both slab_offset and slab_shape, or neither")
        if self.slab_offset is not None and self.slab_shape is not None:
            self.slab_offset = tuple(int(o) for o in self.slab_offset)
            self.slab_shape = tuple(int(n) for n in self.slab_shape)


@dataclass
class Placed:
    """``local`` placed on the consolidated tensor ``key`` of ``global_shape``: each piece
    maps a region of ``local`` to a box of it (see :mod:`ucp_zarr.layout.pieces`). Made by
    :func:`ucp_zarr.place`; save writes the pieces, load fills them in place and zeroes the
    ``pad`` regions (padding that has no consolidated counterpart)."""

    local: torch.Tensor
    key: str
    global_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    pad: tuple[Piece, ...] = ()
    replicated: bool = False
    """Equal on every rank that holds it (checked at save): TP-replicated parameters."""
    average: bool = False
    """Its replicas may differ: what the layout's :attr:`hooks` combine them into is saved
    (the mean over the ranks holding it, by default and for the rule language)."""
    meaning: dict[str, Any] | None = None
    """What the consolidated tensor is (the rule's kind, sub-parameter sizes, vocabulary
    size): stored per tensor, compared at load."""
    rule: str = ""
    """The pattern that chose the rule (for messages)."""
    rules: dict[str, Any] | None = None
    """The rules (``Rules.to_dict()``) that placed it, stored with the checkpoint."""
    used: frozenset[str] = frozenset()
    """Patterns that matched a parameter on this rank (the save checks none is unused)."""
    stored: bool = True
    """False for a copy that the first pipeline stage holds too (a pipeline-replicated
    parameter beyond the first stage, and its optimizer state): not this stage's own
    placement (no clash between stages), and, as any replica, compared with the other
    copies at save (they must be equal) and written once."""
    alias: str | None = None
    """The consolidated key it has when the rules' ``rename`` is not applied, when that
    renames it onto ``key`` (an output layer tied to the embedding): recorded as a tie."""
    hooks: LayoutHooks | None = None
    """The checks of the layout that placed it (:mod:`.hooks`), which saves and loads call."""


@dataclass
class PerRank:
    """State that is each rank's own (RNG states, data-loader positions): a plain tensor
    or a JSON-able value, saved once per saving rank and restored on the rank of the same
    number: the rank within the ``process_group`` of the save and of the load (the global
    rank with the default group). A plain tensor that differs between ranks without this
    wrapper is an error."""

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
    average: bool = False
    """Its replicas may differ: the layout's hooks combine them at save (:attr:`Placed.average`)."""
    meaning: dict[str, Any] | None = None
    rule: str = ""
    pad: list[torch.Tensor] = field(default_factory=list)
    """Local regions that are padding: zeroed at load."""

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
    """Whether ``value`` is a DTensor, without importing DTensor's module (about a second)
    when nothing has: then nothing can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``ShardedTensor`` (FSDP1's ``SHARDED_STATE_DICT``), without
    importing its module when nothing has."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return module is not None and isinstance(value, module.ShardedTensor)


def _sharded_tensor_fragment(key: str, value: Any) -> "Fragment":
    """A ``ShardedTensor``: its local shards, each at its offset (its metadata, not the
    tensor's properties, which a ShardedTensor refuses to give)."""
    meta = value.metadata()
    shape, dtype = tuple(meta.size), meta.tensor_properties.dtype
    _check_geometry(key, shape)
    pieces, device = [], torch.device("cpu")
    for s in value.local_shards():
        local = check_tensor(key, s.tensor)
        box = Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
        if tuple(local.shape) != box.shape or box.ndim != len(shape) or not Box.whole(shape).contains(box):
            raise LayoutError(f"tensor {key!r}: a local shard of shape {list(local.shape)} at {box} does not fit the "
                              f"ShardedTensor's shape {list(shape)}")
        if local.dtype != dtype:
            raise LayoutError(f"tensor {key!r}: a local shard of {local.dtype} in a ShardedTensor of {dtype}")
        device = local.device
        if box.numel:
            pieces.append((box, local))
    return Fragment(key, shape, dtype, pieces, device=device)


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
    runs = local_runs(shape, tuple(mesh.shape), coord, splits)
    held = tuple(sum(n for _, n in r) for r in runs)
    if tuple(local.shape) != held:  # (DTensor.from_local(..., shape=) with other shards: torch leaves it undefined)
        raise LayoutError(f"tensor {key!r}: this rank's local tensor of the DTensor has shape {tuple(local.shape)}, but "
                          f"its placements {tuple(dt.placements)} of global shape {shape} give it {held}")
    return shape, [(gbox, local[lbox.slices()]) for gbox, lbox in runs_to_boxes(runs)]


def is_fragment_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Shard, FlatShard, Placed))


def piece_view(local: torch.Tensor, p: Piece, key: str) -> torch.Tensor:
    """The view of ``local`` that piece ``p`` names (never a copy: load fills it in place)."""
    base = local
    if p.base is not None:
        start, shape = p.base
        if local.dim() != 1 and not local.is_contiguous():
            raise LayoutError(f"tensor {key!r}: a flat piece needs a 1-D or contiguous local tensor")
        flat = local if local.dim() == 1 else local.reshape(-1)
        base = flat[start : start + math.prod(shape)].view(shape)
    step = p.step or (1,) * p.src.ndim
    return base[tuple(slice(o, o + (n - 1) * s + 1, s) for o, n, s in zip(p.src.offset, p.src.shape, step))]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (dense, on its device), in row-major order, as a 1-D uint8 tensor: a
    view where its elements lie one after another, else a copy. (torch calls a one-element
    view contiguous whatever its stride, and ``contiguous()`` returns it as it is: ``view``
    then refuses its stride.)"""
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


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
    """Normalise a state-dict value (DTensor, ShardedTensor, Shard, FlatShard or tensor) to a Fragment."""
    if is_dtensor(value):
        check_tensor(key, value.to_local())
        shape, pieces = dtensor_pieces(value, key)
        return Fragment(key, shape, value.dtype, pieces, device=value.device)
    if is_sharded_tensor(value):
        return _sharded_tensor_fragment(key, value)
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
    if isinstance(value, Placed):
        local = check_tensor(key, value.local)
        try:
            check_pieces(value.pieces, tuple(local.shape), value.global_shape, value.pad)
        except PieceError as e:
            raise LayoutError(f"tensor {value.key!r}: {e}") from None
        pieces = [(p.dst, piece_view(local, p, value.key)) for p in value.pieces if p.dst.numel]
        whole = len(pieces) == 1 and pieces[0][0] == Box.whole(value.global_shape) or not math.prod(value.global_shape)
        return Fragment(
            value.key, value.global_shape, local.dtype, pieces, plain=(value.replicated or value.average) and whole,
            device=local.device, average=value.average, meaning=value.meaning, rule=value.rule,
            pad=[piece_view(local, p, value.key) for p in value.pad],
        )
    if isinstance(value, FlatShard):
        local = check_tensor(key, value.local)
        _check_geometry(key, value.global_shape)
        return _flat_fragment(key, value, local)
    if isinstance(value, torch.Tensor):
        check_tensor(key, value)
        shape = tuple(value.shape)
        pieces = [(Box.whole(shape), value)] if math.prod(shape) else []
        return Fragment(key, shape, value.dtype, pieces, plain=True, device=value.device)
    raise NotJSONableError(f"tensor {key!r}: unsupported value of type {type(value).__name__}")


def _flat_fragment(key: str, value: FlatShard, local: torch.Tensor) -> Fragment:
    """A :class:`FlatShard`: a flat range of the global tensor, or of its slab."""
    if local.dim() != 1:
        raise LayoutError(f"tensor {key!r}: FlatShard.local must be 1-D, got shape {list(local.shape)}")
    slab, of = Box.whole(value.global_shape), ""
    if value.slab_offset is not None and value.slab_shape is not None:
        _check_geometry(key, value.slab_shape, value.slab_offset)
        slab, of = Box(value.slab_offset, value.slab_shape), " of its slab"
        if len(value.slab_offset) != len(value.global_shape) or not Box.whole(value.global_shape).contains(slab):
            raise LayoutError(f"tensor {key!r}: slab {slab} lies outside the global shape {list(value.global_shape)}")
    start, stop = value.flat_offset, value.flat_offset + local.numel()
    if not 0 <= start <= stop <= slab.numel:
        raise LayoutError(f"tensor {key!r}: FlatShard [{start}, {stop}) is outside{of} {slab.numel} elements")
    pieces = flat_range(slab.shape, whole_pieces(slab.shape, slab.offset), start, stop)
    views = [(p.dst, piece_view(local, p, key)) for p in pieces]
    flat = (start, stop) if value.slab_shape is None else None  # (recorded as a flat range of the tensor)
    return Fragment(key, value.global_shape, local.dtype, views, flat=flat, device=local.device)
