"""ucp_zarr: universal checkpointing for PyTorch training, stored as plain Zarr v3."""

from .version import __version__

from typing import TYPE_CHECKING

from .api import load, save, wait_for_pending_save
from .checkpoint import Checkpoint, TensorView, open
from .fragments import FlatShard, Shard
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptChunkError,
    FormatError,
    IncompleteCheckpointError,
    KeyMismatchError,
    NotJSONableError,
)

if TYPE_CHECKING:
    from .adapters.dcp import ZarrStorageReader, ZarrStorageWriter

__all__ = [
    "Checkpoint",
    "FlatShard",
    "Shard",
    "CheckpointError",
    "CheckpointExistsError",
    "CorruptChunkError",
    "FormatError",
    "IncompleteCheckpointError",
    "KeyMismatchError",
    "NotJSONableError",
    "TensorView",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "load",
    "open",
    "save",
    "wait_for_pending_save",
]


def __getattr__(name: str):
    # The DCP storage plug-ins import torch.distributed.checkpoint (about 1.5 s), so they
    # are loaded on first use rather than with the package.
    if name in ("ZarrStorageReader", "ZarrStorageWriter"):
        from .adapters import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
