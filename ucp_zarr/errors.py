"""Exceptions raised by ucp_zarr; each names the tensor, key, file or rank at fault."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ucp_zarr raises on purpose."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds a checkpoint whose commit record was never written."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving would overwrite a committed checkpoint."""


class NotJSONableError(CheckpointError, TypeError):
    """A non-tensor value in the state dict cannot be stored as JSON."""


class KeyMismatchError(CheckpointError, KeyError):
    """Keys missing from the checkpoint or unexpected in it (``strict=True``)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing = missing
        self.unexpected = unexpected
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state dict: {', '.join(unexpected)}")
        super().__init__("; ".join(parts))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class CorruptChunkError(CheckpointError):
    """A chunk or shard index failed its crc32c check, or a file is malformed."""


class FormatError(CheckpointError, ValueError):
    """A metadata document is missing, malformed or of an unknown format version."""
