"""ucp_zarr: universal checkpointing for PyTorch training, stored as plain Zarr v3."""

__version__ = "0.1.0"

from .api import load, save, wait_for_pending_save
from .fragments import FlatShard, Shard
from .checkpoint import Checkpoint, TensorView, open
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptChunkError,
    FormatError,
    IncompleteCheckpointError,
    KeyMismatchError,
    NotJSONableError,
)

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
    "load",
    "open",
    "save",
    "wait_for_pending_save",
]
