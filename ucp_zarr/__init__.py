"""ucp_zarr: universal checkpointing for PyTorch training, stored as plain Zarr v3.

The package imports lazily (PEP 562): ``import ucp_zarr`` loads neither torch nor zarr, so
read-only tools (``ucp-zarr info``, :mod:`ucp_zarr.browse.inspect`) start fast; each public name is
imported from its module on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AuthenticationError,
    CheckpointError,
    CheckpointExistsError,
    ConversionError,
    CheckpointReplacedError,
    CorruptChunkError,
    DtypeMismatchError,
    FormatError,
    IncompleteCheckpointError,
    KeyMismatchError,
    LayoutError,
    NotACheckpointError,
    NotJSONableError,
    OptionError,
    OwnershipError,
    PerRankStateError,
    SaveError,
    ShapeMismatchError,
    UnknownKeyError,
    UnsafePathError,
    UntrustedInputError,
)
from .version import __version__

if TYPE_CHECKING:
    from .adapters.dcp import ZarrStorageReader, ZarrStorageWriter
    from .api import async_save, save, wait_for_pending_save
    from .browse.checkpoint import Checkpoint, TensorView, open
    from .converters import convert, export
    from .protocol.fragments import FlatShard, PerRank, Placed, Shard
    from .browse.diff import diff
    from .protocol.loader import IncompatibleKeys, IncompatibleKeysWarning, load
    from .protocol.read_state import read_state_dict
    from .ops import CheckpointManager, optimal_interval
    from .rules.place import place
    from .rules.language import Rules
    from .rules.params import RuleError
    from .browse.runs import open_run
    from .protocol.saver import SaveResult

_LAZY = {
    "IncompatibleKeys": ".protocol.loader",
    "IncompatibleKeysWarning": ".protocol.loader",
    "load": ".protocol.loader",
    "read_state_dict": ".protocol.read_state",
    "async_save": ".api",
    "save": ".api",
    "wait_for_pending_save": ".api",
    "Checkpoint": ".browse.checkpoint",
    "TensorView": ".browse.checkpoint",
    "open": ".browse.checkpoint",
    "convert": ".converters",
    "export": ".converters",
    "FlatShard": ".protocol.fragments",
    "PerRank": ".protocol.fragments",
    "Placed": ".protocol.fragments",
    "Shard": ".protocol.fragments",
    "diff": ".browse.diff",
    "CheckpointManager": ".ops",
    "optimal_interval": ".ops",
    "place": ".rules.place",
    "RuleError": ".rules.params",
    "Rules": ".rules.language",
    "open_run": ".browse.runs",
    "SaveResult": ".protocol.saver",
    "ZarrStorageReader": ".adapters.dcp",
    "ZarrStorageWriter": ".adapters.dcp",
}
"""Public names imported on first use, by module (torch, zarr and torch.distributed.checkpoint
cost seconds to import)."""

__all__ = [
    "AuthenticationError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "ConversionError",
    "CheckpointReplacedError",
    "CorruptChunkError",
    "DtypeMismatchError",
    "FlatShard",
    "FormatError",
    "IncompatibleKeys",
    "IncompatibleKeysWarning",
    "IncompleteCheckpointError",
    "KeyMismatchError",
    "LayoutError",
    "NotACheckpointError",
    "NotJSONableError",
    "OptionError",
    "OwnershipError",
    "PerRank",
    "PerRankStateError",
    "Placed",
    "RuleError",
    "Rules",
    "SaveError",
    "SaveResult",
    "Shard",
    "ShapeMismatchError",
    "TensorView",
    "UnknownKeyError",
    "UnsafePathError",
    "UntrustedInputError",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "__version__",
    "convert",
    "diff",
    "export",
    "load",
    "open",
    "open_run",
    "optimal_interval",
    "place",
    "read_state_dict",
    "async_save",
    "save",
    "wait_for_pending_save",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

