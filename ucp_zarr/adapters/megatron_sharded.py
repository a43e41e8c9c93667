"""Megatron-core's ``sharded_state_dict()`` as a ucp_zarr state dict: :func:`sharded_state`.

Megatron describes each rank's part of every tensor itself: a ``ShardedTensor`` names its
checkpoint key, the global shape and this rank's offset in it (the layers of
``decoder.layers.*`` stacked along ``prepend_axis_num`` leading axes), and whether the rank
holds a replica. Each becomes a :class:`~ucp_zarr.Placed` of that key (the local tensor,
viewed with the prepended axes, at its global offset), so that

* ``ucp_zarr.save(sharded_state(model.sharded_state_dict()), path)`` writes every rank's
  part, in the global shapes Megatron's own ``torch_dist`` checkpoints have, under the same
  keys: a ``torch_dist`` folder converted by ``ucp-zarr convert`` and such a save are
  interchangeable;
* ``ucp_zarr.load(sharded_state(model.sharded_state_dict()), path, strict=False)`` fills the
  model's parameters in place with its own part, at any TP/PP of the same model.

Model state only: an optimizer's ``sharded_state_dict`` is refused (its keys start with
``optimizer.``). Megatron's ``load_state_dict`` copies an optimizer's state in from the
buffers its ``sharded_state_dict(is_loading=True)`` makes, which an in-place load would fill
and drop; load a Megatron optimizer with the rules (``Rules.from_megatron``, ``place`` and
``FlatShard`` of the DistributedOptimizer's ranges, ``docs/rules.md``) or with Megatron's own
``dist_checkpointing``.

``ShardedTensorFactory`` (SwiGLU's ``[gate; up]``) is built first: its tensors are views of
the parameter, so a load fills the parameter. Other leaves are values under their dotted
path, as ``common.pt`` is converted. ``ShardedObject`` holding ``None`` (the local layer
spec's ``_extra_state``) and ``LocalNonpersistentObject`` are left out; any other
``ShardedObject`` (pickled per rank: Megatron-LM's ``rng_state``, the DistributedOptimizer's
per-rank formats) is refused, naming it. Flattened ranges (refused by Megatron 0.16 itself)
are refused. A tensor Megatron lets change its global shape at load (``allow_shape_mismatch``:
a vocabulary padded for another TP) must have the saved shape: the load refuses another.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import LayoutError
from ..layout import Box
from ..layout.pieces import Piece
from ..protocol.fragments import Placed

OPTIMIZER_PREFIX = "optimizer."
"""The checkpoint keys of Megatron's optimizer state (``optimizer.state.exp_avg.<key>``...)."""


def sharded_state(sharded_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-core's ``sharded_state_dict`` of a model (nested with other state) as a
    state dict for :func:`ucp_zarr.save` and :func:`ucp_zarr.load` (see the module
    docstring). Factories are built in place, as Megatron's own save does."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    out: dict[str, Any] = {}
    count: dict[str, int] = {}
    sharded = (ShardedTensor, ShardedTensorFactory, ShardedObject, LocalNonpersistentObject)

    def holds_sharded(v: Any) -> bool:
        if isinstance(v, sharded):
            return True
        if isinstance(v, Mapping):
            return any(holds_sharded(x) for x in v.values())
        return isinstance(v, list) and any(holds_sharded(x) for x in v)

    def walk(v: Any, path: tuple[str, ...]) -> None:
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and v.key.startswith(OPTIMIZER_PREFIX):
            raise LayoutError(f"{'.'.join(path)}: {v.key!r} is Megatron optimizer state, which a load would fill into "
                              "buffers only Megatron's load_state_dict copies in: not supported; sharded_state takes "
                              "the model's sharded_state_dict (see the module docstring for the optimizer)")
        if isinstance(v, ShardedTensorFactory):
            walk(v.build(), path)
        elif isinstance(v, ShardedTensor):
            n = count[v.key] = count.get(v.key, -1) + 1  # (a factory gives one key several boxes)
            name = v.key if n == 0 else f"{v.key}#{n}"
            if name in out:
                raise LayoutError(f"{name!r} is both a value and a Megatron ShardedTensor key")
            out[name] = _placed(v)
        elif isinstance(v, ShardedObject):
            if v.data is not None:
                raise LayoutError(f"{'.'.join(path)}: Megatron ShardedObject {v.unique_key!r} is pickled per rank, "
                                  "which ucp_zarr does not store; leave it out of the state dict")
        elif isinstance(v, LocalNonpersistentObject):
            return
        elif isinstance(v, Mapping):
            for k, x in v.items():
                walk(x, path + (str(k),))
        elif isinstance(v, list) and holds_sharded(v):  # (other lists are values, as common.pt's are converted)
            for i, x in enumerate(v):
                walk(x, path + (str(i),))
        else:
            key = ".".join(path)
            if key in out:
                raise LayoutError(f"{key!r} is both a value and a Megatron ShardedTensor key")
            out[key] = v

    walk(sharded_state_dict, ())
    return out


def _placed(sh: Any) -> Placed:
    if sh.flattened_range is not None:
        raise LayoutError(f"tensor {sh.key!r}: a Megatron ShardedTensor with a flattened_range is not supported")
    if sh.data is None:
        raise LayoutError(f"tensor {sh.key!r}: a Megatron ShardedTensor without data")
    local = sh.data
    for _ in range(sh.prepend_axis_num):
        local = local.unsqueeze(0)
    box = Box(tuple(int(o) for o in sh.global_offset), tuple(local.shape))
    return Placed(local, sh.key, tuple(int(n) for n in sh.global_shape), (Piece(box, Box.whole(box.shape)),))
