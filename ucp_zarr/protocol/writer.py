"""Writing a checkpoint from one process, tensor by tensor, from lazy sources.

This is what converters stream through. A :class:`TensorSource` describes one consolidated
tensor (shape, dtype) and reads any box of it on demand; :func:`write_checkpoint` plans
the arrays (the same planner as a save by one rank), claims the path with the same
:class:`~.transaction.Transaction`, writes each shard from ``source.read(shard box)`` on a
pool of ``max_workers`` threads, and commits. At most ``max_workers`` shards are in memory
at once (less when a source returns views of memory-mapped files), so memory is bounded
by the shard size, never by the model. An interrupted write leaves no root (no complete-
looking checkpoint); a new write to the path reclaims the leftovers of a dead writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from .distributed import Comm
from ..format.dtypes import stored_dtype
from ..errors import LayoutError
from .exchange import Exchange
from ..layout import Box
from .planner import FragmentInfo, SavePlan, plan_save
from .saver import PreparedSave, SaveOptions, SaveResult, begin_transaction
from ..format.statedict import Structure, to_json
from .ties import check_ties
from ..io.store import Store

CONVERT_SHARD_BYTES = 256 << 20
"""Shard size for converted checkpoints: bounds the memory of one writing thread."""


class TensorSource(Protocol):
    """One consolidated tensor, read box by box."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        """A CPU tensor holding ``box`` of the tensor, and the box it holds (containing
        ``box``; a view of a larger tensor or memory-mapped file is fine). A source may also
        have ``release(box)``, called once the shard ``box`` is written (to drop the pages
        of a memory-mapped view)."""
        ...


@dataclass(frozen=True)
class InMemory:
    """A whole tensor already in memory."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self, box: Box) -> tuple[torch.Tensor, Box]:
        # (a lazy conjugate or negative view, as torch.save keeps one, has its values made)
        return self.tensor.detach().cpu().resolve_conj().resolve_neg(), Box.whole(tuple(self.tensor.shape))


class _SourceStaging:
    """What :class:`~.saver.PreparedSave` writes from: boxes read from the sources."""

    memory = None
    """(No shared memory: this process writes the shards.)"""

    def __init__(self, plan: SavePlan, sources: Mapping[str, TensorSource], progress: Callable[[int], None] | None):
        self.plan = plan
        self.sources = sources
        self.progress = progress

    def holding(self, akey: str, box: Box) -> tuple[torch.Tensor, Box]:
        meta = self.plan.arrays[akey][1]
        try:
            t, held = self.sources[akey].read(box)
        except LayoutError as e:
            raise LayoutError(f"tensor {akey!r}: {e}") from None
        if not held.contains(box) or tuple(t.shape) != held.shape:
            raise LayoutError(f"tensor {akey!r}: its source returned {list(t.shape)} for {held}, asked for {box}")
        t = t.detach()
        if t.dtype != meta.dtype.torch_dtype:
            raise LayoutError(f"tensor {akey!r}: its source returned {t.dtype}, announced {meta.dtype.torch_dtype}")
        storage = meta.dtype.storage_torch_dtype
        if self.progress is not None:
            self.progress(box.numel * t.element_size())
        return (t if t.dtype == storage else t.view(storage)), held

    def release(self, akey: str, box: Box) -> None:
        release = getattr(self.sources[akey], "release", None)
        if release is not None:
            release(box)

    def data(self, akey: str, box: Box) -> torch.Tensor:  # pragma: no cover - one process sends nothing
        t, held = self.holding(akey, box)
        return t[box.relative_to(held).slices()]


def write_checkpoint(
    store: Store,
    tensors: Mapping[str, TensorSource],
    values: Mapping[str, Any] | None = None,
    *,
    options: SaveOptions | None = None,
    layout: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    ties: Mapping[str, str] | None = None,
    structure: Structure | None = None,
) -> SaveResult:
    """Write a checkpoint of ``tensors`` (flattened key -> source) and ``values``
    (flattened key -> JSON-able value) at ``store`` from this process alone, as one
    transaction (see :func:`ucp_zarr.save` for ``options``). ``progress(nbytes)`` is called
    as each shard's data is read. ``layout`` is stored in the root (e.g. the rules);
    ``ties`` (alias -> canonical key of ``tensors``) names keys that read a tensor of
    ``tensors`` (tied weights, stored once); ``structure``, how the keys nested."""
    options = options or SaveOptions(shard_bytes=CONVERT_SHARD_BYTES)
    clash = sorted(set(tensors) & set(values or {}))
    if clash:
        raise LayoutError(f"keys {clash} are both a tensor and a value")
    check_ties(ties or {}, tensors, values or {})
    infos = []
    for key, src in tensors.items():
        shape = tuple(int(n) for n in src.shape)
        stored_dtype(src.dtype, key=key)  # a dtype the format cannot hold is refused before anything is written
        infos.append(FragmentInfo(key, shape, str(src.dtype).removeprefix("torch."), (Box.whole(shape),)))
    json_values = {k: to_json(v, k) for k, v in (values or {}).items()}
    plan = plan_save([infos], chunk_bytes=options.chunk_bytes, shard_bytes=options.shard_bytes)
    txn = begin_transaction(store, plan, options)
    prepared = PreparedSave(
        store, Comm(local=True), options, plan, txn, txn.save_id, txn.staged, _SourceStaging(plan, tensors, progress),
        Exchange(), (json_values, {}), list(tensors), layout, structure=structure, ties=dict(ties or {}),
    )
    return prepared.finish()


def total_bytes(tensors: Mapping[str, TensorSource]) -> int:
    """The bytes of every tensor's data (for progress bars)."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in tensors.values())
