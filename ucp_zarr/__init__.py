"""ucp_zarr: universal checkpointing for PyTorch training, stored as plain Zarr v3."""

from typing import TYPE_CHECKING

from .api import load, save, wait_for_pending_save
from .checkpoint import Checkpoint, TensorView, open
from .convert import convert, export
from .errors import (
    AuthenticationError,
    CheckpointError,
    CheckpointExistsError,
    ConversionError,
    CorruptChunkError,
    DtypeMismatchError,
    FormatError,
    IncompleteCheckpointError,
    KeyMismatchError,
    LayoutError,
    NotACheckpointError,
    NotJSONableError,
    OwnershipError,
    PerRankStateError,
    SaveError,
    ShapeMismatchError,
    UntrustedInputError,
)
from .fragments import FlatShard, PerRank, Placed, Shard
from .place import place
from .rules import RuleError, Rules
from .saver import SaveResult
from .version import __version__

if TYPE_CHECKING:
    from .adapters.dcp import ZarrStorageReader, ZarrStorageWriter

__all__ = [
    "AuthenticationError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "ConversionError",
    "CorruptChunkError",
    "DtypeMismatchError",
    "FlatShard",
    "FormatError",
    "IncompleteCheckpointError",
    "KeyMismatchError",
    "LayoutError",
    "NotACheckpointError",
    "NotJSONableError",
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
    "UntrustedInputError",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "__version__",
    "convert",
    "export",
    "load",
    "open",
    "place",
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
