"""Plain ``torch.save`` state dicts in: tensors under their flattened keys (as ``save``
flattens a nested state dict), other leaves as JSON values; tied tensors (one memory under
several keys, as ``torch.load`` gives them back) stored once, as a save stores them.

The file is loaded ``weights_only`` (no code runs) and memory-mapped where its format
allows, so tensors are read from disk as their shards are written; a file that needs full
unpickling is refused unless the caller trusts it (:func:`.base.torch_load`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConversionError
from ..format.statedict import iter_leaves, structure_of, to_json
from ..protocol.fragments import to_fragment
from ..protocol.ties import find_ties
from ..protocol.writer import InMemory
from .base import Imported, prefix_key, torch_load


def read(src: Path, *, trust: bool = False, prefix: str = "") -> Imported:
    obj = torch_load(Path(src), trust=trust)
    if isinstance(obj, torch.Tensor):
        obj = {"tensor": obj}
    if not isinstance(obj, dict):
        raise ConversionError(f"{src}: holds a {type(obj).__name__}, not a state dict (a dict)")
    out = Imported(layout={"source": {"format": "torch", "file": Path(src).name}})
    # read_state_dict nests as torch.load gives it, under the prefix's key (see prefix_key)
    above = prefix_key(prefix)
    top = {above: obj} if above else obj
    paths, empty, held = {}, [], []
    for leaf in iter_leaves(top, empty):
        key = leaf.key if top is not obj else prefix + leaf.key
        paths[key] = leaf.path
        if isinstance(leaf.value, torch.Tensor):
            out.tensors[key] = InMemory(leaf.value)
            held.append((key, leaf.value, to_fragment(key, leaf.value)))
        else:
            to_json(leaf.value, f"{src}: {key}")  # refused here, naming the file, if not JSON-able
            out.values[key] = leaf.value
    out.ties = find_ties(held)  # (torch.load gives tied weights one storage again, as a save would see them)
    for alias in out.ties:
        del out.tensors[alias]
    if above is not None:
        out.structure = structure_of(top, paths, empty)
    return out
