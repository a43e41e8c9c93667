"""Megatron-core ``dist_checkpointing`` folders of the ``torch_dist`` backend, as the DCP
converter (:mod:`.dcp`) reads them.

Such a folder (``megatron.core.dist_checkpointing.save(sharded_state_dict, dir)``, Megatron
0.16) is a DCP folder plus:

* ``metadata.json``: ``{"sharded_backend": "torch_dist", "common_backend": "torch", ...}``;
* ``common.pt``: what the state dict held besides sharded tensors and objects (the
  optimizer's ``param_groups`` and step, ``iteration``, Megatron-LM's ``args``...), a
  ``torch.save`` of a nested dict;
* in the DCP folder, tensors under their ``ShardedTensor`` keys (the layers of
  ``decoder.layers.*`` stacked along a leading axis, optimizer state under
  ``optimizer.state.<exp_avg|exp_avg_sq|param>.<key>``), and each ``ShardedObject`` as a
  value keyed ``<key>/shard_<offset>_<shape>``.

Read here: ``common.pt``'s leaves become values under their dotted keys (weights-only,
``argparse.Namespace`` and Megatron's enums as inert records; anything else needs
``trust``). Megatron-LM's ``rng_state`` objects (each rank's generators, of the saving
layout) are left out with a warning, objects holding nothing (``[None]``) without one;
optimizer state that Megatron pickles into objects per
data-parallel rank (the DistributedOptimizer's ``dp_reshardable`` and
``dp_zero_gather_scatter`` formats) is refused, naming the format that converts.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import ConversionError, NotJSONableError
from ..format.statedict import iter_leaves, to_json
from .base import plain, torch_load

COMMON_FILE = "common.pt"
METADATA_JSON = "metadata.json"
COMMON_OPAQUE = ("argparse.Namespace", "megatron.core.transformer.enums.AttnBackend",
                 "megatron.core.transformer.enums.AttnMaskType", "megatron.core.enums.ModelType")
"""Classes ``common.pt`` may pickle that are read as inert records without ``trust``."""
_SHARDED_OBJECT = re.compile(r"(?P<base>.+)/shard_[\d_.]+")
_RNG = re.compile(r"(.+\.)?rng_state")
_FLAT_OPTIMIZER = re.compile(r"(.+\.)?optimizer\.distributed\..*")


def is_torch_dist(src: Path) -> bool:
    """Whether ``src`` is a Megatron ``dist_checkpointing`` folder of the ``torch_dist`` backend."""
    f = src / METADATA_JSON
    if not f.is_file():
        return False
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return False  # (another tool's file)
    return isinstance(info, dict) and info.get("sharded_backend") == "torch_dist"


def left_out(fqn: str) -> bool:
    """Whether the value ``fqn`` is a Megatron-LM ``rng_state`` object (not converted)."""
    m = _SHARDED_OBJECT.fullmatch(fqn)
    return m is not None and _RNG.fullmatch(m["base"]) is not None


def warn_left_out(src: Path, keys: list[str]) -> None:
    """Warn of the ``rng_state`` objects ``keys`` that the conversion of ``src`` left out."""
    if keys:
        warnings.warn(f"ucp_zarr: {src}: Megatron's rng_state objects {keys[:2]}{' ...' * (len(keys) > 2)} (each rank's "
                      "random generators, of the saving layout) are not converted; a resume from the conversion seeds "
                      "them anew (Megatron's own load of the folder restores them at the same layout)", stacklevel=3)


def empty(fqn: str, value: Any) -> bool:
    """Whether the value ``fqn`` is a ``ShardedObject`` that holds nothing (``[None]``: the
    ``_extra_state`` of a layer without one), which the conversion leaves out, as
    :func:`ucp_zarr.adapters.megatron_sharded.sharded_state` does."""
    return value == [None] and _SHARDED_OBJECT.fullmatch(fqn) is not None


def refusal(fqn: str) -> str | None:
    """Why the value ``fqn`` that cannot be stored is a Megatron record this converter
    does not take, and the way out; None for another value."""
    m = _SHARDED_OBJECT.fullmatch(fqn)
    if m is None or _FLAT_OPTIMIZER.fullmatch(m["base"]) is None:
        return None
    return ("it is Megatron DistributedOptimizer state pickled per data-parallel rank (its 'dp_reshardable' or "
            "'dp_zero_gather_scatter' format: flat buffers of the saving layout), which is not converted; save with "
            "distrib_optim_sharding_type='fully_reshardable', whose state is one tensor per parameter")


def common_state(src: Path, trust: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``common.pt``'s leaves, flattened as a save flattens a state dict: its tensors, and its
    other leaves as JSON-able values (one that is not is refused, naming the file)."""
    f = src / COMMON_FILE
    if not f.is_file():
        raise ConversionError(f"{f}: missing: a Megatron torch_dist folder keeps its non-sharded state there")
    common = torch_load(f, trust=trust, opaque=COMMON_OPAQUE, mmap=False)
    if not isinstance(common, dict):
        raise ConversionError(f"{f}: holds a {type(common).__name__}, not the dict Megatron saves")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for leaf in iter_leaves(common):
        if isinstance(leaf.value, torch.Tensor):
            tensors[leaf.key] = leaf.value.detach()
            continue
        values[leaf.key] = plain(leaf.value)
        try:
            to_json(values[leaf.key], leaf.key)
        except NotJSONableError as e:
            raise ConversionError(f"{f}: {e}") from None
    return tensors, values
